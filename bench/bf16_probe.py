"""bf16 mismatch probe beside its noise floor: how far the trainer's logprobs are from the engine's.

One process. The policy (megatron, local spec) and the embedded rollout engine (transformers) are
built in bf16 from the job config; the trainer's weights are synced into the engine, and on one
fixed batch of random token sequences (teacher-forced, ``--rows`` x ``--length``, logprobs after
a ``--prompt-len`` prefix) the script reports:

- probe: |trainer logprob - engine logprob|, mean and max (what ``mismatch/probe_*`` logs);
- floor: |engine bf16 logprob - engine fp32 logprob| on the same weights (an fp32 copy of the
  engine's bf16 model): the rounding noise of running the model in bf16 at all. A probe above the
  floor means the two sides compute different things, not just round differently.
- for an MoE model: the share of token-layer routes where the trainer's experts differ from the
  engine's (route_disagreement), and the probe again with the engine's routes replayed in the
  trainer (probe_replay_*, routing replay r3).

    python bench/bf16_probe.py                                  # examples/demo.yaml, CPU
    python bench/bf16_probe.py --config examples/tiny_moe.yaml --override model.hf_overrides.hidden_size=1024
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _stats(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    diff = torch.cat([(torch.tensor(x) - torch.tensor(y)).abs() for x, y in zip(a, b, strict=True)])
    return float(diff.mean()), float(diff.max())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "demo.yaml")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--train-steps", type=int, default=2, help="optimizer steps before the probe")
    parser.add_argument("--override", action="append", default=[], help="config override section.key=value")
    args = parser.parse_args()

    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed
    from grpo_megatron.rollout.embedded import EmbeddedEngine
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.forward_backward import MicroBatch, forward_backward
    from grpo_megatron.training.job import engine_spec
    from grpo_megatron.training.phases.sync import ProbeBatch, mismatch_probe
    from grpo_megatron.training.policy import build_policy

    backend = "gloo" if args.device == "cpu" else "nccl"
    overrides = [
        "model.dtype=bfloat16",
        "parallel.ep=1",
        f"parallel.backend={backend}",
        "model.transformer_impl=local",
    ]
    cfg = load_config(args.config, [*overrides, *args.override])
    validate(cfg, 1)
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    policy = build_policy(hf, cfg.model, cfg.parallel, cfg.train, ps)
    gen = torch.Generator().manual_seed(0)
    tokens_bl = torch.randint(3, int(hf["vocab_size"]), (args.rows, args.length), generator=gen)
    # A few steps move the norm weights off their initial ones (where bf16 and fp32 agree exactly).
    for _ in range(args.train_steps):
        policy.zero_grad()
        forward_backward(
            policy.model,
            [MicroBatch(tokens_bl[:, :-1], tokens_bl[:, 1:])],
            ps,
            lambda lp, _h, _mb: (-lp.mean(), {}),
            vocab_size=int(hf["vocab_size"]),
        )
        policy.step()
    fleet = RolloutFleet.build(engine_spec(cfg), hf, ps)
    fleet.sync_weights(policy.model, version=1)
    sequences = tokens_bl.tolist()
    prompt_lens = [args.prompt_len] * args.rows
    probe = mismatch_probe(
        policy.model,
        fleet,
        ps,
        ProbeBatch(sequences, prompt_lens),
        vocab_size=int(hf["vocab_size"]),
        temperature=1.0,
    )

    engine = fleet.engine
    assert isinstance(engine, EmbeddedEngine)
    fp32_engine = EmbeddedEngine(hf, device=ps.device, dtype=torch.float32)
    fp32_engine.model.load_state_dict({k: v.float() for k, v in engine.model.state_dict().items()})
    bf16_lp = engine.score(sequences, prompt_lens, 1.0)
    fp32_lp = fp32_engine.score(sequences, prompt_lens, 1.0)
    floor_mean, floor_max = _stats(bf16_lp, fp32_lp)
    result = {
        "model": f"{hf['model_type']} hidden {hf['hidden_size']} layers {hf['num_hidden_layers']} vocab {hf['vocab_size']}",
        "tokens": probe["mismatch/probe_tokens"],
        "probe_mean": probe["mismatch/probe_abs_diff_mean"],
        "probe_max": probe["mismatch/probe_abs_diff_max"],
        "floor_mean": floor_mean,
        "floor_max": floor_max,
    }
    if "mismatch/probe_replay_abs_diff_mean" in probe:
        result |= {
            "route_disagreement": probe.get("routing/probe_disagreement"),
            "probe_replay_mean": probe["mismatch/probe_replay_abs_diff_mean"],
            "probe_replay_max": probe["mismatch/probe_replay_abs_diff_max"],
        }
    print(json.dumps(result, indent=1))
    fleet.shutdown()
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
