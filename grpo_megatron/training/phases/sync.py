"""Sync phase (``time/sync``): the trainer's weights stream into the engines, then the mismatch probe
compares the trainer's and the engines' logprobs on one fixed batch. With train.offload_trainer the
colocated memory moves around the stream (training/offload.py:ColocatedMemory)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.models.routing import RoutingPass, reduce_routing_stats
from grpo_megatron.training.batching import pad_routes
from grpo_megatron.training.forward_backward import MicroBatch, forward_logprobs
from grpo_megatron.training.offload import merge_memory_metrics

if TYPE_CHECKING:
    from grpo_megatron.data import PromptRecord
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.offload import ColocatedMemory


@dataclass
class ProbeBatch:
    """A fixed batch for the mismatch probe: token sequences and the length of each one's prompt (the
    probe compares the tokens after it)."""

    sequences: list[list[int]] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)


def probe_due(iteration: int, interval: int, last_iteration: int) -> bool:
    """Whether iteration ``iteration``'s sync runs the mismatch probe: every ``interval``-th, and the
    last (``rollout.probe_interval``; the run's first sync, before iteration 1, always probes)."""
    return iteration % interval == 0 or iteration == last_iteration


def probe_batch(
    prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[Sequence[int]]], size: int
) -> ProbeBatch:
    """The first ``size`` (prompt + continuation) sequences, ``continuations[i]`` being prompt ``i``'s
    (a rollout's responses, or a reference answer); empty continuations are skipped."""
    probe = ProbeBatch()
    for prompt, group in zip(prompts, continuations, strict=True):
        for continuation in group:
            if len(probe.sequences) == size:
                return probe
            if continuation:
                probe.sequences.append(list(prompt) + list(continuation))
                probe.prompt_lens.append(len(prompt))
    return probe


def answer_probe(records: Sequence[PromptRecord], tokenizer: Any, eos_id: int, size: int) -> ProbeBatch:
    """The trainer's probe: the first ``size`` prompts of ``records`` (held-out, else training) followed
    by their reference answers and EOS, so every run and every resume probes the same tokens."""
    records = records[:size]
    answers = [[[*tokenizer(str(r.answer), add_special_tokens=False)["input_ids"], eos_id]] for r in records]
    return probe_batch([r.prompt_ids for r in records], answers, size)


def mismatch_probe(
    model: torch.nn.Module,
    fleet: RolloutFleet,
    ps: ParallelState,
    probe: ProbeBatch,
    *,
    vocab_size: int,
    temperature: float,
) -> dict[str, float]:
    """Collective: trainer ``forward_logprobs`` vs every engine's ``score`` on ``probe``, over the tokens
    after each prompt; max and mean absolute difference over all engines (an empty probe, e.g.
    rollout.probe_batch=0, gives no metrics). For an MoE engine that reports routes, the trainer's pass
    also counts how often its experts differ from the first engine's (``routing/probe_disagreement``),
    and a copy of the batch replays those routes (``mismatch/probe_replay_*``, models/routing.py): both
    in one forward, the copy's rows after the plain ones (a forward's collectives cost more than its
    rows here)."""
    sequences, prompt_lens = probe.sequences, probe.prompt_lens
    if not sequences:
        return {}
    scored, routes = fleet.score(sequences, prompt_lens, temperature)  # lost engines: restarted
    if ps.cp > 1:  # routes are not split over context-parallel ranks (the config refuses replay there)
        routes = None
    length = max(len(s) for s in sequences)
    copies = 1 if routes is None else 2  # plain rows, then (with routes) the rows that replay them
    tokens_bl = torch.zeros((copies * len(sequences), length), dtype=torch.long)  # right padding is harmless
    for i, seq in enumerate(sequences * copies):
        tokens_bl[i, : len(seq)] = torch.tensor(list(seq))
    batch = MicroBatch(tokens_bl[:, :-1], tokens_bl[:, 1:])
    routing = None
    if routes is not None:
        batch.routes_lbsk = pad_routes(routes * 2, length - 1)
        replay_rows = torch.arange(2 * len(sequences)) >= len(sequences)
        routing = RoutingPass(model, ps, replay=True, replay_rows=replay_rows)
    (out,) = forward_logprobs(
        model, [batch], ps, vocab_size=vocab_size, temperature=temperature, routing=routing
    )
    logprobs_bl = out.logprobs_bs.float().cpu()
    by_suffix = {"": _local_diffs(logprobs_bl[: len(sequences)], probe, scored)}
    metrics: dict[str, float] = {}
    if routing is not None:
        by_suffix["_replay"] = _local_diffs(logprobs_bl[len(sequences) :], probe, scored)
        compare_m2, _ = reduce_routing_stats(*routing.stats(), ps)  # the plain rows' own experts only
        if float(compare_m2[:, 1].sum()) > 0:
            metrics["routing/probe_disagreement"] = float(compare_m2[:, 0].sum() / compare_m2[:, 1].sum())
        routing.close()
    # One gather for both copies' differences.
    return _probe_diffs(by_suffix, ps) | metrics


_Diffs = tuple[float, float, int]
"""One rank's |engine - trainer| over its engine's probe tokens: (max, sum, count)."""


def _local_diffs(
    trainer_bl: torch.Tensor, probe: ProbeBatch, scored: list[list[float]] | None
) -> _Diffs | None:
    """|engine - trainer| logprobs after each prompt on this rank (None: it has no engine)."""
    if scored is None:
        return None
    pairs = zip(probe.sequences, probe.prompt_lens, scored, strict=True)
    diffs = [
        (torch.tensor(engine_lp) - trainer_bl[i, p - 1 : len(s) - 1]).abs()
        for i, (s, p, engine_lp) in enumerate(pairs)
    ]
    diff_t = torch.cat(diffs) if diffs else torch.zeros(0)
    return (float(diff_t.max()) if diff_t.numel() else 0.0, float(diff_t.sum()), diff_t.numel())


def _probe_diffs(by_suffix: dict[str, _Diffs | None], ps: ParallelState) -> dict[str, float]:
    """Collective: max and mean of each pass's (metric suffix) differences over all engines."""
    gathered: list[Any] = [None] * ps.world_size
    dist.all_gather_object(gathered, by_suffix)
    out: dict[str, float] = {}
    for suffix in by_suffix:
        got = [g[suffix] for g in gathered if g[suffix] is not None]
        count = sum(g[2] for g in got)
        out[f"mismatch/probe{suffix}_abs_diff_max"] = max(g[0] for g in got)
        out[f"mismatch/probe{suffix}_abs_diff_mean"] = sum(g[1] for g in got) / max(count, 1)
        if not suffix:
            out["mismatch/probe_tokens"] = float(count)
    return out


def sync_weights(
    model: torch.nn.Module,
    fleet: RolloutFleet,
    memory: ColocatedMemory,
    ps: ParallelState,
    version: int,
    probe: ProbeBatch,
    *,
    vocab_size: int,
    temperature: float,
    max_abs: float = 0.0,
    max_mean: float = 0.0,
) -> dict[str, float]:
    """Weight sync as ``version`` (``sync/*``) and the mismatch probe (``mismatch/probe_*``), between
    the colocated memory's ``before_sync`` and ``after_sync`` (``offload/*`` of every memory phase,
    merged: ``merge_memory_metrics``, when it is on); the probe
    runs once the engines have their caches back (``engines_serve``: a released KV cache cannot
    score) and before the trainer's parameters leave. A probe beyond ``max_abs`` or ``max_mean``
    (``rollout.probe_max_abs`` / ``probe_max_mean``; 0: no bound) stops the run on every rank alike
    (``check_probe``). Engines the sync
    (or the probe) finds lost are restarted inside it, as the fleet decides."""
    moved = [memory.before_sync()]  # every memory phase's offload/* is reported (issue 51 item 1)
    metrics = fleet.sync_weights(model, version=version)
    if probe.sequences:  # the engines score with their KV cache, the trainer with its parameters
        moved.append(memory.engines_serve())
        metrics |= mismatch_probe(model, fleet, ps, probe, vocab_size=vocab_size, temperature=temperature)
        check_probe(metrics, max_abs, version, max_mean)
    moved.append(memory.after_sync())
    return metrics | merge_memory_metrics(*moved)


class ProbeMismatchError(RuntimeError):
    """The engines and the trainer disagree beyond ``rollout.probe_max_abs`` or ``probe_max_mean`` after
    a weight sync."""


def check_probe(metrics: dict[str, float], max_abs: float, version: int, max_mean: float = 0.0) -> None:
    """Raise ``ProbeMismatchError`` when the probe's largest difference (``mismatch/probe_abs_diff_max``)
    exceeds ``max_abs`` > 0 or its mean (``mismatch/probe_abs_diff_mean``) exceeds ``max_mean`` > 0 (the
    same on every rank: gathered). The engines then serve a model other than the trainer's (wrong or
    stale weights, a quantized engine fed without its scales, a different architecture): every rollout
    would train on another policy's samples. An FP8 engine's own gap (rollout.weight_dtype=fp8) stays
    below both (tests/test_fp8_rollout.py)."""
    worst = metrics.get("mismatch/probe_abs_diff_max")
    mean = metrics.get("mismatch/probe_abs_diff_mean", float("nan"))
    beyond = []
    if max_abs > 0 and worst is not None and worst > max_abs:
        beyond.append(f"rollout.probe_max_abs={max_abs:g}")
    if max_mean > 0 and mean == mean and mean > max_mean:
        beyond.append(f"rollout.probe_max_mean={max_mean:g}")
    if not beyond:
        return
    raise ProbeMismatchError(
        f"mismatch probe after the weight sync of version {version}: the engines' logprobs differ from the "
        f"trainer's by up to {worst:.3g} nats (mean {mean:.3g}) over {metrics.get('mismatch/probe_tokens', 0):.0f} "
        f"tokens, above {' and '.join(beyond)}: the engines do not serve the trainer's model (a "
        "quantized checkpoint started as such, a config SGLang reads otherwise, stale weights). Look at the "
        "engine's log and the model's config.json; raise the bound (0 disables the check) only "
        "if the difference is known to be noise"
    )
