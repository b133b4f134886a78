"""The open-file limit a rank needs, raised at start (``init_distributed``), before any group opens.

At 1024 ranks a rank holds more sockets than the usual soft limit of 1024 open files: gloo connects
every pair of a group's ranks when the group is created, one socket per peer, and the rollout
results travel over a gloo group of the whole world (``rollout/fleet.py``'s data group), beside
megatron's gloo groups. A rank past its limit fails in the middle of a group's creation with
``Too many open files``, on some ranks only, which the others see as a hang until the timeout.

``open_files_needed`` estimates a rank's peak from the groups it will open; ``raise_open_file_limit``
raises the soft limit to the hard one (the headroom is free), or stops with the numbers and the fix
when even the hard limit is below the estimate.

The launcher's key-value store (the rendezvous, every process group's bootstrap, each rank's progress
watchdog) is a TCP server holding one connection per client, and it lives where the launcher put it:
under torchrun's c10d rendezvous (launch/slurm/node.sh) node 0's torchrun agent serves it
(``TORCHELASTIC_USE_AGENT_STORE``: the ranks are its clients), so the agent needs ``store_open_files``
(about 2,200 at 1024 ranks) and launch/slurm/node.sh raises the agent's limit before starting it;
without an agent (srun straight into the ranks, env://) rank 0 serves it and counts it here.

    python -m grpo_megatron.distributed.open_files store WORLD_SIZE NODES   # the agent's need: a number
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Mapping
from dataclasses import dataclass

RESERVE = 1024
"""Open files besides the groups' sockets: the Python runtime and its libraries, NCCL's own
descriptors, checkpoint and safetensors files, engine pipes and sockets, reward workers."""
NCCL_GROUP_FILES = 8
"""Descriptors per NCCL communicator (its proxy's sockets and pipes, shared-memory segments)."""
NCCL_GROUPS = 24
"""NCCL communicators of a rank: megatron's groups (TP, PP, DP, CP, EP, ETP, expert DP and their
products) and ours (the engines' group); each is created at its first collective."""


@dataclass(frozen=True)
class OpenFiles:
    """A rank's estimated peak of open files, by what opens them."""

    data_group: int
    """The rollout results' gloo group (the whole world): a socket per other rank."""
    megatron_gloo: int
    """megatron's gloo groups: data-parallel with and without CP, expert data-parallel."""
    world: int
    """The default group: a socket per other rank on gloo (CPU); NCCL's bootstrap otherwise."""
    store: int
    """The launcher's key-value store: served by rank 0 when no torchrun agent serves it (srun
    straight into the ranks: one connection per rank for the rendezvous and one per rank's progress
    watchdog); else this rank's two client connections (node 0's agent serves it: ``store_open_files``)."""
    nccl: int
    reserve: int = RESERVE

    @property
    def total(self) -> int:
        return self.data_group + self.megatron_gloo + self.world + self.store + self.nccl + self.reserve

    def describe(self) -> str:
        return (
            f"{self.total} = {self.data_group} for the rollout data group + {self.megatron_gloo} for "
            f"megatron's gloo groups + {self.world} for the world group + {self.store} for the store + "
            f"{self.nccl} for NCCL + {self.reserve} reserve"
        )


STORE_CLIENTS_PER_RANK = 2
"""A rank's connections to the launcher's store: its process group's and its progress watchdog's."""
STORE_CLIENTS_PER_AGENT = 1
"""A torchrun agent's own connection to the store (its c10d rendezvous handler)."""


def agent_serves_store(environ: Mapping[str, str]) -> bool:
    """Whether a torchrun agent serves the launcher's store (torchrun sets ``TORCHELASTIC_USE_AGENT_STORE``
    in its workers' environment: their ``env://`` store is a client of the agent's)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")


def store_open_files(world_size: int, nodes: int) -> int:
    """Open files of the process serving the store: a connection per rank's client and per agent,
    plus ``RESERVE``."""
    return STORE_CLIENTS_PER_RANK * world_size + STORE_CLIENTS_PER_AGENT * nodes + RESERVE


def open_files_needed(
    world_size: int, *, dp: int, cp: int, expert_dp: int, rank: int, nccl: bool, agent_store: bool = True
) -> OpenFiles:
    """Rank ``rank``'s estimated peak of open files in a job of ``world_size`` ranks whose
    data-parallel size is ``dp``, context-parallel ``cp`` and expert data-parallel ``expert_dp``
    (a resolved ``ParallelConfig``'s); ``nccl``: the job's backend is NCCL (else gloo);
    ``agent_store``: a torchrun agent serves the launcher's store (``agent_serves_store``), else rank 0
    does and counts it."""
    serves = rank == 0 and not agent_store
    return OpenFiles(
        data_group=world_size - 1,
        megatron_gloo=(dp - 1) + (dp * cp - 1) + (expert_dp - 1),
        world=(NCCL_GROUP_FILES if nccl else world_size - 1),
        store=STORE_CLIENTS_PER_RANK * world_size if serves else STORE_CLIENTS_PER_RANK,
        nccl=NCCL_GROUPS * NCCL_GROUP_FILES if nccl else 0,
    )


def raise_open_file_limit(needed: OpenFiles) -> int:
    """Raise this process's soft limit of open files to its hard limit (``ulimit -n`` up to
    ``ulimit -Hn``), at least to ``needed.total``; return the new soft limit. RuntimeError, with
    the estimate and the fix, when the hard limit is below what the rank needs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = hard == resource.RLIM_INFINITY
    if not unlimited and hard < needed.total:
        raise RuntimeError(
            f"this rank needs about {needed.describe()} open files, but its hard limit is {hard} "
            f"(soft {soft}): raise the hard limit of open files (RLIMIT_NOFILE) on every node to at least "
            f"{needed.total}: `ulimit -Hn` in the job script is capped by /etc/security/limits.conf "
            "(nofile), and under Slurm by the limits slurmd propagates (PropagateResourceLimits)"
        )
    target = hard if not unlimited else max(soft, needed.total, 1 << 20)
    if soft >= target:
        return soft
    error: Exception | None = None
    for attempt in (target, max(soft, needed.total)):  # unlimited still stops at the kernel's nr_open
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (attempt, hard))
            return attempt
        except (ValueError, OSError) as exc:
            error = exc
    raise RuntimeError(
        f"this rank needs about {needed.describe()} open files; raising its soft limit from {soft} failed "
        f"({error}): raise the limit of open files (ulimit -n, /proc/sys/fs/nr_open) on every node"
    )


def main(argv: list[str]) -> int:
    """``store WORLD_SIZE NODES``: print the open files the store's server needs (launch/slurm/node.sh
    raises node 0's torchrun agent's limit to at least that)."""
    if len(argv) != 3 or argv[0] != "store" or not all(a.isdigit() for a in argv[1:]):
        print("usage: python -m grpo_megatron.distributed.open_files store WORLD_SIZE NODES", file=sys.stderr)
        return 2
    print(store_open_files(int(argv[1]), int(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
