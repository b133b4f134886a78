"""Distributed bootstrap: torchrun/srun-compatible init and the explicit ``ParallelState``.

``init_distributed`` reads the standard env:// variables (torchrun sets them; under srun we derive
them from SLURM_* when torchrun is not used), creates the default process group (gloo on CPU,
nccl on GPU), builds megatron's ``parallel_state`` for TP/PP/EP/ETP/CP/DP, and returns a
``ParallelState`` holding every group and rank our code needs. Our code takes that object as an
argument; only megatron-core's internals read megatron's module-level ``parallel_state``.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from grpo_megatron.distributed.config import ParallelConfig


@dataclass(frozen=True)
class ParallelState:
    """Process groups and ranks of this process, passed explicitly into our code.

    Sizes: ``tp`` tensor, ``pp`` pipeline, ``cp`` context, ``dp`` data (dense parameters),
    ``ep`` expert, ``etp`` expert-tensor, ``edp`` expert-data (world = pp * etp * ep * edp).
    """

    world_size: int
    rank: int
    local_rank: int
    device: torch.device
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    ep_rank: int
    etp_rank: int
    sequence_parallel: bool
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup  # data-parallel group of dense parameters (without CP)
    dp_cp_group: dist.ProcessGroup  # data x context: where dense gradients are reduced
    ep_group: dist.ProcessGroup
    etp_group: dist.ProcessGroup
    edp_group: dist.ProcessGroup  # expert data-parallel: where expert gradients are reduced
    pg_collection: Any  # megatron.core.process_groups_config.ProcessGroupCollection
    timeout: datetime.timedelta = datetime.timedelta(minutes=30)
    """parallel.timeout_minutes: every process group our code creates takes it (torch's ``new_group``
    default is 30 min for gloo, 10 for NCCL, whatever the world group was given)."""

    @property
    def is_first_pp_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def last_pp_stage_global_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        import torch.distributed as dist

        return dist.get_global_rank(self.pp_group, self.pp - 1)

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} on {socket.gethostname()}: tp {self.tp_rank}/{self.tp} "
            f"pp {self.pp_rank}/{self.pp} cp {self.cp_rank}/{self.cp} dp {self.dp_rank}/{self.dp} "
            f"ep {self.ep_rank}/{self.ep} etp {self.etp_rank}/{self.etp}"
        )


def _env_from_slurm() -> None:
    """Under plain ``srun`` (one task per GPU, no torchrun) derive env:// variables from SLURM_*."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        raise RuntimeError(
            "running under srun without torchrun: export MASTER_ADDR (the first node's hostname, e.g. "
            "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)) and MASTER_PORT before srun"
        )


def world_size_from_env() -> int:
    """The world size the launcher announced (1 when not launched by torchrun/srun)."""
    _env_from_slurm()
    return int(os.environ.get("WORLD_SIZE", "1"))


# megatron-core warns about these on every rank of every run without TE/apex (the CPU path);
# they say nothing the user can act on, and they bury the run's own output.
_EXPECTED_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    r"The 'megatron\.core\.transformer\.custom_layers\.transformer_engine'",
    # megatron's optimizer probes `.grad` of non-leaf fp32 views it keeps of our parameters
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
)


def quiet_expected_warnings() -> None:
    """Silence the warnings megatron-core always prints on a CPU / no-TE run (and only those)."""
    import warnings

    for pattern in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def job_backend(backend: str) -> str:
    """``parallel.backend`` resolved: auto = nccl when this process sees CUDA, else gloo. The job's
    device follows from it (nccl: CUDA, gloo: CPU); code that picks a device asks the job, not
    ``torch.cuda.is_available()`` (a gloo test on a GPU machine runs on CPU)."""
    import torch

    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(parallel: ParallelConfig, *, seed: int = 1234) -> ParallelState:
    """Create the process groups for ``parallel`` (already validated) and seed megatron's RNGs.

    The job's device follows ``parallel.backend`` (``job_backend``): nccl runs on
    ``cuda:<local rank>``, gloo on CPU. Before anything is built, the megatron-core adjustments
    this process needs are applied (``megatron_compat``: TransformerEngine absent, torch's Adam,
    and the CUDA-absent ones for a CPU job only).
    """
    quiet_expected_warnings()

    world_size = world_size_from_env()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size == 1:
        # A single process needs no launcher: rendezvous with itself on a free local port.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    parallel = parallel.resolve(world_size)

    backend = job_backend(parallel.backend)
    use_cuda = backend == "nccl"
    device = _job_device(use_cuda, local_rank)
    from grpo_megatron.distributed import open_files
    from grpo_megatron.distributed.megatron_compat import apply_megatron_compat

    # Before any group opens its sockets (the whole world's gloo data group: a socket per rank).
    needed = open_files.open_files_needed(
        world_size,
        dp=parallel.dp or 1,
        cp=parallel.cp,
        expert_dp=parallel.expert_dp,
        rank=rank,
        nccl=use_cuda,
        agent_store=open_files.agent_serves_store(os.environ),
    )
    open_files.raise_open_file_limit(needed)

    # By cause, not by device: TE absent and torch's Adam need fixes on a GPU too.
    apply_megatron_compat(device)
    _rendezvous(backend, world_size, rank, parallel.timeout_minutes)

    from megatron.core import parallel_state as mpu

    from grpo_megatron.distributed.megatron_compat import groups_take_timeout

    timeout = datetime.timedelta(minutes=parallel.timeout_minutes)
    with groups_take_timeout(timeout):  # the one gloo group megatron creates without it, too
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            context_parallel_size=parallel.cp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.etp,
            distributed_timeout_minutes=parallel.timeout_minutes,
        )
    _seed_megatron(seed, use_cuda)

    return parallel_state_from_megatron(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        device=device,
        parallel=parallel,
        timeout=timeout,
    )


def _job_device(use_cuda: bool, local_rank: int) -> Any:
    """This rank's device: ``cuda:<local rank>`` for an nccl job (refused without CUDA), else the CPU."""
    import torch

    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "parallel.backend=nccl needs CUDA, which this process does not have: set "
            "parallel.backend=gloo (CPU) or auto"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _rendezvous(backend: str, world_size: int, rank: int, timeout_minutes: float) -> None:
    """The world's process group (env://), unless one exists; a failure names the rank and host."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    try:
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    except Exception as exc:  # name the rank and host: the first thing a cluster user needs
        raise RuntimeError(
            f"rank {rank}/{world_size} on {socket.gethostname()}: process-group rendezvous at "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} failed ({exc}). "
            "Check MASTER_ADDR/MASTER_PORT, the network interface (GLOO_SOCKET_IFNAME / "
            "NCCL_SOCKET_IFNAME) and parallel.timeout_minutes"
        ) from exc


def parallel_state_from_megatron(
    *,
    world_size: int,
    rank: int,
    local_rank: int,
    device: Any,
    parallel: Any,
    timeout: datetime.timedelta | None = None,
) -> ParallelState:
    """Our ``ParallelState``, read from megatron's ``parallel_state`` after ``initialize_model_parallel``
    (the bootstrap above, and the planner's fake-process-group dry run). ``parallel``: anything with
    resolved ``tp, pp, cp, ep, sequence_parallel`` (a ParallelConfig, the planner's Layout); ``timeout``:
    the job's collective timeout (None: ParallelState's default, parallel.timeout_minutes' own)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ParallelState(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        device=device,
        tp=parallel.tp,
        pp=parallel.pp,
        cp=parallel.cp,
        dp=mpu.get_data_parallel_world_size(),
        ep=parallel.ep,
        etp=mpu.get_expert_tensor_parallel_world_size(),
        edp=mpu.get_expert_data_parallel_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        cp_rank=mpu.get_context_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        sequence_parallel=bool(parallel.sequence_parallel),
        tp_group=mpu.get_tensor_model_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        cp_group=mpu.get_context_parallel_group(),
        dp_group=mpu.get_data_parallel_group(),
        dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True),
        ep_group=mpu.get_expert_model_parallel_group(),
        etp_group=mpu.get_expert_tensor_parallel_group(),
        edp_group=mpu.get_expert_data_parallel_group(),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        **({} if timeout is None else {"timeout": timeout}),
    )


def _seed_megatron(seed: int, use_cuda: bool) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (CUDA or the CPU equivalent)."""
    import torch

    torch.manual_seed(seed)
    if use_cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        from grpo_megatron.distributed.megatron_compat import cpu_model_parallel_seed

        cpu_model_parallel_seed(seed)


def destroy_distributed(*, keep_process_group: bool = False) -> None:
    """Tear down megatron's parallel state (and the default process group unless kept)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if not keep_process_group and dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick): loopback for a one-node rendezvous, "" (every
    interface) for an address other nodes connect to."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
