"""Training checkpoints: save every N iterations, resume exactly, prune old ones.

One checkpoint = one directory ``<dir>/iter_XXXXXXX`` holding
- megatron's distributed checkpoint of the model, the optimizer (``checkpoint.optimizer_format``
  for the distributed optimizer) and the LR scheduler (in megatron's common state);
- ``rng/rank_NNNNN.pt``: every RNG state of each rank (``checkpoint/rng.py``);
- ``trainer_state.pt``: the trainer's own state (iteration, consumed prompts, sampler position:
  plain data, loaded with ``weights_only=True``);
- ``grpo_checkpoint.json``: the completion marker (iteration, layout, formats), written last.
The directory is written as ``iter_XXXXXXX.tmp-<nonce>`` and renamed when complete; then the
``latest`` file is replaced atomically; then ``keep_last`` prunes older checkpoints. A crash at any
point leaves ``latest`` naming a complete checkpoint.

Resume at another layout: megatron reshards the model at any TP/PP/EP/ETP/DP change. The
optimizer follows where megatron can: the non-distributed optimizer and the distributed one in the
fully_reshardable format load at any layout with the same number of chained optimizers (megatron
builds a second, expert-parallel optimizer exactly when EP > 1 for MoE models); dp_reshardable
loads only at the same TP/PP/EP. Elsewhere resume stops with an error naming
``checkpoint.load_optimizer=false`` (model, scheduler, RNG and trainer state with a fresh optimizer).
RNG states are restored only at the same layout (a rank's streams have no counterpart elsewhere).
"""

from __future__ import annotations

import io
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from grpo_megatron.checkpoint.config import CheckpointConfig
from grpo_megatron.checkpoint.dist import (
    BASE_CONTENT_METADATA,
    FORMAT_VERSION,
    finish,
    keep_writer_results_in_process,
    layout_of,
    load_failures,
    model_dtype,
    model_sharded_state_dict,
    new_temporary_dir,
    resolve_checkpoint,
)
from grpo_megatron.checkpoint.integrity import (
    RNG_DIR,
    TRAINER_STATE,
    CheckpointMismatch,
    model_shape,
    verify_checkpoint,
)
from grpo_megatron.checkpoint.marker import LATEST, MARKER, CheckpointError, is_complete, read_marker
from grpo_megatron.checkpoint.rng import capture_rng_state, restore_rng_state
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.distributed.collectives import collective_device, on_rank0
from grpo_megatron.fileio import TMP_INFIX, write_text_atomic

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from grpo_megatron.models.builder import PolicySpec


class Policy(Protocol):
    """What a checkpoint saves and restores: the model, its optimizer and LR schedule.

    ``training.policy.Policy`` is the one implementation; it is named here by its shape because
    checkpoint/ sits below training/ in the layering (docs/architecture.md).
    """

    @property
    def model(self) -> torch.nn.Module: ...  # megatron DistributedDataParallel around GPTModel

    @property
    def optimizer(self) -> MegatronOptimizer: ...

    @property
    def spec(self) -> PolicySpec: ...

    @property
    def scheduler(self) -> OptimizerParamScheduler | None: ...


_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_of(path: Path) -> int | None:
    """The iteration of a final checkpoint directory name, None for anything else."""
    match = _ITER_RE.match(path.name)
    return int(match.group(1)) if match else None


def complete_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``ckpt_dir``, oldest first (temporary and unmarked ones left out)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for path in ckpt_dir.iterdir():
        iteration = iteration_of(path)
        if iteration is not None and is_complete(path):
            found.append((iteration, path))
    return sorted(found)


def find_latest(ckpt_dir: str | Path) -> Path | None:
    """The checkpoint to resume from in ``ckpt_dir``: the one ``latest`` names when it is complete,
    else the complete one with the highest iteration; None when there is none.

    Never a temporary (``*.tmp-*``) directory or one without the completion marker.
    """
    ckpt_dir = Path(ckpt_dir)
    latest = ckpt_dir / LATEST
    if latest.is_file():
        named = ckpt_dir / latest.read_text().strip()
        if iteration_of(named) is not None and is_complete(named):
            return named
    found = complete_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def _check_trainer_state(trainer_state: dict[str, Any]) -> bytes:
    """``trainer_state`` serialised; raises when it would not load with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save(trainer_state, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:
        raise TypeError(
            "trainer_state must hold only plain data (dict, list, tuple, str, int, float, bool, None, "
            f"tensors) so it loads with weights_only=True: {exc}"
        ) from exc
    return buffer.getvalue()


def _require_finite(policy: Policy, iteration: int, ckpt_dir: Path) -> None:
    """Collective: refuse to save non-finite parameters (a NaN checkpoint marked ``latest`` would be
    what every restart resumes), naming the iteration and what stays intact."""
    from grpo_megatron.bridge.layout import unwrap

    bad = [name for name, p in unwrap(policy.model).named_parameters() if not bool(torch.isfinite(p).all())]
    flag = torch.tensor([len(bad)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(flag)
    if int(flag):
        mine = f" (rank {dist.get_rank()}: {', '.join(bad[:3])})" if bad else ""
        raise CheckpointError(
            f"iteration {iteration}: {int(flag)} parameter tensor(s) hold inf/NaN{mine}; not saved, so the "
            f"checkpoints in {ckpt_dir} stay as they were. Lower train.lr or set train.grad_clip"
        )


def _optimizer_count(optimizer: Any) -> int:
    """Number of optimizers megatron chained (dense, plus expert-parallel when EP > 1)."""
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


class CheckpointManager:
    """Saves and resumes training state under ``cfg.dir`` (default ``<run_dir>/checkpoints``)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, ps: ParallelState) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.dir) if cfg.dir is not None else Path(run_dir) / "checkpoints"
        self.ps = ps

    # ------------------------------------------------------------------------------------------
    # Saving

    def should_save(self, iteration: int, final_iteration: int | None = None) -> bool:
        """True when ``checkpoint.save_interval`` asks for a save after ``iteration``: every
        ``save_interval`` iterations and after ``final_iteration`` (0 = never)."""
        interval = self.cfg.save_interval
        return interval > 0 and (iteration % interval == 0 or iteration == final_iteration)

    def content_metadata(self, policy: Policy) -> dict[str, Any]:
        metadata = dict(BASE_CONTENT_METADATA)
        if policy.optimizer.config.use_distributed_optimizer:
            metadata["distrib_optim_sharding_type"] = self.cfg.optimizer_format
        return metadata

    def save(self, iteration: int, policy: Policy, trainer_state: dict[str, Any]) -> Path:
        """Collective: write checkpoint ``iter_XXXXXXX`` for ``iteration``; returns its path."""

        start = time.perf_counter()
        _require_finite(policy, iteration, self.dir)
        trainer_bytes = on_rank0(lambda: _check_trainer_state(trainer_state))
        final = self.dir / checkpoint_name(iteration)
        tmp = new_temporary_dir(final)
        try:
            self._write(tmp, final, iteration, policy, trainer_bytes)
        except BaseException:
            # A full disk (or any failure) must not leave a half-written copy of the model behind:
            # it would keep the disk full and block every restart. Each failing rank removes it.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.ps.rank == 0:
            print(f"[checkpoint] saved {final} in {time.perf_counter() - start:.1f}s", flush=True)
        return final

    def _write(self, tmp: Path, final: Path, iteration: int, policy: Policy, trainer_bytes: bytes) -> None:
        from megatron.core import dist_checkpointing

        metadata = self.content_metadata(policy)
        model_sd = model_sharded_state_dict(policy.model, metadata)
        state = {
            "model": model_sd,
            "optimizer": policy.optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata),
        }
        if policy.scheduler is not None:
            state["scheduler"] = policy.scheduler.state_dict()
        keep_writer_results_in_process()
        dist_checkpointing.save(state, str(tmp), content_metadata=metadata)

        rng_path = tmp / RNG_DIR / f"rank_{self.ps.rank:05d}.pt"
        rng_path.parent.mkdir(exist_ok=True)
        torch.save(capture_rng_state(), rng_path)
        dist.barrier()  # every rank's files are in place before rank 0 marks the checkpoint complete

        marker = {
            "kind": "train",
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "layout": layout_of(self.ps),
            "dtype": model_dtype(policy.model),
            "model": model_shape(policy.model, policy.spec.vocab_size),
            "use_distributed_optimizer": bool(policy.optimizer.config.use_distributed_optimizer),
            "optimizer_format": metadata.get("distrib_optim_sharding_type"),
            "optimizers": _optimizer_count(policy.optimizer),
            "megatron_core": _megatron_version(),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

        def publish() -> None:
            (tmp / TRAINER_STATE).write_bytes(trainer_bytes)
            finish(tmp, final, marker)
            write_text_atomic(self.dir / LATEST, final.name + "\n")
            self._prune(iteration)

        on_rank0(publish, f"publishing {final}")
        dist.barrier()

    def _prune(self, current: int) -> None:
        """Rank 0: keep the newest ``keep_last`` checkpoints up to ``current``; drop leftovers of
        interrupted saves up to this one (its own was renamed already). Later iterations (another
        run's) are left alone."""
        if self.cfg.keep_last is not None:
            older = [path for iteration, path in complete_checkpoints(self.dir) if iteration < current]
            for path in older[: max(0, len(older) - (self.cfg.keep_last - 1))]:
                shutil.rmtree(path, ignore_errors=True)
        self._remove_temporaries(up_to=current)

    def _remove_temporaries(self, up_to: int | None = None) -> list[Path]:
        """Rank 0: remove the ``*.tmp-*`` directories of saves of iterations <= ``up_to`` (all when
        None) that crashed or failed; returns them."""
        stale = []
        for path in sorted(self.dir.glob(f"iter_*{TMP_INFIX}*")) if self.dir.is_dir() else []:
            iteration = iteration_of(path.with_name(path.name.split(TMP_INFIX)[0]))
            if up_to is None or (iteration is not None and iteration <= up_to):
                shutil.rmtree(path, ignore_errors=True)
                stale.append(path)
        return stale

    def prune_temporaries(self) -> list[Path]:
        """Rank 0, at start-up (no save of this job is under way): remove every ``*.tmp-*`` directory
        that crashed or failed saves left; returns them."""
        stale = self._remove_temporaries()
        if stale:
            print(
                f"[checkpoint] removed {len(stale)} unfinished save(s): {', '.join(p.name for p in stale)}",
                flush=True,
            )
        return stale

    # ------------------------------------------------------------------------------------------
    # Resuming

    def resume_path(self, policy: Policy | None = None) -> Path | None:
        """The checkpoint ``checkpoint.resume`` selects (same on every rank), or None to start fresh.

        Every candidate is verified first (``integrity.verify_checkpoint``: intact files, safe
        metadata, and, given ``policy``, this model's shape). With ``auto``, a damaged newest
        checkpoint is skipped, with a message naming it, for the next older complete one; a
        checkpoint of another model stops the run (a config mistake, which an older checkpoint
        of the same directory would not fix)."""
        resume = self.cfg.resume
        shape = None if policy is None else model_shape(policy.model, policy.spec.vocab_size)

        def choose() -> str | None:
            if resume == "none":
                return None
            if resume == "auto":
                self.prune_temporaries()
                return self._newest_loadable(shape)
            path = resolve_checkpoint(resume)
            verify_checkpoint(path, shape=shape, source="the configured model")
            return str(path)

        chosen = on_rank0(choose, "choosing the checkpoint to resume")
        return None if chosen is None else Path(chosen)

    def _newest_loadable(self, shape: dict[str, Any] | None) -> str | None:
        first = find_latest(self.dir)
        candidates = [path for _, path in reversed(complete_checkpoints(self.dir))]
        if first is not None:
            candidates = [first, *(p for p in candidates if p != first)]
        skipped = []
        for path in candidates:
            try:
                verify_checkpoint(path, shape=shape, source="the configured model")
            except CheckpointMismatch:
                raise
            except CheckpointError as exc:
                print(f"[checkpoint] skipping {path}: {exc}", flush=True)
                skipped.append(path.name)
                continue
            if skipped:
                print(f"[checkpoint] resuming from {path.name}, the newest intact checkpoint", flush=True)
            return str(path)
        if skipped:
            raise CheckpointError(
                f"every checkpoint in {self.dir} is damaged ({', '.join(skipped)}): move them aside to start "
                "fresh, or set checkpoint.resume=none"
            )
        return None

    def resume(self, policy: Policy) -> dict[str, Any] | None:
        """Collective: restore model, optimizer, scheduler and RNG from the checkpoint selected by
        ``checkpoint.resume``; return its trainer state (None when starting fresh)."""
        path = self.resume_path(policy)
        if path is None:
            return None
        return self.load(path, policy)

    def load(self, path: str | Path, policy: Policy) -> dict[str, Any]:
        """Collective: restore ``policy`` and the RNG states from training checkpoint ``path``."""
        from megatron.core import dist_checkpointing

        start = time.perf_counter()
        path = Path(path)
        marker = read_marker(path)
        if marker.get("kind") != "train":
            raise CheckpointError(
                f"{path} is a {marker.get('kind')!r} checkpoint (model weights only, e.g. from "
                "`grpo-megatron convert`), not a training checkpoint: it has no optimizer or trainer "
                "state to resume"
            )
        load_optimizer = self.cfg.load_optimizer
        if load_optimizer:
            self._check_optimizer_compatible(path, marker, policy)
        metadata = dist_checkpointing.load_content_metadata(str(path)) or self.content_metadata(policy)
        model_sd = model_sharded_state_dict(policy.model, metadata)
        request: dict[str, Any] = {"model": model_sd}
        if load_optimizer:
            request["optimizer"] = policy.optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata=metadata
            )
        try:
            loaded = dist_checkpointing.load(request, str(path))
        except load_failures() as exc:
            raise CheckpointError(f"loading {path} failed: {type(exc).__name__}: {exc}") from exc

        from grpo_megatron.bridge.layout import unwrap

        unwrap(policy.model).load_state_dict(loaded["model"])
        if load_optimizer:
            policy.optimizer.load_state_dict(loaded["optimizer"])
        else:
            # The fresh optimizer's fp32 main copies were taken from the weights it was built with.
            policy.optimizer.reload_model_params()
        if policy.scheduler is not None and "scheduler" in loaded:
            policy.scheduler.load_state_dict(loaded["scheduler"])

        if marker["layout"] == layout_of(self.ps):
            rng_path = path / RNG_DIR / f"rank_{self.ps.rank:05d}.pt"
            restore_rng_state(torch.load(rng_path, weights_only=True))
        elif self.ps.rank == 0:
            print(
                f"[checkpoint] {path} was saved at layout {marker['layout']}, resumed at "
                f"{layout_of(self.ps)}: RNG states are not restored (the run continues from its own seeding)",
                flush=True,
            )
        trainer_state = torch.load(path / TRAINER_STATE, weights_only=True)
        dist.barrier()
        if self.ps.rank == 0:
            print(
                f"[checkpoint] resumed from {path} (iteration {marker['iteration']}) in "
                f"{time.perf_counter() - start:.1f}s",
                flush=True,
            )
        return trainer_state

    def _check_optimizer_compatible(self, path: Path, marker: dict[str, Any], policy: Policy) -> None:
        """Refuse, with the reason and the fix, what megatron cannot load into this optimizer."""
        fix = (
            "set checkpoint.load_optimizer=false to resume the model, LR schedule and trainer state "
            "with a fresh optimizer"
        )
        saved_dist = marker["use_distributed_optimizer"]
        here_dist = bool(policy.optimizer.config.use_distributed_optimizer)
        if saved_dist != here_dist:
            raise CheckpointError(
                f"{path} holds {'distributed' if saved_dist else 'non-distributed'} optimizer state, "
                f"but parallel.use_distributed_optimizer={str(here_dist).lower()}: megatron-core cannot "
                f"convert between the two. Set parallel.use_distributed_optimizer={str(saved_dist).lower()}, "
                f"or {fix}"
            )
        here_count = _optimizer_count(policy.optimizer)
        if marker["optimizers"] != here_count:
            raise CheckpointError(
                f"{path} holds {marker['optimizers']} chained optimizer(s) (saved at "
                f"EP={marker['layout']['ep']}), this layout builds {here_count} (EP={self.ps.ep}; "
                "megatron adds an expert-parallel optimizer "
                f"when EP > 1): megatron-core {_megatron_version()} cannot load one into the other. Resume "
                f"at EP {'> 1' if marker['optimizers'] > 1 else '= 1'}, or {fix}"
            )
        if marker["optimizer_format"] == "dp_reshardable":
            saved = {k: v for k, v in marker["layout"].items() if k not in ("dp", "world_size")}
            here = {k: v for k, v in layout_of(self.ps).items() if k not in ("dp", "world_size")}
            if saved != here:
                raise CheckpointError(
                    f"{path} holds dp_reshardable optimizer state saved at {saved}, which loads only at "
                    f"the same TP/PP/EP/ETP/CP (here {here}); save with checkpoint.optimizer_format="
                    f"fully_reshardable to change those, or {fix}"
                )


def _megatron_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("megatron-core")


__all__ = [
    "MARKER",
    "CheckpointError",
    "CheckpointManager",
    "checkpoint_name",
    "complete_checkpoints",
    "find_latest",
]
