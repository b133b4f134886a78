"""GPU acceptance run: every stage of the GPU path, one markdown table (bench/gpu_check.sh calls this).

Stages, each in a process of its own (a job's device and megatron-core adjustments are per process), in
order of value (``STAGES``; bench/_gpu_check_sglang.py has the first three):

1. ``sglang_engine``: SGLang's own engine (bench/sglang_gpu_probe.py): start, generate, score against
   transformers, a weight version through CUDA IPC buckets, release, resume.
2. ``sglang_train``: the train CLI with colocated SGLang engines, trainer resident (killed after its
   iteration-2 checkpoint and resumed) and offloaded (with routing replay on a GPU); every iteration's
   row must carry ``offload/cached_free_bytes`` (each engine resume's) within its limit.
3. ``sglang_fp8``: FP8 rollout (``rollout.weight_dtype=fp8``): the train CLI with colocated SGLang
   serving block-FP8 weights that every sync quantizes, beside the same run in bf16: the mismatch
   probe's gap (max and mean) and the sync's seconds of each; skipped on a CPU without AMX.
4. ``sglang``: bench/gpu_smoke.py's colocated loop with ``rollout.engine=sglang``, bf16, the engine
   started with the server arguments of the other SGLang stages (on a GPU: head_dim 128, triton
   attention and MoE); skipped, with the reason, where SGLang's Engine cannot run.
5. ``smoke``: bench/gpu_smoke.py on the tiny fp32 MoE: rollout, offload, weight sync; the mismatch
   probe (engine vs trainer logprobs after the sync) must stay <= 1e-4.
6. ``resume``: the real train CLI (examples/demo.yaml, one rank, trainer offload, a checkpoint every
   2 iterations), killed after its iteration-2 checkpoint and resumed; its metrics must equal an
   uninterrupted run's (every key but the timing ones and the allocator's), fp32.
7. ``table``: bench/gpu_smoke.py on the 0.43B bf16 Qwen3-MoE slice (hidden 1024, 8 layers, 8 heads
   of 128, 4 KV heads, 32 experts top-4 of width 512, vocab 64; 64 prompts x 8 samples x 128 new
   tokens): rollout tokens/s, train tokens/s and MFU, weight-sync GB/s beside a device-to-device
   copy of the same bytes, offload GB/s, trainer-only and engine-only memory left after the
   offload, peak memory; MoE route disagreement (trainer vs engine) and the mismatch probe without
   and with routing replay (``--routing-replay off,r3``) beside the bf16 noise floor. With
   ``--device cpu`` a tiny bf16 version runs the same code.
8. ``true_on_policy``: the train CLI with ``rollout.true_on_policy`` (the trainer's own model generates
   with batch-invariant numerics, issue 53), bf16, one rank, a reward that moves the weights, 3
   iterations: every iteration's ``mismatch/logprob_abs_diff_max`` must be 0.0 and the off-policy
   ratio exactly 1 (cuBLAS's products and the batched attention on the GPU, where the CPU's pass).
9. ``sglang_on_policy``: the train CLI with colocated SGLang started with its on-policy switches
   (``enable_deterministic_inference``, ``rl_on_policy_target=fsdp``; issue 53 item 3): the
   ``mismatch/*`` and off-policy ratio against this trainer, beside the sglang_train stage's plain
   engine. SGLang's CPU engine refuses both switches: ``--device cpu`` runs the job without them.
10. ``te``: tests/test_gpu.py -k transformer_engine where TransformerEngine imports.
11. ``pytest``: tests/test_gpu.py and test_offload.py with the pytest of this Python.

Every memory phase's metric is required where an engine resumes (``offload/cached_free_bytes``, 0 on
CPU): missing, the stage fails (issue 51 item 1). ``--budget-s`` (480 s: one device call) bounds the
whole check: the stage running at the deadline is stopped (its processes killed: bench/_gpu_check_clock.py),
later ones are skipped, and ``<out>/gpu_check.md`` (the table) and ``<out>/gpu_check.json`` are
rewritten after every stage; ``<out>`` defaults to ``$OUT/gpu_check-<time>`` where ``$OUT`` is set
(what the device tool brings back). Exits 1 when a stage failed. A cold first call (empty JIT caches)
does not reach every stage within 480 s: docs/gpu.md says how far it gets.

    python bench/gpu_check.py                        # on the first GPU
    python bench/gpu_check.py --device cpu           # every stage on CPU (tiny sizes)
    python bench/gpu_check.py --stages smoke,table   # a subset
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _gpu_check_sglang as sglang_stages
from _gpu_check_clock import CLOCK

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "bench" / "gpu_smoke.py"
DEMO = REPO / "examples" / "demo.yaml"
STAGES = (
    "sglang_engine",
    "sglang_train",
    "sglang_fp8",
    "sglang",
    "smoke",
    "resume",
    "table",
    "true_on_policy",
    "sglang_on_policy",
    "te",
    "pytest",
)
"""In order of value: SGLang never ran on a GPU before this check; the embedded path did (docs/gpu.md)."""
BUDGET_S = 480.0
"""The whole check on one H200, the first engine start's JIT compilation included (issue 37)."""
PROBE_LIMIT = 1e-4
# Dense bf16 tensor-core peak, flop/s, by a name the device reports (for MFU).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12, "GH200": 989e12}
# The 0.43B slice of the table (tiny_moe's config.json with these overrides).
LARGE_MODEL = [
    "model.dtype=bfloat16",
    "model.hf_overrides.hidden_size=1024",
    "model.hf_overrides.num_hidden_layers=8",
    "model.hf_overrides.num_attention_heads=8",
    "model.hf_overrides.head_dim=128",
    "model.hf_overrides.num_key_value_heads=4",
    "model.hf_overrides.num_experts=32",
    "model.hf_overrides.num_experts_per_tok=4",
    "model.hf_overrides.moe_intermediate_size=512",
    "model.hf_overrides.intermediate_size=512",
    "rollout.sync_bucket_mb=512",
]
# Train CLI settings of the resume stage: small, fp32, one rank, offload and checkpoints on.
RESUME = [
    "parallel.ep=1",
    "model.dtype=float32",
    "train.iterations=4",
    "checkpoint.save_interval=2",
    "train.offload_trainer=true",
    "train.prompts_per_iteration=4",
    "rollout.n_samples_per_prompt=4",
    "data.num_train_prompts=256",
    "data.num_eval_prompts=8",
    "train.micro_batch_size=8",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "parallel.timeout_minutes=3",
]
# Train CLI settings of the true_on_policy stage, over RESUME's: the policy engine in bf16, a length
# reward (variance from the first iteration, so every update moves the weights), no offload or saves.
TRUE_ON_POLICY = [
    "rollout.true_on_policy=true",
    "model.dtype=bfloat16",
    "train.iterations=3",
    "train.offload_trainer=false",
    "checkpoint.save_interval=0",
    "train.lr=1e-3",
    "reward.components=[{name: len, function: length, kwargs: {target_chars: 6}}]",
]
# Keys not compared between the resumed and the uninterrupted run: wall times (as tests/test_train.py),
# every "*seconds" key (offload/seconds ...), and the allocator's view of device memory left
# after an offload, which depends on the process's allocation history, not on training.
TIMING_PREFIXES = ("time/", "throughput/", "sync/")
UNCOMPARED_SUFFIXES = ("seconds", "device_memory_left")


@dataclass
class Stage:
    name: str
    status: str = "not run"  # ok / FAILED / skipped
    seconds: float = 0.0
    summary: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def python_env(device: str) -> dict[str, str]:
    env = dict(os.environ, TORCH_COMPILE_DISABLE="1", WANDB_SILENT="true", PYTHONPATH=_pythonpath())
    if device == "cuda":
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the resume stage
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _pythonpath() -> str:
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([*parts, str(REPO)] if str(REPO) not in parts else parts)


def run(cmd: list[str], log: Path, env: dict[str, str], timeout_s: float) -> int:
    """Run ``cmd`` (its own session, so a timeout ends every process it started); output to ``log``."""
    with log.open("w") as out:
        proc = CLOCK.popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[gpu_check] timed out after {timeout_s:.0f} s\n")
            return 124


def tail(log: Path, n: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _after_first(records: list[dict[str, float]]) -> list[dict[str, float]]:
    return records[1:] or records  # the first iteration pays allocation and warm-up


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _mean(records: list[dict[str, float]], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else float("nan")


# ----------------------------------------------------------------------------------------------
# Stages


def stage_smoke(args: argparse.Namespace, out: Path, stage: Stage) -> None:
    result = out / "smoke.json"
    cmd = [
        sys.executable,
        str(SMOKE),
        "--device",
        args.device,
        "--no-sglang",
        "--iterations",
        "2",
        "--json",
        str(result),
    ]
    rc = run(cmd, out / "smoke.log", python_env(args.device), timeout_s=150)
    if rc != 0 or not result.is_file():
        stage.status, stage.summary = "FAILED", f"exit {rc}:\n{tail(out / 'smoke.log')}"
        return
    records = json.loads(result.read_text())["embedded"]
    worst = max(r["probe_abs_diff_max"] for r in records)
    stage.details = {"probe_abs_diff_max": worst}
    missing = memory_metric_problems(records)
    stage.status = "ok" if worst <= PROBE_LIMIT and not missing else "FAILED"
    stage.summary = f"tiny fp32: mismatch probe max {worst:.1e} (limit {PROBE_LIMIT:.0e})" + "".join(
        f" - {m}" for m in missing
    )


def memory_metric_problems(records: list[dict[str, Any]]) -> list[str]:
    """bench/gpu_smoke.py's records: every iteration's sync resumes the engines' memory, so each must
    carry the trainer's cached bytes at that resume (``offload/cached_free_bytes``; 0 on CPU) and on a
    GPU stay within the limit. A memory phase that drops the metric fails here, not a NaN skipped."""
    key = "trainer_cached_free_bytes_at_resume"
    missing = [int(r.get("iteration", -1)) for r in records if key not in r]
    problems = (
        [f"offload/cached_free_bytes missing at the engine resumes of iterations {missing}"]
        if missing
        else []
    )
    worst = max((r[key] for r in records if key in r), default=0.0) / 2**30
    if worst > sglang_stages.CACHED_AT_RESUME_LIMIT_GIB:
        problems.append(
            f"the trainer held {worst:.2f} GiB of cached blocks at an engine resume "
            f"(> {sglang_stages.CACHED_AT_RESUME_LIMIT_GIB})"
        )
    return problems


def _train(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> subprocess.Popen:
    backend = "gloo" if args.device == "cpu" else "nccl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "-m",
        "grpo_megatron",
        "train",
        "--debug",
        str(DEMO),
        *RESUME,
        f"parallel.backend={backend}",
        f"logging.run_dir={run_dir}",
        *extra,
    ]
    log = (run_dir.parent / f"{run_dir.name}.log").open("a")
    return CLOCK.popen(cmd, cwd=REPO, env=python_env(args.device), stdout=log, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124


def _comparable(path: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        {
            k: v
            for k, v in r.items()
            if not k.startswith(TIMING_PREFIXES) and not k.endswith(UNCOMPARED_SUFFIXES)
        }
        for r in records
    ]


def stage_resume(args: argparse.Namespace, out: Path, stage: Stage) -> None:
    root = out / "resume"
    root.mkdir(exist_ok=True)
    full, cut = root / "full", root / "cut"
    rc = _finish(_train(args, full, []), timeout_s=240)
    if rc != 0:
        stage.status, stage.summary = "FAILED", f"uninterrupted run: exit {rc}:\n{tail(root / 'full.log')}"
        return
    proc = _train(args, cut, [])
    latest = cut / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while not (latest.is_file() and latest.read_text().strip().endswith("2")):
        if proc.poll() is not None or time.monotonic() > deadline:
            _finish(proc, 1)
            stage.status, stage.summary = "FAILED", f"no checkpoint at iteration 2:\n{tail(root / 'cut.log')}"
            return
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # as a scheduler's preemption would
    proc.wait()
    killed_at = len(_comparable(cut / "metrics.jsonl"))
    rc = _finish(_train(args, cut, ["checkpoint.resume=auto"]), timeout_s=240)
    if rc != 0:
        stage.status, stage.summary = "FAILED", f"resumed run: exit {rc}:\n{tail(root / 'cut.log')}"
        return
    want, got = _comparable(full / "metrics.jsonl"), _comparable(cut / "metrics.jsonl")
    differing = sorted(
        {k for w, g in zip(want, got, strict=False) for k in set(w) | set(g) if w.get(k) != g.get(k)}
    )
    equal = want == got
    stage.details = {"iterations": [r.get("iteration") for r in got], "differing_keys": differing}
    stage.status = "ok" if equal else "FAILED"
    stage.summary = (
        f"train CLI, fp32, offload + checkpoints: killed after the iteration-2 checkpoint ({killed_at} "
        f"records logged), resumed; {len(got)} records "
        + (
            "equal to the uninterrupted run's (every key but times and device memory left)"
            if equal
            else f"DIFFER in {differing[:8]}"
        )
    )


def true_on_policy_verdict(records: list[dict[str, Any]]) -> tuple[bool, str]:
    """(every training iteration exact, a summary): ``mismatch/logprob_abs_diff_max`` 0.0 and
    ``off_policy/ratio_min`` = ``ratio_max`` = 1.0 in each (iteration 0 is the evaluation)."""
    trained = [r for r in records if r.get("iteration", 0) > 0]
    keys = ("mismatch/logprob_abs_diff_max", "off_policy/ratio_min", "off_policy/ratio_max")
    want = (0.0, 1.0, 1.0)
    inexact = [r["iteration"] for r in trained if tuple(r.get(k) for k in keys) != want]
    worst = max((r.get(keys[0]) or 0.0 for r in trained), default=float("nan"))
    summary = f"{len(trained)} iterations, bf16: behaviour logprobs " + (
        "equal to the trainer's bitwise in every one (ratio exactly 1)"
        if trained and not inexact
        else f"DIFFER in iterations {inexact} (mismatch max {worst:.3g})"
    )
    return bool(trained) and not inexact, summary


def stage_true_on_policy(args: argparse.Namespace, out: Path, stage: Stage) -> None:
    run_dir = out / "true_on_policy"
    rc = _finish(_train(args, run_dir, TRUE_ON_POLICY), timeout_s=300)
    metrics = run_dir / "metrics.jsonl"
    if rc != 0 or not metrics.is_file():
        stage.status, stage.summary = "FAILED", f"exit {rc}:\n{tail(out / 'true_on_policy.log')}"
        return
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    exact, stage.summary = true_on_policy_verdict(records)
    stage.status = "ok" if exact else "FAILED"
    stage.details = {
        "mismatch_max": [r.get("mismatch/logprob_abs_diff_max") for r in records if r.get("iteration", 0) > 0]
    }


def stage_table(args: argparse.Namespace, out: Path, stage: Stage) -> None:
    result = out / "table.json"
    if args.device == "cuda":
        size = ["--prompts", "64", "--n", "8", "--max-new-tokens", "128", "--iterations", "3"]
        overrides = LARGE_MODEL
    else:  # the same code on the tiny model, in bf16
        size = ["--prompts", "8", "--n", "4", "--max-new-tokens", "16", "--iterations", "2"]
        overrides = ["model.dtype=bfloat16"]
    cmd = [
        sys.executable,
        str(SMOKE),
        "--device",
        args.device,
        "--no-sglang",
        *size,
        "--json",
        str(result),
        "--routing-replay",
        "off,r3",
        *(f"--override={o}" for o in overrides),
    ]
    rc = run(cmd, out / "table.log", python_env(args.device), timeout_s=300)
    if rc != 0 or not result.is_file():
        stage.status, stage.summary = "FAILED", f"exit {rc}:\n{tail(out / 'table.log')}"
        return
    data = json.loads(result.read_text())
    records = _after_first(data["embedded"])
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in data["device"]), None)
    tflops = _mean(records, "train_tflops")
    stage.details = {
        "model": f"{_count(data['parameters'])} parameters ({_count(data['active_parameters'])} active), "
        f"{data['dtype']}",
        "rollout_tokens_per_s": _mean(records, "rollout_tokens_per_s"),
        "rollout_tokens": _mean(records, "rollout_tokens"),
        "train_tokens_per_s": _mean(records, "train_tokens_per_s"),
        "train_tokens": _mean(records, "train_tokens"),
        "train_seconds": _mean(records, "train_seconds"),
        "train_tflops": tflops,
        "mfu": tflops * 1e12 / peak if peak else None,
        "sync_bytes": _mean(records, "sync_bytes"),
        "sync_gb_per_s": _mean(records, "sync_gb_per_s"),
        "copy_gb_per_s": _mean(records, "copy_gb_per_s"),
        "offload_bytes": _mean(records, "offload_bytes"),
        "offload_gb_per_s": _mean(records, "offload_gb_per_s"),
        "trainer_left_bytes": _mean(records, "trainer_left_bytes"),
        "engine_weights_bytes": _mean(records, "engine_weights_bytes"),
        "peak_bytes": max((r.get("peak_bytes", 0.0) for r in data["embedded"]), default=0.0),
        "peak_host_rss_bytes": max(
            (r.get("peak_host_rss_bytes", 0.0) for r in data["embedded"]), default=0.0
        ),
        "probe_abs_diff_mean": _mean(records, "probe_abs_diff_mean"),
        "probe_abs_diff_max": max(r["probe_abs_diff_max"] for r in records),
    }
    routing_keys = (
        "route_disagreement",
        "probe_route_disagreement",
        "probe_replay_abs_diff_mean",
        "load_max_over_mean",
        "load_cv",
    )
    if all(k in r for r in records for k in routing_keys):
        stage.details |= {k: _mean(records, k) for k in routing_keys}
        stage.details["probe_replay_abs_diff_max"] = max(r["probe_replay_abs_diff_max"] for r in records)
    floors = [r for r in data["embedded"] if "floor_abs_diff_mean" in r]
    if floors:
        stage.details["floor_abs_diff_mean"] = floors[-1]["floor_abs_diff_mean"]
        stage.details["floor_abs_diff_max"] = floors[-1]["floor_abs_diff_max"]
    stage.status = "ok"
    stage.summary = f"{stage.details['model']}: see the table below"


def stage_pytest(args: argparse.Namespace, out: Path, stage: Stage) -> None:
    """The GPU-only tests and the offload tests, with each test's duration in the log (the rest of the
    suite runs on CPU in CI, wherever it runs)."""
    tests = ["tests/test_gpu.py", "tests/test_offload.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--durations=0", *tests]
    rc = run(cmd, out / "pytest.log", python_env(args.device), timeout_s=args.pytest_timeout)
    lines = [
        line for line in out.joinpath("pytest.log").read_text(errors="replace").splitlines() if line.strip()
    ]
    result = next(
        (
            line.strip("= ")
            for line in reversed(lines)
            if " in " in line and ("passed" in line or "failed" in line)
        ),
        "",
    )
    stage.status = "ok" if rc == 0 else "FAILED"
    stage.summary = f"{', '.join(t.removeprefix('tests/') for t in tests)}: {result or f'exit {rc}'}"
    if rc != 0:
        stage.summary += "\n" + tail(out / "pytest.log")


def stage_te(args: argparse.Namespace, out: Path, stage: Stage) -> None:
    """TransformerEngine's layer spec and fused Adam, where TE imports (it cannot be carried to the lent
    machine: ../shared/GUIDE.md section 10)."""
    if importlib.util.find_spec("transformer_engine") is None:
        stage.status = "skipped"
        stage.summary = "TransformerEngine is not importable here (no wheel fits the lent machine's torch: GUIDE section 10)"
        return
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        "tests/test_gpu.py",
        "-k",
        "transformer_engine",
    ]
    rc = run(cmd, out / "te.log", python_env(args.device), timeout_s=240)
    stage.status = "ok" if rc == 0 else "FAILED"
    stage.summary = f"tests/test_gpu.py -k transformer_engine: exit {rc}" + (
        "" if rc == 0 else "\n" + tail(out / "te.log")
    )


def sglang_env(device: str) -> dict[str, str]:
    env = python_env(device)
    if device == "cpu":
        env.pop("OMP_NUM_THREADS", None)  # SGLang's CPU engine binds its own threads
    return env


def stage_sglang_engine(args: argparse.Namespace, out: Path, stage: Stage) -> None:
    if (why := sglang_missing(args.device)) is not None:
        stage.status, stage.summary = "skipped", why
        return
    sglang_stages.stage_sglang_engine(args, out, stage, sglang_env(args.device))


def stage_sglang_fp8(args: argparse.Namespace, out: Path, stage: Stage) -> None:
    if why := sglang_missing(args.device):
        stage.status, stage.summary = "skipped", why
        return
    sglang_stages.stage_sglang_fp8(args, out, stage, sglang_env(args.device))


def stage_sglang_train(args: argparse.Namespace, out: Path, stage: Stage) -> None:
    if (why := sglang_missing(args.device)) is not None:
        stage.status, stage.summary = "skipped", why
        return
    sglang_stages.stage_sglang_train(args, out, stage, sglang_env(args.device))


def stage_sglang_on_policy(args: argparse.Namespace, out: Path, stage: Stage) -> None:
    if (why := sglang_missing(args.device)) is not None:
        stage.status, stage.summary = "skipped", why
        return
    sglang_stages.stage_sglang_on_policy(args, out, stage, sglang_env(args.device))


def sglang_missing(device: str) -> str | None:
    """Why SGLang's engine cannot run here (None: it can): not installed, or on CPU no kernel library."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not importable in this Python (on the GPU machine: bring .gpu-carry/, see tools/build_gpu_carry.py)"
    if device == "cpu" and importlib.util.find_spec("sgl_kernel") is None:
        return "SGLang's CPU kernels (sgl_kernel) are not installed: make setup WHEELHOUSE=../shared/wheels"
    return None


def sglang_smoke_overrides(device: str) -> list[str]:
    """The ``sglang`` stage's model and engine: bf16 (SGLang's GPU kernels, and its AMX CPU path, serve
    no fp32), on a GPU the sglang_train stage's layer shapes (head_dim 128: SGLang's CUDA rotary) and the
    server arguments every SGLang stage starts with (triton attention and MoE: the carry has no FA3)."""
    model = sglang_stages.GPU_TRAIN_MODEL if device == "cuda" else ["model.dtype=bfloat16"]
    return [*model, *sglang_stages.server_arg_overrides(device)]


def stage_sglang(args: argparse.Namespace, out: Path, stage: Stage) -> None:
    """bench/gpu_smoke.py's colocated loop with ``rollout.engine=sglang`` (on CPU: SGLang's CPU engine),
    bf16, started as the other SGLang stages start it."""
    if (why := sglang_missing(args.device)) is not None:
        stage.status, stage.summary = "skipped", why
        return
    result = out / "sglang.json"
    cmd = [
        sys.executable,
        str(SMOKE),
        "--device",
        args.device,
        "--sglang-only",
        "--iterations",
        "2",
        "--json",
        str(result),
        *(f"--override={o}" for o in sglang_smoke_overrides(args.device)),
    ]
    rc = run(cmd, out / "sglang.log", sglang_env(args.device), timeout_s=300)
    data = json.loads(result.read_text()) if result.is_file() else {}
    if "sglang_skipped" in data:
        stage.status, stage.summary = "skipped", data["sglang_skipped"]
    elif rc != 0 or "sglang" not in data:
        stage.status, stage.summary = "FAILED", f"exit {rc}:\n{tail(out / 'sglang.log')}"
    else:
        worst = max(r["probe_abs_diff_max"] for r in data["sglang"])
        problems = memory_metric_problems(data["sglang"])
        if worst > sglang_stages.SCORE_LIMIT:
            problems.insert(0, f"probe max {worst:.3f} > {sglang_stages.SCORE_LIMIT}")
        stage.details = {"probe_abs_diff_max": worst, "model": data.get("dtype")}
        stage.status = "FAILED" if problems else "ok"
        stage.summary = f"{data.get('dtype')} via SGLang: mismatch probe max {worst:.1e}" + "".join(
            f" - {p}" for p in problems
        )


RUNNERS: dict[str, Callable[[argparse.Namespace, Path, Stage], None]] = {
    "sglang_engine": stage_sglang_engine,
    "sglang_fp8": stage_sglang_fp8,
    "sglang_train": stage_sglang_train,
    "te": stage_te,
    "smoke": stage_smoke,
    "resume": stage_resume,
    "table": stage_table,
    "pytest": stage_pytest,
    "sglang": stage_sglang,
    "sglang_on_policy": stage_sglang_on_policy,
    "true_on_policy": stage_true_on_policy,
}


# ----------------------------------------------------------------------------------------------
# The report


def _gib(n: float | None) -> str:
    return "n/a" if n is None or n != n or n == 0 else f"{n / 2**30:.2f} GiB"


def table_rows(details: dict[str, Any], device: str) -> list[tuple[str, str]]:
    d = details
    mfu = (
        f"MFU {d['mfu'] * 100:.1f}%"
        if d.get("mfu") is not None
        else "MFU n/a (CPU)"
        if device == "cpu"
        else "MFU n/a (no bf16 peak known for this device)"
    )
    rows = [
        ("model", d["model"]),
        (
            "rollout, embedded engine",
            f"{d['rollout_tokens']:.0f} tokens: {d['rollout_tokens_per_s']:.0f} tokens/s",
        ),
        (
            "train step (one micro-batch)",
            f"{d['train_tokens']:.0f} tokens in {d['train_seconds']:.2f} s: {d['train_tokens_per_s']:.0f} tokens/s, "
            f"{d['train_tflops']:.2f} TFLOP/s (6 x active params x tokens), {mfu}",
        ),
        (
            "weight sync, colocated",
            f"{d['sync_bytes'] / 2**20:.1f} MiB: {d['sync_gb_per_s']:.2f} GB/s; a device-to-device copy of the same "
            f"bytes in this run: {d['copy_gb_per_s']:.1f} GB/s",
        ),
        (
            "offload grads+optimizer+params",
            f"{d['offload_bytes'] / 1e9:.3f} GB: {d['offload_gb_per_s']:.2f} GB/s",
        ),
    ]
    if device == "cuda":
        rows += [
            ("memory left after offload: trainer only", _gib(d["trainer_left_bytes"])),
            ("memory left after offload: engine only (its weights)", _gib(d["engine_weights_bytes"])),
            ("peak device memory", _gib(d["peak_bytes"])),
        ]
    else:
        rows += [
            ("memory left after offload (trainer / engine)", "n/a on CPU (no device memory)"),
            ("peak host memory (process RSS)", _gib(d["peak_host_rss_bytes"])),
        ]
    rows.append(
        (
            "mismatch probe after sync",
            f"mean {d['probe_abs_diff_mean']:.1e}, max {d['probe_abs_diff_max']:.1e}",
        )
    )
    if "probe_replay_abs_diff_mean" in d:
        rows += [
            (
                "MoE routes, trainer vs engine (routing_replay=off)",
                f"{d['route_disagreement'] * 100:.2f}% of token-layer routes differ in the train step, "
                f"{d['probe_route_disagreement'] * 100:.2f}% on the probe",
            ),
            (
                "mismatch probe, engine routes replayed (r3)",
                f"mean {d['probe_replay_abs_diff_mean']:.1e}, max {d['probe_replay_abs_diff_max']:.1e} "
                "(routes used = the engine's: 0% differ)",
            ),
            ("expert load (train step)", f"max/mean {d['load_max_over_mean']:.2f}, CV {d['load_cv']:.2f}"),
        ]
    if "floor_abs_diff_mean" in d:
        rows.append(
            (
                "bf16 noise floor (engine bf16 vs its fp32 copy)",
                f"mean {d['floor_abs_diff_mean']:.1e}, max {d['floor_abs_diff_max']:.1e}",
            )
        )
    return rows


def report(stages: list[Stage], args: argparse.Namespace, device_name: str, total_s: float) -> str:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"### bench/gpu_check.py --device {args.device}: {device_name}, {date}",
        "",
        f"Total {total_s:.0f} s. Python {sys.version.split()[0]}, torch {_version('torch')}, "
        f"megatron-core {_version('megatron-core')}, transformers {_version('transformers')}, "
        f"TransformerEngine {_version('transformer-engine') or 'absent'}, sglang {_version('sglang') or 'absent'}.",
        "",
        "| stage | result | seconds | what |",
        "|---|---|---|---|",
    ]
    for s in stages:
        summary = s.summary.splitlines()[0] if s.summary else ""
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.0f} | {summary} |")
    table = next((s for s in stages if s.name == "table" and s.status == "ok"), None)
    if table is not None:
        lines += ["", "| what (iterations after the first) | measured |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in table_rows(table.details, args.device)]
    failures = [s for s in stages if s.status in ("FAILED", "stopped")]
    for s in failures:
        what = "failed" if s.status == "FAILED" else "stopped at the budget"
        lines += ["", f"#### {s.name} {what}", "```", s.summary, "```"]
    return "\n".join(lines) + "\n"


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _device_name(device: str) -> str:
    if device == "cpu":
        return "CPU"
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"


def default_out() -> Path:
    """``$OUT/gpu_check-<time>`` where the caller has an output folder (the device tool brings back only
    its ``$OUT``), else ``runs/gpu_check/<time>``."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = os.environ.get("OUT")
    return Path(out) / f"gpu_check-{stamp}" if out else REPO / "runs" / "gpu_check" / stamp


def write_report(
    out: Path, stages: list[Stage], args: argparse.Namespace, device_name: str, total_s: float
) -> str:
    """``gpu_check.md`` and ``gpu_check.json`` as they stand (after every stage: a call cut short keeps
    the stages it finished)."""
    text = report(stages, args, device_name, total_s)
    (out / "gpu_check.md").write_text(text)
    rows = [
        {"name": s.name, "status": s.status, "seconds": s.seconds, "summary": s.summary, "details": s.details}
        for s in stages
    ]
    (out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    return text


def run_stage(name: str, args: argparse.Namespace, out: Path) -> Stage:
    """One stage, stopped (its processes killed) when the budget runs out while it runs."""
    stage = Stage(name)
    if CLOCK.left() <= 0:
        stage.status, stage.summary = "skipped", f"over the {args.budget_s:.0f} s budget (--budget-s)"
        return stage
    print(f"[{name}] ...", flush=True)
    t0 = time.perf_counter()
    try:
        RUNNERS[name](args, out, stage)
    except Exception as exc:  # one stage's crash is its failure; the others still run
        stage.status, stage.summary = "FAILED", f"{type(exc).__name__}: {exc}"
    stage.seconds = time.perf_counter() - t0
    if CLOCK.expired and stage.status != "ok":
        stage.status = "stopped"
        stage.summary = (
            f"stopped at the {args.budget_s:.0f} s budget (--budget-s), {stage.seconds:.0f} s in\n"
            + (stage.summary or "")
        )
    print(
        f"[{name}] {stage.status} in {stage.seconds:.0f} s: {stage.summary.splitlines()[0] if stage.summary else ''}",
        flush=True,
    )
    return stage


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default $OUT/gpu_check-<time>, else runs/gpu_check/...)",
    )
    parser.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}"
    )
    parser.add_argument("--pytest-timeout", type=float, default=150.0, help="seconds for the pytest stage")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help="the whole check's seconds: the stage running at the end is stopped, later ones skipped "
        "(the device call's limit)",
    )
    args = parser.parse_args()
    wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(STAGES))
    if unknown:
        parser.error(f"--stages: unknown {unknown}; choose from {','.join(STAGES)}")
    out = args.out or default_out()
    out.mkdir(parents=True, exist_ok=True)
    device_name = _device_name(args.device)
    print(f"gpu_check: device {args.device} ({device_name}); output in {out}", flush=True)

    start = time.perf_counter()
    CLOCK.start(args.budget_s)
    stages: list[Stage] = []
    text = ""
    for name in (s for s in STAGES if s in wanted):
        stages.append(run_stage(name, args, out))
        text = write_report(out, stages, args, device_name, time.perf_counter() - start)
    CLOCK.stop()
    print("\n" + text)
    return 1 if any(s.status == "FAILED" for s in stages) else 0


if __name__ == "__main__":
    sys.exit(main())
