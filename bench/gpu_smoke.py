"""GPU smoke run of the colocated GRPO loop: tiny MoE policy, rollout engine, offload and weight sync.

One process, one device. The policy is the tiny Qwen3-MoE of examples/tiny_moe.yaml on megatron's
local spec; the rollout engine is the embedded transformers engine on the same device. Each of the
iterations runs, and times, the colocated sequence:

    generate -> engine releases memory -> onload trainer -> GRPO train step
      -> offload grads + optimizer -> engine resumes weights -> weight sync + mismatch probe
      -> offload parameters -> (next generate)

with the trainer's own ``ColocatedMemory`` (training/offload.py) doing every memory move, in its order.

and prints the device memory left after each offload. When ``sglang`` imports (and the device is a
GPU) the same loop runs again with ``rollout.engine=sglang`` on a copy of the policy saved to disk.
Not part of the test suite; it must finish in well under 8 minutes on one GPU.

MoE routing (``--routing-replay off,r3``): the train step compares the trainer's own experts with
the engine's (``route_disagreement``, the share of token-layer routes whose expert sets differ) and,
with r3 listed, replays the engine's experts; the mismatch probe reports its logprob difference
without and with replay of the engine's routes (``probe_*`` / ``probe_replay_*``); on a bf16 model the
last iteration also measures the noise floor (the engine's bf16 logprobs vs an fp32 copy of it).

    python bench/gpu_smoke.py                    # the first GPU
    python bench/gpu_smoke.py --device cpu       # a quick check anywhere
    python bench/gpu_smoke.py --override model.hf_overrides.hidden_size=512 --prompts 32
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_moe.yaml"


def sglang_unavailable(device: torch.device) -> str | None:
    """Why SGLang's Engine cannot run here, or None when it can (a GPU job and ``sglang.Engine`` imports)."""
    if device.type != "cuda":
        return "not on a GPU"
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    try:
        from sglang import Engine  # noqa: F401
    except Exception as exc:  # a broken install (kernels built for another torch, ...) is a skip with its reason
        return f"sglang.Engine does not import: {type(exc).__name__}: {exc}"
    return None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def memory(device: torch.device) -> str:
    if not on_cuda(device):
        return "n/a (CPU)"
    return f"{torch.cuda.memory_allocated() / 2**20:.1f} MiB allocated"


@contextmanager
def phase(times: dict[str, float], name: str, device: torch.device) -> Iterator[None]:
    if on_cuda(device):
        torch.cuda.synchronize()
    start = time.perf_counter()
    yield
    if on_cuda(device):
        torch.cuda.synchronize()
    times[name] = times.get(name, 0.0) + time.perf_counter() - start


def copy_seconds(nbytes: int, device: torch.device) -> float:
    """Seconds of one device-to-device copy of ``nbytes`` (the bound a same-device sync could reach)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: allocation and the copy kernel's first launch
    if on_cuda(device):
        torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src)
    if on_cuda(device):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del src, dst
    return seconds


def active_parameters(model: torch.nn.Module, hf: dict[str, Any]) -> float:
    """Parameters one token passes through: every non-expert one, and top-k of the experts' share."""
    total = expert = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if ".experts." in name:
            expert += param.numel()
    num_experts = hf.get("num_experts") or hf.get("n_routed_experts") or 0
    if not num_experts:
        return float(total)
    return float(total - expert) + expert * hf["num_experts_per_tok"] / num_experts


def grpo_step(
    policy: Any, ps: Any, hf: dict[str, Any], cfg: Any, prompts: Any, completions: Any, *, replay: bool = False
) -> dict[str, float]:
    """One on-policy GRPO update with a toy reward: the share of even token ids in a response. With
    the engine's routes (an MoE model), the trainer's experts are compared with them and, with
    ``replay``, the engine's are used (r3)."""
    from grpo_megatron.algorithm.advantages import group_advantages
    from grpo_megatron.algorithm.policy_loss import grpo_policy_loss
    from grpo_megatron.algorithm.routing_metrics import load_metrics
    from grpo_megatron.models.routing import RoutingPass, reduce_routing_stats
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
    batch = MicroBatch(tokens_bl[:, :-1], tokens_bl[:, 1:], extras={"adv": advantages_b, "mask": mask_bt})
    routed = [c.routed_experts for group in completions for c in group]
    routing = None
    if all(r is not None for r in routed):
        first = routed[0]
        batch.routes_lbsk = torch.full((first.shape[0], len(routed), length - 1, first.shape[2]), -1, dtype=first.dtype)
        for i, r in enumerate(routed):
            batch.routes_lbsk[:, i, : r.shape[1]] = r
        routing = RoutingPass(policy.model, ps, replay=replay)

    def loss_fn(
        logprobs_bt: torch.Tensor, entropy_bt: torch.Tensor | None, mb: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return grpo_policy_loss(
            logprobs_bt, None, mb.extras["adv"], mb.extras["mask"], cfg.algorithm, normalizer=normalizer
        )

    policy.zero_grad()
    forward_backward(
        policy.model, [batch], ps, loss_fn, vocab_size=hf["vocab_size"], temperature=cfg.rollout.temperature,
        routing=routing,
    )  # fmt: skip
    out = {"reward": sum(rewards) / len(rewards), "train_tokens": float(tokens_bl.numel())}
    if routing is not None:
        compare_m2, counts_me = reduce_routing_stats(*routing.stats(), ps)
        routing.close()
        out["route_disagreement"] = float(compare_m2[:, 0].sum() / compare_m2[:, 1].sum().clamp(min=1))
        load = load_metrics(counts_me, per_layer=False)
        out["load_max_over_mean"] = load.get("routing/load_max_over_mean", float("nan"))
        out["load_cv"] = load.get("routing/load_cv", float("nan"))
    return policy.step() | out


def noise_floor(engine: Any, sequences: list[list[int]], prompt_lens: list[int], temperature: float) -> dict[str, float]:
    """|engine logprob - the same engine in fp32| on the probe batch: the rounding noise of running the
    model in a narrower dtype at all (an fp32 copy of the engine's own weights)."""
    from grpo_megatron.rollout.embedded import EmbeddedEngine

    fp32 = EmbeddedEngine(engine.model.config.to_dict(), device=engine.device, dtype=torch.float32)
    fp32.model.load_state_dict({k: v.float() for k, v in engine.model.state_dict().items()})
    low = engine.score(sequences, prompt_lens, temperature)
    high = fp32.score(sequences, prompt_lens, temperature)
    fp32.shutdown()
    diff = torch.cat([(torch.tensor(a) - torch.tensor(b)).abs() for a, b in zip(low, high, strict=True)])
    return {"floor_abs_diff_mean": float(diff.mean()), "floor_abs_diff_max": float(diff.max())}


def run_loop(label: str, cfg: Any, hf: dict[str, Any], ps: Any, policy: Any, args: argparse.Namespace) -> list[dict[str, float]]:
    """The colocated loop above, ``args.iterations`` times; one record of measurements per iteration."""
    from grpo_megatron.rollout.engine import SamplingParams
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.job import engine_spec
    from grpo_megatron.training.offload import ColocatedMemory
    from grpo_megatron.training.phases.sync import ProbeBatch, mismatch_probe, probe_batch

    device = ps.device
    print(f"[{label}] building the rollout fleet ({cfg.rollout.engine} engine) ...", flush=True)
    start = time.perf_counter()
    fleet = RolloutFleet.build(engine_spec(cfg), hf, ps)
    first_sync = fleet.sync_weights(policy.model, version=0)
    print(
        f"[{label}] fleet ready in {time.perf_counter() - start:.2f}s; first sync "
        f"{first_sync['sync/seconds']:.3f}s for {first_sync['sync/bytes'] / 2**20:.2f} MiB; memory {memory(device)}"
    )
    engine_model = getattr(fleet.engine, "model", None)  # the embedded engine's, in this process
    engine_bytes = (
        sum(p.numel() * p.element_size() for p in engine_model.parameters()) if engine_model is not None else 0
    )
    active = active_parameters(policy.model, hf)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, hf["vocab_size"], (args.prompts, args.prompt_len), generator=gen).tolist()
    # The trainer's colocated choreography (train.offload_trainer), the same object and order; gradients
    # are discarded, not copied: this loop zeroes them before its next step anyway.
    assert fleet.placement is not None  # RolloutFleet.build decides it
    offloading = dataclasses.replace(fleet.placement, offload_trainer=True, swaps_engine_memory=True)
    colocated = ColocatedMemory(policy, fleet, offloading.phases(), discard_grads=True)
    records: list[dict[str, float]] = []
    probe: ProbeBatch | None = None
    if on_cuda(device):
        torch.cuda.reset_peak_memory_stats()
    for it in range(args.iterations):
        times: dict[str, float] = {}
        params = SamplingParams(
            n=cfg.rollout.n_samples_per_prompt,
            temperature=cfg.rollout.temperature,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop_token_ids=(int(hf["eos_token_id"]),),
            seed=it,
            routes=True,
        )
        with phase(times, "generate", device):
            completions = fleet.generate(prompts, params)
            # this smoke trains the whole batch on every rank: every route to every rank
            routes = fleet.deliver_routes({c.route_id: range(ps.world_size) for g in completions for c in g
                                           if c.route_id is not None})  # fmt: skip
            for c in (c for g in completions for c in g):
                c.routed_experts = routes.get(c.route_id) if c.route_id is not None else None
        if probe is None:
            probe = probe_batch(prompts, [[c.token_ids for c in g] for g in completions], size=cfg.rollout.probe_batch)
        with phase(times, "onload", device):  # engines release, then the trainer's state returns
            colocated.to_trainer()
        with phase(times, "train", device):
            step = grpo_step(policy, ps, hf, cfg, prompts, completions, replay="r3" in args.routing_replay)
        with phase(times, "offload", device):  # grads + optimizer out, engine weights back
            colocated.before_sync()
        left_opt = memory(device)
        with phase(times, "sync", device):
            sync = fleet.sync_weights(policy.model, version=it + 1)
        copy_s = copy_seconds(int(sync["sync/bytes"]), device)
        with phase(times, "probe", device):
            mismatch = mismatch_probe(
                policy.model, fleet, ps, probe, vocab_size=int(hf["vocab_size"]), temperature=cfg.rollout.temperature
            )
        with phase(times, "offload", device):  # params out, engine caches back
            colocated.after_sync()
        left_all = torch.cuda.memory_allocated() if on_cuda(device) else None
        moved = sum(r.bytes_moved for r in colocated.offloaded)
        tokens = sum(len(c.token_ids) for g in completions for c in g)
        record = {
            "iteration": float(it),
            "rollout_tokens": float(tokens),
            "rollout_tokens_per_s": tokens / times["generate"],
            "train_tokens": step["train_tokens"],
            "train_seconds": times["train"],
            "train_tokens_per_s": step["train_tokens"] / times["train"],
            # 6 flops per active parameter per token (forward + backward); attention's share,
            # small at these lengths, is left out.
            "train_tflops": 6 * active * step["train_tokens"] / times["train"] / 1e12,
            "sync_bytes": sync["sync/bytes"],
            "sync_seconds": times["sync"],
            "sync_gb_per_s": sync["sync/bytes"] / times["sync"] / 1e9,
            "copy_gb_per_s": sync["sync/bytes"] / copy_s / 1e9,
            "offload_bytes": float(moved),
            "offload_seconds": times["offload"],
            "offload_gb_per_s": moved / times["offload"] / 1e9,
            "probe_abs_diff_mean": mismatch["mismatch/probe_abs_diff_mean"],
            "probe_abs_diff_max": mismatch["mismatch/probe_abs_diff_max"],
            "reward": step["reward"],
            "grad_norm": step["grad_norm"],
        }
        for key in ("route_disagreement", "load_max_over_mean", "load_cv"):
            if key in step:
                record[key] = step[key]
        if "mismatch/probe_replay_abs_diff_mean" in mismatch:
            record["probe_route_disagreement"] = mismatch.get("routing/probe_disagreement", float("nan"))
            record["probe_replay_abs_diff_mean"] = mismatch["mismatch/probe_replay_abs_diff_mean"]
            record["probe_replay_abs_diff_max"] = mismatch["mismatch/probe_replay_abs_diff_max"]
        engine = fleet.engine
        if it == args.iterations - 1 and cfg.model.dtype != "float32" and hasattr(engine, "model"):
            record |= noise_floor(engine, probe.sequences, probe.prompt_lens, cfg.rollout.temperature)
        if left_all is not None:
            record["left_after_offload_bytes"] = float(left_all)
            record["engine_weights_bytes"] = float(engine_bytes)
            record["trainer_left_bytes"] = float(left_all - engine_bytes)
            record["peak_bytes"] = float(torch.cuda.max_memory_allocated())
        else:  # the process's peak resident host memory (Linux reports KiB)
            record["peak_host_rss_bytes"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        records.append(record)
        print(
            f"[{label}] iter {it}: reward {step['reward']:.3f} grad_norm {step['grad_norm']:.3f} "
            f"tokens {tokens} | " + " ".join(f"{k} {v:.3f}s" for k, v in times.items())
        )
        print(
            f"[{label}]   offload moved {moved / 2**20:.2f} MiB; memory left after grads+optimizer offload: "
            f"{left_opt}; after params offload: {memory(device)} | sync {sync['sync/bytes'] / 2**20:.2f} MiB in "
            f"{sync['sync/buckets']:.0f} buckets | mismatch max {mismatch['mismatch/probe_abs_diff_max']:.2e} "
            f"mean {mismatch['mismatch/probe_abs_diff_mean']:.2e}"
        )
    colocated.trainer_back()
    fleet.shutdown()
    return records


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the same loop on CPU (gloo)"
    )
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--no-sglang", action="store_true", help="skip the SGLang loop even if sglang imports"
    )
    parser.add_argument(
        "--sglang-only", action="store_true", help="run only the SGLang loop (the embedded one is skipped)"
    )
    parser.add_argument("--override", action="append", default=[], help="config override section.key=value")
    parser.add_argument(
        "--routing-replay",
        type=lambda text: [m for m in text.split(",") if m],
        default=["off"],
        help="MoE routing modes to report, from off,r3: with r3 the train step replays the engine's experts; "
        "the probe always reports both (without and with replay) when the engine reports routes",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="write every loop's per-iteration measurements here"
    )
    args = parser.parse_args()
    if not set(args.routing_replay) <= {"off", "r3"}:
        parser.error(f"--routing-replay {','.join(args.routing_replay)}: choose from off, r3")

    from grpo_megatron.config import load_config, validate
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
    validate(cfg, 1)
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    print(
        f"device {ps.device} ({device_name(ps.device)}); {ps.describe()}"
    )
    total = time.perf_counter()
    policy = build_policy(hf, cfg.model, cfg.parallel, cfg.train, ps)
    params = sum(p.numel() for p in policy.model.parameters())
    print(f"policy: {hf['model_type']} {params / 1e6:.2f}M parameters, {cfg.model.dtype}; memory {memory(ps.device)}")
    failed = False
    results: dict = {
        "device": device_name(ps.device),
        "dtype": cfg.model.dtype,
        "parameters": float(params),
        "active_parameters": active_parameters(policy.model, hf),
    }
    if not args.sglang_only:
        results["embedded"] = run_loop("embedded", cfg, hf, ps, policy, args)

    why = sglang_unavailable(ps.device) if not args.no_sglang else "--no-sglang"
    if why is not None:
        print(f"[sglang] skipped: {why}")
        results["sglang_skipped"] = why
    else:
        from grpo_megatron.bridge.safetensors_writer import write_hf_checkpoint

        with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as tmp:
            out_dir = Path(tmp) / "policy"
            write_hf_checkpoint(policy.model, ps, hf, out_dir)
            sg_cfg = dataclasses.replace(
                cfg,
                model=dataclasses.replace(cfg.model, hf_path=str(out_dir)),
                rollout=dataclasses.replace(cfg.rollout, engine="sglang"),
            )
            try:
                results["sglang"] = run_loop("sglang", sg_cfg, hf, ps, policy, args)
            except Exception as exc:  # report and fail the run, after the embedded results are printed
                print(f"[sglang] FAILED: {type(exc).__name__}: {exc}")
                failed = True
    print(f"total {time.perf_counter() - total:.1f}s; {'FAILED' if failed else 'OK'}")
    results["failed"] = failed
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    destroy_distributed()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
