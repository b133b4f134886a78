"""Everything a training job holds, built once at start-up: the wiring from `JobConfig` to components.

`Runtime` is what both loops run on (policy, engines, rewards, logger, ...), built the same way for
`grpo-megatron train` (`build_job(cfg)` -> `Job`: plus training prompts, checkpoints and the
reference; training/grpo.py) and `grpo-megatron sft` (`build_sft_job(cfg)` -> `SFTJob`: plus the
prompt/response pairs; training/sft.py). Components are handed their config sections here, never
the whole `JobConfig`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpo_megatron.distributed.bootstrap import ParallelState

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from transformers import PreTrainedTokenizerFast

    from grpo_megatron.checkpoint.config import CheckpointConfig
    from grpo_megatron.checkpoint.manager import CheckpointManager
    from grpo_megatron.config import JobConfig
    from grpo_megatron.data import PromptRecord, PromptSampler, SFTRecord
    from grpo_megatron.distributed.preemption import Preemption
    from grpo_megatron.distributed.watchdog import ProgressWatchdog
    from grpo_megatron.logging_utils.metrics import MetricsLogger
    from grpo_megatron.models.config import ModelConfig
    from grpo_megatron.rewards.config import RewardConfig
    from grpo_megatron.rewards.pool import RewardPool
    from grpo_megatron.rollout.config import MultiTurnConfig
    from grpo_megatron.rollout.engine import EngineSpec
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.rollout.multiturn import Environment
    from grpo_megatron.training.offload import ColocatedMemory
    from grpo_megatron.training.phases.reward import Scorer
    from grpo_megatron.training.phases.rollout import Rollout
    from grpo_megatron.training.phases.sync import ProbeBatch
    from grpo_megatron.training.policy import Policy
    from grpo_megatron.training.teacher import Teacher


@dataclass(kw_only=True)
class Runtime:
    """What both loops run on: process groups, model config, tokenizer, policy, engines, rewards,
    logger and the held-out prompts, plus the colocated memory, preemption flag and watchdog."""

    cfg: JobConfig
    ps: ParallelState
    hf: dict[str, Any]
    """The model's config.json."""
    run_dir: Path
    tokenizer: PreTrainedTokenizerFast
    policy: Policy
    fleet: RolloutFleet
    logger: MetricsLogger
    eval_records: list[PromptRecord]
    rewards: RewardPool | None
    """Only on global rank 0 (it scores for everyone and broadcasts); None elsewhere."""
    memory: ColocatedMemory
    """The colocated memory choreography (rollout/placement.py's phases; moves nothing when no
    engine shares the trainer's device memory and train.offload_trainer is off)."""
    preemption: Preemption
    """This process's save-on-signal flag (SIGTERM, checkpoint.signal), asked at the loop's safe point."""
    watchdog: ProgressWatchdog | None = None
    """This rank's progress watchdog (parallel.progress_timeout_s); None when off or on one rank."""
    env: Environment | None = None
    """rollout.multiturn: the episodes' environment (its tool workers), on global rank 0 only."""

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

        return Rollout(
            self.fleet,
            self.cfg.rollout,
            self.eos_id,
            self.tokenizer,
            self.env,
            watchdog=self.watchdog,
            long_phase_s=self.cfg.parallel.long_phase_timeout_s,
        )

    @property
    def scorer(self) -> Scorer:
        """What the reward phase acts on: the tokenizer and rank 0's reward pool."""
        from grpo_megatron.training.phases.reward import Scorer

        return Scorer(self.tokenizer, self.rewards, self.cfg.reward)

    @property
    def has_engines(self) -> bool:
        """False in a replay (rollout.replay_dir): no engine was started, nothing to sync or evaluate."""
        return bool(self.fleet.engine_ranks)

    def sync_engines(self, version: int, probe: ProbeBatch | None = None) -> dict[str, float]:
        """The sync phase with this job's objects, for both loops: the policy's weights into the engines
        as ``version`` inside the placement's memory phases (``phases/sync.py:sync_weights``, the one
        way weights reach the engines), then the mismatch probe when ``probe`` has sequences. Leaves the
        memory in the rollout phase (the engines can generate)."""
        from grpo_megatron.training.phases.sync import ProbeBatch, sync_weights

        if not self.has_engines:
            return {}
        return sync_weights(
            self.policy.model,
            self.fleet,
            self.memory,
            self.ps,
            version,
            probe or ProbeBatch(),
            vocab_size=int(self.hf["vocab_size"]),
            temperature=self.cfg.rollout.temperature,
            max_abs=self.cfg.rollout.probe_max_abs,
            max_mean=self.cfg.rollout.probe_max_mean,
        )

    def make_sampler(self, num_items: int) -> PromptSampler:
        """The seeded, resumable order in which ``num_items`` training items are drawn."""
        from grpo_megatron.data import PromptSampler

        return PromptSampler(num_items, seed=self.cfg.train.seed, shuffle=self.cfg.data.shuffle)

    def close(self, *, together: bool = False) -> None:
        """Stop what the job started. ``together``: every rank closes at this point of a run that ends
        in order (``RolloutFleet.shutdown``); False after an error, where a rank may be gone."""
        if self.preemption.received is None:  # after a signal, the grace keeps bounding the exit
            self.preemption.uninstall()
        if self.watchdog is not None:
            self.watchdog.stop()
        # The reward workers and the logger (wandb's service) close before the engines stop: an
        # engine's shutdown must not be what ends them (rollout/sglang/health.py).
        if self.rewards is not None:
            self.rewards.close()
        if self.env is not None:
            self.env.close()
        self.logger.close()
        self.fleet.shutdown(together=together)


@dataclass(kw_only=True)
class Job(Runtime):
    """A GRPO job (``grpo-megatron train``): the runtime plus its training prompts, checkpoints and
    the frozen reference."""

    train_records: list[PromptRecord]
    checkpoints: CheckpointManager
    reference: torch.nn.Module | None = None
    """Frozen reference model (same layout as the policy); None when the KL penalty is off or when
    the policy is its own reference (``reference_is_base``)."""
    reference_is_base: bool = False
    """model.lora with the KL penalty on: the reference is the policy with its adapters off (no copy)."""
    teacher: Teacher | None = None
    """The frozen distillation teacher (``distill:``, training/teacher.py); None without distillation."""

    def make_sampler(self, num_items: int | None = None) -> PromptSampler:
        """The seeded, resumable order in which training prompts are drawn."""
        return super().make_sampler(len(self.train_records) if num_items is None else num_items)

    @contextmanager
    def reference_on_device(self) -> Iterator[torch.nn.Module | None]:
        """The reference model for the reference pass (None: no KL penalty). With model.lora, the
        policy with its adapters off for the block; with train.reference_on_cpu on a GPU, the
        reference's weights live in host memory and visit the device only for the block."""
        if self.reference_is_base:
            with self.policy.reference():
                yield self.policy.model
            return
        swap = self.cfg.train.reference_on_cpu and self.ps.device.type == "cuda"
        reference = self.reference if swap else None
        if reference is not None:
            reference.to(self.ps.device)
        try:
            yield self.reference
        finally:
            if reference is not None:
                reference.to("cpu")

    @contextmanager
    def teacher_on_device(self) -> Iterator[Teacher | None]:
        """The teacher for the teacher pass (None without distillation); with distill.on_cpu on a GPU,
        its weights visit the device for the block only."""
        if self.teacher is None:
            yield None
            return
        with self.teacher.on_device(self.ps.device):
            yield self.teacher


@dataclass(kw_only=True)
class SFTJob(Runtime):
    """A cold start (``grpo-megatron sft``): the runtime plus its prompt/response pairs."""

    sft_records: list[SFTRecord]


def has_safetensors(hf_path: str | Path) -> bool:
    return any(Path(hf_path).glob("*.safetensors"))


def load_initial_weights(model: torch.nn.Module, model_cfg: ModelConfig, ps: ParallelState, hf: dict) -> bool:
    """Load model.hf_path's safetensors into ``model`` when it has any; False = keep the random init."""
    from grpo_megatron.bridge.hf_loader import load_hf_weights

    if not has_safetensors(model_cfg.hf_path):
        return False
    load_hf_weights(model, ps, model_cfg.hf_path, hf)
    return True


def build_reference(model_cfg: ModelConfig, hf: dict, ps: ParallelState, policy: Policy) -> torch.nn.Module:
    """The frozen reference: built like the policy, with the policy's initial weights copied shard by
    shard (same layout, so local state dicts line up), no gradients."""
    from grpo_megatron.bridge.layout import unwrap
    from grpo_megatron.models.builder import build_gpt_model

    reference, _ = build_gpt_model(hf, model_cfg, ps)
    reference.load_state_dict(unwrap(policy.model).state_dict())
    reference.requires_grad_(False)
    reference.eval()
    return reference


def export_hf_checkpoint(job: Runtime, out_dir: Path) -> None:
    """Stream the policy's weights into a Hugging Face directory (safetensors, index, config.json and
    the tokenizer files), written atomically by rank 0; every rank takes part in the stream. With
    model.lora the weights are merged (W + scale * B A), and the adapters alone go beside them as a
    PEFT adapter directory, ``<out_dir>/adapter``."""
    from grpo_megatron.bridge.hf_loader import tokenizer_files
    from grpo_megatron.bridge.safetensors_writer import write_hf_checkpoint

    tokenizer_dir = Path(job.cfg.data.tokenizer_path or job.cfg.model.hf_path)
    job.memory.to_trainer()  # the export reads the parameters (train.offload_trainer)
    write_hf_checkpoint(job.policy.model, job.ps, job.hf, out_dir, extra_files=tokenizer_files(tokenizer_dir))
    if job.policy.lora:
        from grpo_megatron.bridge.peft_export import write_peft_adapter

        write_peft_adapter(
            job.policy.model,
            job.ps,
            job.hf,
            job.cfg.model.lora,
            out_dir / "adapter",
            base_model=job.cfg.model.hf_path,
        )


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


def engine_spec(cfg: JobConfig) -> EngineSpec:
    """What the rollout engines are built from: the rollout and model sections, train.seed, the
    tokenizer (data.tokenizer_path), where engines log (logging.run_dir/sglang or /engines) and
    whether responses carry their routes (algorithm.routing_replay=r3)."""
    from grpo_megatron.rollout.engine import EngineSpec

    return EngineSpec(
        rollout=cfg.rollout,
        model=cfg.model,
        seed=cfg.train.seed,
        tokenizer_path=cfg.data.tokenizer_path or None,
        log_dir=Path(cfg.logging.run_dir) / ("sglang" if cfg.rollout.engine == "sglang" else "engines"),
        record_routes=cfg.algorithm.routing_replay == "r3",
        offload_trainer=cfg.train.offload_trainer,
        max_staleness=cfg.generation_overlaps_training,
    )


@dataclass
class _Startup:
    """What start-up holds before the models exist (``_start``), in the order it is made."""

    ps: ParallelState
    preemption: Preemption
    watchdog: ProgressWatchdog | None
    hf: dict[str, Any]
    run_dir: Path
    rewards: RewardPool | None
    tokenizer: PreTrainedTokenizerFast
    env: Environment | None = None
    """rollout.multiturn: rank 0's environment."""

    def beat(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(phase)

    def long_phase(self, phase: str, limit_s: float) -> AbstractContextManager[None]:
        """A start-up phase that blocks in one call for long (``ProgressWatchdog.long_phase``)."""
        return self.watchdog.long_phase(phase, limit_s) if self.watchdog is not None else nullcontext()


def build_environment(mt: MultiTurnConfig, reward: RewardConfig, tokenizer: Any) -> Environment:
    """rollout.multiturn's environment: the tool environment, its tool in sandboxed workers (the
    reward section's sandbox)."""
    from grpo_megatron.rewards.tools import ToolPool
    from grpo_megatron.rollout.multiturn import TOOL_NAME, ToolEnvironment

    pool = ToolPool(
        {TOOL_NAME: mt.tool},
        reward,
        timeout_s=mt.tool_timeout_s,
        num_workers=mt.tool_workers,
        max_output_chars=mt.max_tool_output_chars,
        error_text=mt.error_text,
    )
    return ToolEnvironment(mt, tokenizer, pool)


def _start(cfg: JobConfig, *, install_preemption: bool) -> _Startup:
    """Bootstrap the process groups, the preemption flag and watchdog, the run directory, rank 0's
    reward pool and the tokenizer."""
    from grpo_megatron.data import load_tokenizer
    from grpo_megatron.distributed.bootstrap import init_distributed
    from grpo_megatron.distributed.collectives import on_rank0
    from grpo_megatron.distributed.watchdog import start_watchdog
    from grpo_megatron.rewards.pool import RewardPool

    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    preemption = start_preemption(cfg.checkpoint, install=install_preemption)
    watchdog = start_watchdog(cfg.parallel.progress_timeout_s, ps.rank, ps.world_size)
    hf = cfg.model.load_hf_config()
    run_dir = Path(cfg.logging.run_dir)
    if ps.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(run_dir / "config.yaml")
    # Rank 0 holds the reward pool. It starts before the model is built, so that a reward that fails to
    # import costs seconds, and through on_rank0, so that the failure stops every rank at once instead
    # of leaving the others in the next collective until the process-group timeout.
    pools: list[RewardPool] = []
    if not cfg.rollout.replay_dir:  # a replay's rewards come from its dump
        on_rank0(lambda: pools.append(RewardPool(cfg.reward)), "starting the reward workers")
    tokenizer = load_tokenizer(cfg.data.tokenizer_path or cfg.model.hf_path)
    envs: list[Environment] = []
    # rank 0's tool workers (none in a replay), started (and failing) like the reward pool
    if cfg.rollout.multiturn.enabled and not cfg.rollout.replay_dir:
        on_rank0(
            lambda: envs.append(build_environment(cfg.rollout.multiturn, cfg.reward, tokenizer)),
            "starting the tool workers",
        )
    return _Startup(
        ps,
        preemption,
        watchdog,
        hf,
        run_dir,
        pools[0] if pools else None,
        tokenizer,
        envs[0] if envs else None,
    )


def _models(
    cfg: JobConfig,
    start: _Startup,
    *,
    with_reference: bool,
    engines: bool = True,
    restarts: bool = True,
    with_teacher: bool = False,
) -> tuple[Policy, torch.nn.Module | None, Teacher | None, RolloutFleet, ColocatedMemory]:
    """The policy (with model.hf_path's weights when it has any), the frozen reference and the
    distillation teacher when asked for, and the rollout engines, in this order (each draws from the
    seeded generators); the colocated memory choreography, which started the engines as
    rollout/placement.py says (colocated SGLang engines while the trainer's state is in host memory).
    ``engines`` False (a replay, rollout.replay_dir): a fleet of no engines, and memory that never
    moves. ``restarts``: lost engines are restarted in place up to rollout.recovery.max_restarts,
    resynced from the policy (GRPO; SFT restarts none)."""
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.rollout.placement import runtime_placement
    from grpo_megatron.rollout.recovery import Resync
    from grpo_megatron.training.offload import ColocatedMemory
    from grpo_megatron.training.policy import build_policy

    ps, hf = start.ps, start.hf
    key_length = None
    if cfg.rollout.true_on_policy:
        from grpo_megatron.models.batch_invariant import BatchInvariantMode, key_width

        # From here on every product of this process is batch-invariant: the trainer's passes compute
        # what the policy engine computes (models/batch_invariant.py, rollout/policy_engine.py).
        BatchInvariantMode().__enter__()
        key_length = key_width(cfg.data.max_prompt_tokens + cfg.rollout.response_budget.tokens)
    policy = build_policy(hf, cfg.model, cfg.parallel, cfg.train, ps, key_length=key_length)
    start.beat("policy")
    with start.long_phase("initial weights", cfg.parallel.long_phase_timeout_s):
        loaded = load_initial_weights(policy.model, cfg.model, ps, hf)
    start.beat("initial weights")
    if ps.rank == 0:
        source = cfg.model.hf_path if loaded else "random initialisation (no *.safetensors in model.hf_path)"
        print(f"[job] {policy.spec.model_type} from {source} | {ps.describe()}", flush=True)
    # With LoRA the policy with its adapters off is the reference: no copy (Job.reference_is_base).
    reference = build_reference(cfg.model, hf, ps, policy) if with_reference and not policy.lora else None
    if reference is not None and cfg.train.reference_on_cpu:
        reference.to("cpu")
    start.beat("reference")
    teacher = None
    if with_teacher:
        with start.long_phase("teacher", cfg.parallel.long_phase_timeout_s):
            teacher = _teacher(cfg, start)
        start.beat("teacher")
    if not engines:
        from grpo_megatron.rollout.placement import PHASES, TRAINER_PARTS, Occupancy

        fleet = RolloutFleet.without_engines(ps, hf)
        resident = dict.fromkeys(PHASES, Occupancy(TRAINER_PARTS, frozenset()))  # nothing ever moves
        return policy, reference, teacher, fleet, ColocatedMemory(policy, None, resident)
    spec = engine_spec(cfg)
    placement = runtime_placement(spec, ps, hf)
    memory = ColocatedMemory(policy, None, placement.phases())
    # What a restarted engine is given: the weights, and the memory phases it resyncs and starts in.
    resync = Resync(policy.model, memory.sync_visit, memory.restart_visit) if restarts else None
    engine = None
    if cfg.rollout.true_on_policy:
        from grpo_megatron.rollout.policy_engine import PolicyEngine
        from grpo_megatron.training.forward_backward import TrainerForward

        engine = PolicyEngine(
            TrainerForward(policy.model, ps, policy.spec.vocab_size), ps, policy.spec.vocab_size
        )
    with start.long_phase(
        "engines", cfg.parallel.long_phase_timeout_s
    ):  # an engine's start blocks in one call
        fleet = memory.start_engines(
            lambda: RolloutFleet.build(
                spec, hf, ps, tokenizer=start.tokenizer, placement=placement, resync=resync, engine=engine
            )
        )
    start.beat("engines")
    return policy, reference, teacher, fleet, memory


def _teacher(cfg: JobConfig, start: _Startup) -> Teacher:
    """The distillation teacher (training/teacher.py), once its tokenizer is found to be the
    student's: a mismatch stops every rank before any weight is read."""
    from grpo_megatron.data.tokenizer import load_tokenizer, vocabulary_mismatch
    from grpo_megatron.training.teacher import build_teacher

    distill = cfg.distill
    mismatch = vocabulary_mismatch(
        start.tokenizer,
        cfg.data.tokenizer_path or cfg.model.hf_path,
        load_tokenizer(distill.teacher_path),
        distill.teacher_path,
    )
    if mismatch:
        raise ValueError(mismatch)
    on_cpu = distill.on_cpu and start.ps.device.type == "cuda"
    teacher = build_teacher(distill, cfg.model, start.ps, on_cpu=on_cpu)
    if start.ps.rank == 0:
        print(
            f"[job] distillation teacher {teacher.spec.model_type} from {distill.teacher_path} "
            f"(coef {distill.coef}, reward_coef {distill.reward_coef})",
            flush=True,
        )
    return teacher


def _logger(
    cfg: JobConfig, start: _Startup, total_iterations: int, required_keys: Sequence[str]
) -> MetricsLogger:
    from grpo_megatron.logging_utils.metrics import MetricsLogger

    return MetricsLogger(
        cfg.logging,
        run_dir=start.run_dir,
        job_config=cfg.to_dict(),
        is_writer=start.ps.rank == 0,
        total_iterations=total_iterations,
        required_keys=required_keys,
    )


def build_job(cfg: JobConfig, *, with_reference: bool) -> Job:
    """A GRPO job: bootstrap, then prompts, policy (and reference), engines, logger and checkpoints."""
    from grpo_megatron.checkpoint.manager import CheckpointManager
    from grpo_megatron.data import build_prompt_datasets
    from grpo_megatron.logging_utils.metrics import REQUIRED_KEYS

    start = _start(cfg, install_preemption=True)
    train_records, eval_records = build_prompt_datasets(cfg.data, start.tokenizer, cfg.train.seed)
    start.beat("data")
    engines = not cfg.rollout.replay_dir  # a replay trains from a dump: no engine starts
    policy, reference, teacher, fleet, memory = _models(
        cfg, start, with_reference=with_reference, engines=engines, with_teacher=cfg.distill.enabled
    )
    ps, run_dir = start.ps, start.run_dir
    return Job(
        cfg=cfg,
        ps=ps,
        hf=start.hf,
        run_dir=run_dir,
        tokenizer=start.tokenizer,
        policy=policy,
        fleet=fleet,
        logger=_logger(cfg, start, cfg.train.iterations, REQUIRED_KEYS),
        checkpoints=CheckpointManager(cfg.checkpoint, run_dir, ps),
        eval_records=eval_records,
        rewards=start.rewards,
        memory=memory,
        preemption=start.preemption,
        watchdog=start.watchdog,
        train_records=train_records,
        reference=reference,
        reference_is_base=with_reference and policy.lora,
        teacher=teacher,
        env=start.env,
    )


def build_sft_job(cfg: JobConfig) -> SFTJob:
    """A cold start: bootstrap, then the prompt/response pairs (sft.dev_prompts held out), policy,
    engines (for the held-out check) and logger; no reference, no checkpoints, no signal handler."""
    from grpo_megatron.data import build_sft_dataset

    start = _start(cfg, install_preemption=False)
    sft_records, eval_records = build_sft_dataset(cfg.data, start.tokenizer, cfg.train.seed)
    start.beat("data")
    policy, _, _, fleet, memory = _models(cfg, start, with_reference=False, restarts=False)
    return SFTJob(
        cfg=cfg,
        ps=start.ps,
        hf=start.hf,
        run_dir=start.run_dir,
        tokenizer=start.tokenizer,
        policy=policy,
        fleet=fleet,
        logger=_logger(cfg, start, cfg.sft.max_steps, ("iteration", "sft/loss", "eval/accuracy")),
        eval_records=eval_records[: cfg.sft.dev_prompts],
        rewards=start.rewards,
        memory=memory,
        preemption=start.preemption,
        watchdog=start.watchdog,
        sft_records=sft_records,
        env=start.env,
    )
