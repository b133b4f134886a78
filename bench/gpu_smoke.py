"""GPU smoke run of the colocated GRPO loop: tiny MoE policy, rollout engine, offload and weight sync.

One process, one device. The policy is the tiny Qwen3-MoE of examples/tiny_moe.yaml on megatron's
local spec; the rollout engine is the embedded transformers engine on the same device. Each of the
iterations runs, and times, the colocated sequence:

    generate -> engine releases memory -> onload trainer -> GRPO train step
      -> offload grads + optimizer -> engine resumes weights -> weight sync + mismatch probe
      -> offload parameters -> (next generate)

and prints the device memory left after each offload. When ``sglang`` imports (and the device is a
GPU) the same loop runs again with ``rollout.engine=sglang`` on a copy of the policy saved to disk.
Not part of the test suite; it must finish in well under 8 minutes on one GPU.

    python bench/gpu_smoke.py                    # the first GPU
    python bench/gpu_smoke.py --device cpu       # a quick check anywhere
    python bench/gpu_smoke.py --override model.hf_overrides.hidden_size=512 --prompts 32
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_moe.yaml"


def memory() -> str:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return "n/a (CPU)"
    return f"{torch.cuda.memory_allocated() / 2**20:.1f} MiB allocated"


@contextmanager
def phase(times: dict[str, float], name: str):
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    start = time.perf_counter()
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    times[name] = times.get(name, 0.0) + time.perf_counter() - start


def grpo_step(policy, ps, hf, cfg, prompts, completions) -> dict[str, float]:
    """One on-policy GRPO update with a toy reward: the share of even token ids in a response."""
    from grpo_megatron.algorithm.advantages import group_advantages
    from grpo_megatron.algorithm.policy_loss import grpo_policy_loss
    from grpo_megatron.training.forward_backward import MicroBatch, forward_backward

    sequences, prompt_lens, rewards = [], [], []
    for prompt, group in zip(prompts, completions, strict=True):
        for c in group:
            sequences.append(list(prompt) + c.token_ids)
            prompt_lens.append(len(prompt))
            rewards.append(sum(t % 2 == 0 for t in c.token_ids) / max(len(c.token_ids), 1))
    n = len(completions[0])
    advantages_b = group_advantages(torch.tensor(rewards), n)
    length = max(len(s) for s in sequences)
    tokens_bl = torch.zeros((len(sequences), length), dtype=torch.long)
    mask_bt = torch.zeros((len(sequences), length - 1))
    for i, (s, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        tokens_bl[i, : len(s)] = torch.tensor(s)
        mask_bt[i, p - 1 : len(s) - 1] = 1
    normalizer = float(mask_bt.sum())

    def loss_fn(logprobs_bt, entropy_bt, mb):
        return grpo_policy_loss(
            logprobs_bt, None, mb.extras["adv"], mb.extras["mask"], cfg.algorithm, normalizer=normalizer
        )

    policy.zero_grad()
    forward_backward(
        policy.model,
        [MicroBatch(tokens_bl[:, :-1], tokens_bl[:, 1:], extras={"adv": advantages_b, "mask": mask_bt})],
        ps,
        loss_fn,
        vocab_size=hf["vocab_size"],
        temperature=cfg.rollout.temperature,
    )
    return policy.step() | {"reward": sum(rewards) / len(rewards)}


def run_loop(label: str, cfg, hf, ps, policy, args) -> None:
    from grpo_megatron.rollout.engine import SamplingParams
    from grpo_megatron.rollout.fleet import RolloutFleet, probe_batch
    from grpo_megatron.training.offload import offload, onload

    print(f"[{label}] building the rollout fleet ({cfg.rollout.engine} engine) ...", flush=True)
    start = time.perf_counter()
    fleet = RolloutFleet.build(cfg, hf, ps)
    first_sync = fleet.sync_weights(policy.model, version=0)
    print(
        f"[{label}] fleet ready in {time.perf_counter() - start:.2f}s; first sync "
        f"{first_sync['sync/seconds']:.3f}s for {first_sync['sync/bytes'] / 2**20:.2f} MiB; memory {memory()}"
    )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, hf["vocab_size"], (args.prompts, args.prompt_len), generator=gen).tolist()
    reports: list = []
    probe: tuple[list[list[int]], list[int]] | None = None
    for it in range(args.iterations):
        times: dict[str, float] = {}
        params = SamplingParams(
            n=cfg.rollout.n_samples_per_prompt,
            temperature=cfg.rollout.temperature,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop_token_ids=(int(hf["eos_token_id"]),),
            seed=it,
        )
        with phase(times, "generate"):
            completions = fleet.generate(prompts, params)
        if probe is None:
            probe = probe_batch(prompts, completions, size=cfg.rollout.probe_batch)
        with phase(times, "engine_release"):
            fleet.release_memory()
        with phase(times, "onload"):
            for report in reversed(reports):
                onload(policy, report)
            reports = []
        with phase(times, "train"):
            step = grpo_step(policy, ps, hf, cfg, prompts, completions)
        with phase(times, "offload_opt"):
            reports.append(offload(policy, parts=("grads", "optimizer"), discard_grads=True))
        left_opt = memory()
        with phase(times, "engine_resume"):
            fleet.resume_memory(["weights"])
        with phase(times, "sync"):
            sync = fleet.sync_weights(policy.model, version=it + 1)
        with phase(times, "probe"):
            mismatch = fleet.mismatch_probe(policy.model, ps, *probe, temperature=cfg.rollout.temperature)
        with phase(times, "offload_params"):
            reports.append(offload(policy, parts=("params",)))
        left_all = memory()
        with phase(times, "engine_resume"):
            fleet.resume_memory(["kv_cache", "cuda_graph"])
        moved = sum(r.bytes_moved for r in reports) / 2**20
        tokens = sum(len(c.token_ids) for g in completions for c in g)
        print(
            f"[{label}] iter {it}: reward {step['reward']:.3f} grad_norm {step['grad_norm']:.3f} "
            f"tokens {tokens} | " + " ".join(f"{k} {v:.3f}s" for k, v in times.items())
        )
        print(
            f"[{label}]   offload moved {moved:.2f} MiB; memory left after grads+optimizer offload: {left_opt}; "
            f"after params offload: {left_all} | sync {sync['sync/bytes'] / 2**20:.2f} MiB in "
            f"{sync['sync/buckets']:.0f} buckets | mismatch max {mismatch['mismatch/probe_abs_diff_max']:.2e} "
            f"mean {mismatch['mismatch/probe_abs_diff_mean']:.2e}"
        )
    for report in reversed(reports):
        onload(policy, report)
    fleet.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--no-sglang", action="store_true", help="skip the SGLang loop even if sglang imports"
    )
    parser.add_argument("--override", action="append", default=[], help="config override section.key=value")
    args = parser.parse_args()

    from grpo_megatron.config import load_config
    from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed
    from grpo_megatron.training.policy import build_policy

    overrides = [
        "model.transformer_impl=local",
        f"parallel.backend={'gloo' if args.device == 'cpu' else 'nccl'}",
        f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.sync_bucket_mb=1",  # several buckets even for the tiny model
        *args.override,
    ]
    cfg = load_config(EXAMPLE, overrides)
    cfg.validate(1)
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    print(
        f"device {ps.device} ({torch.cuda.get_device_name() if ps.device.type == 'cuda' else 'CPU'}); {ps.describe()}"
    )
    total = time.perf_counter()
    policy = build_policy(hf, cfg, ps)
    params = sum(p.numel() for p in policy.model.parameters())
    print(f"policy: {hf['model_type']} {params / 1e6:.2f}M parameters, {cfg.model.dtype}; memory {memory()}")
    failed = False
    run_loop("embedded", cfg, hf, ps, policy, args)

    sglang_ok = importlib.util.find_spec("sglang") is not None
    if args.no_sglang or not sglang_ok or ps.device.type != "cuda":
        why = (
            "--no-sglang" if args.no_sglang else "sglang not importable" if not sglang_ok else "not on a GPU"
        )
        print(f"[sglang] skipped: {why}")
    else:
        from grpo_megatron.bridge.export import write_hf_checkpoint

        with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as tmp:
            out_dir = Path(tmp) / "policy"
            write_hf_checkpoint(policy.model, ps, hf, out_dir)
            sg_cfg = dataclasses.replace(
                cfg,
                model=dataclasses.replace(cfg.model, hf_path=str(out_dir)),
                rollout=dataclasses.replace(cfg.rollout, engine="sglang"),
            )
            try:
                run_loop("sglang", sg_cfg, hf, ps, policy, args)
            except Exception as exc:  # report and fail the run, after the embedded results are printed
                print(f"[sglang] FAILED: {type(exc).__name__}: {exc}")
                failed = True
    print(f"total {time.perf_counter() - total:.1f}s; {'FAILED' if failed else 'OK'}")
    destroy_distributed()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
