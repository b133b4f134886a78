"""Workers of tests/test_faults.py: checkpoints of a real 2-rank policy, resumed from damaged,
foreign or mismatched directories, and saves that must fail cleanly (gloo, fp32)."""

from __future__ import annotations

import contextlib
import io
import resource
import signal
import time
from pathlib import Path
from typing import Any

from tests.workers.checkpoint_workers import _setup, _teardown, _train_step, run_case


def resume(overrides: list[str], ckpt_dir: str) -> dict[str, Any]:
    """``checkpoint.resume`` (auto unless overridden) from ``ckpt_dir``: the iteration resumed, or
    the error; rank 0's console output."""
    from grpo_megatron.checkpoint.manager import CheckpointManager

    cfg, ps, policy = _setup([f"checkpoint.dir={ckpt_dir}", "parallel.ep=2", *overrides])
    manager = CheckpointManager(cfg.checkpoint, cfg.logging.run_dir, ps)
    out: dict[str, Any] = {"error": "", "iteration": -1}
    console = io.StringIO()
    try:
        with contextlib.redirect_stdout(console):
            state = manager.resume(policy)
        out["iteration"] = 0 if state is None else int(state["iteration"])
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["console"] = console.getvalue()
    _teardown()
    return out


def failing_save(ckpt_dir: str, fault: str) -> dict[str, Any]:
    """Resume from ``ckpt_dir``, train one step, then save with ``fault``: ``nan`` (rank 1 holds a
    NaN weight) or ``disk_full`` (every rank may write at most 64 KiB per file: EFBIG, as ENOSPC
    would)."""
    import torch

    from grpo_megatron.bridge.layout import unwrap
    from grpo_megatron.checkpoint.manager import CheckpointManager

    cfg, ps, policy = _setup([f"checkpoint.dir={ckpt_dir}", "parallel.ep=2"])
    manager = CheckpointManager(cfg.checkpoint, cfg.logging.run_dir, ps)
    start = manager.resume(policy)["iteration"]
    _train_step(policy, ps, start + 1)
    if fault == "nan" and ps.rank == 1:
        with torch.no_grad():
            next(unwrap(policy.model).parameters())[0] = float("nan")
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if fault == "disk_full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limits[1]))
    try:
        manager.save(start + 1, policy, {"iteration": start + 1})
        error = ""
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    import torch.distributed as dist

    dist.barrier()
    time.sleep(0.5)  # let the other rank finish its own clean-up before listing
    listing = sorted(p.name for p in Path(ckpt_dir).iterdir())
    _teardown()
    return {"error": error, "listing": listing}


def cases(calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Several of the functions above (and checkpoint_workers.run_case) in one launch."""
    from tests.helpers.dist import init_gloo

    init_gloo()
    known = {"run_case": run_case, "resume": resume, "failing_save": failing_save}
    return [known[name](**kwargs) for name, kwargs in calls]


def stuck_rank(bound_s: float, stuck: int, steps: int = 50, async_wait: bool = False) -> dict[str, Any]:
    """Timed phases with a collective each, as the trainer's; rank ``stuck`` sleeps in step 3
    (outside any collective, as a hung file system or engine would). The watchdog must end every
    rank, naming it; returning means it did not. ``async_wait``: the collective is posted
    asynchronously and waited for with ``work.wait()``, outside c10d's Python frames (as NCCL's)."""
    import torch
    import torch.distributed as dist

    from grpo_megatron.distributed.watchdog import start_watchdog
    from grpo_megatron.training.timing import PhaseTimer
    from tests.helpers.dist import init_gloo

    rank, world = init_gloo()
    watchdog = start_watchdog(bound_s, rank, world)
    timer = PhaseTimer(beat=watchdog.beat)
    for step in range(steps):
        with timer(f"step {step}"):
            if rank == stuck and step == 3:
                time.sleep(600)
            if async_wait:
                dist.all_reduce(torch.ones(1), async_op=True).wait()
            else:
                dist.all_reduce(torch.ones(1))
    watchdog.stop()
    return {"finished": True}


def long_phases(bound_s: float) -> dict[str, Any]:
    """Rank 0 computes (torch steps) for three bounds in step 1; rank 1 blocks in one call for three
    bounds in step 2, inside ``long_phase``; the other rank waits in a collective each time."""
    import torch
    import torch.distributed as dist

    from grpo_megatron.distributed.watchdog import start_watchdog
    from grpo_megatron.training.timing import PhaseTimer
    from tests.helpers.dist import init_gloo

    rank, world = init_gloo()
    watchdog = start_watchdog(bound_s, rank, world)
    assert watchdog is not None
    timer = PhaseTimer(beat=watchdog.beat)
    for step in range(4):
        with timer(f"step {step}"):
            if rank == 0 and step == 1:  # a long phase of ordinary work: small torch steps
                end, layer = time.monotonic() + 3 * bound_s, torch.nn.Linear(256, 256)
                while time.monotonic() < end:
                    layer(torch.randn(64, 256)).square().mean().backward()
            if rank == 1 and step == 2:
                with watchdog.long_phase("engine start", 10 * bound_s):
                    time.sleep(3 * bound_s)
            dist.all_reduce(torch.ones(1))
    watchdog.stop()
    return {"finished": True}


def long_rollout(bound_s: float, long_phase: bool) -> dict[str, Any]:
    """A rollout that takes three watchdog bounds: rank 0's engine process (rollout.embedded_process)
    is stopped (SIGSTOP) as the generation is submitted and continued three bounds later, so rank 0
    blocks on its engine's pipe and rank 1 in the fleet's collective, in the real ``Rollout`` phase.
    ``long_phase``: the phase gets the job's watchdog (its wait runs under the long bound); else none
    (the wait under ``progress_timeout_s``, as before issue 36). Returning means the watchdog let it be."""
    import os
    import signal
    import threading

    from grpo_megatron.config import load_config
    from grpo_megatron.data.records import PromptRecord
    from grpo_megatron.distributed.bootstrap import init_distributed
    from grpo_megatron.distributed.watchdog import start_watchdog
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.job import engine_spec
    from grpo_megatron.training.phases.rollout import Rollout
    from grpo_megatron.training.timing import PhaseTimer
    from tests.helpers.dist import CPU_JOB
    from tests.workers.rollout_workers import EXAMPLE

    cfg = load_config(
        EXAMPLE,
        [
            *CPU_JOB,
            "rollout.embedded_process=true",
            "rollout.max_new_tokens=4",
            f"parallel.long_phase_timeout_s={20 * bound_s}",
        ],
    )
    ps = init_distributed(cfg.parallel)
    fleet = RolloutFleet.build(engine_spec(cfg), cfg.model.load_hf_config(), ps)
    watchdog = start_watchdog(bound_s, ps.rank, ps.world_size)
    assert watchdog is not None
    rollout = Rollout(
        fleet,
        cfg.rollout,
        eos_id=0,
        watchdog=watchdog if long_phase else None,
        long_phase_s=cfg.parallel.long_phase_timeout_s,
    )
    timer = PhaseTimer(beat=watchdog.beat)
    records = [PromptRecord("", "", {}, (3, 4, 5)), PromptRecord("", "", {}, (6, 7))]
    if ps.rank == 0:
        assert fleet.engine is not None
        pid = fleet.engine.proc.pid  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(3 * bound_s, os.kill, (pid, signal.SIGCONT)).start()
    start = time.monotonic()
    with timer("rollout"):
        groups = rollout.generate(records, rollout.params(n=2, seed=1))
    seconds = time.monotonic() - start
    watchdog.stop()
    fleet.shutdown()
    return {"finished": True, "seconds": seconds, "groups": len(groups)}
