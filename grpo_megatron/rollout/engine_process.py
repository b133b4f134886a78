"""An embedded engine in a process of its own (``rollout.embedded_process``): it generates while the
trainer trains (the asynchronous loop, training/groups.py: GroupProducer).

``EngineProcess`` is the trainer's side: a ``RolloutEngine`` whose ``submit`` returns at once and
whose result is collected later. ``serve`` is the engine's side (``python -m
grpo_megatron.rollout.engine_process SPEC``): one ``EmbeddedEngine`` on CPU, ``rollout.
embedded_process_threads`` threads, requests served in the order they were sent.

Versions: every request carries the weight version the trainer had sent before it (``weight_version``
of the proxy). The engine serves a request with exactly that version, loading the weights it was
sent (in order) between two requests, never in the middle of one: which weights sampled which batch
depends only on the order of the trainer's calls, never on timing, so runs are reproducible. Each
``Completion.weight_version`` is the version that sampled it.

Wire (nothing is unpickled in either direction): requests are JSON lines on the engine's stdin;
weights go through a safetensors file, results through a JSON file, both in a private temporary
folder (``/dev/shm`` where it exists), announced by one short JSON line on the engine's stdout, so no
pipe ever fills while its reader is busy.

Health (issue 41): while it serves a request the engine sends a heartbeat line every ``heartbeat_s``
(an eighth of the health deadline, at most 10 s; a thread of its own, so a long generation is not
a hang). The trainer's handle raises ``EngineLost`` (engine rank, host, why, the last lines of the
engine's log: ``<logging.run_dir>/engines/engine-process-rank<R>.log`` in a job, every life appended
with a header line) when the process has exited, or sent nothing for
``health_timeout_s`` while a result is awaited (a stopped process, SIGSTOP, counts: its state is
named), or its pipe broke. ``EngineProcess.restart`` kills
what is left, cleans its folder and starts it again from the same spec (the fleet then syncs the
current weights into it and resubmits its share: rollout/fleet.py, ``EngineRecovery``).

Fault injection for tests (``rollout/faults.py``): ``GRPO_ENGINE_FAULT="kill:N"`` (or ``"stop:N"``;
``"kill:N@R"``: only the engine of trainer rank R) makes the engine process SIGKILL (SIGSTOP) itself
when it takes its N-th generate request, in its first life only (a restarted engine serves normally).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from grpo_megatron.rollout.engine import (
    LOG_TAIL_LINES,
    Bucket,
    Completion,
    EngineLost,
    Manifest,
    RolloutEngine,
    SamplingParams,
    log_tail,
)
from grpo_megatron.rollout.faults import EngineFaults

__all__ = ["EngineLost", "EngineProcess", "serve"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------- wire


def completions_to_json(batch: Sequence[Sequence[Completion]]) -> list[list[dict[str, Any]]]:
    """Completions as plain JSON data (float32 logprobs round-trip exactly through Python floats)."""

    def one(c: Completion) -> dict[str, Any]:
        routes = c.routed_experts
        return {
            "token_ids": list(c.token_ids),
            "logprobs": [float(x) for x in c.logprobs],
            "finish_reason": c.finish_reason,
            "weight_version": c.weight_version,
            "token_versions": None if c.token_versions is None else list(c.token_versions),
            "loss_mask": None if c.loss_mask is None else list(c.loss_mask),
            "routes": None
            if routes is None
            else {
                "shape": list(routes.shape),
                "dtype": str(routes.dtype).removeprefix("torch."),
                "data": routes.reshape(-1).tolist(),
            },
        }

    return [[one(c) for c in group] for group in batch]


def completions_from_json(data: Sequence[Sequence[Mapping[str, Any]]]) -> list[list[Completion]]:
    """The inverse of ``completions_to_json``."""

    def one(d: Mapping[str, Any]) -> Completion:
        routes = d.get("routes")
        tensor = None
        if routes is not None:
            dtype = {"int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "uint8": torch.uint8}
            tensor = torch.tensor(routes["data"], dtype=dtype[routes["dtype"]]).reshape(routes["shape"])
        mask, versions = d.get("loss_mask"), d.get("token_versions")
        return Completion(
            list(d["token_ids"]),
            list(d["logprobs"]),
            d["finish_reason"],
            tensor,
            loss_mask=None if mask is None else [int(m) for m in mask],
            weight_version=int(d["weight_version"]),
            token_versions=None if versions is None else [int(v) for v in versions],
        )

    return [[one(d) for d in group] for group in data]


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def params_from_json(data: Mapping[str, Any]) -> SamplingParams:
    fields = dict(data)
    fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
    fields["stop_strings"] = tuple(fields["stop_strings"])
    if fields.get("max_new_tokens_each") is not None:
        fields["max_new_tokens_each"] = tuple(fields["max_new_tokens_each"])
    return SamplingParams(**fields)


class LineReader:
    """JSON lines from a file descriptor, with a timeout (``select``) and no buffering surprises."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.closed = False

    def read(self, timeout_s: float | None) -> dict[str, Any] | None:
        """The next message; None when none arrives within ``timeout_s`` (None: wait for one)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            if self.closed:
                raise EOFError("the other side closed the pipe")
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                self.closed = True
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return dict(json.loads(line))


def _send(stream: Any, message: Mapping[str, Any]) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


# ------------------------------------------------------------------------------ the engine's side


@dataclasses.dataclass
class _Server:
    """The engine process's state: its engine, the weights sent but not loaded yet (by version) and
    the requests not served yet, in order."""

    engine: Any
    folder: Path
    loads: dict[int, str] = dataclasses.field(default_factory=dict)
    requests: deque[dict[str, Any]] = dataclasses.field(default_factory=deque)
    faults: EngineFaults = dataclasses.field(default_factory=lambda: EngineFaults(None, armed=False))
    """``GRPO_ENGINE_FAULT`` for this engine (tests; its first life only): kill or stop at a generate request."""

    def take(self, message: dict[str, Any]) -> bool:
        """File one message; False on ``stop``."""
        if message["op"] == "stop":
            return False
        if message["op"] == "load":
            self.loads[int(message["version"])] = message["path"]
        else:
            self.requests.append(message)
        return True

    def runnable(self) -> bool:
        if not self.requests:
            return False
        version = int(self.requests[0]["version"])
        return version == self.engine.weight_version or version in self.loads

    def use_version(self, version: int) -> None:
        """Load the weights of ``version`` unless the engine holds them (files of older versions go)."""
        if version == self.engine.weight_version:
            return
        from safetensors.torch import load_file

        path = self.loads.pop(version)
        for old in [v for v in self.loads if v < version]:
            Path(self.loads.pop(old)).unlink(missing_ok=True)
        tensors = load_file(path)
        Path(path).unlink(missing_ok=True)
        self.engine.update_weights(list(tensors.items()), version=version, last=True)

    def serve_one(self) -> dict[str, Any]:
        request = self.requests.popleft()
        reply: dict[str, Any] = {"id": request["id"]}
        try:
            self.use_version(int(request["version"]))
            if request["op"] == "generate":
                if (signum := self.faults.at_generation()) is not None:
                    os.kill(os.getpid(), signum)
                out: Any = completions_to_json(
                    self.engine.generate(request["prompts"], params_from_json(request["params"]))
                )
                for group in out:
                    for c in group:
                        c["weight_version"] = self.engine.weight_version
            else:  # score
                scored, routes = self.engine.score_with_routes(
                    request["sequences"], request["prompt_lens"], float(request["temperature"])
                )
                out = {
                    "scored": scored,
                    "routes": None
                    if routes is None
                    else [{"shape": list(r.shape), "data": r.reshape(-1).tolist()} for r in routes],
                }
            path = self.folder / f"result-{request['id']}.json"
            path.write_text(json.dumps(out))
            reply["path"] = str(path)
        except Exception as exc:  # reported to the trainer, which raises with it
            reply["error"] = f"{type(exc).__name__}: {exc}"
        return reply


def serve(spec_path: str) -> None:
    """The engine process: build the engine, say what weights it takes, then serve until ``stop``."""
    # A signal to the job's process group (a scheduler's SIGTERM, Ctrl-C) is the trainer's to handle:
    # it saves (waiting for the batches in flight) and exits, which closes this process's stdin.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(Path(spec_path).read_text())
    out = os.fdopen(os.dup(1), "w")  # the replies' channel; anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(int(spec["threads"]))
    from grpo_megatron.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(
        spec["hf"],
        device="cpu",
        dtype=_DTYPES[spec["dtype"]],
        max_batch_rows=int(spec["max_batch_rows"]),
        record_routes=bool(spec["record_routes"]),
    )
    expected = [[n, list(shape), str(dtype)] for n, (shape, dtype) in engine.expected_tensors().items()]
    lock = threading.Lock()  # the replies' channel is shared with the heartbeat thread
    busy = threading.Event()

    def heartbeat() -> None:
        while True:
            time.sleep(float(spec["heartbeat_s"]))
            if busy.is_set():
                with lock:
                    _send(out, {"beat": True})

    threading.Thread(target=heartbeat, name="heartbeat", daemon=True).start()
    _send(out, {"ready": True, "expected": expected})
    faults = EngineFaults(int(spec["rank"]), ("kill", "stop"), armed=int(spec["life"]) == 0)
    server = _Server(engine, Path(spec["folder"]), faults=faults)
    reader = LineReader(sys.stdin.fileno())
    while True:
        message = reader.read(0.0)  # file whatever has arrived, without waiting
        while message is None and not server.runnable():
            message = reader.read(None)
        if message is not None:
            if not server.take(message):
                break
            continue
        busy.set()
        reply = server.serve_one()
        busy.clear()
        with lock:
            _send(out, reply)
    engine.shutdown()


# ----------------------------------------------------------------------------- the trainer's side


class EngineProcess(RolloutEngine):
    """The trainer's handle of an engine process (an ``EmbeddedEngine`` on CPU with ``threads``
    threads). ``weight_version`` is the version last sent; requests are served with it. ``rank``:
    the trainer rank that owns it (named when it is lost); ``health_timeout_s``: how long a result
    may be awaited with no line from the engine (it beats every eighth of it, at most every 10 s,
    while it serves)."""

    def __init__(
        self,
        hf: Mapping[str, Any],
        *,
        dtype: torch.dtype,
        max_batch_rows: int = 0,
        threads: int = 1,
        record_routes: bool = True,
        startup_timeout_s: float = 600.0,
        rank: int = 0,
        health_timeout_s: float = 120.0,
        log_path: Path | None = None,
    ) -> None:
        name = {v: k for k, v in _DTYPES.items()}[dtype]
        heartbeat_s = min(10.0, health_timeout_s / 8)  # unread beats fill the pipe's 64 KiB in hours only
        self.spec: dict[str, Any] = {
            "hf": dict(hf),
            "dtype": name,
            "max_batch_rows": max_batch_rows,
            "threads": threads,
            "record_routes": record_routes,
            "rank": rank,
            "heartbeat_s": heartbeat_s,
        }
        self.threads, self.startup_timeout_s, self.health_timeout_s = (
            threads,
            startup_timeout_s,
            health_timeout_s,
        )
        self.rank, self.host = rank, socket.gethostname()
        self._log_given = log_path
        self.log_path = log_path
        """Where the engine's stderr goes, every life appended; None given: ``engine.log`` in each
        life's folder (removed with it)."""
        self._start()

    def _start(self) -> None:
        """Start the process of ``self.spec`` in a new folder and wait for its hello."""
        shm = Path("/dev/shm")
        self.folder = Path(tempfile.mkdtemp(prefix="grpo-engine-", dir=shm if shm.is_dir() else None))
        self.spec["folder"], self.spec["life"] = str(self.folder), self.life
        (self.folder / "spec.json").write_text(json.dumps(self.spec))
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        self.log_path = self._log_given or self.folder / "engine.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- engine process of rank {self.rank}, life {self.life} ---\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "grpo_megatron.rollout.engine_process",
                    str(self.folder / "spec.json"),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
            )
        assert self.proc.stdout is not None
        self._reader = LineReader(self.proc.stdout.fileno())
        self._replies: dict[int, dict[str, Any]] = {}
        self._next_id = 0
        self._staged: dict[str, torch.Tensor] = {}
        self._ready = None
        hello = self._wait(lambda: self._ready, "start", self.startup_timeout_s)
        self._expected = {n: (tuple(shape), dtype) for n, shape, dtype in hello["expected"]}
        self.weight_version = -1

    _ready: dict[str, Any] | None = None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def _lost(self, why: str) -> EngineLost:
        return EngineLost(self.rank, self.host, why, self.log_tail(), str(self.log_path))

    def _state(self) -> str:
        """The process's state letter from /proc (T: stopped), or '?' where there is none."""
        try:
            return Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "?"

    def _wait(
        self, ready: Callable[[], dict[str, Any] | None], what: str, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Read the engine's lines until ``ready`` gives one. Raises ``EngineLost`` if the process
        exits, or (``timeout_s`` None: waiting for a result) sends nothing for ``health_timeout_s``;
        ``TimeoutError`` past ``timeout_s`` (the start)."""
        start = last = time.monotonic()
        while (got := ready()) is None:
            if self.proc.poll() is not None:
                raise self._lost(f"the process exited with code {self.proc.returncode} during {what}")
            now = time.monotonic()
            if timeout_s is not None and now - start > timeout_s:
                raise TimeoutError(
                    f"the engine process did not {what} within {timeout_s} s; its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}"
                )
            if timeout_s is None and now - last > self.health_timeout_s:
                stopped = " (it is stopped: state T)" if self._state() == "T" else ""
                raise self._lost(
                    f"no reply or heartbeat for {now - last:.1f} s during {what}{stopped}, "
                    f"past rollout.recovery.health_timeout_s={self.health_timeout_s:g}"
                )
            try:
                message = self._reader.read(min(1.0, self.health_timeout_s / 4))
            except EOFError:  # its end of the pipe closed: it exited (or is about to)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    raise self._lost(f"it closed its pipe during {what} and is still running") from None
                continue
            if message is None:
                continue
            last = time.monotonic()
            if "ready" in message:
                self._ready = message
            elif "beat" not in message:
                self._replies[int(message["id"])] = message
        return got

    def _send(self, message: dict[str, Any]) -> None:
        try:
            assert self.proc.stdin is not None
            _send(self.proc.stdin, message)
        except OSError as exc:  # a broken pipe: the process is gone
            raise self._lost(
                f"its pipe broke ({type(exc).__name__}: {exc}); exit code {self.proc.poll()}"
            ) from exc

    def _request(self, message: dict[str, Any]) -> int:
        ticket = self._next_id
        self._next_id += 1
        self._send({**message, "id": ticket, "version": self.weight_version})
        return ticket

    def _result(self, ticket: int) -> Any:
        reply = self._wait(lambda: self._replies.pop(ticket, None), f"request {ticket}")
        if "error" in reply:
            raise RuntimeError(f"engine process: {reply['error']}")
        path = Path(reply["path"])
        data = json.loads(path.read_text())
        path.unlink(missing_ok=True)
        return data

    def restart(self, address: str | None = None) -> None:
        """Kill what is left of the process, clean its folder, start it again from the same spec (no
        fault injection: ``life`` counts up); its weights are -1 until the next ``update_weights``.
        ``address`` (``EngineRecovery.restart_engines``'s, for engines across nodes) is None here: an
        engine process serves one GPU."""
        self._kill()
        self.life += 1
        self._start()

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL ends a stopped process too
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)

    # --------------------------------------------------------------------------- generation

    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> Callable[[], list[list[Completion]]]:
        """Send the request and return at once; calling the result waits for the completions."""
        ticket = self._request(
            {"op": "generate", "prompts": [list(p) for p in prompts], "params": params_to_json(params)}
        )
        life = self.life

        def result() -> list[list[Completion]]:
            if self.life != life:  # restarted since: the request went with the lost process
                raise self._lost(f"request {ticket} was sent to its process before a restart")
            return completions_from_json(self._result(ticket))

        return result

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        return self.submit(prompts, params)()

    def score(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> list[list[float]]:
        return self.score_with_routes(sequences, prompt_lens, temperature)[0]

    def score_with_routes(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> tuple[list[list[float]], list[torch.Tensor] | None]:
        ticket = self._request(
            {
                "op": "score",
                "sequences": [list(s) for s in sequences],
                "prompt_lens": list(prompt_lens),
                "temperature": temperature,
            }
        )
        data = self._result(ticket)
        routes = data["routes"]
        if routes is not None:
            routes = [torch.tensor(r["data"], dtype=torch.int64).reshape(r["shape"]) for r in routes]
        return data["scored"], routes

    # ------------------------------------------------------------------------------ weights

    def check_manifest(self, manifest: Manifest, version: int) -> list[str]:
        """Names and shapes against what the engine reported at start (completeness, where tied aliases
        count once, and dtypes it checks on load)."""
        if self.proc.poll() is not None:  # lost since its last request: the fleet may restart it (EngineLost)
            raise self._lost(
                f"the process exited with code {self.proc.returncode} before the weight sync of "
                f"version {version}"
            )
        sent = {name: tuple(shape) for name, shape, _ in manifest}
        problems = [f"{n}: unknown to the engine" for n in sent if n not in self._expected][:5]
        problems += [
            f"{n}: shape {list(s)}, the engine has {list(self._expected[n][0])}"
            for n, s in sent.items()
            if n in self._expected and s != self._expected[n][0]
        ][:5]
        return problems

    def update_weights(self, bucket: Bucket, *, version: int, last: bool) -> None:
        """Copy each tensor (the stream's may be borrowed views); on ``last`` write them to a file the
        engine loads before the first request sent after this call."""
        from safetensors.torch import save_file

        for name, tensor in bucket:
            self._staged[name] = tensor.detach().to("cpu", copy=True).contiguous()
        if not last:
            return
        staged, self._staged = self._staged, {}
        path = self.folder / f"weights-{version}.safetensors"
        save_file(staged, str(path))
        self._send({"op": "load", "version": version, "path": str(path)})
        self.weight_version = version

    def abort_update(self, version: int) -> None:
        self._staged = {}

    def shutdown(self) -> None:
        if self.proc.poll() is None and self._state() != "T":
            try:
                assert self.proc.stdin is not None
                _send(self.proc.stdin, {"op": "stop"})
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()


if __name__ == "__main__":
    serve(sys.argv[1])
