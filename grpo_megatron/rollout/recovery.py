"""Engine loss in one room: what the run does when an engine is lost, decided in one object.

An engine is lost when a process of it exited, was stopped or hangs (issue 41): an engine process
(``rollout/engine_process.py``: exited, pipe broken, silent past ``rollout.recovery.health_timeout_s``)
or a colocated SGLang engine (``rollout/sglang/health.py``, ``rollout/sglang/watch.py``). Every engine
part says so the same way, through the contract of ``rollout/engine.py:WeightSink``: a call raises
``EngineLost`` (the one error type of the event), ``check_alive()`` raises it on demand, ``restart(address)``
starts the part again in place and ``restart_address()`` says where the parts of an engine across
nodes meet again. Fault injection for tests lives in ``rollout/faults.py``.

The fleet (``rollout/fleet.py``) builds one ``EngineRecovery`` whatever the bound and hands it every
failure of a collective step (a rollout's ``collect``, the two phases of a weight sync, the mismatch
probe): ``recover`` gathers every rank's (error, loss) over the data group; any other error, or a loss
past ``rollout.recovery.max_restarts`` (0 included), raises on every rank naming them (each lost engine
with its rank, host, why and its log's tail); else ``restart_engines``: each owner restarts its engine
(each further node of an engine across nodes its part, at the leader's fresh address) and every rank
streams the version last synced into every GPU of them only (``resync``, the fleet's weight sync with
``targets``). The step that found the loss then goes on (a rollout's lost shares are submitted again).
Restarts are counted per run and reported as ``engine/restarts`` and ``engine/restart_s`` (``metrics``).

Torchtitan's ``FTManager`` and slime's ``health_monitor.py`` are the same shape: one module, one object.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from grpo_megatron.rollout.engine import EngineLost

if TYPE_CHECKING:
    import torch

    from grpo_megatron.rollout.engine import EngineParts

Gather = Callable[[Any], list[Any]]
"""The ranks' agreement: every rank's object, by rank (an ``all_gather_object`` over the data group)."""


@dataclasses.dataclass(frozen=True)
class Resync:
    """What a restarted engine is given: the policy ``model`` whose weights the fleet synced last;
    ``visit``, a context inside which its parameters are on the device (the job's
    ``ColocatedMemory.sync_visit``: a colocated rollout phase has them offloaded); and ``starting``, a
    context inside which the engine starts again (the job's ``ColocatedMemory.restart_visit``: the
    trainer's state off the device, as at the first start, since SGLang sizes its KV pool from the
    memory free as it starts: issue 51 item 2)."""

    model: torch.nn.Module
    visit: Callable[[], AbstractContextManager[Any]] = nullcontext
    starting: Callable[[], AbstractContextManager[Any]] = nullcontext


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _indented(text: str) -> str:
    """``text``'s lines, each indented by four spaces (an engine's log tail in a message)."""
    return "\n".join(f"    {line}" for line in text.splitlines())


class EngineRecovery:
    """Engine loss for one rank of the fleet (module docstring); every rank holds one and calls
    ``recover`` together.

    ``engine_ranks``: the ranks holding an engine (its leader), in engine-index order; ``engine_groups``:
    every rank of each engine of several GPUs, its leader first, by leader (an engine absent is its
    rank alone); ``parts``: this rank's engine or member (``WeightSink``s); ``gather``: the ranks'
    agreement; ``resync(version, ranks)``: streams ``version`` into the sinks of ``ranks`` only (None:
    no model to resync from, so nothing is restarted: the bound is 0); ``starting()``: the context each
    rank of a restarting engine restarts its part in (``Resync.starting``)."""

    def __init__(
        self,
        max_restarts: int,
        rank: int,
        engine_ranks: Sequence[int],
        engine_groups: dict[int, tuple[int, ...]],
        parts: EngineParts,
        gather: Gather,
        resync: Callable[[int, list[int]], None] | None = None,
        starting: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self.max_restarts = max_restarts if resync is not None else 0
        self.starting = starting
        self.rank = rank
        self.engine_ranks = list(engine_ranks)
        self.engine_groups = engine_groups
        self.parts = parts
        self.gather = gather
        self.resync = resync
        self.restarts = 0
        """Engines restarted so far in this run (the bound counts them)."""
        self.unreported = 0
        """Engines restarted since the last ``metrics``."""
        self.seconds: list[float] = []
        """Wall seconds of each restart event not yet reported: from the ranks' agreement that engines
        were lost to every one of them serving again (engines lost together restart at once: one event)."""
        self.depth = 0
        """Restarts in progress on this rank (one found inside another's resync belongs to its wall time)."""

    def metrics(self) -> dict[str, float]:
        """``engine/restarts`` (engines restarted since the last call) and ``engine/restart_s`` (the wall
        seconds of their restart events, summed: two engines restarted at once count once); empty when
        there was none."""
        if not self.unreported:
            return {}
        out = {"engine/restarts": float(self.unreported), "engine/restart_s": sum(self.seconds)}
        self.unreported, self.seconds = 0, []
        return out

    def recover(
        self,
        error: str | None,
        lost: EngineLost | None,
        what: str,
        *,
        version: int,
        resync: bool = True,
        consequence: str = "",
    ) -> None:
        """Collective, after a step that failed somewhere: the ranks agree on every rank's ``error`` and
        ``lost`` engine. Any error, or a loss past the bound: every rank raises with them (``consequence``
        follows the count of an error's message; lost engines named with rank, host, why and their log's
        tail). Else the lost engines are restarted and (``resync``) given ``version``. The error of
        another GPU of a lost engine (its weight round failed with the engine) is the loss's, not one of
        its own."""
        lost = lost or self._member_loss()
        mine = (
            None
            if lost is None
            else {"host": lost.host, "why": lost.why, "tail": lost.log_tail, "log": lost.log_path}
        )
        reports = self.gather((error, mine))
        losses = {rank: info for rank, (_, info) in enumerate(reports) if info is not None}
        lost_engines = sorted(
            {self.leader_of(rank) for rank in losses}
        )  # a further node's part: its engine's
        with_lost = set(self.ranks_of(lost_engines))
        errors = [(rank, e) for rank, (e, _) in enumerate(reports) if e is not None and rank not in with_lost]
        named = "\n".join(
            f"  engine {self.engine_ranks.index(self.leader_of(rank))} (rank {rank} on {info['host']}) "
            f"was lost: {info['why']}; its log ({info['log']}) ends:\n{_indented(info['tail'])}"
            for rank, info in losses.items()
        )
        if errors or not losses:
            lines = "\n".join(f"  rank {rank}: {e}" for rank, e in errors[:8])
            count = len(errors) + len(losses)
            raise RuntimeError(f"{what} failed on {count} rank(s){consequence}:\n{lines}\n{named}".rstrip())
        if self.restarts + len(lost_engines) > self.max_restarts:
            raise RuntimeError(
                f"{what}: {len(lost_engines)} engine(s) lost, past rollout.recovery.max_restarts="
                f"{self.max_restarts} ({self.restarts} restart(s) so far); resume from the last checkpoint "
                f"(or raise the bound):\n{named}"
            )
        seconds = self.restart_engines(lost_engines, version, resync=resync)
        if self.rank == 0:
            for rank, info in losses.items():
                print(
                    f"[engine] engine {self.engine_ranks.index(self.leader_of(rank))} (rank {rank} on "
                    f"{info['host']}) lost during {what}: {info['why']}; restarted for weights version "
                    f"{version} in {seconds:.1f} s (restart {self.restarts} of at most {self.max_restarts}); "
                    f"its log ended:\n{_indented(info['tail'])}",
                    flush=True,
                )

    def _member_loss(self) -> EngineLost | None:
        """This rank's part of an engine led from another rank, lost (a further node's part of an SGLang
        engine across nodes); None when alive or none."""
        try:
            if self.parts.member is not None:
                self.parts.member.check_alive()
        except EngineLost as exc:
            return exc
        except Exception:  # not a loss: the failure that brought us here is reported
            pass
        return None

    def ranks_of(self, leaders: Iterable[int]) -> list[int]:
        """Every rank of the engines led from ``leaders`` (an engine of several GPUs: its leader and its
        members), in rank order."""
        return sorted({r for leader in leaders for r in self.engine_groups.get(leader, (leader,))})

    def leader_of(self, rank: int) -> int:
        """The leader of the engine whose GPUs include ``rank``'s; itself elsewhere."""
        return next((leader for leader, ranks in self.engine_groups.items() if rank in ranks), rank)

    def _restart_addresses(self, leaders: Sequence[int]) -> dict[int, str | None]:
        """Collective: where each restarting engine's parts meet again, by its leader (an engine across
        nodes needs a fresh one; None elsewhere), so that each further node's part restarts at its
        leader's."""
        engine = self.parts.engine
        mine = engine.restart_address() if self.rank in leaders and engine is not None else None
        everyone = self.gather(mine)
        return {leader: everyone[leader] for leader in leaders}

    def restart_engines(self, leaders: Sequence[int], version: int, *, resync: bool) -> float:
        """Collective: the engines of ``leaders`` restart (each owner kills what is left and starts it
        again, same spec and width; a further node's part with its leader, at its fresh address; every
        other member drops what it staged of an abandoned version) and (``resync``; not when the sync
        that found them lost goes on) every rank streams ``version`` into every GPU of them only.
        Returns the wall seconds it took (kept for ``metrics`` unless it runs inside another restart)."""
        start = time.perf_counter()
        error = None
        everyone = self.ranks_of(leaders)
        addresses = self._restart_addresses(leaders)
        engine, member = self.parts.engine, self.parts.member
        try:
            # On a restarting engine's GPUs the engine starts as at the first start (``starting``: the
            # trainer's state out, then back once it serves, its memory phase restored by ``restart``).
            with self.starting() if self.rank in everyone else nullcontext():
                if self.rank in leaders and engine is not None:
                    engine.restart(addresses[self.rank])
                elif self.rank in everyone and member is not None:
                    member.restart(addresses[self.leader_of(self.rank)])
        except Exception as exc:
            error = describe(exc)
        failed = [(rank, e) for rank, e in enumerate(self.gather(error)) if e is not None]
        if failed:
            lines = "\n".join(f"  rank {rank}: {e}" for rank, e in failed[:8])
            raise RuntimeError(
                f"restarting the lost rollout engine(s) failed on {len(failed)} rank(s):\n{lines}"
            )
        self.restarts += len(leaders)
        self.unreported += len(leaders)
        self.depth += 1
        try:
            if resync and self.resync is not None:
                self.resync(version, everyone)
        finally:
            self.depth -= 1
        seconds = time.perf_counter() - start
        if self.depth == 0:
            self.seconds.append(seconds)
        return seconds
