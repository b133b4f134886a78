"""On-policy distillation (``distill:``): the loss and its gradient against the full-vocabulary
reverse KL computed in plain PyTorch and by TRL's GKD loss, ``distill.coef: 0`` changing nothing,
and the config checks (vocabulary, layout, weights).

The oracle: our loss is a policy gradient on the token the student sampled, with advantage
log pi_T(y) - log pi_S(y) (algorithm/distill.py). Its expectation over y ~ pi_S is exactly the
gradient of KL(pi_S || pi_T) at that position, so the pi_S-weighted sum, over every token of the
vocabulary, of the gradient our loss gives when that token is the sampled one must equal the
gradient of the full-vocabulary reverse KL, to fp32 rounding. The loss runs as the trainer runs it:
logprobs from the vocab-parallel kernel (models/logprobs.py) at a temperature, GRPOLoss.loss_fn over
a collated micro-batch's LossInputs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from grpo_megatron.algorithm.config import AlgorithmConfig
from grpo_megatron.algorithm.distill import distill_advantages, mixed_advantages, sampled_reverse_kl
from grpo_megatron.models.logprobs import vocab_parallel_logprobs
from grpo_megatron.training.batching import LossInputs, collate, make_samples, scatter_logprobs
from grpo_megatron.training.config import DistillConfig
from grpo_megatron.training.forward_backward import MicroBatch
from grpo_megatron.training.phases.train import LOSS_METRICS, GRPOLoss, Reduction

V, N, T = 11, 3, 0.7  # vocabulary, positions, temperature


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(N, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * 2.0


def _distill_loss(
    student_nv: torch.Tensor, teacher_nv: torch.Tensor, token: int, distill: DistillConfig | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The trainer's loss of N one-token responses whose sampled token is ``token`` at every position."""
    labels_n1 = torch.full((N, 1), token)
    logprobs_n1, _ = vocab_parallel_logprobs(
        student_nv[:, None, :], labels_n1, tp_group=None, vocab_start=0, temperature=T
    )
    teacher_n1 = F.log_softmax(teacher_nv / T, dim=-1).gather(-1, labels_n1)
    inputs = LossInputs(
        mask_bs=torch.ones(N, 1),
        rollout_logprobs_bs=logprobs_n1.detach(),
        advantages_b=torch.zeros(N),
        teacher_logprobs_bs=teacher_n1,
    )
    mb = MicroBatch(labels_n1, labels_n1, extras=inputs.to_extras())
    loss = GRPOLoss(AlgorithmConfig(loss_agg_mode="token-mean"), 0.0, 1, False, distill=distill)
    return loss.loss_fn(normalizer=float(N))(logprobs_n1, None, mb)


def _expected_over_tokens(student_nv: torch.Tensor, teacher_nv: torch.Tensor) -> tuple[torch.Tensor, float]:
    """sum_y pi_S(y) * (gradient of our loss, value of distill/reverse_kl) with y sampled at every
    position: one position's term each (the loss is a sum over positions)."""
    pure = DistillConfig(teacher_path="t", coef=1.0, reward_coef=0.0)
    p_nv = F.softmax(student_nv / T, dim=-1).detach()
    grad_nv = torch.zeros_like(student_nv)
    value = 0.0
    for n in range(N):
        for y in range(V):
            z_nv = student_nv.detach().clone().requires_grad_(True)
            loss, _ = _distill_loss(z_nv, teacher_nv, y, pure)
            per_position = torch.autograd.grad(loss, z_nv)[0][n]  # positions do not interact
            grad_nv[n] += p_nv[n, y] * per_position
            kl_n = -distill_advantages(
                F.log_softmax(teacher_nv / T, -1)[n, y], F.log_softmax(z_nv / T, -1)[n, y], torch.tensor(1.0)
            )
            value += float(p_nv[n, y] * kl_n) / N
    return grad_nv, value


def _plain_reverse_kl(student_nv: torch.Tensor, teacher_nv: torch.Tensor) -> torch.Tensor:
    """KL(pi_S || pi_T) per position, summed over the vocabulary in plain PyTorch, mean over positions."""
    log_s = F.log_softmax(student_nv / T, dim=-1)
    log_t = F.log_softmax(teacher_nv / T, dim=-1)
    return (log_s.exp() * (log_s - log_t)).sum(-1).mean()


def test_distill_advantage_is_the_logprob_difference_of_full_vocabulary_logits() -> None:
    student, teacher = _logits(0), _logits(1)
    y = torch.tensor([[3], [0], [10]])
    lp_s, _ = vocab_parallel_logprobs(student[:, None], y, tp_group=None, vocab_start=0, temperature=T)
    lp_t, _ = vocab_parallel_logprobs(teacher[:, None], y, tp_group=None, vocab_start=0, temperature=T)
    plain = (F.log_softmax(teacher / T, -1) - F.log_softmax(student / T, -1)).gather(-1, y)
    mask = torch.tensor([[1.0], [1.0], [0.0]])
    got = distill_advantages(lp_t, lp_s, mask)
    assert torch.allclose(got, plain * mask, atol=1e-6, rtol=0)
    assert sampled_reverse_kl(lp_t, lp_s, mask).item() == pytest.approx(-plain[:2].mean().item(), abs=1e-6)
    mixed = mixed_advantages(torch.tensor([0.5, -1.0, 2.0]), got, mask, reward_coef=0.25, coef=2.0)
    assert torch.allclose(mixed, (0.25 * torch.tensor([[0.5], [-1.0], [0.0]]) + 2.0 * got) * mask)


def test_expected_gradient_equals_the_full_vocabulary_reverse_kl_in_plain_pytorch() -> None:
    student, teacher = _logits(2), _logits(3)
    grad, value = _expected_over_tokens(student, teacher)
    z = student.clone().requires_grad_(True)
    kl = _plain_reverse_kl(z, teacher)
    (want,) = torch.autograd.grad(kl, z)
    assert value == pytest.approx(kl.item(), abs=1e-6)
    assert torch.allclose(grad, want, atol=1e-6, rtol=1e-5), (grad - want).abs().max()


def test_expected_gradient_equals_trl_gkd_at_its_reverse_kl_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # TRL's GKD loss (Agarwal et al. 2024) at beta = 1 of its generalized JSD is KL(student || teacher),
    # both at the temperature, "batchmean" over [batch, 1 position]: the per-position mean
    # (trl/experimental/gkd/gkd_trainer.py:GKDTrainer.generalized_jsd_loss, TRL 1.16). Fully on
    # policy (GKD's lmbda = 1: the student's own samples) the two objectives are the same.
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL 1.16 keeps GKD under trl.experimental
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    student, teacher = _logits(4), _logits(5)
    grad, value = _expected_over_tokens(student, teacher)
    z = student.clone().requires_grad_(True)
    trl_loss = gkd.GKDTrainer.generalized_jsd_loss(
        z[:, None, :], teacher[:, None, :], beta=1.0, temperature=T, reduction="batchmean"
    )
    (want,) = torch.autograd.grad(trl_loss, z)
    assert value == pytest.approx(trl_loss.item(), abs=1e-6)
    assert torch.allclose(grad, want, atol=1e-6, rtol=1e-5), (grad - want).abs().max()


def test_reverse_kl_metric_is_declared_and_reduced_over_tokens() -> None:
    assert LOSS_METRICS["distill/reverse_kl"] is Reduction.TOKEN_MEAN
    student, teacher = _logits(6), _logits(7)
    _, out = _distill_loss(student, teacher, 4, DistillConfig(teacher_path="t", coef=1.0))
    lp = F.log_softmax(student / T, -1)[:, 4] - F.log_softmax(teacher / T, -1)[:, 4]
    # the loss function reports token sums; reduce_metrics divides by the global token count
    assert out["distill/reverse_kl"].item() == pytest.approx(lp.sum().item(), abs=1e-5)


@pytest.mark.parametrize("distill", [None, DistillConfig(), DistillConfig(teacher_path="t", coef=0.0)])
def test_coef_zero_is_plain_grpo_bit_for_bit(distill: DistillConfig | None) -> None:
    gen = torch.Generator().manual_seed(8)
    samples = make_samples(
        [[1, 2], [3]], [[4, 5, 6], [7, 8]], [[-0.5, -1.0, -2.0], [-0.1, -0.3]], [1.0, -1.0]
    )
    mb = collate(samples, [0, 1], pad_id=0)
    logits = torch.randn(2, mb.labels_bs.shape[1], 9, generator=gen)

    def run(d: DistillConfig | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        z = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(z, mb.labels_bs, tp_group=None, vocab_start=0, with_entropy=True)
        loss, out = GRPOLoss(AlgorithmConfig(), 0.0, 4, False, distill=d).loss_fn(2.0)(lp, ent, mb)
        loss.backward()
        assert z.grad is not None
        return loss.detach(), z.grad, out

    base, with_d = run(None), run(distill)
    assert torch.equal(base[0], with_d[0]) and torch.equal(base[1], with_d[1])
    assert base[2].keys() == with_d[2].keys() and all(torch.equal(base[2][k], with_d[2][k]) for k in base[2])


def test_teacher_logprobs_travel_with_the_samples() -> None:
    samples = make_samples([[1, 2], [3]], [[4, 5], [6, 7, 8]], [[-1.0, -2.0], [-1.0, -1.0, -1.0]], [0.0, 0.0])
    outputs = [torch.arange(8, dtype=torch.float32).reshape(2, 4)]
    scatter_logprobs(samples, [[0, 1]], outputs, "teacher")
    assert samples[0].teacher_logprobs_s.tolist() == [0, 1, 2]  # type: ignore[union-attr]
    assert samples[1].teacher_logprobs_s.tolist() == [4, 5, 6]  # type: ignore[union-attr]
    teacher_bs = LossInputs.of(collate(samples, [0, 1], pad_id=0, packed=True)).teacher_logprobs_bs
    assert teacher_bs is not None and teacher_bs.tolist() == [[0, 1, 2], [4, 5, 6]]
    assert samples[0].ref_logprobs_s is None and samples[0].old_logprobs_s is None


def test_placeholder_microbatch_needs_no_teacher_logprobs() -> None:
    mb = collate([], [], pad_id=0)
    lp = torch.zeros(1, 1, requires_grad=True)
    loss_fn = GRPOLoss(
        AlgorithmConfig(), 0.0, 4, False, distill=DistillConfig(teacher_path="t", coef=1.0)
    ).loss_fn(2.0)
    loss, out = loss_fn(lp, None, mb)
    assert loss.item() == 0.0 and out["distill/reverse_kl"].item() == 0.0


@pytest.mark.launches
def test_teacher_logprobs_at_tp2_and_ep2_equal_the_one_process_teacher(tmp_path: Path) -> None:
    # The teacher (a tiny Qwen3-MoE saved by transformers) built by training/teacher.py and run by
    # the teacher pass at TP2 (sequence parallel) and EP2 (2 ranks, one launch) against the
    # one-process teacher, and that one against transformers' own logprobs of the same weights.
    from tests.helpers.dist import run_distributed
    from tests.workers.bridge_workers import save_tiny_model
    from tests.workers.distill_workers import PROMPT

    teacher = tmp_path / "teacher"
    hf_logprobs = save_tiny_model("qwen3_moe", teacher, seed=0)["logprobs"][:, PROMPT - 1 :]
    target = "tests.workers.distill_workers:layouts"
    (one,) = run_distributed(target, 1, timeout_s=180, teacher_dir=str(teacher), layouts={"one": []})
    single = one["one"][:, PROMPT - 1 :]
    assert (single - hf_logprobs).abs().max().item() <= 1e-5
    assert (one["one"][:, : PROMPT - 1] == 0).all()  # prompt positions carry no logprob
    two = {"TP2": ["parallel.tp=2"], "EP2": ["parallel.ep=2"]}
    for rank_results in run_distributed(target, 2, timeout_s=300, teacher_dir=str(teacher), layouts=two):
        for name in two:
            diff = (rank_results[name] - one["one"]).abs().max().item()
            assert diff <= 1e-5, f"{name}: the teacher's logprobs differ from one process by {diff:.3g}"


# ----------------------------------------------------------------------------------------------------
# The teacher's checks (grpo-megatron check and the job's start) and a distillation job.

DEMO_DIR = Path(__file__).resolve().parents[1] / "examples" / "demo"


def _teacher_dir(
    out: Path, model_type: str = "qwen3", tokenizer: Path = DEMO_DIR, weights: bool = True
) -> Path:
    """A tiny teacher of ``model_type`` with the demo's vocabulary, random weights saved by
    transformers (or none), and ``tokenizer``'s tokenizer files."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers.tiny_configs import tiny_hf_config

    config = tiny_hf_config(model_type, vocab_size=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    out.mkdir(parents=True)
    if weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(out)
    else:
        (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    return out


def _demo_config(*overrides: str):  # type: ignore[no-untyped-def]
    from grpo_megatron.config import load_config

    return load_config(DEMO_DIR.parent / "demo.yaml", list(overrides))


def test_check_accepts_a_teacher_of_another_architecture_and_size(tmp_path: Path) -> None:
    from grpo_megatron.config import preflight_errors, validate

    teacher = _teacher_dir(tmp_path / "teacher")  # a dense Qwen3 teacher of the MoE demo student
    cfg = _demo_config(f"distill.teacher_path={teacher}", "distill.coef=1.0")
    validate(cfg, world_size=2)  # EP2: the dense teacher has no experts to spread
    assert preflight_errors(cfg, "check") == []


def test_check_refuses_a_teacher_with_another_vocabulary_naming_both(tmp_path: Path) -> None:
    from grpo_megatron.config import preflight_errors
    from grpo_megatron.data.tokenizer import build_char_tokenizer

    other = tmp_path / "other_tokenizer"
    build_char_tokenizer("9876543210+=", other)  # the demo's digits at other ids
    teacher = _teacher_dir(tmp_path / "teacher", tokenizer=other)
    (error,) = preflight_errors(_demo_config(f"distill.teacher_path={teacher}", "distill.coef=1.0"), "check")
    assert "is not the student's" in error and str(teacher) in error and "examples/demo" in error
    assert "tokens differ" in error and "student" in error and "teacher" in error


def test_check_refuses_a_teacher_without_weights_and_another_layout(tmp_path: Path) -> None:
    from grpo_megatron.config import ConfigError, preflight_errors, validate

    teacher = _teacher_dir(tmp_path / "teacher", weights=False)
    cfg = _demo_config(f"distill.teacher_path={teacher}", "distill.coef=1.0", "distill.tp=2")
    (error,) = preflight_errors(cfg, "check")
    assert "holds no *.safetensors" in error
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=2)
    (layout,) = info.value.errors
    assert (
        "distill.tp=2 differs from parallel.tp=1" in layout
        and "one model-parallel state per process" in layout
    )
    with pytest.raises(ConfigError, match="distill.teacher_path is empty"):
        validate(_demo_config("distill.coef=1.0"), world_size=2)
    served = _demo_config(f"distill.teacher_path={teacher}", "distill.coef=1.0", "distill.engine=sglang")
    with pytest.raises(
        ConfigError, match=r"distill.engine=sglang \(a teacher served by an SGLang engine\) is not"
    ):
        validate(served, world_size=2)
    with pytest.raises(ConfigError, match="drops groups of equal rewards"):
        validate(
            _demo_config(
                f"distill.teacher_path={teacher}",
                "distill.coef=1.0",
                "distill.reward_coef=0.0",
                "algorithm.dynamic_sampling.enabled=true",
            ),
            world_size=2,
        )
    odd = _teacher_dir(tmp_path / "odd", "qwen3_moe", weights=False)  # 4 experts: EP 3 cannot split them
    cfg = _demo_config(
        f"distill.teacher_path={odd}", "distill.coef=1.0", "distill.hf_overrides={num_experts: 3}"
    )
    with pytest.raises(ConfigError, match="the distillation teacher .* parallel.ep=2 does not divide"):
        validate(cfg, world_size=2)


def test_plan_counts_the_teacher(tmp_path: Path) -> None:
    from grpo_megatron.planner import memory

    recipe = Path(__file__).resolve().parents[1] / "examples" / "recipes" / "distill_qwen3_30b_a3b_to_8b.yaml"
    from grpo_megatron.config import load_config

    cfg = load_config(recipe, [])
    opts = memory.PlanOptions(gpus_per_node=8, gpu=memory.GPUS["h100"])
    plan = memory.plan_memory(cfg, cfg.model.load_hf_config(), 16, opts)
    teacher = [line for line in plan.phases["train"] if line.name == "distillation teacher"]
    assert len(teacher) == 1 and 14 < teacher[0].gib < 15  # 30.5B / TP 4 in bf16 = 15.3 GB = 14.2 GiB
    assert not any(line.name == "distillation teacher" for line in plan.phases["rollout"])  # on_cpu
    resident = memory.plan_memory(_replace_distill(cfg, on_cpu=False), cfg.model.load_hf_config(), 16, opts)
    assert any(line.name == "distillation teacher" for line in resident.phases["rollout"])


def _replace_distill(cfg, **changes):  # type: ignore[no-untyped-def]
    import dataclasses

    return dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, **changes))


@pytest.mark.launches
def test_distillation_job_with_lora_partial_rollouts_and_context_parallelism(tmp_path: Path) -> None:
    # One job, every arrangement the distillation advantage must pass through: a dense teacher of the
    # MoE demo student at CP2 x EP2 (packed sequences split over the CP ranks), a LoRA student, partial
    # rollouts one version off (IcePop weighting the advantage like any other), top-k sampling (the
    # teacher unscathed by it). Two iterations.
    from grpo_megatron.logging_utils.metrics import read_jsonl
    from tests.helpers.runs import SMALL, finish, launch

    teacher = _teacher_dir(tmp_path / "teacher")
    run = tmp_path / "run"
    extra = [
        f"distill.teacher_path={teacher}",
        "distill.coef=1.0",
        "distill.reward_coef=0.5",
        "parallel.cp=2",
        "model.lora.rank=4",
        "rollout.partial.enabled=true",
        "rollout.partial.segment_tokens=3",
        "train.max_staleness=1",
        "algorithm.off_policy.correction=icepop",
        "rollout.top_k=4",  # the student samples from its top 4; the teacher grades with all 32 tokens
    ]
    out = finish(launch("train", [*SMALL, *extra, "train.iterations=2", f"logging.run_dir={run}"]))
    assert "distillation teacher qwen3" in out
    trained = [r for r in read_jsonl(run / "metrics.jsonl") if r["iteration"] > 0]
    assert [r["iteration"] for r in trained] == [1, 2]
    for r in trained:
        assert r["time/teacher_logprob"] > 0 and r["distill/teacher_bytes"] > 0
        # a random student and a random teacher: the estimate of their KL, finite and not 0
        assert math.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] != 0.0
        # the teacher's full distribution: a token outside its own top 4 would score the truncation
        # floor (-100: models/logprobs.py) and the estimate would be near 100
        assert abs(r["distill/reverse_kl"]) < 10.0
