"""Rollout section of the job config: how responses are sampled from the policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from grpo_megatron.algorithm.truncation import Truncation


@dataclass
class MultiTurnConfig:
    """Multi-turn, tool-using episodes (rollout/multiturn.py): after each model turn an environment
    answers with an observation appended to the trajectory as token ids (never trained on), until it
    says done, the model ends with EOS, or a limit is reached. Off (the default): single-turn rollouts."""

    enabled: bool = False
    environment: Literal["tool"] = "tool"
    """tool = the model calls a tool as ``<call_open>ARGUMENT<call_close>`` (default ``<calc>12*34</calc>``)
    and reads ``<result_open>OUTPUT<result_close>`` (``<result>408</result>``); a turn without a call ends
    the episode."""
    max_turns: int = 4
    """Model turns per episode at most (observations come between them)."""
    max_total_tokens: int = 256
    """Response-side tokens per episode at most (model and observation tokens, the prompt excluded): a
    turn samples at most the budget left (and at most rollout.max_new_tokens); an observation that does
    not fit ends the episode."""
    tool: str = "calculator"
    """The tool the environment calls: a built-in (calculator) or ``package.module:function`` taking
    the call's argument text and returning the output text. It runs in sandboxed workers (the reward
    sandbox: reward.sandbox, reward.worker_memory_mb), never in the trainer."""
    tool_timeout_s: float = 5.0
    """A call running longer is killed (with everything it started) and counted in tool/timeouts (and
    tool/errors)."""
    tool_workers: int = 2
    """Sandboxed tool worker processes on rank 0."""
    max_tool_output_chars: int = 200
    """A longer tool output is cut to this (counted in tool/truncated)."""
    call_open: str = "<calc>"
    call_close: str = "</calc>"
    """Also a stop string of every turn: a turn ends right after its call."""
    result_open: str = "<result>"
    result_close: str = "</result>"
    error_text: str = "error"
    """What the observation shows in place of the output of a call that failed."""

    def validate(self, p: str = "rollout.multiturn") -> None:
        errors = []
        if self.max_turns < 1:
            errors.append(f"{p}.max_turns={self.max_turns} must be >= 1")
        if self.max_total_tokens < 1:
            errors.append(f"{p}.max_total_tokens={self.max_total_tokens} must be >= 1")
        if not 0 < self.tool_timeout_s < float("inf"):
            errors.append(f"{p}.tool_timeout_s={self.tool_timeout_s} must be a finite number of seconds > 0")
        if self.tool_workers < 1:
            errors.append(
                f"{p}.tool_workers={self.tool_workers} must be >= 1 (tools never run in the trainer)"
            )
        if not 1 <= self.max_tool_output_chars <= 4096:
            errors.append(f"{p}.max_tool_output_chars={self.max_tool_output_chars} must be in [1, 4096]")
        module, sep, attr = self.tool.partition(":")
        if self.tool != "calculator" and not (sep and module and attr):
            errors.append(
                f"{p}.tool={self.tool!r} is neither the built-in calculator nor 'package.module:function'"
            )
        for name in ("call_open", "call_close", "result_open", "result_close"):
            if not getattr(self, name):
                errors.append(f"{p}.{name} must be a non-empty string (the documented call format)")
        if errors:
            raise ValueError("\n".join(errors))


@dataclass
class PartialConfig:
    """Continuous generation with partial rollouts (training/partial.py): a pool of in-flight groups is
    advanced in segments; a response left unfinished at an iteration's end continues under the next
    weight version, each token keeping the version that sampled it and its behaviour logprob.
    train.max_staleness then bounds each token's lag: a response whose oldest token lags more is
    regenerated from scratch. Needs (train.max_staleness + 1) * segment_tokens >= rollout.max_new_tokens.
    Off (the default): each iteration generates its batch whole."""

    enabled: bool = False
    """Generate continuously: the rollout phase advances the pool instead of generating a batch whole."""
    segment_tokens: int = 64
    """The most new tokens a response gets per segment (one engine request); between two segments the
    weights may change, so its later tokens may be sampled by a newer version."""
    groups_in_flight: int = 0
    """Groups in the pool (each iteration tops it up with new prompts); 0 = 2 x
    train.prompts_per_iteration."""
    overlap: bool = False
    """With engines in processes of their own (rollout.embedded_process, or rollout.engine=sglang): each
    iteration submits the pool's next segment round before it trains, so the engines generate while the
    trainer trains (training/partial.py); those tokens lag one version more, so it needs
    train.max_staleness * segment_tokens >= rollout.max_new_tokens."""
    one_request: bool = False
    """Each segment round goes to the engines as one request, new and continued responses together (the
    embedded engine prefills them in batches of similar lengths and decodes them as one batch:
    ``SamplingParams.ragged_prefill``; SGLang batches them by itself), instead of two requests where a
    continued response holds more than segment_tokens (the default: the engine pads a request's prompts
    to its longest, and the second request's steps run after the first's). Its rows share one seed."""
    keep_kv: bool = False
    """With rollout.engine=sglang: a weight update keeps the engine's prefix (radix) cache instead of
    flushing it, so a continued response's next segment reuses the KV of its prompt and tokens so far,
    computed under the weights of the moment they were fed, instead of recomputing it (what SGLang's
    in-place pause keeps: NeMo-RL's in-flight weight updates, miles' ``--pause-generation-mode``). Its
    tokens, and new requests whose prompts share a cached prefix, then attend to keys and values up to
    train.max_staleness versions older than the weights that sample them: the cache is flushed at the
    update to version v whenever it may hold KV of a version below v - max_staleness. Each token's
    version is still the one whose logits sampled it and its behaviour logprob the one it was sampled
    from, so the off-policy corrections stay right. Scoring (the mismatch probe) flushes an older cache
    first; evaluation may reuse it like rollouts do."""

    def validate(self, p: str = "rollout.partial") -> None:
        errors = []
        if self.segment_tokens < 1 or self.groups_in_flight < 0:
            errors.append(
                f"{p}.segment_tokens={self.segment_tokens} must be >= 1 and {p}.groups_in_flight="
                f"{self.groups_in_flight} >= 0 (0 = 2 x train.prompts_per_iteration)"
            )
        if not self.enabled:
            for name, what in (
                ("keep_kv", "keeps the KV of continued responses across weight updates"),
                ("one_request", "sends each segment round as one request"),
                ("overlap", "overlaps the segment rounds of partial rollouts"),
            ):
                if getattr(self, name):
                    errors.append(
                        f"{p}.{name}=true without {p}.enabled=true: it {what}; set {p}.enabled=true "
                        f"or {p}.{name}=false"
                    )
        if errors:
            raise ValueError("\n".join(errors))


@dataclass
class SGLangConfig:
    """rollout.engine=sglang: colocated engines (an ``sglang.Engine`` on the trainer's GPUs, or on CPU
    for a CPU job: rollout/sglang/launch.py CPU_SERVER_ARGS) or disaggregated servers."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    """colocated = an sglang.Engine on the trainer's GPUs (memory swapped with the trainer, weights by
    CUDA IPC); disaggregated = running SGLang servers (server_urls) on their own GPUs, weights by NCCL
    broadcast from the trainer's first rank."""
    tp: int = 0
    """GPUs one colocated SGLang engine spans (its tp_size): one engine per this many consecutive
    trainer ranks, led by the first of them; a divisor of the GPUs per node (inside one node) or a
    multiple of it (whole nodes, launched with SGLang's nnodes / node_rank: docs/architecture.md).
    0 = by ``rollout.placement``: per_node a node's GPUs, per_dp_rank one model replica (tp x pp x cp
    GPUs). ``rollout/placement.py`` decides it, for the job and for ``grpo-megatron plan`` alike."""
    ep: int = 0
    """Expert parallelism inside one colocated SGLang engine (its ep_size; must divide tp and the routed
    experts): each engine GPU loads, and the weight sync sends it, the dense weights and experts / ep.
    0 = for a MoE model the largest divisor of both the engine's GPUs and the routed experts (the
    engine's GPUs, usually), 1 for a dense one."""
    server_urls: list[str] = field(default_factory=list)
    """disaggregated: base URLs of the SGLang servers (http://host:port); prompts are split over them."""
    sync_master_addr: str = ""
    """disaggregated: address the servers use to reach the trainer's first rank for the NCCL weight
    group; empty = this host's name."""
    sync_master_port: int = 29650
    """disaggregated: TCP port of that NCCL weight group's rendezvous on the trainer's first rank."""
    request_timeout_s: float = 600.0
    """disaggregated: seconds an HTTP request to a server (and a wait for it to be healthy) may take."""
    routed_experts: bool = True
    """Ask SGLang for each token's routed experts (MoE models only), kept for routing replay."""
    cpu_path: Literal["auto", "torch_native"] = "auto"
    """SGLang engines on CPU: auto = the path SGLang takes on this CPU (intel_amx where the CPU has AMX:
    bf16/fp16 models only; torch_native elsewhere); torch_native = its torch-native path on every CPU
    (an fp32 model on an AMX machine). rollout/sglang/cpu_path.py."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Extra sglang ServerArgs of colocated engines, over ours (e.g. {attention_backend: fa3,
    enable_deterministic_inference: true} for seeded, reproducible sampling)."""

    def validate(self, p: str = "rollout.sglang") -> None:
        errors = []
        if self.tp < 0:
            errors.append(f"{p}.tp={self.tp} must be >= 0 (0: by rollout.placement)")
        if self.ep < 0:
            errors.append(f"{p}.ep={self.ep} must be >= 0 (0: by the engine's GPUs and experts)")
        for key, own in (("tp_size", "tp"), ("ep_size", "ep")):
            if key in self.server_args:
                errors.append(
                    f"{p}.server_args sets {key}: set {p}.{own} instead (the runtime and grpo-megatron plan "
                    "both read it there)"
                )
        bad_urls = [u for u in self.server_urls if not u.startswith(("http://", "https://"))]
        if bad_urls:
            errors.append(
                f"{p}.server_urls has {bad_urls[:3]}: each must be a base URL like http://host:30000"
            )
        if not 0 < self.sync_master_port < 65536:
            errors.append(f"{p}.sync_master_port={self.sync_master_port} must be in 1..65535")
        if self.request_timeout_s <= 0:
            errors.append(f"{p}.request_timeout_s={self.request_timeout_s} must be > 0")
        if errors:
            raise ValueError("\n".join(errors))


@dataclass
class RecoveryConfig:
    """Lost engines (rollout/recovery.py): when an engine counts as lost, and how many are restarted in
    place per run (per launch of the job)."""

    max_restarts: int = 0
    """Engines lost during a rollout, a weight sync or the mismatch probe (exited, stopped, or silent
    past ``health_timeout_s``) that are restarted in place per run: each is started again, given the
    current weights and its share of the batch generated again (rollout/recovery.py:
    ``EngineRecovery``); one more loss ends the run naming the engine, rank, host and its log's tail.
    0: the first loss ends it. Engine processes (rollout.embedded_process=true) and colocated SGLang
    engines (a lost SGLang engine is shut down and started again, whole, in its leader's process, and
    every GPU of it resynced; an engine across nodes restarts every node's part at a fresh address)."""
    health_timeout_s: float = 120.0
    """An engine process awaited for a result that sends nothing (no reply, no heartbeat: it beats every
    eighth of this, at most every 10 s, while it generates) for this long is lost (a stopped process
    counts). A colocated SGLang engine: a process of it stopped (state T) this long while a generation
    is awaited is lost (a dead one at once: SGLang's watchdog notices within a second), and so is one
    alive that leaves a state request unanswered this long (a hung scheduler: the wait's
    ``SchedulerProbe``, rollout/sglang/watch.py)."""

    def validate(self, p: str = "rollout.recovery") -> None:
        errors = []
        if self.max_restarts < 0:
            errors.append(
                f"{p}.max_restarts={self.max_restarts} must be >= 0 (0: a lost engine ends the run)"
            )
        if not self.health_timeout_s > 0:
            errors.append(f"{p}.health_timeout_s={self.health_timeout_s} must be > 0 (120 is a good start)")
        if errors:
            raise ValueError("\n".join(errors))


class ResponseBudget(NamedTuple):
    """``RolloutConfig.response_budget``: the field that bounds a response, and its tokens."""

    field: str
    tokens: int


@dataclass
class RolloutConfig:
    """Generation settings for the rollout engine."""

    engine: Literal["embedded", "sglang"] = "embedded"
    """embedded = generate with the megatron policy itself (CPU and small runs);
    sglang = SGLang engines fed with the trainer's weights (colocated on the trainer's GPUs, or on CPU for a
    CPU job: rollout/sglang/launch.py CPU_SERVER_ARGS; or disaggregated servers)."""
    n_samples_per_prompt: int = 8
    """Group size G of GRPO: responses sampled per prompt, compared with each other."""
    temperature: float = 1.0
    """Sampling temperature; 1.0 samples from the policy itself, as the GRPO objective assumes."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0: off). With top_p < 1, top_k > 0 or min_p > 0 the engine samples from
    the truncated, renormalised distribution and reports its logprobs, and every trainer pass computes
    the logprobs of the same truncation at its own weights, so the importance ratio stays that of the
    distribution sampled (``algorithm/truncation.py``). The embedded and policy engines only: SGLang
    reports the full distribution's logprobs."""
    top_k: int = -1
    """Sample from the k most likely tokens (-1: off); see top_p."""
    min_p: float = 0.0
    """Keep tokens with at least min_p times the most likely one's probability (0: off); see top_p."""
    max_new_tokens: int = 1024
    """Longest response generated per sample."""
    placement: Literal["per_dp_rank", "per_node", "per_rank"] = "per_dp_rank"
    """Where engines live: one per data-parallel replica (each serves its own prompts), one per node, or
    (embedded only) one on every rank: more engines to spread the prompts over, each fed in parallel."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory an sglang engine may use for weights and KV cache (its mem_fraction_static)."""
    sync_bucket_mb: int = 512
    """Weight sync streams the trainer's weights to every engine at once in buckets of about this many
    MiB (bigger = fewer, larger messages; a rank's transfer buffers stay within about two buckets)."""
    sync_rounds_in_flight: int = 2
    """Weight-sync transfer rounds (a quarter bucket each) posted ahead of the one being waited on: more
    overlaps more of the transfer with packing and assembly, at a quarter bucket of memory per round."""
    weight_dtype: Literal["model", "fp8"] = "model"
    """What the engines hold their weights in. model = the trained model's model.dtype (the sync sends
    exactly the trainer's weights; an FP8 checkpoint's engines start unquantized). fp8 = block-wise
    FP8 (e4m3, 128 x 128 blocks, ``weight_scale_inv`` as DeepSeek-V3's published checkpoints hold them,
    dynamic activation scales: bridge/fp8.py): SGLang engines (colocated) start quantized on dummy
    weights and every sync quantizes the trainer's weights on the way, on the device they are on, and
    sends weight + scales (norms, routers, embeddings and the output head go as they are). About half
    the engines' weight memory, for a trainer/engine gap the off-policy correction absorbs
    (algorithm.off_policy.correction=auto takes icepop with it). On CPU SGLang serves FP8 only on its
    intel_amx path (a CPU with AMX)."""
    engine_device: Literal["auto", "cpu"] = "auto"
    """Where an embedded engine runs: auto = this rank's device (its GPU, else CPU); cpu = always CPU."""
    true_on_policy: bool = False
    """The trainer's own megatron-core model generates (training/policy_engine.py: every rank together,
    each data-parallel replica its prompts), with batch-invariant numerics in it and in every trainer
    pass (models/batch_invariant.py): each behaviour logprob then equals, bit for bit, the trainer's
    logprob of that token at the same weights, so the first mini-batch's importance ratio is exactly 1
    and every ``mismatch/*`` metric exactly 0, MoE routes agreeing without replay. Costs a full forward
    of every prefix per decoded token (no KV cache). Needs rollout.engine=embedded in this process, no
    asynchronous or partial rollouts (rollout.partial), PP 1, CP 1, TP at most 2
    (``config/validation.py``)."""
    embedded_process: bool = False
    """Run each embedded engine in a process of its own, on CPU (rollout/engine_process.py), so that it
    generates while the trainer trains: the loop becomes a producer of scored groups and a consumer
    that trains (training/groups.py: GroupProducer), ahead by at most train.max_staleness weight versions."""
    embedded_process_threads: int = 1
    """torch threads of each engine process."""
    embedded_max_batch_rows: int = 0
    """Rows (prompts x samples) an embedded engine decodes at once; 0 = all of a generate call together."""
    probe_batch: int = 4
    """Sequences of the fixed batch on which the trainer and the engines are compared after a weight
    sync (the mismatch probe, every ``probe_interval`` iterations); 0 disables the probe."""
    probe_interval: int = 5
    """Iterations between mismatch probes (a probe costs about a tenth of a demo iteration): the sync
    of every ``probe_interval``-th iteration probes, and so do the run's first sync (its start or
    resume) and its last iteration; 1 = after every sync."""
    probe_max_abs: float = 5.0
    """Stop the run (a clear error, after the sync that showed it) when the mismatch probe's largest
    |trainer - engine| logprob difference (``mismatch/probe_abs_diff_max``) exceeds this many nats;
    0 = never stop. The default sits far above honest bf16 noise (seen: 0.07 on an H200, 0.15 on
    CPU's AVX2 kernels) and MoE routing flips, and below an engine serving wrong weights (e.g. bf16
    tensors cast into float8 parameters beside stale scales), which misjudges most tokens by several
    nats (about ln(vocab) at a token the trainer is sure of)."""
    probe_max_mean: float = 0.5
    """Stop the run likewise when the probe's mean |trainer - engine| logprob difference
    (``mismatch/probe_abs_diff_mean``) exceeds this many nats; 0 = never. Honest engines sit far below
    it, FP8 ones included (rollout.weight_dtype=fp8: 0.21 mean, 1.7 max on the tiny test model of
    hidden size 128, whose blocks' rounding errors barely average out, tests/test_fp8_rollout.py;
    bf16: 0.0005-0.01), while an engine serving wrong weights is off on most tokens (the same model's
    float8 weights that lost their scales: 1.6 mean)."""
    multiturn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-using episodes (off by default)."""
    partial: PartialConfig = field(default_factory=PartialConfig)
    """Continuous generation with partial rollouts (off by default)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """engine=sglang: how its engines run (colocated width and EP, or disaggregated servers)."""
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """Lost engines: when one counts as lost, and how many are restarted in place."""
    dump_dir: str = ""
    """Write each iteration's rollout batch, as the trainer takes it, into this directory (rank 0;
    safetensors + JSON, nothing pickled; training/rollout_dump.py): prompt and response token ids,
    behaviour logprobs, rewards, weight versions, engine routes under routing replay r3, the rollout
    metrics. slime's --save-debug-rollout-data. Empty = no dump."""
    replay_dir: str = ""
    """Train from a dump (``dump_dir`` of an earlier run) instead of generating: no engine starts, no
    weight sync, no held-out evaluation; each iteration's scored groups are read from the dump. On the
    dumped run's layout and config the losses and gradient norms equal its own bit for bit. slime's
    --load-debug-rollout-data with --debug-train-only. Empty = generate."""

    @property
    def truncation(self) -> Truncation:
        """The sampler's top-k / top-p / min-p (``algorithm/truncation.py``)."""
        return Truncation(self.top_k, self.top_p, self.min_p)

    @property
    def response_budget(self) -> ResponseBudget:
        """The longest response and the field that sets it: a multi-turn episode's
        ``multiturn.max_total_tokens``, else ``max_new_tokens``."""
        if self.multiturn.enabled:
            return ResponseBudget("rollout.multiturn.max_total_tokens", self.multiturn.max_total_tokens)
        return ResponseBudget("rollout.max_new_tokens", self.max_new_tokens)

    def restart_errors(self) -> list[str]:
        """Engines restarted in place (issue 41): which engines can (the section checks its own values)."""
        errors: list[str] = []
        bound = f"rollout.recovery.max_restarts={self.recovery.max_restarts}"
        if self.recovery.max_restarts > 0 and not (self.embedded_process or self.engine == "sglang"):
            errors.append(
                f"{bound}: engines are restarted in place as engine processes "
                "(rollout.embedded_process=true) or colocated SGLang engines; in-process embedded "
                "engines cannot be lost alone: set one of those, or rollout.recovery.max_restarts=0"
            )
        if self.recovery.max_restarts > 0 and self.engine == "sglang" and self.sglang.mode != "colocated":
            errors.append(
                f"{bound}: disaggregated SGLang servers are not started by the job, so it cannot "
                "restart them; set rollout.recovery.max_restarts=0 (a failed server goes through its "
                "own restart hook and a full sync)"
            )
        return errors

    def sglang_width(self, gpus_per_node: int, replica: int) -> tuple[int, str]:
        """The GPUs of each colocated SGLang engine, and why: ``sglang.tp`` when set, else by ``placement``
        (per_node: a node's GPUs; otherwise one model replica, ``replica`` = tp x pp x cp).
        ``rollout/placement.py:decide_placement`` checks that it tiles the nodes."""
        if self.sglang.tp > 0:
            return self.sglang.tp, f"rollout.sglang.tp={self.sglang.tp}"
        if self.placement == "per_node":
            return gpus_per_node, f"rollout.placement=per_node: the {gpus_per_node} GPUs of a node"
        return replica, f"rollout.placement={self.placement}: one model replica (tp x pp x cp = {replica})"

    def validate(self) -> None:
        errors = []
        for section in (self.multiturn, self.partial, self.sglang, self.recovery):
            try:
                section.validate()
            except ValueError as e:
                errors += str(e).splitlines()
        if self.n_samples_per_prompt < 2:
            errors.append(
                f"rollout.n_samples_per_prompt={self.n_samples_per_prompt} must be >= 2: GRPO's advantage "
                "compares samples of the same prompt (8 or 16 is usual)"
            )
        if self.temperature <= 0:
            errors.append(f"rollout.temperature={self.temperature} must be > 0 (1.0 samples from the policy)")
        if not 0 < self.top_p <= 1 or not 0 <= self.min_p < 1 or self.top_k == 0 or self.top_k < -1:
            errors.append(
                f"rollout.top_p={self.top_p}, top_k={self.top_k}, min_p={self.min_p}: top_p must be in "
                "(0, 1] (1: off), top_k -1 (off) or >= 1, min_p in [0, 1) (0: off)"
            )
        if self.truncation.active and self.engine == "sglang":
            errors.append(
                f"rollout.top_p={self.top_p}, top_k={self.top_k}, min_p={self.min_p} with "
                "rollout.engine=sglang: SGLang reports the logprobs of the full distribution, not of the "
                "truncated one it samples from, which biases the importance ratio; use "
                "rollout.engine=embedded, or turn truncation off (rollout.temperature sharpens sampling)"
            )
        if self.max_new_tokens < 1:
            errors.append(f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not 0 < self.gpu_memory_utilization < 1:
            errors.append(
                f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1); "
                "leave room for the trainer when colocated (0.5 is a safe start)"
            )
        if self.sync_bucket_mb < 1:
            errors.append(
                f"rollout.sync_bucket_mb={self.sync_bucket_mb} must be >= 1 (MiB per weight-sync bucket; "
                "512 is a good start)"
            )
        if self.sync_rounds_in_flight < 1:
            errors.append(
                f"rollout.sync_rounds_in_flight={self.sync_rounds_in_flight} must be >= 1 (2 is a good start)"
            )
        if self.placement == "per_rank" and self.engine != "embedded":
            errors.append(
                "rollout.placement=per_rank is for embedded engines only: SGLang engines use per_dp_rank or "
                "per_node (rollout.sglang.tp GPUs each)"
            )
        if self.embedded_process and self.engine != "embedded":
            errors.append(
                f"rollout.embedded_process=true is for rollout.engine=embedded (it is {self.engine}): "
                "SGLang engines already run in processes of their own"
            )
        errors += self.restart_errors()
        if self.embedded_process_threads < 1:
            errors.append(f"rollout.embedded_process_threads={self.embedded_process_threads} must be >= 1")
        if self.embedded_max_batch_rows < 0:
            errors.append(
                f"rollout.embedded_max_batch_rows={self.embedded_max_batch_rows} must be >= 0 "
                "(0 = decode all rows of a generate call at once)"
            )
        if self.probe_interval < 1:
            errors.append(
                f"rollout.probe_interval={self.probe_interval} must be >= 1 (1 probes after every sync)"
            )
        for name in ("probe_max_abs", "probe_max_mean"):
            if not getattr(self, name) >= 0:
                errors.append(f"rollout.{name}={getattr(self, name)} must be >= 0 (0 never stops the run)")
        if self.probe_batch < 0:
            errors.append(
                f"rollout.probe_batch={self.probe_batch} must be >= 0 (0 disables the mismatch probe)"
            )
        if self.engine == "sglang" and self.probe_batch > 0 and self.temperature != 1.0:
            errors.append(
                f"rollout.temperature={self.temperature} with rollout.engine=sglang and rollout.probe_batch="
                f"{self.probe_batch}: SGLang scores sequences (the mismatch probe) from unscaled logits, "
                "i.e. at temperature 1 only; sample at temperature 1.0, or set rollout.probe_batch=0"
            )
        if (
            self.dump_dir
            and self.replay_dir
            and Path(self.dump_dir).resolve() == Path(self.replay_dir).resolve()
        ):
            errors.append(
                f"rollout.dump_dir and rollout.replay_dir are both {self.dump_dir}: a replay would write over "
                "the dump it reads; choose another rollout.dump_dir (or leave it empty)"
            )
        errors += self._sglang_errors()
        if errors:
            raise ValueError("\n".join(errors))

    def _sglang_errors(self) -> list[str]:
        """The SGLang rules that read the rest of the section (the engine)."""
        errors = []
        if self.engine == "sglang" and self.sglang.mode == "disaggregated" and not self.sglang.server_urls:
            errors.append(
                "rollout.sglang.mode=disaggregated needs rollout.sglang.server_urls: the base URLs of running "
                "SGLang servers (python -m sglang.launch_server ...), e.g. [http://node1:30000]"
            )
        if self.weight_dtype == "fp8" and (self.engine != "sglang" or self.sglang.mode != "colocated"):
            where = f"rollout.engine={self.engine}" + (
                f" with rollout.sglang.mode={self.sglang.mode}" if self.engine == "sglang" else ""
            )
            errors.append(
                f"rollout.weight_dtype=fp8 with {where}: FP8 weights are served by colocated SGLang engines "
                "(started quantized by the job, fed weight + scales by the sync); use rollout.engine=sglang "
                "with rollout.sglang.mode=colocated, or rollout.weight_dtype=model"
            )
        return errors
