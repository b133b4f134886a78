"""The rollout engine interface (modelled on SGLang's ``Engine``), shared by every engine module.

One module per engine implements ``RolloutEngine``: ``rollout/embedded.py`` (a transformers model,
the default on CPU) and ``rollout/sglang/engine.py`` (SGLang, on GPUs or its CPU engine). The trainer
never talks to an engine directly; it goes through the fleet (``rollout/fleet.py``), which places
engines on ranks, scatters prompts, gathers results in order and streams weights into them.

Logprob convention (shared with the trainer, ``models/logprobs.py``): the logprob of a sampled token
is ``log_softmax(logits / temperature)`` at that token, before top-k / top-p filtering, i.e. the
distribution the trainer's forward computes with the same temperature.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from grpo_megatron.algorithm.truncation import Truncation

if TYPE_CHECKING:
    from grpo_megatron.models.config import ModelConfig
    from grpo_megatron.rollout.config import RolloutConfig

# One bucket of the weight stream: (Hugging Face checkpoint name, full tensor) pairs.
Bucket = Sequence[tuple[str, torch.Tensor]]
# What a weight sync will deliver, known from the export plan before any byte moves: (HF name, shape, dtype).
Manifest = Sequence[tuple[str, tuple[int, ...], torch.dtype]]

MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]
ALL_MEMORY_TAGS: tuple[MemoryTag, ...] = ("weights", "kv_cache", "cuda_graph")


class EngineLost(RuntimeError):
    """An engine lost while the run needs it (issue 41): an engine process that exited, stopped
    answering past its health deadline, or broke its pipe; an SGLang engine whose process died or
    stopped (``rollout.recovery.max_restarts`` > 0). Which (trainer ``rank``, ``host``), ``why``, and
    the last lines of its log: the fleet restarts it in place (rollout/fleet.py) or names it."""

    def __init__(
        self, rank: int, host: str, why: str, log_tail: str, log_path: str, what: str = "engine process"
    ) -> None:
        self.rank, self.host, self.why, self.log_tail, self.log_path = rank, host, why, log_tail, log_path
        super().__init__(
            f"the {what} of rank {rank} on {host} was lost: {why}; the last lines of its log "
            f"({log_path}):\n{log_tail}"
        )


LOG_TAIL_LINES = 20
"""Lines of an engine's log quoted when it is lost or fails to start."""


_ERROR_LINE = re.compile(r"^\s*((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?)$")
"""A traceback's last line: ``NotImplementedError: "rmsnorm_kernel" not implemented for 'Float'``."""


def last_error_line(path: Path | None) -> str | None:
    """The last exception line (a traceback's last line) in an engine's log at ``path``, or None."""
    try:
        lines = path.read_text(errors="replace").splitlines() if path is not None else []
    except OSError:
        return None
    for line in reversed(lines):
        match = _ERROR_LINE.match(line)
        if match:
            return match.group(1).strip()
    return None


def log_tail(path: Path | None, lines: int = LOG_TAIL_LINES, indent: str = "") -> str:
    """The last ``lines`` lines of an engine's log at ``path`` (Python's repeated ``UserWarning``
    lines left out), each prefixed with ``indent``: what ``EngineLost`` and the start errors quote."""
    try:
        if path is None:
            raise OSError("no log")
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"{indent}(unreadable: {exc})"
    kept = [
        line for line in text if "UserWarning" not in line and not line.strip().startswith("warnings.warn")
    ]
    return "\n".join(f"{indent}{line}" for line in kept[-lines:]) or f"{indent}(empty)"


@dataclass(frozen=True)
class EngineSpec:
    """What the engines of a job are built from: their config sections and the job settings they read
    (the wiring, ``training/job.py:engine_spec``, fills it from the job config)."""

    rollout: RolloutConfig
    model: ModelConfig
    """The policy's model (``hf_path``, ``dtype``, ``hf_overrides``): the engines serve the same one."""
    seed: int
    """``train.seed``: an SGLang engine's sampling seed (a colocated engine adds its leader's rank)."""
    tokenizer_path: str | None = None
    """``data.tokenizer_path`` when set; None = the model's directory."""
    log_dir: Path | None = None
    """Where the engines' processes write their logs: ``<logging.run_dir>/sglang`` for colocated
    SGLang engines, ``<logging.run_dir>/engines`` for embedded engine processes; None = the system's
    temporary directory (an engine process: its own folder)."""
    record_routes: bool = True
    """Whether the engines are built to report MoE routes (``Completion.routed_experts``):
    ``algorithm.routing_replay=r3``, the one mode that replays them, decided once in
    ``training/job.py:engine_spec``. The embedded engine records them, an SGLang engine is started with
    ``enable_return_routed_experts``, and the fleet (``RolloutFleet.routes``) tells the training rollouts
    to ask for them (``SamplingParams.routes``); an embedded engine's scoring reports them always."""
    offload_trainer: bool = False
    """``train.offload_trainer``: part of the rollout placement's phase table (rollout/placement.py)."""
    max_staleness: int = 0
    """``train.max_staleness``: above 0 the engines generate while the trainer trains (part of the
    placement's phase table: nothing swaps)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the responses of one ``generate`` call (the same for every prompt in it, but for
    ``max_new_tokens_each``)."""

    n: int = 1
    """Responses per prompt (GRPO's group size G)."""
    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1.0 disables it."""
    top_k: int = -1
    """-1 disables it."""
    min_p: float = 0.0
    """0 disables it. With any of the three the engine samples from, and reports the logprobs of, the
    truncated, renormalised distribution (``algorithm/truncation.py``)."""
    max_new_tokens: int = 128
    max_new_tokens_each: tuple[int, ...] | None = None
    """Each prompt's own limit, in prompt order (at most ``max_new_tokens``, at least 1): the turns of
    multi-turn episodes, whose budgets left differ (rollout/multiturn.py); None = ``max_new_tokens``
    for every prompt. ``budgets`` reads it."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a response ends after any of these tokens (it is kept in the response)."""
    stop_strings: tuple[str, ...] = ()
    """Generation ends once the decoded response contains one of these (kept in the response)."""
    seed: int | None = None
    """Seeds the sampler: the same seed, prompts and weights give the same responses."""
    greedy: bool = False
    """Take the argmax token (evaluation); logprobs still follow the temperature convention."""
    routes: bool = False
    """Report each completion's MoE routes (``Completion.routed_experts``) and have the fleet hold them
    for ``RolloutFleet.deliver_routes``: the training rollouts of a job that replays the engine's routes
    (``EngineSpec.record_routes``, ``algorithm.routing_replay=r3``). An engine built without route
    recording reports none; an SGLang engine is asked for them only in such requests."""
    ragged_prefill: bool = False
    """The embedded engine (n=1, no routes): prefill prompts of very different lengths in batches of
    similar lengths (a new batch where a prompt is over twice its batch's shortest), then decode every
    row as one batch, instead of left-padding every prompt to the longest for one prefill: a continuous
    round's new responses beside long continued ones (``rollout.partial.one_request``). Rows are then
    sampled in length order. SGLang batches ragged prompts by itself and ignores it."""

    @property
    def truncation(self) -> Truncation:
        return Truncation(self.top_k, self.top_p, self.min_p)

    def budgets(self, num_prompts: int) -> list[int]:
        """Each of ``num_prompts`` prompts' ``max_new_tokens`` (``max_new_tokens_each``, else the same)."""
        if self.max_new_tokens_each is None:
            return [self.max_new_tokens] * num_prompts
        each = list(self.max_new_tokens_each)
        if len(each) != num_prompts or not all(1 <= b <= self.max_new_tokens for b in each):
            raise ValueError(
                f"SamplingParams.max_new_tokens_each has {len(each)} limits for {num_prompts} prompts "
                f"(each must be in [1, max_new_tokens={self.max_new_tokens}]): {each[:8]}"
            )
        return each

    def sliced(self, start: int, end: int) -> SamplingParams:
        """These params for prompts ``start:end`` of the call (their own limits)."""
        if self.max_new_tokens_each is None:
            return self
        return dataclasses.replace(self, max_new_tokens_each=self.max_new_tokens_each[start:end])


@dataclass
class Completion:
    """One sampled response."""

    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each sampled token, ``len(logprobs) == len(token_ids)``."""
    finish_reason: Literal["stop", "length"]
    """stop = a stop token or string ended it; length = it reached max_new_tokens."""
    routed_experts: torch.Tensor | None = None
    """MoE models: the experts each token was routed to, for routing replay and its metrics. An
    integer tensor ``[moe_layers, len(prompt) + len(response) - 1, top_k]``: MoE layers in model
    order (dense layers, e.g. DeepSeek-V3's first ``first_k_dense_replace``, are skipped), then every
    token that was an input of the engine's forward (prompt and response; the last sampled token
    never is), i.e. exactly the trainer's input positions (``training/batching.py``), then the
    top-k expert ids in the engine's order (compare them as sets). None: a dense model, or an engine
    that does not report routes; also every completion the fleet returns (routes travel separately:
    ``route_id``)."""
    loss_mask: list[int] | None = None
    """Multi-turn trajectories (rollout/multiturn.py): 1 at a token the engine sampled, 0 at an
    observation token (appended by the environment, with logprob 0.0 and never trained on); None = every
    token was sampled (a single-turn response)."""
    weight_version: int = -1
    """The weight version that sampled it, stamped by the engine (``RolloutEngine.submit``: its
    ``weight_version`` when the batch was submitted; an engine process: the version it served the
    request with); the fleet only carries it. The asynchronous loop's staleness is the trainer's
    version minus this."""
    token_versions: list[int] | None = None
    """Per response token, the weight version that sampled it (``len == len(token_ids)``): a response
    continued across weight updates (``rollout.partial.enabled``, training/partial.py) mixes versions,
    and each of its ``logprobs`` is its token's under that token's version; ``weight_version`` is then
    its oldest token's. None: every token has ``weight_version`` (``versions`` reads either)."""
    route_id: int | None = None
    """Set by ``RolloutFleet.generate`` for ``SamplingParams.routes``: the id under which the engine's rank holds
    this completion's routes until ``RolloutFleet.deliver_routes``; None: no routes held."""
    payload_id: int | None = None
    """Set by ``RolloutFleet.generate(payload="owners")``: the id under which the engine's rank holds
    this completion's tokens, logprobs and loss mask until ``RolloutFleet.deliver_completions``."""
    sizes: tuple[int, int] | None = None
    """(response tokens, sampled tokens) of a completion whose tokens, logprobs and loss mask are not
    on this rank (``RolloutFleet.generate`` with ``payload`` other than "everywhere": they are empty
    here); None: they are here."""
    cached_tokens: int | None = field(default=None, compare=False)
    """Prompt tokens whose KV the engine took from its prefix cache instead of computing them (SGLang's
    ``meta_info["cached_tokens"]``), as the engine's own adapter returns it; None: not reported (the
    embedded engine; a completion that crossed ranks: the fleet does not carry it)."""

    @property
    def num_tokens(self) -> int:
        """Response tokens, whether or not they are on this rank."""
        return len(self.token_ids) if self.sizes is None else self.sizes[0]

    @property
    def versions(self) -> list[int]:
        """Each response token's weight version (``token_versions``, else ``weight_version`` each)."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.weight_version] * self.num_tokens

    @property
    def num_sampled(self) -> int:
        """Response tokens the engine sampled (the loss is taken there): all but a multi-turn
        trajectory's observation tokens."""
        if self.sizes is not None:
            return self.sizes[1]
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)


def stamped(groups: list[list[Completion]], version: int) -> list[list[Completion]]:
    """``groups`` with ``version`` as the ``weight_version`` of every completion that has none (-1):
    what an engine's ``submit`` returns (the version its batch was submitted under)."""
    for group in groups:
        for c in group:
            if c.weight_version < 0:
                c.weight_version = version
    return groups


class WeightSink(abc.ABC):
    """What the fleet's weight sync feeds on a rank, and what engine loss asks of it
    (``rollout/recovery.py``): every ``RolloutEngine``, and on the other GPUs of an engine that spans
    several (a colocated SGLang engine) the object that loads that GPU's share
    (``rollout/sglang/member.py:SGLangSyncMember``). Defaults for all but the manifest check, the load
    and shutdown."""

    weight_version: int = -1
    """Version of the weights last committed by ``update_weights``; -1 = never updated."""
    sync_group_ranks: tuple[int, ...] = ()
    """Trainer ranks that receive this engine's weights together, one per engine GPU in the engine's
    TP-rank order (this rank first); empty = this rank alone. Each calls ``update_weights`` as often
    as the others (the fleet makes their stream yield every round)."""
    life: int = 0
    """How often this part was restarted in place (``restart``): a request submitted in an earlier life
    went with the lost processes."""

    def weight_needs(self) -> Callable[[str], bool] | None:
        """Which HF tensors this rank receives, by name (picklable: every rank plans with it); None =
        every tensor. Default: None."""
        return None

    def bind_sync_group(self, group: Any) -> None:
        """Take the process group of ``sync_group_ranks`` (made collectively by the fleet). Default:
        unused."""
        return None

    @abc.abstractmethod
    def check_manifest(self, manifest: Manifest, version: int) -> list[str]:
        """Phase one of the fleet's all-or-nothing weight sync (``RolloutEngine.check_manifest``)."""

    @abc.abstractmethod
    def update_weights(self, bucket: Bucket, *, version: int, last: bool) -> None:
        """Take one bucket of the weight stream (``RolloutEngine.update_weights``)."""

    def load_target(self, name: str) -> torch.Tensor | None:
        """Where the accepted version's tensor ``name`` goes (a view of the live weights), for the
        transport to receive it straight there (then ``update_weights`` gets that very view and has
        nothing to copy); None = no such place, the tensor comes through ``update_weights``. Valid
        only between an accepted ``check_manifest`` and the closing ``update_weights``; the weights
        are partial from the first call on. Default: None (SGLang loads through its own loader)."""
        return None

    def abort_update(self, version: int) -> None:
        """Drop what was staged or accepted for ``version`` (another engine rejected it): the engine
        keeps its previous weights and version. Nothing staged: nothing to drop."""
        return None

    # -- engine loss (rollout/recovery.py)

    def check_alive(self) -> None:
        """Raise ``EngineLost`` naming this part if it is lost (a process of it dead, stopped or hung);
        cheap (the process table). The recovery asks every part when some engine was lost, so that
        each loss is named with its own log. Default: always alive (an engine inside this process)."""
        return None

    def restart(self, address: str | None = None) -> None:
        """Start this lost part again in place, same spec and width (``life`` + 1): what is left of it
        is stopped first; it comes back with its checkpoint's (or dummy) weights and the recovery
        resyncs it. ``address``: where the parts of an engine across nodes meet again (the leader's
        ``restart_address``); None elsewhere. Default: refused (an engine that cannot be lost alone)."""
        raise RuntimeError(f"{type(self).__name__} cannot be restarted in place")

    def restart_address(self) -> str | None:
        """Where the parts of this engine meet when they restart (an engine across nodes: its first
        node's host with a port free now); None: no address needed. Default: None."""
        return None

    def stop_watching(self) -> None:
        """From now on the deaths of this part's processes are expected (a run that ends in order is
        about to shut every engine down): they no longer end the rank. Default: nothing watched."""
        return None

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine (or this part of it) and free everything it holds."""


class RolloutEngine(WeightSink):
    """A generator of responses that takes Hugging Face-named weights from the trainer."""

    collective: bool = False
    """Every rank's engine takes part in every call (the policy engine of ``rollout.true_on_policy``:
    its decode steps are collectives), so the fleet calls it with an empty share too."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt (token ids), as ``[prompt][sample]``."""

    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> Callable[[], list[list[Completion]]]:
        """Start ``generate``; calling the result returns its completions. An engine in a process of
        its own (rollout/engine_process.py) returns at once and generates while the caller works on;
        default: generate now (completions stamped with this ``weight_version``)."""
        done = stamped(self.generate(prompts, params), self.weight_version)
        return lambda: done

    @abc.abstractmethod
    def update_weights(self, bucket: Bucket, *, version: int, last: bool) -> None:
        """Take one bucket of the weight stream. ``last=True`` marks the final bucket of ``version``.
        Without an accepted manifest (``check_manifest``) the engine stages the buckets and only on
        ``last`` checks them (every expected name present, shapes and dtypes right) and commits: a bad
        name or shape raises before anything is applied. After ``check_manifest`` accepted ``version``
        the engine may load each bucket as it arrives; the tensors may be borrowed views of the
        sender's buffers, valid only during the call (copy, never keep them)."""

    def check_manifest(self, manifest: Manifest, version: int) -> list[str]:
        """Phase one of the fleet's all-or-nothing weight sync, before any byte moves: every problem the
        engine would have with ``version`` made of exactly the tensors ``manifest`` lists (HF name,
        shape, dtype), each naming its tensors; empty = accepted. An engine that accepts must then
        take the stream's buckets (``update_weights(..., last=False)``, then ``last=True``) for this
        version and may write them straight into its live weights (the fleet calls ``abort_update``
        instead if another engine rejected). Default: accept (engines that cannot judge from metadata,
        e.g. SGLang, report problems on the bucket that shows them)."""
        return []

    @abc.abstractmethod
    def score(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> list[list[float]]:
        """Teacher-forced logprobs of each sequence's tokens after its prompt (the mismatch probe)."""

    def score_with_routes(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> tuple[list[list[float]], list[torch.Tensor] | None]:
        """``score`` plus each sequence's routes in the ``Completion.routed_experts`` layout
        (``[moe_layers, len(seq) - 1, top_k]``); None where the engine does not report them."""
        return self.score(sequences, prompt_lens, temperature), None

    def release_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        """Free device memory of ``tags`` (None = all). A no-op where there is nothing to free."""
        return None

    def resume_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        """Re-allocate what ``release_memory`` freed (weights come back with the next update)."""
        return None

    def flush_cache(self) -> None:
        """Drop cached prefixes / KV state (after a weight update)."""
        return None

    def shutdown(self) -> None:
        """Stop the engine and free everything it holds."""
        return None


@dataclass
class EngineParts:
    """The parts of the fleet's engines this rank holds, shared by the fleet's rooms (its weight sync
    feeds ``sink``; its engine recovery asks and restarts both): ``engine`` (an engine it drives) or
    ``member`` (another GPU of an engine led from another rank), or neither."""

    engine: RolloutEngine | None = None
    member: WeightSink | None = None

    @property
    def sink(self) -> WeightSink | None:
        """What this rank's weight sync feeds: its engine, else its member, else None."""
        return self.engine if self.engine is not None else self.member
