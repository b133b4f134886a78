"""The open-file limit a rank needs, raised at start (``init_distributed``), before any group opens.

At 1024 ranks a rank holds more sockets than the usual soft limit of 1024 open files: gloo connects
every pair of a group's ranks when the group is created, one socket per peer, and the rollout
results travel over a gloo group of the whole world (``rollout/fleet.py``'s data group), beside
megatron's gloo groups. A rank past its limit fails in the middle of a group's creation with
``Too many open files``, on some ranks only, which the others see as a hang until the timeout.

``open_files_needed`` estimates a rank's peak from the groups it will open; ``raise_open_file_limit``
raises the soft limit to the hard one (the headroom is free), or stops with the numbers and the fix
when even the hard limit is below the estimate.
"""

from __future__ import annotations

import resource
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
    """The launcher's key-value store: served by rank 0 under srun (one connection per rank for
    the rendezvous and one per rank's progress watchdog); a client connection elsewhere."""
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


def open_files_needed(
    world_size: int, *, dp: int, cp: int, expert_dp: int, rank: int, nccl: bool
) -> OpenFiles:
    """Rank ``rank``'s estimated peak of open files in a job of ``world_size`` ranks whose
    data-parallel size is ``dp``, context-parallel ``cp`` and expert data-parallel ``expert_dp``
    (a resolved ``ParallelConfig``'s); ``nccl``: the job's backend is NCCL (else gloo)."""
    return OpenFiles(
        data_group=world_size - 1,
        megatron_gloo=(dp - 1) + (dp * cp - 1) + (expert_dp - 1),
        world=(NCCL_GROUP_FILES if nccl else world_size - 1),
        store=2 * world_size if rank == 0 else 2,
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
