"""Everything a training job holds, built once at start-up: `build_job(cfg)` -> `Job`.

Shared by `grpo-megatron train` (training/grpo.py) and `grpo-megatron sft` (training/sft.py), so both
load models, data, engines and checkpoints the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpo_megatron.distributed.bootstrap import ParallelState

if TYPE_CHECKING:
    from collections.abc import Iterator

    from grpo_megatron.checkpoint.config import CheckpointConfig
    from grpo_megatron.checkpoint.manager import CheckpointManager
    from grpo_megatron.config import JobConfig
    from grpo_megatron.data import PromptRecord, PromptSampler, SFTRecord
    from grpo_megatron.distributed.preemption import Preemption
    from grpo_megatron.distributed.watchdog import ProgressWatchdog
    from grpo_megatron.logging_utils.metrics import MetricsLogger
    from grpo_megatron.rewards.pool import RewardPool
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.offload import ColocatedMemory
    from grpo_megatron.training.phases.reward import Scorer
    from grpo_megatron.training.phases.rollout import Rollout
    from grpo_megatron.training.policy import Policy


@dataclass
class Job:
    cfg: JobConfig
    ps: ParallelState
    hf: dict[str, Any]
    """The model's config.json."""
    run_dir: Path
    tokenizer: Any
    policy: Policy
    fleet: RolloutFleet
    logger: MetricsLogger
    checkpoints: CheckpointManager
    train_records: list[PromptRecord]
    eval_records: list[PromptRecord]
    rewards: RewardPool | None
    """Only on global rank 0 (it scores for everyone and broadcasts); None elsewhere."""
    memory: ColocatedMemory
    """The colocated memory choreography (train.offload_trainer; a no-op when off)."""
    preemption: Preemption
    """This process's save-on-signal flag (SIGTERM, checkpoint.signal), asked at the loop's safe point."""
    reference: torch.nn.Module | None = None
    """Frozen reference model (same layout as the policy); None when the KL penalty is off."""
    sft_records: list[SFTRecord] = field(default_factory=list)
    """Prompt/response pairs of `grpo-megatron sft` (empty for GRPO)."""
    watchdog: ProgressWatchdog | None = None
    """This rank's progress watchdog (parallel.progress_timeout_s); None when off or on one rank."""

    def beat(self, phase: str) -> None:
        """A progress point of the main loop (see distributed/watchdog.py)."""
        if self.watchdog is not None:
            self.watchdog.beat(phase)

    @property
    def eos_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return int(eos if eos is not None else self.hf["eos_token_id"])

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.eos_id)

    @property
    def rollout(self) -> Rollout:
        """What the rollout and eval phases act on: the engines and rollout.* sampling settings."""
        from grpo_megatron.training.phases.rollout import Rollout

        return Rollout(self.fleet, self.cfg.rollout, self.eos_id)

    @property
    def scorer(self) -> Scorer:
        """What the reward phase acts on: the tokenizer and rank 0's reward pool."""
        from grpo_megatron.training.phases.reward import Scorer

        return Scorer(self.tokenizer, self.rewards, self.cfg.reward)

    def make_sampler(self, num_items: int | None = None) -> PromptSampler:
        """The seeded, resumable order in which training prompts (or SFT pairs) are drawn."""
        from grpo_megatron.data import PromptSampler

        n = len(self.train_records) if num_items is None else num_items
        return PromptSampler(n, seed=self.cfg.train.seed, shuffle=self.cfg.data.shuffle)

    @contextmanager
    def reference_on_device(self) -> Iterator[None]:
        """With train.reference_on_cpu on a GPU, the reference's weights live in host memory and
        visit the device only for the reference pass; otherwise nothing moves."""
        swap = self.cfg.train.reference_on_cpu and self.ps.device.type == "cuda"
        reference = self.reference if swap else None
        if reference is not None:
            reference.to(self.ps.device)
        try:
            yield
        finally:
            if reference is not None:
                reference.to("cpu")

    def close(self) -> None:
        if self.preemption.received is None:  # after a signal, the grace keeps bounding the exit
            self.preemption.uninstall()
        if self.watchdog is not None:
            self.watchdog.stop()
        self.fleet.shutdown()
        if self.rewards is not None:
            self.rewards.close()
        self.logger.close()


Timer = Callable[[str], AbstractContextManager[None]]
"""What times the phases of an iteration: ``with timer(name):`` (``PhaseTimer``; benches bring their own)."""


@dataclass
class PhaseTimer:
    """Wall time per named phase, accumulated over an iteration (``time/<name>`` metrics)."""

    seconds: dict[str, float] = field(default_factory=dict)
    beat: Callable[[str], None] | None = None
    """Called with the phase's name as it starts and ends (Job.beat: the progress watchdog)."""

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.beat is not None:
            self.beat(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"time/{name}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
            if self.beat is not None:
                self.beat(f"{name} (done)")


def has_safetensors(hf_path: str | Path) -> bool:
    return any(Path(hf_path).glob("*.safetensors"))


def load_initial_weights(model: torch.nn.Module, job_cfg: JobConfig, ps: ParallelState, hf: dict) -> bool:
    """Load model.hf_path's safetensors into ``model`` when it has any; False = keep the random init."""
    from grpo_megatron.bridge.hf_loader import load_hf_weights

    if not has_safetensors(job_cfg.model.hf_path):
        return False
    load_hf_weights(model, ps, job_cfg.model.hf_path, hf)
    return True


def build_reference(job_cfg: JobConfig, hf: dict, ps: ParallelState, policy: Policy) -> torch.nn.Module:
    """The frozen reference: built like the policy, with the policy's initial weights copied shard by
    shard (same layout, so local state dicts line up), no gradients."""
    from grpo_megatron.bridge.layout import unwrap
    from grpo_megatron.models.builder import build_gpt_model

    reference, _ = build_gpt_model(hf, job_cfg.model, ps)
    reference.load_state_dict(unwrap(policy.model).state_dict())
    reference.requires_grad_(False)
    reference.eval()
    return reference


def export_hf_checkpoint(job: Job, out_dir: Path) -> None:
    """Stream the policy's weights into a Hugging Face directory (safetensors, index, config.json and
    the tokenizer files), written atomically by rank 0; every rank takes part in the stream."""
    from grpo_megatron.bridge.hf_loader import tokenizer_files
    from grpo_megatron.bridge.safetensors_writer import write_hf_checkpoint

    tokenizer_dir = Path(job.cfg.data.tokenizer_path or job.cfg.model.hf_path)
    job.memory.to_trainer()  # the export reads the parameters (train.offload_trainer)
    write_hf_checkpoint(job.policy.model, job.ps, job.hf, out_dir, extra_files=tokenizer_files(tokenizer_dir))


def start_preemption(cfg: CheckpointConfig, install: bool) -> Preemption:
    """SIGTERM and checkpoint.signal noted from now on (distributed/preemption.py) when ``install``
    (GRPO; SFT keeps no checkpoints, so a signal ends it as before)."""
    import signal

    from grpo_megatron.distributed.preemption import Preemption

    signals = [signal.SIGTERM] + ([signal.Signals[cfg.signal]] if cfg.signal else [])
    preemption = Preemption(signals, cfg.signal_grace_s)
    if install:
        preemption.install()
    return preemption


def build_job(cfg: JobConfig, *, with_reference: bool, sft: bool = False) -> Job:
    """Bootstrap the process groups and build policy, engines, data, rewards, logger and checkpoints."""
    from grpo_megatron.checkpoint.manager import CheckpointManager
    from grpo_megatron.data import build_prompt_datasets, build_sft_dataset, load_tokenizer
    from grpo_megatron.distributed.bootstrap import init_distributed
    from grpo_megatron.distributed.collectives import on_rank0
    from grpo_megatron.distributed.watchdog import start_watchdog
    from grpo_megatron.logging_utils.metrics import REQUIRED_KEYS, MetricsLogger
    from grpo_megatron.rewards.pool import RewardPool
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.offload import ColocatedMemory
    from grpo_megatron.training.policy import build_policy

    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    preemption = start_preemption(cfg.checkpoint, install=not sft)
    watchdog = start_watchdog(cfg.parallel.progress_timeout_s, ps.rank, ps.world_size)
    beat = watchdog.beat if watchdog is not None else (lambda phase: None)
    hf = cfg.model.load_hf_config()
    run_dir = Path(cfg.logging.run_dir)
    if ps.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(run_dir / "config.yaml")
    # Rank 0 holds the reward pool. It starts before the model is built, so that a reward that fails to
    # import costs seconds, and through on_rank0, so that the failure stops every rank at once instead
    # of leaving the others in the next collective until the process-group timeout.
    pools: list[RewardPool] = []
    on_rank0(lambda: pools.append(RewardPool(cfg.reward)), "starting the reward workers")
    tokenizer = load_tokenizer(cfg.data.tokenizer_path or cfg.model.hf_path)
    sft_records: list = []
    train_records: list[PromptRecord]
    if sft:
        sft_records, eval_records = build_sft_dataset(cfg.data, tokenizer, cfg.train.seed)
        train_records, eval_records = [], eval_records[: cfg.sft.dev_prompts]
    else:
        train_records, eval_records = build_prompt_datasets(cfg.data, tokenizer, cfg.train.seed)

    beat("data")
    policy = build_policy(hf, cfg, ps)
    beat("policy")
    loaded = load_initial_weights(policy.model, cfg, ps, hf)
    beat("initial weights")
    if ps.rank == 0:
        source = cfg.model.hf_path if loaded else "random initialisation (no *.safetensors in model.hf_path)"
        print(f"[job] {policy.spec.model_type} from {source} | {ps.describe()}", flush=True)
    reference = build_reference(cfg, hf, ps, policy) if with_reference else None
    if reference is not None and cfg.train.reference_on_cpu:
        reference.to("cpu")
    beat("reference")
    fleet = RolloutFleet.build(cfg, hf, ps, tokenizer=tokenizer)
    beat("engines")
    return Job(
        cfg=cfg,
        ps=ps,
        hf=hf,
        run_dir=run_dir,
        tokenizer=tokenizer,
        policy=policy,
        fleet=fleet,
        logger=MetricsLogger(
            cfg.logging,
            run_dir=run_dir,
            job_config=cfg.to_dict(),
            is_writer=ps.rank == 0,
            total_iterations=cfg.sft.max_steps if sft else cfg.train.iterations,
            required_keys=("iteration", "sft/loss", "eval/accuracy") if sft else REQUIRED_KEYS,
        ),
        checkpoints=CheckpointManager(cfg.checkpoint, run_dir, ps),
        train_records=train_records,
        eval_records=eval_records,
        rewards=pools[0] if pools else None,
        memory=ColocatedMemory(policy, fleet, enabled=cfg.train.offload_trainer),
        preemption=preemption,
        reference=reference,
        sft_records=sft_records,
        watchdog=watchdog,
    )
