"""The sandboxed reward pool: reward code is imported and run only in worker processes, with a
per-sample timeout.

Contract with the trainer: `RewardPool.score(samples)` always returns one finite float per
sample. A sample whose reward code raises, exceeds `timeout_s`, kills its worker, or returns a
non-number / NaN / inf gets `cfg.fallback` instead; each case is counted in the metrics. A
worker that timed out or died is killed (SIGKILL) and replaced by a fresh process.

Scheduling. A call's samples are handed out in chunks, one message per chunk each way (an even
share of the samples still waiting per worker, at most _MAX_CHUNK; one sample per worker while
there are no more samples than workers): per-sample messages cost more than the rewards themselves.
The timeout stays per sample: before each sample a worker writes which one it starts and when into
a two-number shared-memory record, and the pool's clock for that sample starts there (the first
sample's when the chunk is handed over; never later than timeout_s per sample of the chunk after
it). A sample past timeout_s, a crash or a malformed message is settled for the sample at fault
(the one running, or the one whose result was due); the rest of that worker's chunk goes back to
the queue for the other workers, so one bad sample never costs its neighbours their rewards. Every
such event settles at least one sample, so the whole call is still bounded by about
ceil(N / num_workers) * timeout_s (+ about 1 s of process overhead) however the reward code
misbehaves; in particular a batch of at most num_workers samples returns within timeout_s + 1 s
even if every sample hangs. A worker sends what it finished at least every _FLUSH_S seconds.
`cfg.batch_timeout_s` (or the argument of
`score`) is a hard bound on the whole call: samples not finished by then get the fallback and
count as timeouts; by default it is derived from timeout_s and the worker count (config.py).

Containment. The trainer never imports user reward modules (with num_workers >= 1): the workers are
rewards/workers.py's sandboxed processes (the tool pool's too): each first enters its sandbox
(sandbox.py), then imports the components within `cfg.startup_timeout_s`, reporting which component
it is importing so that a hang or a failure names its config field. The pool logs the active
protections once.

Failures are counted per component (`reward/<component>/error_frac`); `report_failures` (called
by the trainer on each scoring call) prints the first failure and stops the run when more than
`cfg.max_error_frac` of the samples fell back.

Processes are started with the `forkserver` (default) or `spawn` method (rewards/workers.py). With
`forkserver` the server preloads the
built-in reward modules (math-verify, sympy) once, so replacing a worker takes milliseconds
instead of a fresh interpreter's import time; this sets multiprocessing's forkserver preload
list, which only has an effect if the forkserver has not started yet.

Responses are cut to their last `cfg.max_response_chars` characters in the trainer process,
before pickling (`reward_pool/truncated` counts them).

The other way nothing is unpickled: reward code can reach its worker's pipe, so every message a
worker sends is a size-bounded frame of JSON checked against a fixed schema (wire.py), read with a
deadline. A malformed, oversized, incomplete or out-of-turn message kills that worker: its sample
falls back (an error) and a replacement starts, as for a crash; at start-up it stops the start
naming the component being imported.
"""

import json
import math
import multiprocessing.connection as mp_conn
import pickle
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from grpo_megatron.rewards import wire
from grpo_megatron.rewards.base import RewardSample
from grpo_megatron.rewards.composite import CompositeReward, RewardComponentError
from grpo_megatron.rewards.config import RewardComponentConfig, RewardConfig
from grpo_megatron.rewards.loader import build_composite
from grpo_megatron.rewards.sandbox import SandboxPlan, SandboxReport, set_cpu_backstop
from grpo_megatron.rewards.workers import (
    StartFailure,
    Worker,
    WorkerKind,
    WorkerPool,
    ready_connections,
    serve_in_sandbox,
)

__all__ = [
    "RewardPool",
    "RewardBatch",
    "SampleStatus",
    "RewardStartupError",
    "RewardFailureError",
    "check_reward_imports",
    "report_failures",
    "default_batch_timeout_s",
]

SampleStatus = Literal["ok", "error", "timeout", "invalid"]
Outcome = tuple[SampleStatus, float | None, dict[str, float] | None, str | None, str | None]
"""One sample's (status, total reward, component rewards, error message, failing component)."""
_NOT_SCORED: Outcome = ("error", None, None, "not scored", None)

# Modules the forkserver imports once so that forked workers start warm.
_PRELOAD = ["grpo_megatron.rewards.loader", "grpo_megatron.rewards.math_accuracy", "math_verify"]
# Error messages kept per call (for logs); the counts are always complete.
_MAX_ERROR_MESSAGES = 8
# Workers that fail to start within one call before the call gives up on its remaining samples.
_MAX_INIT_FAILURES_PER_WORKER = 3
# The most samples handed to a worker in one message (a call's samples are spread evenly below it).
_MAX_CHUNK = 64
# A worker sends what it scored of a chunk at least this often (seconds), so that a batch timeout or
# a kill loses little finished work; and keeps each "results" frame this far under the frame bound.
_FLUSH_S = 0.1
_FRAME_BUDGET = wire.MAX_FRAME_BYTES - 1024


@dataclass
class RewardBatch:
    """Everything `score_detailed` learned about a batch."""

    rewards: list[float]
    """Total reward per sample (fallback where status != "ok")."""
    components: list[dict[str, float]]
    """Unweighted component scores per sample (empty where status != "ok")."""
    status: list[SampleStatus]
    metrics: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    """The first few error messages of this call, for logging."""


class RewardStartupError(ValueError):
    """Reward workers could not start: a component failed to import (its config field named),
    an import hung past reward.startup_timeout_s, or the sandbox could not be set up."""


class RewardFailureError(RuntimeError):
    """More than reward.max_error_frac of a scoring call's samples fell back."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def default_batch_timeout_s(cfg: RewardConfig, n_samples: int) -> float:
    """The bound on one scoring call of `n_samples` when reward.batch_timeout_s is null:
    timeout_s * (2 + ceil(n / num_workers) / 8) (see RewardConfig.batch_timeout_s)."""
    waves = math.ceil(n_samples / max(cfg.num_workers, 1))
    return cfg.timeout_s * (2.0 + waves / 8.0)


def _worker_main(
    conn: mp_conn.Connection,
    plan: SandboxPlan,
    components: list[RewardComponentConfig],
    timeout_s: float,
    stop_on_error: bool,
    progress: Any,
) -> None:
    """Worker loop: the sandboxed start (``serve_in_sandbox``: the components imported, saying which),
    then score chunks of samples (``_serve``). Everything it says is a wire.py frame."""
    composite = serve_in_sandbox(
        conn, plan, lambda on_import: build_composite(components, on_import=on_import), what="reward"
    )
    if composite is not None:
        _serve(conn, composite, timeout_s, progress, stop_on_error)


def _score_one(composite: CompositeReward, task_id: int, sample: RewardSample) -> wire.Result:
    try:
        total, comps = composite(sample)
        return wire.Result(task_id, "ok", float(total), {k: float(v) for k, v in comps.items()}, None, None)
    except RewardComponentError as err:
        status: Literal["invalid", "error"] = "invalid" if err.invalid else "error"
        return wire.Result(task_id, status, None, None, str(err)[:2000], err.component)
    except BaseException as err:  # noqa: BLE001 - e.g. SystemExit or KeyboardInterrupt from user code
        tb = traceback.format_exc(limit=3)
        return wire.Result(task_id, "error", None, None, f"{type(err).__name__}: {err}\n{tb}"[:2000], None)


def _serve(
    conn: mp_conn.Connection, composite: CompositeReward, timeout_s: float, progress: Any, stop_on_error: bool
) -> None:
    """Score each chunk of (task id, sample) pairs the pool sends, in order, and answer with "results"
    frames: one per chunk, or more where a chunk takes longer than _FLUSH_S or would overflow a frame.
    Before each sample, ``progress`` (shared memory: [task id, start time]) says which sample runs
    since when: the pool's per-sample clock. With ``stop_on_error`` the chunk ends at an error (the
    pool replaces this worker and hands the rest of the chunk to another)."""
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        pending: list[dict[str, Any]] = []
        size, flushed = 0, time.monotonic()
        for task_id, sample in chunk:
            progress[1] = time.monotonic()  # the start first: a reader that sees the new id sees its start
            progress[0] = task_id
            set_cpu_backstop(timeout_s)
            reply = _score_one(composite, task_id, sample)
            fields = wire.result_fields(reply)
            cost = len(json.dumps(fields)) + 2
            if pending and (size + cost > _FRAME_BUDGET or len(pending) == wire.MAX_ITEMS):
                if not _send(conn, pending):
                    return
                pending, size, flushed = [], 0, time.monotonic()
            pending.append(fields)
            size += cost
            if time.monotonic() - flushed > _FLUSH_S or (stop_on_error and reply.status == "error"):
                if not _send(conn, pending):
                    return
                pending, size, flushed = [], 0, time.monotonic()
                if stop_on_error and reply.status == "error":
                    break
        if pending and not _send(conn, pending):
            return


def _send(conn: mp_conn.Connection, fields: list[dict[str, Any]]) -> bool:
    try:
        conn.send_bytes(wire.encode_results(fields))
        return True
    except (OSError, ValueError):
        return False


REWARD_WORKERS = WorkerKind(
    _worker_main, "reward", "reward", wire.REWARD_KINDS, preload=tuple(_PRELOAD), progress=True
)
"""Reward workers: chunks of samples, each sample's start written to their progress record."""


class RewardPool:
    """Scores RewardSamples with the configured composite reward in sandboxed workers.

    Use as a context manager (or call close()). `num_workers=0` imports and scores in the
    calling process: failures still become the fallback, but there is no timeout and no
    isolation (debugging only). One thread at a time may call `score` (the trainer's driver
    loop); it is not re-entrant. `log` receives the one start-up line naming the active
    protections.
    """

    def __init__(self, cfg: RewardConfig, log: Callable[[str], None] | None = print):
        cfg.validate()
        self.cfg = cfg
        self._components = list(cfg.components)
        self._names = frozenset(c.name for c in cfg.components)
        self._composite: CompositeReward | None = None
        self._log = log
        self._init_failures = 0
        self._closed = False
        self.workers: WorkerPool | None = None
        """The sandboxed workers (None with num_workers=0)."""
        if cfg.num_workers == 0:
            self._composite = build_composite(cfg.components)  # in this process, by request
            return
        self.workers = WorkerPool(
            cfg,
            REWARD_WORKERS,
            (self._components, cfg.timeout_s, cfg.replace_worker_on_error),
            num_workers=cfg.num_workers,
            imports=len(self._components),
            component_names=self._names,
            log=log,
        )
        try:
            self.workers.wait_ready(time.monotonic() + cfg.startup_timeout_s)
        except StartFailure as failure:
            self.close()
            why = failure.init_error or self._startup_failure(failure.worker, failure.cause)
            raise RewardStartupError(_one_line(why)) from None

    @property
    def sandbox(self) -> SandboxReport | None:
        """What the first worker reported as active (None with num_workers=0)."""
        return self.workers.sandbox if self.workers is not None else None

    @property
    def _workers(self) -> list[Worker]:
        return self.workers.workers if self.workers is not None else []

    def _replace(self, worker: Worker) -> None:
        assert self.workers is not None
        self.workers.replace(worker)

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for tests and diagnostics)."""
        return [w.process.pid for w in self._workers]

    def _startup_failure(self, w: Worker, cause: str) -> str:
        timeout = self.cfg.startup_timeout_s
        if w.importing is None:
            return f"reward worker did not set up its sandbox within reward.startup_timeout_s={timeout:g} s ({cause})"
        i = w.importing
        spec = self._components[i].function
        return (
            f"reward.components[{i}].function={spec!r}: importing it did not finish within "
            f"reward.startup_timeout_s={timeout:g} s ({cause}); fix the module or raise the timeout"
        )

    def _receive(self, w: Worker) -> wire.Message:
        """The next message of ``w`` (its pipe is readable; ``WorkerPool.receive``), results checked
        against what it owes. EOFError/OSError: the worker is gone; wire.ProtocolError: it sent
        something else, or a message out of turn (an import out of order, a result for another task)."""
        assert self.workers is not None
        message = self.workers.receive(w)
        if isinstance(message, wire.Result | wire.Results):
            results = message.results if isinstance(message, wire.Results) else (message,)
            if len(results) > len(w.tasks):
                raise wire.ProtocolError(f"{len(results)} result(s) from a worker owing {len(w.tasks)}")
            for result, task in zip(
                results, w.tasks, strict=False
            ):  # in the order the samples were handed over
                if result.task != task:
                    raise wire.ProtocolError(f"a result for task {result.task} from a worker scoring {task}")
        return message

    def close(self) -> None:
        """Kill the workers and remove their scratch directories. Idempotent."""
        self._closed = True
        if self.workers is not None:
            self.workers.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- scoring ----------------------------------------------------------------------------

    def score(
        self, samples: Sequence[RewardSample], batch_timeout_s: float | None = None
    ) -> tuple[list[float], dict[str, float]]:
        """One finite reward per sample, and metrics (see `score_detailed`)."""
        batch = self.score_detailed(samples, batch_timeout_s)
        return batch.rewards, batch.metrics

    def score_detailed(
        self, samples: Sequence[RewardSample], batch_timeout_s: float | None = None
    ) -> RewardBatch:
        """Score `samples`; never raises because of reward code, never hangs.

        Metrics: reward/mean, reward/std, reward/<component> (mean over samples scored "ok"),
        reward_pool/{errors,timeouts,invalid,fallback} (counts), reward_pool/fallback_frac,
        reward_pool/worker_restarts (this call), reward_pool/truncated (responses cut).
        """
        if self._closed:
            raise RuntimeError("RewardPool.score called after close()")
        start = time.monotonic()
        limit = self.cfg.max_response_chars
        truncated = sum(len(s.response) > limit for s in samples)
        prepared = [
            replace(s, response=s.response[-limit:]) if len(s.response) > limit else s for s in samples
        ]
        n = len(prepared)
        outcomes: list[Outcome | None] = [None] * n
        restarts_before = self._restarts()
        if self.cfg.num_workers == 0:
            for i, sample in enumerate(prepared):
                outcomes[i] = self._score_in_process(sample)
        else:
            if batch_timeout_s is None:
                batch_timeout_s = self.cfg.batch_timeout_s
            if batch_timeout_s is None:
                batch_timeout_s = default_batch_timeout_s(self.cfg, n)
            batch_deadline = start + batch_timeout_s
            self._init_failures = 0
            self._run_in_workers(prepared, outcomes, batch_deadline)
            assert self.workers is not None
            self.workers.reap()
        return self._collect(outcomes, truncated, self._restarts() - restarts_before)

    def _restarts(self) -> int:
        return self.workers.restarts if self.workers is not None else 0

    def _score_in_process(self, sample: RewardSample) -> Outcome:
        assert self._composite is not None
        try:
            total, comps = self._composite(sample)
            return ("ok", total, comps, None, None)
        except RewardComponentError as err:
            return ("invalid" if err.invalid else "error", None, None, str(err), err.component)
        except Exception as err:  # noqa: BLE001 - reward code must not stop training
            return ("error", None, None, f"{type(err).__name__}: {err}", None)

    def _run_in_workers(
        self, samples: list[RewardSample], outcomes: list[Outcome | None], batch_deadline: float
    ) -> None:
        pending = deque(range(len(samples)))
        timeout_s = self.cfg.timeout_s
        while pending or any(w.tasks for w in self._workers):
            now = time.monotonic()
            if now >= batch_deadline:
                self._batch_timeout(pending, outcomes)
                break
            if self._init_failures > _MAX_INIT_FAILURES_PER_WORKER * len(self._workers):
                while pending:  # workers keep failing to import the reward code: give up on this call
                    i = pending.popleft()
                    outcomes[i] = ("error", None, None, "reward workers keep failing to start", None)
                if not any(w.tasks for w in self._workers):
                    break
            # Kill workers past their sample's deadline, and workers that never got ready.
            for w in list(self._workers):
                if w.tasks and now >= w.deadline(timeout_s, now):
                    culprit = w.running(now)[0]
                    culprit = w.tasks[0] if culprit is None else culprit
                    outcomes[culprit] = (
                        "timeout",
                        None,
                        None,
                        f"sample {culprit} exceeded {timeout_s} s",
                        None,
                    )
                    self._fail(w, pending, culprit)
                elif not w.ready and now - w.started_at > self.cfg.startup_timeout_s:
                    self._init_failures += 1
                    self._replace(w)
            self._hand_out(samples, pending, outcomes)
            # Sleep until a message, a death (EOF), or the next deadline.
            now = time.monotonic()
            next_deadline = min([w.deadline(timeout_s, now) for w in self._workers] + [batch_deadline])
            wait_s = max(0.0, min(next_deadline, now + 1.0) - now)
            by_conn = {w.conn: w for w in self._workers if w.tasks or not w.ready}
            for conn in ready_connections(list(by_conn), wait_s):
                self._handle_message(by_conn[conn], pending, outcomes)

    def _batch_timeout(self, pending: deque[int], outcomes: list[Outcome | None]) -> None:
        """The call's bound has passed: what is still owed or waiting falls back as a timeout."""
        for w in list(self._workers):
            if w.tasks:
                culprit = w.running(time.monotonic())[0]
                for i in w.tasks:
                    why = "while scoring" if i == culprit else "before"
                    outcomes[i] = ("timeout", None, None, f"batch timeout {why} sample {i}", None)
                w.tasks.clear()
                self._replace(w)
        while pending:
            i = pending.popleft()
            outcomes[i] = ("timeout", None, None, f"batch timeout before sample {i} was scored", None)

    def _fail(self, w: Worker, pending: deque[int], culprit: int | None) -> None:
        """Replace ``w``; the samples it still owed but for ``culprit`` (whose outcome is set) go back
        to the front of ``pending``, in order: they were not at fault."""
        pending.extendleft(reversed([i for i in w.tasks if i != culprit]))
        w.tasks.clear()
        self._replace(w)

    def _hand_out(
        self, samples: list[RewardSample], pending: deque[int], outcomes: list[Outcome | None]
    ) -> None:
        """Give each idle, ready worker a chunk of ``pending``: an even share of it over the pool's
        workers (one sample each while there are no more samples than workers), at most _MAX_CHUNK."""
        for w in list(self._workers):
            if not (pending and w.ready and not w.tasks):
                continue
            if w.conn.poll():
                self._replace(w)  # it spoke out of turn (more frames after its results): a liar
                continue
            size = min(-(-len(pending) // len(self._workers)), _MAX_CHUNK)
            chunk = [pending.popleft() for _ in range(size)]
            w.progress[0] = -1.0  # the clock of its first sample starts now
            w.tasks.extend(chunk)
            w.sent_at = time.monotonic()
            w.hard_deadline = w.sent_at + self.cfg.timeout_s * len(chunk)
            try:
                w.conn.send([(i, samples[i]) for i in chunk])
            except (OSError, ValueError, TypeError, AttributeError, pickle.PicklingError) as err:
                # the worker died while idle, or a sample does not pickle: only that one is at fault
                bad = [i for i in chunk if not _picklable(samples[i])]
                for i in bad:
                    outcomes[i] = ("error", None, None, f"could not send sample {i}: {err}", None)
                for i in bad:
                    w.tasks.remove(i)
                self._fail(w, pending, None)

    @staticmethod
    def _culprit(w: Worker, *, protocol: bool) -> int | None:
        """The owed sample a dead or lying worker is blamed for. A death: the sample it was scoring
        (else the next it owes, so that a worker dying on every chunk still settles one sample each time).
        A bad frame: the first owed sample (the frame came where its result was due), unless the
        worker is still inside a sample it already answered (that sample's code wrote the frame, and
        its first answer stands)."""
        if not w.tasks:
            return None
        progress = float(w.progress[0])
        running = w.running(time.monotonic())[0]
        if not protocol:
            return (
                w.tasks[0] if running is None else running
            )  # between samples: the next one (as before chunks)
        answered = math.isfinite(progress) and running is None and int(progress) >= 0
        return None if answered else w.tasks[0]

    def _handle_message(self, w: Worker, pending: deque[int], outcomes: list[Outcome | None]) -> None:
        try:
            msg = self._receive(w)
        except (
            EOFError,
            OSError,
            wire.ProtocolError,
        ) as err:  # died (os._exit, segfault, OOM kill ...) or lied
            if not w.ready:
                self._init_failures += 1
            culprit = self._culprit(w, protocol=isinstance(err, wire.ProtocolError))
            if culprit is not None:
                if isinstance(err, wire.ProtocolError):
                    why = f"reward worker sent a malformed message on sample {culprit} and was killed: {err}"
                else:
                    why = f"reward worker died (exit code {w.process.exitcode}) on sample {culprit}"
                outcomes[culprit] = ("error", None, None, why, None)
            self._fail(w, pending, culprit)
            return
        if isinstance(msg, wire.Importing):
            w.importing = msg.index
            return
        if isinstance(msg, wire.Ready):
            w.ready = True
            assert self.workers is not None
            self.workers.note_sandbox(msg)
            return
        if isinstance(
            msg, wire.InitError
        ):  # user code imported at start-up but not now: retry, within limits
            self._init_failures += 1
            self._replace(w)
            return
        assert isinstance(msg, wire.Result | wire.Results)  # wire.REWARD_KINDS: nothing else decodes
        errors = False
        for result in msg.results if isinstance(msg, wire.Results) else (msg,):
            w.tasks.popleft()  # _receive checked the order
            if result.status == "ok":
                outcomes[result.task] = ("ok", result.reward, result.components, None, None)
            else:
                outcomes[result.task] = (result.status, None, None, result.message, result.component)
            errors |= result.status == "error"
        if errors and self.cfg.replace_worker_on_error:
            self._fail(
                w, pending, None
            )  # the worker stopped its chunk at the error: the rest goes on elsewhere

    def _collect(self, outcomes: list[Outcome | None], truncated: int, restarts: int) -> RewardBatch:
        fallback = float(self.cfg.fallback)
        rewards: list[float] = []
        components: list[dict[str, float]] = []
        status: list[SampleStatus] = []
        errors: list[str] = []
        failed_by_component = dict.fromkeys((c.name for c in self._components), 0)
        for out in outcomes:
            kind, total, comps, err, component = out if out is not None else _NOT_SCORED
            if component in failed_by_component:
                failed_by_component[component] += 1
            if kind == "ok" and (not isinstance(total, float) or not math.isfinite(total)):
                kind, err = "invalid", f"non-finite total reward {total!r}"  # e.g. weight * huge = inf
            status.append(kind)
            if kind == "ok" and total is not None:  # a None total was made "invalid" just above
                rewards.append(total)
                components.append(dict(comps or {}))
            else:
                rewards.append(fallback)
                components.append({})
                if err and len(errors) < _MAX_ERROR_MESSAGES:
                    errors.append(err)
        n = len(rewards)
        metrics: dict[str, float] = {
            "reward/mean": sum(rewards) / n if n else 0.0,
            "reward/std": _std(rewards),
            "reward_pool/errors": float(status.count("error")),
            "reward_pool/timeouts": float(status.count("timeout")),
            "reward_pool/invalid": float(status.count("invalid")),
            "reward_pool/fallback": float(n - status.count("ok")),
            "reward_pool/fallback_frac": (n - status.count("ok")) / n if n else 0.0,
            "reward_pool/worker_restarts": float(restarts),
            "reward_pool/truncated": float(truncated),
        }
        keys = sorted({k for c in components for k in c})
        for key in keys:
            values = [c[key] for c in components if key in c]
            metrics[f"reward/{key}"] = sum(values) / len(values)
        for name, failed in failed_by_component.items():  # raised or returned a non-number
            metrics[f"reward/{name}/error_frac"] = failed / n if n else 0.0
        return RewardBatch(
            rewards=rewards, components=components, status=status, metrics=metrics, errors=errors
        )


def _std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def report_failures(batch: RewardBatch, cfg: RewardConfig, log: Callable[[str], None] = print) -> None:
    """Make reward failures visible: print a summary and the first failure's text (one line)
    when any sample fell back, and raise RewardFailureError when more than
    `cfg.max_error_frac` of the samples did (a reward that raises on everything must not train
    silently on the fallback)."""
    n = len(batch.status)
    failed = n - batch.status.count("ok")
    if not failed:
        return
    counts = ", ".join(
        f"{batch.status.count(k)} {k}" for k in ("error", "invalid", "timeout") if k in batch.status
    )
    first = _one_line(batch.errors[0])[:500] if batch.errors else "no message"
    summary = f"{failed}/{n} samples got the fallback reward {cfg.fallback:g} ({counts}); first: {first}"
    log(f"[reward] {summary}")
    if failed / n > cfg.max_error_frac:
        raise RewardFailureError(
            f"{summary} -- more than reward.max_error_frac={cfg.max_error_frac:g} of the batch: fix the reward "
            "function (run it on a few samples with reward.num_workers=0 to debug) or raise reward.max_error_frac"
        )


def check_reward_imports(cfg: RewardConfig, log: Callable[[str], None] | None = print) -> None:
    """Import every configured component in a throwaway sandboxed worker, as the trainer's pool
    will (never in this process); raise RewardStartupError, one line naming
    reward.components[i].function, the module and the cause, if one fails or hangs."""
    with RewardPool(replace(cfg, num_workers=1), log=log):
        pass


def _picklable(sample: RewardSample) -> bool:
    try:
        pickle.dumps(sample)
        return True
    except Exception:  # noqa: BLE001 - whatever pickling raises
        return False
