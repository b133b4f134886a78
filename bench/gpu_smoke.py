"""GPU smoke run of the colocated GRPO loop: tiny MoE policy, rollout engine, offload and weight sync.

One process, one device. The policy is the tiny Qwen3-MoE of examples/tiny_moe.yaml on megatron's
local spec; the rollout engine is the embedded transformers engine on the same device. Each of the
iterations runs, and times, the colocated sequence with the trainer's own pieces:

    generate -> engine releases memory -> onload trainer      (ColocatedMemory.to_trainer)
      -> GRPO update                   (phases/advantages.py, phases/train.py:update_policy)
      -> sync: offload grads + optimizer, engine resumes weights, weight stream; probe: engine caches
         back, mismatch probe; rollout: offload parameters, caches back   (phases/sync.py:sync_weights)
      -> (next generate)

``training/offload.py:ColocatedMemory`` does every memory move, in the trainer's order (the probe runs
in the probe phase, with the engines' KV cache back, as in the trainer), and the loop prints the
device memory left after each offload. When ``sglang`` imports (on CPU: with its CPU kernels, SGLang's
CPU engine) the same loop runs again with ``rollout.engine=sglang`` on a copy of the policy saved to
disk.
Not part of the test suite (bench/gpu_check.py runs it: its table stage took 59 s on an H200).

MoE routing (``--routing-replay off,r3``): the train step compares the trainer's own experts with
the engine's (``route_disagreement``, the share of token-layer routes whose expert sets differ) and,
with r3 listed, replays the engine's experts; the mismatch probe reports its logprob difference
without and with replay of the engine's routes (``probe_*`` / ``probe_replay_*``); on a bf16 model the
last iteration also measures the noise floor (the engine's bf16 logprobs vs an fp32 copy of it).

    python bench/gpu_smoke.py                    # the first GPU
    python bench/gpu_smoke.py --device cpu       # a quick check anywhere (SGLang's CPU engine too)
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
    """Why SGLang's Engine cannot run here, or None when it can: ``sglang.Engine`` imports, and on CPU
    SGLang's CPU kernel library (``sgl_kernel``, which ``make setup`` installs from a wheelhouse) is there
    too (SGLang's CPU engine: no memory saver, so a release frees nothing, but every call is made)."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    if device.type != "cuda" and importlib.util.find_spec("sgl_kernel") is None:
        return "not on a GPU, and SGLang's CPU kernels (sgl_kernel) are not installed"
    try:
        from sglang import Engine  # noqa: F401
    except (
        Exception
    ) as exc:  # a broken install (kernels built for another torch, ...) is a skip with its reason
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
    policy: Any,
    ps: Any,
    hf: dict[str, Any],
    cfg: Any,
    prompts: Any,
    completions: Any,
    *,
    replay: bool = False,
) -> dict[str, float]:
    """One GRPO update through the trainer's own phases (``build_samples``, ``plan_update``,
    ``update_policy``) with a toy reward: the share of even token ids in a response. With the engine's
    routes (an MoE model) the trainer's experts are compared with them and, with ``replay``, the
    engine's are used (r3)."""
    from grpo_megatron.data.records import PromptRecord
    from grpo_megatron.training.phases.advantages import build_samples, plan_update
    from grpo_megatron.training.phases.logprob import PassSettings
    from grpo_megatron.training.phases.reward import Group
    from grpo_megatron.training.phases.train import GRPOLoss, update_policy
    from grpo_megatron.training.route_replay import RoutingReplay

    groups = []
    for prompt, group in zip(prompts, completions, strict=True):
        rewards = [sum(t % 2 == 0 for t in c.token_ids) / max(len(c.token_ids), 1) for c in group]
        groups.append(Group(PromptRecord("", "", {}, tuple(prompt)), list(group), rewards, [""] * len(group)))
    batch = build_samples(cfg.algorithm, cfg.rollout.max_new_tokens, groups)
    plan = plan_update(cfg.train, cfg.algorithm, ps, batch.samples)
    pad_id = int(hf.get("pad_token_id") or hf["eos_token_id"])
    passes = PassSettings(
        ps,
        pad_id,
        policy.spec.vocab_size,
        cfg.rollout.temperature,
        RoutingReplay("r3" if replay else "off", ps, policy.spec.num_experts),
    )
    loss = GRPOLoss(
        cfg.algorithm,
        0.0,
        cfg.algorithm.loss_norm_len or cfg.rollout.max_new_tokens,
        old_from_engine=cfg.train.old_logprobs == "engine",
    )
    metrics = update_policy(policy, batch.samples, plan, loss, passes, measure_routing=True)
    rewards = [r for g in groups for r in g.rewards]
    out = {
        "reward": sum(rewards) / len(rewards),
        "train_tokens": float(sum(s.length + 1 for s in batch.samples)),
        "grad_norm": metrics["grad_norm"],
    }
    for key in ("routing/disagreement", "routing/load_max_over_mean", "routing/load_cv"):
        if key in metrics:
            out[key.removeprefix("routing/").replace("disagreement", "route_disagreement")] = metrics[key]
    return out


def noise_floor(
    engine: Any, sequences: list[list[int]], prompt_lens: list[int], temperature: float
) -> dict[str, float]:
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


def run_loop(
    label: str, cfg: Any, hf: dict[str, Any], ps: Any, policy: Any, args: argparse.Namespace
) -> list[dict[str, float]]:
    """The colocated loop above, ``args.iterations`` times; one record of measurements per iteration."""
    from grpo_megatron.rollout.engine import SamplingParams
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.job import engine_spec
    from grpo_megatron.training.offload import ColocatedMemory
    from grpo_megatron.training.phases.sync import ProbeBatch, probe_batch, sync_weights

    device = ps.device
    print(f"[{label}] building the rollout fleet ({cfg.rollout.engine} engine) ...", flush=True)
    start = time.perf_counter()
    fleet = RolloutFleet.build(engine_spec(cfg), hf, ps)
    # The trainer's colocated choreography (train.offload_trainer), the same object and order; gradients
    # are discarded, not copied: this loop zeroes them before its next step anyway.
    assert fleet.placement is not None  # RolloutFleet.build decides it
    offloading = dataclasses.replace(fleet.placement, offload_trainer=True, swaps_engine_memory=True)
    colocated = ColocatedMemory(policy, fleet, offloading.phases(), discard_grads=True)
    vocab, temperature = int(hf["vocab_size"]), cfg.rollout.temperature
    first_sync = sync_weights(
        policy.model, fleet, colocated, ps, 0, ProbeBatch(), vocab_size=vocab, temperature=temperature
    )
    print(
        f"[{label}] fleet ready in {time.perf_counter() - start:.2f}s; first sync "
        f"{first_sync['sync/seconds']:.3f}s for {first_sync['sync/bytes'] / 2**20:.2f} MiB; memory {memory(device)}"
    )
    engine_model = getattr(fleet.engine, "model", None)  # the embedded engine's, in this process
    engine_bytes = (
        sum(p.numel() * p.element_size() for p in engine_model.parameters())
        if engine_model is not None
        else 0
    )
    active = active_parameters(policy.model, hf)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, hf["vocab_size"], (args.prompts, args.prompt_len), generator=gen).tolist()
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
            routes = fleet.deliver_routes(
                {c.route_id: range(ps.world_size) for g in completions for c in g if c.route_id is not None}
            )
            for c in (c for g in completions for c in g):
                c.routed_experts = routes.get(c.route_id) if c.route_id is not None else None
        if probe is None:
            probe = probe_batch(
                prompts, [[c.token_ids for c in g] for g in completions], size=cfg.rollout.probe_batch
            )
        with phase(times, "onload", device):  # engines release, then the trainer's state returns
            colocated.to_trainer()
        with phase(times, "train", device):
            step = grpo_step(policy, ps, hf, cfg, prompts, completions, replay="r3" in args.routing_replay)
        left_opt = memory(device)
        with phase(times, "sync", device):  # the memory phases, the stream and the probe: one function
            sync = sync_weights(
                policy.model, fleet, colocated, ps, it + 1, probe, vocab_size=vocab, temperature=temperature
            )
        copy_s = copy_seconds(int(sync["sync/bytes"]), device)
        mismatch = sync
        left_all = torch.cuda.memory_allocated() if on_cuda(device) else None
        moved = sum(r.bytes_moved for r in colocated.offloaded)
        offload_s = sum(r.seconds for r in colocated.offloaded)
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
            "sync_seconds": sync["sync/seconds"],
            "sync_gb_per_s": sync["sync/bytes"] / sync["sync/seconds"] / 1e9,
            "sync_phase_seconds": times["sync"],  # with the memory moves and the probe
            "copy_gb_per_s": sync["sync/bytes"] / copy_s / 1e9,
            "offload_bytes": float(moved),
            "offload_seconds": offload_s,
            "offload_gb_per_s": moved / max(offload_s, 1e-9) / 1e9,
            "onload_seconds": times["onload"],
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
        if "offload/cached_free_bytes" in sync:  # CUDA: reserved - allocated right before the engine resumed
            record["trainer_cached_free_bytes_at_resume"] = sync["offload/cached_free_bytes"]
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
            f"[{label}]   offload moved {moved / 2**20:.2f} MiB; memory after the update: "
            f"{left_opt}; after the sync (params offloaded): {memory(device)} | "
            f"sync {sync['sync/bytes'] / 2**20:.2f} MiB in "
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
    if "num_experts_per_tok" in cfg.model.load_hf_config():
        # The engines report their routes (EngineSpec.record_routes: what r3 asks for), so that the train
        # step and the probe compare the trainer's experts with the engine's, and r3 can replay them; the
        # train step's own routing is --routing-replay's (grpo_step).
        cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, routing_replay="r3"))
    validate(cfg, 1)
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    print(f"device {ps.device} ({device_name(ps.device)}); {ps.describe()}")
    total = time.perf_counter()
    policy = build_policy(hf, cfg.model, cfg.parallel, cfg.train, ps)
    params = sum(p.numel() for p in policy.model.parameters())
    print(
        f"policy: {hf['model_type']} {params / 1e6:.2f}M parameters, {cfg.model.dtype}; memory {memory(ps.device)}"
    )
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
