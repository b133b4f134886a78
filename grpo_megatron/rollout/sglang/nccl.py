"""Disaggregated SGLang servers and their weight transport: an NCCL broadcast.

Servers already running on other GPUs or nodes (``rollout.sglang.server_urls``) are driven over
HTTP (``SGLangHttpClient``, the endpoints that mirror ``sglang.Engine``'s methods). The trainer's
first rank joins one process group with every server's TP ranks (``/init_weights_update_group``)
and broadcasts each bucket as one flat byte tensor (``/update_weights_from_distributed`` with
``load_format="flattened_bucket"``); the servers rebuild the same byte layout from the names,
dtypes and shapes the request announces.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch

from grpo_megatron.rollout.config import RolloutConfig
from grpo_megatron.rollout.engine import Bucket
from grpo_megatron.rollout.sglang.weights import aligned_order, flattened_bucket

WEIGHT_GROUP_NAME = "grpo_megatron_weights"


class SGLangServerError(RuntimeError):
    """A SGLang server did not answer, or answered with an error."""


class SGLangHttpClient:
    """One running SGLang server, called through the HTTP endpoints that mirror ``sglang.Engine``'s
    methods (same names and arguments, so ``SGLangEngine`` drives both alike)."""

    def __init__(self, url: str, timeout_s: float):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._sessions: bool | None = None
        self._versioned: bool | None = None  # has /update_weight_version; None: not asked yet

    def _call(self, path: str, body: Mapping[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as e:
            raise SGLangServerError(f"{self.url}{path} answered {e.code}: {e.read().decode()[:500]}") from e
        except (urllib.error.URLError, OSError) as e:
            raise SGLangServerError(f"{self.url}{path} unreachable: {e}") from e
        result = json.loads(text) if text.strip() else None
        if isinstance(result, dict) and result.get("success") is False:
            raise SGLangServerError(f"{self.url}{path} failed: {result.get('message')}")
        return result

    def healthy(self, timeout_s: float = 10.0) -> bool:
        """Whether ``/health_generate`` (a real one-token generation) answers 200 in time."""
        try:
            self._call("/health_generate", timeout_s=timeout_s)
            return True
        except SGLangServerError:
            return False

    def tp_size(self) -> int:
        return int(self._call("/get_server_info")["tp_size"])

    def generate(self, **request: Any) -> list[dict[str, Any]]:
        return self._call("/generate", request)

    def flush_cache(self) -> None:
        self._call("/flush_cache", {})

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call("/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call("/resume_memory_occupation", {"tags": tags})

    def init_weights_update_group(self, **body: Any) -> None:
        self._call("/init_weights_update_group", body)

    def update_weights_from_distributed(self, **body: Any) -> None:
        self._call("/update_weights_from_distributed", body)

    def update_weight_version(self, version: str) -> None:
        """Record ``version`` as the server's weight version (``/update_weight_version``; what its
        outputs' ``meta_info.weight_version`` then report). Requests are not aborted: the engine's
        guard lets none run during a sync. A server without the route (404) is left as it is."""
        if self._versioned is False:
            return
        try:
            self._call("/update_weight_version", {"new_version": version, "abort_all_requests": False})
            self._versioned = True
        except SGLangServerError as e:
            if " answered 404" not in str(e):
                raise
            self._versioned = False

    def update_sessions(self) -> bool:
        """Whether the server has weight-update sessions (``/begin_weight_update``: SGLang 0.5.21 on),
        from the routes it lists (``/openapi.json``); a server that lists none (its
        ``DISABLE_OPENAPI_DOC``) is taken to have them. Asked once."""
        if self._sessions is None:
            try:
                paths = (self._call("/openapi.json") or {}).get("paths", {})
                self._sessions = "/begin_weight_update" in paths
            except SGLangServerError:
                self._sessions = True
        return self._sessions

    def begin_weight_update(self) -> None:
        self._call("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self._call("/end_weight_update", {})

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("/destroy_weights_update_group", {"group_name": group_name})

    def shutdown(self) -> None:
        """Servers are not ours to stop: only our weight group goes."""
        return None


def init_trainer_weight_group(
    master_addr: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
    timeout_s: float = 600.0,
) -> torch.distributed.ProcessGroup:
    """Rank 0 of a process group outside the trainer's world, joined by the servers' TP ranks.

    It must meet SGLang's side of ``init_weights_update_group``: a TCP store at
    ``master_addr:master_port`` hosted here, keys under a ``group_name`` prefix, a group of its own
    (not the default one). torch has no public call for "a second world", so this goes through
    ``_new_process_group_helper`` exactly as SGLang's side does.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    tcp_store = torch.distributed.TCPStore(
        master_addr, master_port, world_size, is_master=True, timeout=timeout
    )
    store = torch.distributed.PrefixStore(group_name, tcp_store)
    group, _ = c10d._new_process_group_helper(
        world_size,
        0,
        [],
        c10d.Backend(backend),
        store,
        group_name=c10d.GroupName(group_name),
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def weight_group_layout(tp_sizes: Sequence[int]) -> tuple[int, list[int]]:
    """``(world_size, rank_offsets)`` of the NCCL weight group: the trainer is rank 0, then each
    server's TP ranks in order."""
    offsets, next_rank = [], 1
    for tp in tp_sizes:
        offsets.append(next_rank)
        next_rank += tp
    return next_rank, offsets


def distributed_update_body(
    bucket: Bucket, *, group_name: str, flush_cache: bool, weight_version: str | None
) -> dict[str, Any]:
    """The JSON body of ``/update_weights_from_distributed`` announcing one flattened bucket
    (``bucket`` already in ``aligned_order``; the receiver rebuilds the same byte layout)."""
    body: dict[str, Any] = {
        "names": [name for name, _ in bucket],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "load_format": "flattened_bucket",
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


class NcclBroadcastTransport:
    """``WeightTransport`` into a set of SGLang servers: the process group is created at the first
    ``send`` (every server joins it) and dropped by ``reset`` (a server restarted). Servers that stop
    answering are restarted here (``restarted_servers``)."""

    def __init__(
        self,
        rollout: RolloutConfig,
        flattened_bucket_cls: type,
        device: torch.device | str,
        timeout: timedelta | None = None,
    ):
        self.rollout = rollout
        self.flattened_bucket_cls = flattened_bucket_cls
        self.device = device
        self.timeout = timeout
        """The weight group's collective timeout: the job's (parallel.timeout_minutes); None: the
        servers' request timeout (rollout.sglang.request_timeout_s), for a transport made alone."""
        self.group: torch.distributed.ProcessGroup | None = None

    def bind_group(self, ranks: Sequence[int], group: Any) -> None:
        return None  # only rank 0 feeds the servers

    def send(
        self, servers: Sequence[Any], bucket: Bucket, *, last: bool, version: int, flush: bool = True
    ) -> None:
        if not bucket:  # nothing to broadcast: what the last bucket would have carried
            if last:  # the fleet's stream ends with an empty last bucket: the version is told here
                for server in servers:
                    if flush:
                        server.flush_cache()
                    server.update_weight_version(str(version))
            return
        if self.group is None:
            self.group = self._init_weight_group(servers)
        ordered = aligned_order(bucket)
        body = distributed_update_body(
            ordered,
            group_name=WEIGHT_GROUP_NAME,
            flush_cache=last and flush,
            weight_version=str(version) if last else None,
        )
        flat = flattened_bucket(ordered, self.flattened_bucket_cls, self.device).get_flattened_tensor()
        # Every server's request blocks until the broadcast it waits for has run: send them first.
        with ThreadPoolExecutor(len(servers)) as pool:
            pending = [pool.submit(s.update_weights_from_distributed, **body) for s in servers]
            torch.distributed.broadcast(flat, src=0, group=self.group)
            for f in pending:
                f.result()

    def _init_weight_group(self, servers: Sequence[Any]) -> torch.distributed.ProcessGroup:
        world_size, offsets = weight_group_layout([s.tp_size() for s in servers])
        addr = self.rollout.sglang.sync_master_addr or socket.gethostname()
        port = self.rollout.sglang.sync_master_port
        with ThreadPoolExecutor(len(servers)) as pool:
            pending = [
                pool.submit(
                    s.init_weights_update_group,
                    master_address=addr,
                    master_port=port,
                    rank_offset=offset,
                    world_size=world_size,
                    group_name=WEIGHT_GROUP_NAME,
                    backend="nccl",
                )
                for s, offset in zip(servers, offsets, strict=True)
            ]
            timeout_s = (
                self.timeout.total_seconds() if self.timeout else self.rollout.sglang.request_timeout_s
            )
            group = init_trainer_weight_group(addr, port, world_size, WEIGHT_GROUP_NAME, timeout_s=timeout_s)
            for f in pending:
                f.result()
        return group

    def refuse(self, reason: str) -> None:
        return None  # only rank 0 feeds the servers: nobody else waits on this bucket

    def restarted_servers(
        self, servers: Sequence[Any], timeout_s: float, restart: Callable[[str], None] | None
    ) -> list[int]:
        """Wait until every server answers ``/health_generate``; one that does not in time goes
        through ``restart(url)`` (or raises naming it) and must answer after it. Returns the restarted
        servers' indices (they have their checkpoint's weights again and no weight-update session);
        after a restart the weight group is made again at the next ``send``."""
        restarted = []
        for i, server in enumerate(servers):
            if not hasattr(server, "healthy") or wait_healthy(server, timeout_s):  # custom servers: not asked
                continue
            if restart is None:
                raise SGLangServerError(
                    f"SGLang server {server.url} is not healthy after {timeout_s:.0f}s "
                    "(rollout.sglang.request_timeout_s); restart it, or pass restart_server= to SGLangEngine"
                )
            restart(server.url)
            if not wait_healthy(server, timeout_s):
                raise SGLangServerError(f"SGLang server {server.url} is not healthy after its restart")
            restarted.append(i)
        if restarted:
            self.reset(servers)
        return restarted

    def reset(self, servers: Sequence[Any]) -> None:
        if self.group is None:
            return
        for server in servers:
            try:  # a restarted server no longer has the group: nothing to destroy there
                server.destroy_weights_update_group(WEIGHT_GROUP_NAME)
            except SGLangServerError:
                pass
        torch.distributed.destroy_process_group(self.group)
        self.group = None

    def manifest_refusal(self, quantized: bool, model_path: str, version: int) -> str | None:
        """Servers started from a quantized checkpoint hold its float8 weights, which the sync's
        unquantized tensors would be cast into beside stale scales: refused."""
        if not quantized:
            return None
        return (
            f"weight sync of version {version}: {model_path} is quantized (quantization_config) and the "
            "disaggregated SGLang servers started from it hold its float8 weights, which the sync's "
            "unquantized tensors cannot replace; start the servers from a copy of the folder whose "
            "config.json has no quantization_config, with --load-format dummy (the first sync fills them)"
        )


def wait_healthy(server: SGLangHttpClient, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.healthy(timeout_s=min(30.0, timeout_s)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
