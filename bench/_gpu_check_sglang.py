"""The SGLang stages of bench/gpu_check.py: SGLang's own engine, and the train CLI with colocated
SGLang engines (killed and resumed; with routing replay). On CPU the same stages run SGLang's CPU
engine at tiny sizes (where its CPU kernels are installed: ``make setup``)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _gpu_check_clock import CLOCK

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "bench" / "sglang_gpu_probe.py"
DEMO = REPO / "examples" / "demo.yaml"
SCORE_LIMIT = 0.1
"""|SGLang's score - transformers' forward| of the same bf16 weights, per token (seen: 0.048 on an H200
for the 0.43B slice, 0.002 on CPU for the tiny model)."""
CACHED_AT_RESUME_LIMIT_GIB = 0.5
"""The trainer's reserved - allocated CUDA memory at an engine resume (issue 36 item 1)."""

GPU_SERVER_ARGS = {
    # What the carry holds on a Hopper GPU (../shared/GUIDE.md section 10): SGLang's sm90 kernels, no
    # FA3, flashinfer importable but without its kernels.
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "moe_runner_backend": "triton",
    "grammar_backend": "none",
}
# The train stage's model on a GPU: the demo's vocabulary with the 0.43B slice's layer shapes (so its
# kernels are the ones the engine stage compiled) in 2 layers; SGLang's CUDA rotary needs head_dim in
# {64, 128, 256, 512} with a bf16 KV cache.
GPU_TRAIN_MODEL = [
    "model.dtype=bfloat16",
    "model.hf_overrides.hidden_size=1024",
    "model.hf_overrides.num_hidden_layers=2",
    "model.hf_overrides.num_attention_heads=8",
    "model.hf_overrides.head_dim=128",
    "model.hf_overrides.num_key_value_heads=4",
    "model.hf_overrides.num_experts=32",
    "model.hf_overrides.num_experts_per_tok=4",
    "model.hf_overrides.moe_intermediate_size=512",
    "model.hf_overrides.intermediate_size=512",
]
TRAIN = [
    "parallel.ep=1",
    "train.iterations=3",
    "checkpoint.save_interval=2",
    "train.prompts_per_iteration=4",
    "rollout.n_samples_per_prompt=4",
    "data.num_train_prompts=64",
    "data.num_eval_prompts=8",
    "train.micro_batch_size=8",
    "rollout.engine=sglang",
    "rollout.probe_interval=1",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "parallel.timeout_minutes=5",
]


TRAIN_GPU_SERVER_ARGS = {
    **GPU_SERVER_ARGS,
    # The train stage's engines decode at most 16 sequences at once: capturing CUDA graphs beyond that
    # would only lengthen each of its three engine starts.
    "cuda_graph_max_bs_decode": 16,
}


def server_arg_overrides(device: str) -> list[str]:
    return (
        [f"rollout.sglang.server_args.{k}={v}" for k, v in TRAIN_GPU_SERVER_ARGS.items()]
        if device == "cuda"
        else []
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(log: Path, n: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.is_file() else ""


def _wait(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124


# ----------------------------------------------------------------------------------------------
# sglang_engine: SGLang's own engine, no adapter


def stage_sglang_engine(args: argparse.Namespace, out: Path, stage: Any, env: dict[str, str]) -> None:
    """bench/sglang_gpu_probe.py: start, generate (with routes on a GPU), score against transformers,
    a weight version through CUDA IPC buckets (the same weights: scores must not move), release, resume."""
    result = out / "sglang_engine.json"
    size = [] if args.device == "cuda" else ["--tiny", "--prompts", "4", "--n", "2", "--max-new-tokens", "8"]
    cmd = [sys.executable, str(PROBE), "--device", args.device, "--json", str(result), *size]
    log = out / "sglang_engine.log"
    with log.open("w") as f:
        proc = CLOCK.popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        rc = _wait(proc, timeout_s=360)
    data = json.loads(result.read_text()) if result.is_file() else {}
    stage.details = data
    problems = engine_problems(data, rc)
    steps = data.get("steps", {})
    gen, sync = steps.get("generate", {}), steps.get("sync", {})
    stage.status = "FAILED" if problems else "ok"
    nan = float("nan")
    start_s = steps.get("engine_start", {}).get("seconds", nan)
    score = steps.get("score", {}).get("max_abs_vs_hf", nan)
    release_s = steps.get("release", {}).get("seconds", nan)
    stage.summary = (
        f"SGLang {data.get('sglang', '?')}: start {start_s:.0f} s, "
        f"{gen.get('tokens_per_s', 0)} tokens/s, score vs transformers max {score:.1e}, "
        f"sync {sync.get('bytes', 0) / 2**20:.1f} MiB at {sync.get('gb_per_s', 0):.3g} GB/s, release {release_s:.3f} s"
    )
    if problems:
        stage.summary += " - " + "; ".join(problems) + "\n" + _tail(log)


def engine_problems(data: dict[str, Any], rc: int) -> list[str]:
    """Why the engine stage failed, from the probe's JSON and exit status (empty: it passed)."""
    steps = data.get("steps", {})
    problems = [] if rc == 0 else [f"exit {rc}"]
    missing = [
        s for s in ("engine_start", "generate", "score", "sync", "release", "resume") if s not in steps
    ]
    if missing:
        problems.append(f"steps not reached: {missing}")
    if data.get("routes_expected") and not steps.get("generate", {}).get("routed"):
        problems.append("no routed experts returned")
    score = steps.get("score", {}).get("max_abs_vs_hf")
    if score is not None and score > SCORE_LIMIT:
        problems.append(f"score vs transformers {score:.3f} > {SCORE_LIMIT}")
    if data.get("resync_max_abs", 0.0) != 0.0:
        problems.append(f"re-sending the same weights moved the scores by {data['resync_max_abs']:.1e}")
    return problems


# ----------------------------------------------------------------------------------------------
# sglang_train: the train CLI with colocated SGLang engines


class TrainRun:
    """One train CLI run (torchrun, one rank) with colocated SGLang, in ``root/<name>``."""

    def __init__(
        self, args: argparse.Namespace, root: Path, name: str, extra: list[str], env: dict[str, str]
    ) -> None:
        self.args, self.run_dir, self.extra, self.env = args, root / name, extra, env
        self.log = root / f"{name}.log"

    def start(self, more: Sequence[str] = ()) -> subprocess.Popen:
        backend = "gloo" if self.args.device == "cpu" else "nccl"
        model = GPU_TRAIN_MODEL if self.args.device == "cuda" else ["model.dtype=bfloat16"]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "grpo_megatron",
            "train",
            str(DEMO),
            *TRAIN,
            *model,
            *server_arg_overrides(self.args.device),
            f"parallel.backend={backend}",
            f"logging.run_dir={self.run_dir}",
            *self.extra,
            *more,
        ]
        with self.log.open("a") as f:
            return CLOCK.popen(cmd, cwd=REPO, env=self.env, stdout=f, stderr=subprocess.STDOUT)

    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return (
            [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if path.is_file()
            else []
        )

    def kill_after_checkpoint(self, proc: subprocess.Popen, iteration: int, timeout_s: float) -> bool:
        latest = self.run_dir / "checkpoints" / "latest"
        deadline = time.monotonic() + timeout_s
        while not (latest.is_file() and latest.read_text().strip().endswith(str(iteration))):
            if proc.poll() is not None or time.monotonic() > deadline:
                _wait(proc, 1)
                return False
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # as a scheduler's preemption would, engine processes included
        proc.wait()
        return True


def stage_sglang_train(args: argparse.Namespace, out: Path, stage: Any, env: dict[str, str]) -> None:
    """Three runs of 3 iterations: trainer resident (``train.offload_trainer=false``) killed after its
    iteration-2 checkpoint and resumed; trainer offloaded with ``algorithm.routing_replay=r3``."""
    root = out / "sglang_train"
    root.mkdir(exist_ok=True)
    resident = TrainRun(args, root, "resident", ["train.offload_trainer=false"], env)
    proc = resident.start()
    if not resident.kill_after_checkpoint(proc, 2, timeout_s=300):
        stage.status, stage.summary = "FAILED", f"resident: no iteration-2 checkpoint:\n{_tail(resident.log)}"
        return
    rc = _wait(resident.start(["checkpoint.resume=auto"]), timeout_s=300)
    if rc != 0:
        stage.status, stage.summary = "FAILED", f"resident, resumed: exit {rc}:\n{_tail(resident.log)}"
        return
    # SGLang's CPU engine cannot report routes (its route buffer is pinned memory): r3 runs on a GPU only.
    r3 = ["algorithm.routing_replay=r3"] if args.device == "cuda" else []
    replay = TrainRun(args, root, "offload_r3" if r3 else "offload", ["train.offload_trainer=true", *r3], env)
    rc = _wait(replay.start(), timeout_s=300)
    if rc != 0:
        stage.status, stage.summary = (
            "FAILED",
            f"offloaded{', r3' if r3 else ''}: exit {rc}:\n{_tail(replay.log)}",
        )
        return
    stage.details = train_details(resident.metrics(), replay.metrics(), replayed=bool(r3))
    problems = train_problems(stage.details)
    stage.status = "FAILED" if problems else "ok"
    stage.summary = (
        f"resident: killed after the iteration-2 checkpoint, resumed to iteration {stage.details['resident_last']}; "
        f"offloaded{' + r3' if r3 else ' (r3: GPU only)'}: {stage.details['replay_iterations']} iterations; "
        f"probe max {stage.details['probe_max']:.1e}"
        + (f", with the engine's routes replayed {stage.details['probe_replay_max']:.1e}" if r3 else "")
        + ("" if not problems else " - " + "; ".join(problems))
    )


CACHED_KEY = "offload/cached_free_bytes"
"""What training/offload.py reports of every engine resume (0 on CPU); each iteration of a run whose
engines swap memory with the trainer (colocated SGLang, train.max_staleness=0) resumes them."""


def missing_metric(records: list[dict[str, Any]], key: str = CACHED_KEY) -> list[int]:
    """Iterations (the training ones: 0 is the evaluation before training) whose row lacks ``key``: a
    memory phase that dropped its metric fails the stage rather than leaving a NaN to skip."""
    return [int(r["iteration"]) for r in records if r.get("iteration", 0) >= 1 and key not in r]


def train_details(
    resident: list[dict[str, Any]], replay: list[dict[str, Any]], *, replayed: bool = False
) -> dict[str, Any]:
    """What the sglang_train stage's runs logged; ``replayed``: the second ran r3 (its probe must
    replay the engine's routes)."""

    def worst(records: list[dict[str, Any]], key: str) -> float:
        values = [r[key] for r in records if key in r]
        return max(values) if values else float("nan")

    both = resident + replay
    return {
        "missing_cached": {"resident": missing_metric(resident), "replay": missing_metric(replay)},
        "resident_last": max((r.get("iteration", 0) for r in resident), default=0),
        "replay_iterations": len(
            [r for r in replay if r.get("iteration", 0) >= 1]
        ),  # 0: the eval before training
        "probe_max": worst(both, "mismatch/probe_abs_diff_max"),
        "replayed": replayed,
        "probe_replay_max": worst(replay, "mismatch/probe_replay_abs_diff_max"),
        "probe_route_disagreement": worst(replay, "routing/probe_disagreement"),
        # what the trainer's allocator kept reserved but unused when an engine resumed (training/offload.py)
        "cached_at_resume_gib": worst(both, CACHED_KEY) / 2**30,
    }


def train_problems(details: dict[str, Any]) -> list[str]:
    problems = []
    if details["resident_last"] < 3:
        problems.append(f"the resumed run ended at iteration {details['resident_last']}, not 3")
    if details["replay_iterations"] < 3:
        problems.append(f"the r3 run logged {details['replay_iterations']} iterations, not 3")
    replay_max = details["probe_replay_max"]
    if details.get("replayed") and replay_max != replay_max:  # NaN: no row has it
        problems.append(
            "the r3 run's mismatch probe replayed no engine routes (mismatch/probe_replay_abs_diff_max "
            "missing): the engine's score returned none (rollout/sglang/protocol.py:score_routes)"
        )
    for run, iterations in details["missing_cached"].items():
        if iterations:
            problems.append(
                f"{CACHED_KEY} missing from the {run} run's rows of iterations {iterations}: a memory "
                "phase did not report its engine resume (training/offload.py)"
            )
    cached = details["cached_at_resume_gib"]
    if cached == cached and cached > CACHED_AT_RESUME_LIMIT_GIB:  # NaN: no row has it, named as missing above
        problems.append(
            f"the trainer held {cached:.2f} GiB of cached blocks at an engine resume (> {CACHED_AT_RESUME_LIMIT_GIB})"
        )
    return problems


# ----------------------------------------------------------------------------------------------
# sglang_on_policy: SGLang's own on-policy switches against this trainer (issue 53 item 3)

ON_POLICY_SERVER_ARGS = {"enable_deterministic_inference": "true", "rl_on_policy_target": "fsdp"}
"""SGLang's switches towards a trainer's numerics (0.5.23 ``srt/server_args.py``): deterministic
inference (batch-invariant kernels, a fixed attention split) and ``rl_on_policy_target=fsdp`` (sampler,
RMSNorm, rotary and LM head in a Hugging Face trainer's forms). Both need a GPU attention backend
(triton here: ``DETERMINISTIC_ATTENTION_BACKEND_CHOICES``); SGLang's CPU engine refuses them."""
ON_POLICY_KEYS = (
    "mismatch/logprob_abs_diff",
    "mismatch/logprob_abs_diff_max",
    "mismatch/probe_abs_diff_mean",
    "mismatch/probe_abs_diff_max",
    "off_policy/ratio_min",
    "off_policy/ratio_max",
)


def missing_switches(env: dict[str, str]) -> list[str]:
    """The ``ON_POLICY_SERVER_ARGS`` this SGLang's ``ServerArgs`` lacks (0.5.17 may lack one)."""
    code = (
        "import dataclasses, json; from sglang.srt.server_args import ServerArgs; "
        "print(json.dumps([f.name for f in dataclasses.fields(ServerArgs)]))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    known = set(json.loads(done.stdout.splitlines()[-1])) if done.returncode == 0 else set()
    return [k for k in ON_POLICY_SERVER_ARGS if k not in known]


def on_policy_summary(records: list[dict[str, Any]]) -> dict[str, float]:
    """The worst (largest; for ``ratio_min`` the smallest) of each ``ON_POLICY_KEYS`` over the training
    iterations (0 is the evaluation before training)."""
    rows = [r for r in records if r.get("iteration", 0) >= 1]
    out = {}
    for key in ON_POLICY_KEYS:
        values = [float(r[key]) for r in rows if key in r]
        if values:
            out[key] = min(values) if key.endswith("_min") else max(values)
    return out


def stage_sglang_on_policy(args: argparse.Namespace, out: Path, stage: Any, env: dict[str, str]) -> None:
    """One run of 3 iterations with colocated SGLang started with ``ON_POLICY_SERVER_ARGS`` (the
    trainer offloaded, routes not replayed), its ``mismatch/*`` and ratio beside the sglang_train stage's
    plain engine where that stage ran. SGLang's CPU engine refuses the switches: the CPU rehearsal runs
    the same job without them and says so."""
    switches = dict(ON_POLICY_SERVER_ARGS) if args.device == "cuda" else {}
    lacking = missing_switches(env) if switches else []
    if lacking:
        stage.status = "skipped"
        stage.summary = f"this SGLang's ServerArgs has no {', '.join(lacking)}"
        return
    root = out / "sglang_on_policy"
    root.mkdir(exist_ok=True)
    extra = [
        "train.offload_trainer=true",
        *(f"rollout.sglang.server_args.{k}={v}" for k, v in switches.items()),
    ]
    run = TrainRun(args, root, "switches" if switches else "cpu_without_switches", extra, env)
    rc = _wait(run.start(), timeout_s=300)
    got = on_policy_summary(run.metrics())
    if rc != 0 or "mismatch/logprob_abs_diff_max" not in got:
        stage.status, stage.summary = "FAILED", f"exit {rc}:\n{_tail(run.log)}"
        return
    plain = [
        r
        for name in ("offload_r3", "offload")
        for r in TrainRun(args, out / "sglang_train", name, [], env).metrics()
    ]
    stage.details = {"switches": got, "plain": on_policy_summary(plain)}
    stage.status = "ok"
    said = (
        "deterministic inference + rl_on_policy_target=fsdp"
        if switches
        else "CPU: SGLang refuses the switches, ran without"
    )
    stage.summary = (
        f"{said}: logprob abs diff mean {got.get('mismatch/logprob_abs_diff', float('nan')):.2e} max "
        f"{got['mismatch/logprob_abs_diff_max']:.2e}, "
        f"probe max {got.get('mismatch/probe_abs_diff_max', float('nan')):.2e}"
        + (
            "; plain engine (sglang_train): max "
            f"{stage.details['plain']['mismatch/logprob_abs_diff_max']:.2e}"
            if "mismatch/logprob_abs_diff_max" in stage.details["plain"]
            else ""
        )
    )


# ----------------------------------------------------------------------------------------------
# sglang_fp8: FP8 rollout (rollout.weight_dtype=fp8) beside bf16, the train CLI with colocated SGLang

FP8_ITERATIONS = 3
"""Per run; the first sync's seconds (JIT compilation, first allocations) are left out of the means."""


def fp8_unsupported(device: str) -> str | None:
    """Why SGLang cannot serve FP8 weights on this device (None: it can): on CPU only its intel_amx
    path takes FP8 layers (SGLang's ``fp8.py`` asserts AMX), and an AVX2-only CPU has none."""
    if device == "cuda":
        return None
    from sglang.srt.utils.common import cpu_has_amx_support

    if cpu_has_amx_support():
        return None
    return (
        "SGLang's CPU FP8 path needs AMX (its fp8.py asserts it); this CPU has none: run it on a Hopper GPU"
    )


def stage_sglang_fp8(args: argparse.Namespace, out: Path, stage: Any, env: dict[str, str]) -> None:
    """Two runs of ``FP8_ITERATIONS`` iterations, trainer resident, the same seed: the engines serving
    the trainer's bf16 weights (``rollout.weight_dtype=model``) and block-FP8 ones that every sync
    quantizes on the way (``rollout.weight_dtype=fp8``, IcePop on by default); the mismatch probe's gap
    and the sync's seconds side by side."""
    why = fp8_unsupported(args.device)
    if why is not None:
        stage.status, stage.summary = "skipped", why
        return
    root = out / "sglang_fp8"
    root.mkdir(exist_ok=True)
    runs = {}
    for dtype in ("model", "fp8"):
        run = TrainRun(
            args,
            root,
            dtype,
            [
                "train.offload_trainer=false",
                f"train.iterations={FP8_ITERATIONS}",
                "checkpoint.save_interval=0",
                f"rollout.weight_dtype={dtype}",
            ],
            env,
        )
        rc = _wait(run.start(), timeout_s=300)
        if rc != 0:
            stage.status, stage.summary = (
                "FAILED",
                f"rollout.weight_dtype={dtype}: exit {rc}:\n{_tail(run.log)}",
            )
            return
        runs[dtype] = run.metrics()
    stage.details = fp8_details(runs["model"], runs["fp8"])
    problems = fp8_problems(stage.details)
    d = stage.details
    stage.status = "FAILED" if problems else "ok"
    stage.summary = (
        f"probe max/mean bf16 {d['bf16_probe_max']:.3f}/{d['bf16_probe_mean']:.4f}, "
        f"fp8 {d['fp8_probe_max']:.3f}/{d['fp8_probe_mean']:.4f} nats; sync bf16 {d['bf16_sync_s']:.3f} s, "
        f"fp8 {d['fp8_sync_s']:.3f} s (x{d['sync_ratio']:.2f}); icepop masked {d['fp8_masked_frac']:.4f}"
        + ("" if not problems else " - " + "; ".join(problems))
    )


def fp8_details(bf16: list[dict[str, Any]], fp8: list[dict[str, Any]]) -> dict[str, Any]:
    """What the FP8 stage reports from the two runs' metrics (iterations >= 1; sync seconds from the
    second on)."""

    def values(records: list[dict[str, Any]], key: str, first: int = 1) -> list[float]:
        return [r[key] for r in records if r.get("iteration", 0) >= first and key in r]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    details: dict[str, Any] = {}
    for name, records in (("bf16", bf16), ("fp8", fp8)):
        details[f"{name}_iterations"] = len(values(records, "iteration"))
        details[f"{name}_probe_max"] = max(
            values(records, "mismatch/probe_abs_diff_max"), default=float("nan")
        )
        details[f"{name}_probe_mean"] = mean(values(records, "mismatch/probe_abs_diff_mean"))
        details[f"{name}_sync_s"] = mean(values(records, "sync/seconds", first=2))
        details[f"{name}_sync_bytes"] = mean(values(records, "sync/bytes"))
    details["fp8_masked_frac"] = mean(values(fp8, "off_policy/masked_frac"))
    details["sync_ratio"] = (
        details["fp8_sync_s"] / details["bf16_sync_s"] if details["bf16_sync_s"] else float("nan")
    )
    return details


FP8_PROBE_MEAN_LIMIT = 0.5
"""The FP8 run's mean probe gap, nats (``rollout.probe_max_mean``'s default: the run stops beyond it)."""


def fp8_problems(details: dict[str, Any]) -> list[str]:
    """Why the FP8 stage failed (empty: it passed): a run short of its iterations, no probe or no
    IcePop metrics in the FP8 run, an FP8 gap beyond the bound or not above bf16's (the engines would
    not be serving FP8 weights)."""
    problems = []
    for name in ("bf16", "fp8"):
        if details[f"{name}_iterations"] < FP8_ITERATIONS:
            problems.append(
                f"the {name} run logged {details[f'{name}_iterations']} iterations, not {FP8_ITERATIONS}"
            )
    gap, floor = details["fp8_probe_mean"], details["bf16_probe_mean"]
    if gap != gap:
        problems.append("the fp8 run logged no mismatch probe")
    elif gap > FP8_PROBE_MEAN_LIMIT:
        problems.append(f"fp8 probe mean {gap:.3f} > {FP8_PROBE_MEAN_LIMIT}")
    elif floor == floor and gap <= floor:
        problems.append(
            f"fp8 probe mean {gap:.4f} not above bf16's {floor:.4f}: are the engines serving FP8?"
        )
    if details["fp8_masked_frac"] != details["fp8_masked_frac"]:
        problems.append("the fp8 run logged no off_policy/* metrics (IcePop should be on by default)")
    return problems
