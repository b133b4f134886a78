"""AlgorithmConfig / RewardConfig defaults and validation messages."""

import pytest

from grpo_megatron.algorithm.config import AlgorithmConfig, KLConfig, OverlongConfig
from grpo_megatron.rewards.config import RewardComponentConfig, RewardConfig


def test_defaults_are_deepseekmath_grpo_and_valid():
    cfg = AlgorithmConfig()
    cfg.validate()
    assert (cfg.clip_low, cfg.clip_high, cfg.norm_adv_by_std) == (0.2, 0.2, True)
    assert cfg.loss_agg_mode == "seq-mean-token-mean" and cfg.kl.estimator == "k3" and cfg.kl.beta == 0.04
    assert not (cfg.tis.enabled or cfg.dynamic_sampling.enabled or cfg.overlong.enabled)
    RewardConfig().validate()


@pytest.mark.parametrize(
    "cfg,prefix",
    [
        (AlgorithmConfig(clip_high=0.1), "algorithm.clip_high=0.1"),
        (AlgorithmConfig(clip_low=1.5), "algorithm.clip_low=1.5"),
        (AlgorithmConfig(dual_clip=0.5), "algorithm.dual_clip=0.5"),
        (AlgorithmConfig(kl=KLConfig(beta=-1.0)), "algorithm.kl.beta=-1.0"),
        (AlgorithmConfig(kl=KLConfig(warmup_fraction=1.0)), "algorithm.kl.warmup_fraction=1.0"),
        (
            AlgorithmConfig(overlong=OverlongConfig(max_len=100, buffer_len=200)),
            "algorithm.overlong.max_len=100",
        ),
        (RewardConfig(timeout_s=0.0), "reward.timeout_s=0.0"),
        (RewardConfig(components=[]), "reward.components"),
        (RewardConfig(components=[RewardComponentConfig(function="nope")]), "reward.components[0].function"),
        (RewardConfig(fallback=float("nan")), "reward.fallback=nan"),
    ],
)
def test_errors_name_the_field(cfg, prefix):
    with pytest.raises(ValueError) as info:
        cfg.validate()
    assert str(info.value).startswith(prefix)
