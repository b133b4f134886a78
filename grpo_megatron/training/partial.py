"""Continuous generation with partial rollouts (``rollout.partial.enabled``): the ``GroupSource``
(training/groups.py) whose responses continue across weight updates, so an iteration never waits
for the longest response of its batch.

A pool of in-flight groups (``rollout.partial.groups_in_flight``, default twice
``train.prompts_per_iteration``) is kept between iterations; per response it holds the tokens so far,
each token's behaviour logprob and the weight version that sampled it, and whether it has finished.
Iteration ``it``, with the engines at version ``v`` (= ``it - 1``, the policy it trains)::

    1. staleness:  every response whose oldest token lags v by more than train.max_staleness is
                   regenerated from scratch (its tokens dropped; it stays in its group and pool slot)
    2. top up:     new prompts from the sampler until the pool holds its size
    3. segments:   every unfinished response gets one row, prompt + its tokens so far with
                   max_new_tokens = min(K, budget left) (K = rollout.partial.segment_tokens), seeded
                   by (train.seed, it, round) (new and continued responses: two engine requests
                   where a continued one holds more than K tokens, the second's seed +
                   CONTINUED_SEED; one with rollout.partial.one_request); its new tokens get
                   version v; one round at least,
                   repeated until at least train.prompts_per_iteration groups are complete (each
                   round adds a token to every unfinished response: the rounds end)
    4. take:       the OLDEST complete groups (submission order, never the quickest: no bias toward
                   short responses), scored by the Scorer and trained; the rest wait in the pool and
                   their unfinished responses continue under v + 1 at the next iteration

In time (K tokens a segment, the long response of group A spans two versions)::

    it k   (v = k-1):  [seg A1 B1 C1][seg A2 C2][reward B C][train k][sync v=k]
    it k+1 (v = k):    [seg A3 D1 ..]...[reward A D][train k+1][sync v=k+1]

Overlapped (``rollout.partial.overlap``; engines in processes of their own: rollout.embedded_process
or SGLang; validation asks ``max_staleness * K >= rollout.max_new_tokens``). The same steps, one
round moved: at the end of ``take`` the pool is topped up and the NEXT iteration's first round is
submitted (``submit`` returns at once, seeded by (train.seed, it + 1, 0)), so the engines generate it
while the trainer trains; the next ``take`` collects it first, then runs steps 1-4 (further rounds
only if fewer than train.prompts_per_iteration groups are complete)::

    engine:  [seg A1 B1 C1 (v=k-1)]        [load v=k][seg A2 C2 D1 (v=k)]        [load v=k+1] ...
    trainer: [take k][reward][train k  ][sync v=k][take k+1][reward][train k+1][sync v=k+1]

Its tokens carry the version that sampled them, exactly: an engine process serves the round before
the weights sent after it, and where a weight load waits for the generation in flight (SGLang)
``before_sync`` collects the round first (``partial/drained``). Taken one iteration later, they lag
one version more. A checkpoint collects a round in flight into the pool it saves (``ahead`` counts
it), which is what the next ``take`` would do: the resumed run redoes nothing and trains exactly what
the uninterrupted one would. The engines then keep their memory in every phase
(``JobConfig.generation_overlaps_training`` is 1).

Semantics. A token's lag is the trainer's version minus the version that sampled it; no trained
token lags more than train.max_staleness (step 1 runs before every take; validation asks for
``(max_staleness + 1) * K >= rollout.max_new_tokens``, so a response taken as soon as it completes
never needs regenerating). A response's behaviour logprobs are each token's under the version that
sampled it (``Completion.token_versions``; ``weight_version`` is its oldest token's): the
off-policy corrections (token TIS, IcePop, sequence TIS/MIS) read them per token already. Continuing
a response is one more request whose prompt ends with the response so far: the engine recomputes the
KV of those tokens under its current weights (prefix caching may reuse it within one version), which
works the same for the embedded engine, an engine process and SGLang, with no engine-specific pause.
``rollout.partial.keep_kv`` (SGLang) keeps that KV instead: weight loads leave SGLang's prefix cache
as it is while the KV in it lags the new weights by at most max_staleness versions
(``rollout/sglang/weights.py:KeptPrefixes``), so a continued request reads its prefix's KV as computed
under the versions that fed it (what an in-place pause keeps); each token's version and behaviour
logprob are still those of the weights whose logits sampled it.
Metrics: ``partial/staleness/{mean,max}`` (token-weighted over the trained responses),
``partial/mixed_versions_frac``, ``partial/segments`` (rounds this iteration),
``partial/carried`` (unfinished responses paused at the weight update), ``partial/regenerated``,
``partial/pool_groups``.

Where the pool lives (``PartialRollouts``): every rank holds its layout (each response's versions and
finish: every step above reads only those), a response's tokens and logprobs only the rank of the
engine that generated its last segment (``PartialResponse.holder``); a row moves to another engine's
rank when a round's split gives it there, and a taken group's responses go to rank 0 and to the
replicas that train them. No rank holds the whole pool, and a segment reaches the ranks without its
engine as a header.

Resume: the pool (tokens, logprobs, versions, finish, prompt indices, submission order) goes into the
checkpoint as JSON text (``state_dict``, gathered on rank 0; nothing is unpickled), so a resumed run
trains exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from grpo_megatron.rollout.engine import Completion, SamplingParams
from grpo_megatron.rollout.results import COLLECTOR, header_of, send_completions, transfer_pairs
from grpo_megatron.training.groups import Produced, SourceParts, fill_groups
from grpo_megatron.training.phases.rollout import rollout_seed

if TYPE_CHECKING:
    from grpo_megatron.training.timing import Timer


@dataclass
class PartialResponse:
    """One response in flight: its tokens so far, each one's logprob and version, its finish (None:
    unfinished) and which rank's copy of its tokens and logprobs is whole (``holder``). Its versions and
    finish are on every rank: every decision about the pool reads them (``length``), never the tokens."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: Literal["stop", "length"] | None = None
    holder: int | None = None
    """The global rank holding ``token_ids`` and ``logprobs`` (the engine's that generates its next
    segment, in the training job: every other rank holds them empty); None: every rank (one process,
    or a response not begun)."""

    @property
    def length(self) -> int:
        """Response tokens so far, wherever they are."""
        return len(self.versions)

    def here(self, rank: int) -> bool:
        """Whether ``rank`` holds this response's tokens and logprobs."""
        return self.holder is None or self.holder == rank

    def restart(self) -> None:
        """Regenerate from scratch: every token dropped."""
        self.token_ids, self.logprobs, self.versions, self.finish_reason = [], [], [], None
        self.holder = None

    def completion(self, here: bool = True) -> Completion:
        """The finished response as a ``Completion``: whole, or (``here`` False: its tokens are on
        another rank) its header only (``Completion.sizes``), as ``payload="owners"`` leaves one."""
        assert self.finish_reason is not None
        return Completion(
            list(self.token_ids) if here else [],
            list(self.logprobs) if here else [],
            self.finish_reason,
            weight_version=min(self.versions),
            token_versions=list(self.versions),
            sizes=None if here else (self.length, self.length),
        )


@dataclass
class PartialGroup:
    """One prompt's group in flight: the prompt (an index into the training records), its place in
    submission order and its responses."""

    index: int
    serial: int
    responses: list[PartialResponse]

    @property
    def complete(self) -> bool:
        return all(r.finish_reason is not None for r in self.responses)


@dataclass
class PartialPool:
    """The groups in flight, in submission order, and the rules of their segments (module docstring)."""

    n: int
    """Responses per group."""
    segment_tokens: int
    max_new_tokens: int
    max_staleness: int
    size: int
    """Groups the pool is topped up to."""
    groups: list[PartialGroup] = field(default_factory=list)
    next_serial: int = 0

    def regenerate_stale(self, version: int) -> int:
        """Step 1: restart every response whose oldest token lags ``version`` by more than
        ``max_staleness``; how many."""
        lags = [(version - min(r.versions), r) for g in self.groups for r in g.responses if r.versions]
        stale = [r for lag, r in lags if lag > self.max_staleness]
        for r in stale:
            r.restart()
        return len(stale)

    def missing(self) -> int:
        return max(self.size - len(self.groups), 0)

    def top_up(self, indices: list[int]) -> None:
        """Step 2: new groups for the prompts ``indices``, after every group in flight."""
        for index in indices:
            responses = [PartialResponse() for _ in range(self.n)]
            self.groups.append(PartialGroup(index, self.next_serial, responses))
            self.next_serial += 1

    def unfinished(self) -> list[tuple[int, PartialResponse]]:
        """(prompt index, response) of every unfinished response, in pool order."""
        return [(g.index, r) for g in self.groups for r in g.responses if r.finish_reason is None]

    def requests(
        self, prompt_ids: Callable[[int], Sequence[int]]
    ) -> tuple[list[tuple[int, PartialResponse]], list[list[int]], tuple[int, ...]]:
        """One round of step 3: every unfinished response with its prompt index (``unfinished``), its
        request's input (its prompt's ids, ``prompt_ids(index)``, then its tokens so far: whole where
        they are here) and its max_new_tokens (min(K, budget left)). ``extend`` each with its segment."""
        todo = self.unfinished()
        inputs = [[*prompt_ids(index), *r.token_ids] for index, r in todo]
        budgets = tuple(min(self.segment_tokens, self.max_new_tokens - r.length) for _, r in todo)
        return todo, inputs, budgets

    def extend(self, response: PartialResponse, segment: Completion) -> None:
        """Append one segment's tokens (each with the segment's version; a segment whose tokens are on
        its engine's rank, ``Completion.sizes``, its versions only); the response finishes on a stop,
        or when it has used the whole budget."""
        if segment.sizes is None:
            response.token_ids += segment.token_ids
            response.logprobs += segment.logprobs
        response.versions += [segment.weight_version] * segment.num_tokens
        if segment.finish_reason == "stop":
            response.finish_reason = "stop"
        elif response.length >= self.max_new_tokens:
            response.finish_reason = "length"

    def complete(self) -> int:
        return sum(g.complete for g in self.groups)

    def take(self, count: int) -> list[PartialGroup]:
        """Step 4: the ``count`` oldest complete groups, out of the pool."""
        taken = [g for g in self.groups if g.complete][:count]
        self.groups = [g for g in self.groups if all(g is not t for t in taken)]
        return taken

    def to_json(self) -> dict[str, Any]:
        """The pool as plain data (float logprobs round-trip exactly through JSON; ``holder`` is this
        process's arrangement, not saved)."""
        return {
            "next_serial": self.next_serial,
            "groups": [
                {
                    "index": g.index,
                    "serial": g.serial,
                    "responses": [
                        {k: v for k, v in dataclasses.asdict(r).items() if k != "holder"} for r in g.responses
                    ],
                }
                for g in self.groups
            ],
        }

    def load_json(self, data: dict[str, Any]) -> None:
        self.next_serial = int(data["next_serial"])
        self.groups = [
            PartialGroup(
                int(g["index"]),
                int(g["serial"]),
                [
                    PartialResponse(
                        [int(t) for t in r["token_ids"]],
                        [float(x) for x in r["logprobs"]],
                        [int(v) for v in r["versions"]],
                        r["finish_reason"],
                    )
                    for r in g["responses"]
                ],
            )
            for g in data["groups"]
        ]


def take_metrics(version: int, groups: list[PartialGroup]) -> dict[str, float]:
    """``partial/staleness/{mean,max}`` (token-weighted lag of the taken responses behind ``version``)
    and ``partial/mixed_versions_frac`` (responses sampled by more than one version)."""
    lags = [version - v for g in groups for r in g.responses for v in r.versions]
    responses = [r for g in groups for r in g.responses]
    mixed = sum(len(set(r.versions)) > 1 for r in responses)
    return {
        "partial/staleness/mean": sum(lags) / max(len(lags), 1),
        "partial/staleness/max": float(max(lags, default=0)),
        "partial/mixed_versions_frac": mixed / max(len(responses), 1),
    }


Submit = Callable[
    [list[tuple[int, "PartialResponse"]], list[list[int]], SamplingParams],
    Callable[[], list[list[Completion]]],
]
"""How a segment round's request reaches the engines: (its rows: each one's prompt index and response;
their inputs: prompt and tokens so far; its sampling) -> what collects its completions, one per row
(``RolloutEngine.submit``'s shape; the source's goes through the fleet)."""
Trace = Callable[..., None]
"""Called with an event name and its fields (``trace("submit", rows=..)``): what a bench records."""

CONTINUED_SEED = 104_729
"""Added to a round's seed for its request of continued responses (its new responses keep the seed)."""


@dataclass
class SegmentRound:
    """A segment round submitted to the engines: per request, its responses (in request order) and what
    collects its completions."""

    parts: list[tuple[list[tuple[int, PartialResponse]], Callable[[], list[list[Completion]]]]]


def submit_round(
    pool: PartialPool,
    prompt_ids: Callable[[int], Sequence[int]],
    submit: Submit,
    params: SamplingParams,
    *,
    one_request: bool = False,
    trace: Trace | None = None,
) -> SegmentRound:
    """Submit one round of step 3 (the module docstring): every unfinished response's next segment, with
    ``params`` (n=1, the round's seed) but each row's own max_new_tokens, min(K, budget left). Where a
    continued response holds more than K tokens, new responses and continued ones go as two requests
    (the second seeded ``+ CONTINUED_SEED``): an engine pads a request's prompts to its longest, and
    padding the new ones to the continued prefixes costs more than the K steps they decode
    (bench/partial_iterations.py measures it); shorter prefixes (the demo's) cost less than a second
    request. ``one_request`` (rollout.partial.one_request): one request whose ragged prompts the engine
    prefills apart (``SamplingParams.ragged_prefill``) and decodes together. The one round function of
    the source, its test and the partial benches."""
    todo, inputs, budgets = pool.requests(prompt_ids)
    if trace is not None:
        trace(
            "submit",
            rows=len(todo),
            continued=sum(bool(r.versions) for _, r in todo),
            prefix=sum(r.length for _, r in todo),
        )
    rows = list(zip(todo, inputs, budgets, strict=True))
    split = not one_request and max((r.length for _, r in todo), default=0) > pool.segment_tokens
    parts = []
    for offset, part in (
        (0, [x for x in rows if not (split and x[0][1].versions)]),
        (CONTINUED_SEED, [x for x in rows if split and x[0][1].versions]),
    ):
        if not part:
            continue
        each = tuple(b for _, _, b in part)
        seed = None if params.seed is None else params.seed + offset
        sampling = dataclasses.replace(
            params, seed=seed, max_new_tokens=max(each), max_new_tokens_each=each, ragged_prefill=one_request
        )
        todo_part = [t for t, _, _ in part]
        parts.append((todo_part, submit(todo_part, [x for _, x, _ in part], sampling)))
    return SegmentRound(parts)


def collect_round(pool: PartialPool, round_: SegmentRound, trace: Trace | None = None, **where: Any) -> None:
    """Collective where the source's submit is: the round's segments, appended to their responses."""
    start = time.perf_counter()
    for todo, collect in round_.parts:
        for (_, response), (segment,) in zip(todo, collect(), strict=True):
            pool.extend(response, segment)
    if trace is not None:
        trace("collect", wait_s=time.perf_counter() - start, **where)


def file_trace(path: str | os.PathLike) -> Trace:
    """A ``Trace`` that appends one JSON line per event to ``path`` (``GRPO_ROUND_TRACE``: benches)."""

    def trace(event: str, **fields: Any) -> None:
        with open(path, "a") as out:
            out.write(json.dumps({"t": time.perf_counter(), "event": event, **fields}) + "\n")

    return trace


def _to_collector(responses: list[PartialResponse]) -> dict[int, tuple[int, int]]:
    """``PartialRollouts._send``'s moves of every response held off ``COLLECTOR`` to it."""
    return {
        k: (r.holder, COLLECTOR)
        for k, r in enumerate(responses)
        if r.holder is not None and r.holder != COLLECTOR
    }


class PartialRollouts:
    """The continuous ``GroupSource`` (module docstring); every rank holds the pool's layout (each
    response's versions and finish: every decision reads them, alike on every rank) and calls it
    together, but a response's tokens and logprobs only on the rank of the engine that generated its
    last segment (``PartialResponse.holder``): a segment reaches the other ranks as its header
    (``payload="engines"``), a row continued by another engine moves there point to point before its
    request (``_place``), and a taken group's responses go to ``COLLECTOR`` and, in the update, to the
    replica that trains them (``_hand_over``). With ``rollout.partial.overlap`` the next iteration's
    first round is submitted at the end of ``take`` and generates while the trainer trains
    (``in_flight``); ``ahead`` counts the rounds of the next iteration already applied. ``trace``: what
    a bench records of each round (``submit_round``, ``collect_round``, ``_collect``)."""

    def __init__(self, parts: SourceParts, trace: Trace | None = None) -> None:
        rollout, train = parts.rollout.cfg, parts.train
        self.parts, self.version, self.trace = parts, 0, trace
        self.rank = parts.rollout.fleet.ps.rank
        self.placed_bytes = 0
        """Bytes of response tokens and logprobs ``_place`` received here since the last collect (its
        trace)."""
        self.pool = PartialPool(
            rollout.n_samples_per_prompt,
            rollout.partial.segment_tokens,
            rollout.max_new_tokens,
            train.max_staleness,
            rollout.partial.groups_in_flight or 2 * train.prompts_per_iteration,
        )
        self.overlap = rollout.partial.overlap
        self.in_flight: SegmentRound | None = None
        self.ahead = 0

    def start(self, version: int) -> None:
        self.version = version

    def _submit(self, iteration: int, round_index: int) -> SegmentRound:
        """Submit one round (``submit_round``), seeded by (train.seed, iteration, round), under the
        engines' weights when they generate it (``Completion.weight_version`` stamps each segment)."""
        parts = self.parts
        params = parts.rollout.params(n=1, seed=rollout_seed(parts.train.seed, iteration, round_index))

        def submit(
            rows: list[tuple[int, PartialResponse]], _inputs: list[list[int]], sampling: SamplingParams
        ) -> Callable[[], Any]:
            # each row's tokens on its engine's rank: its input is whole there
            self._place([r for _, r in rows])
            records = [
                dataclasses.replace(parts.records[i], prompt_ids=(*parts.records[i].prompt_ids, *r.token_ids))
                for i, r in rows
            ]
            pending = parts.rollout.submit(records, sampling)
            return lambda: parts.rollout.collect(pending, payload="engines")

        trace, traced = None, self.trace
        if traced is not None:  # each event names its round
            trace = functools.partial(traced, iteration=iteration, round=round_index)
        return submit_round(
            self.pool,
            lambda index: parts.records[index].prompt_ids,
            submit,
            params,
            one_request=parts.rollout.cfg.partial.one_request,
            trace=trace,
        )

    def _collect(self, round_: SegmentRound, at: str) -> None:
        """Collective: ``collect_round``. Its trace names this rank and what it received for the round:
        ``received_bytes``, the segments' headers (``RolloutFleet.received_bytes``) and the rows moved to
        it before the request (``_place``); ``broadcast_bytes``, what a broadcast of every segment would
        have given it (``pack``'s 16 bytes a token and 72 a completion, every other engine's); the pool's
        tokens it holds and the pool's."""
        fleet, rows = self.parts.rollout.fleet, [r for todo, _ in round_.parts for _, r in todo]
        lengths, before = [r.length for r in rows], fleet.received_bytes
        trace = None if self.trace is None else functools.partial(self.trace, rank=self.rank)
        collect_round(self.pool, round_, trace, at=at)
        if trace is None:
            return
        responses = [r for g in self.pool.groups for r in g.responses]
        trace(
            "received",
            at=at,
            received_bytes=fleet.received_bytes - before + self.placed_bytes,
            broadcast_bytes=sum(
                72 + 16 * (r.length - n) for r, n in zip(rows, lengths, strict=True) if r.holder != self.rank
            ),
            held_tokens=sum(r.length for r in responses if r.holder == self.rank),
            pool_tokens=sum(r.length for r in responses),
        )
        self.placed_bytes = 0

    def _send(
        self, responses: list[PartialResponse], moves: dict[int, tuple[int, int]]
    ) -> tuple[dict[int, Completion], int]:
        """Collective: the tokens and logprobs of ``responses[k]`` from rank ``src`` to rank ``dst`` for
        each ``k: (src, dst)`` of ``moves`` (the same on every rank), point to point over the fleet's
        data group (``results.send_completions``); what this rank received, by ``k``, and its bytes."""
        fleet = self.parts.rollout.fleet
        pairs = transfer_pairs(
            {k: [dst] for k, (_, dst) in moves.items()}, {k: src for k, (src, _) in moves.items()}
        )
        mine = {
            k: Completion(responses[k].token_ids, responses[k].logprobs, "length")
            for k, (src, _) in moves.items()
            if src == self.rank
        }
        headers = {
            k: header_of(Completion([], [], "length", sizes=(responses[k].length,) * 2)) for k in moves
        }
        return send_completions(pairs, mine, headers, self.rank, fleet.data.group())

    def _place(self, rows: list[PartialResponse]) -> None:
        """Collective, before a request of ``rows``: each row's tokens and logprobs onto the rank of the
        engine that generates its next segment (``RolloutFleet.prompt_ranks``), sent by their holder
        where it is another rank; every other rank drops its copy. A response not begun moves nothing."""
        ranks = self.parts.rollout.fleet.prompt_ranks(len(rows))
        moves = {
            k: (r.holder, dst)
            for k, (r, dst) in enumerate(zip(rows, ranks, strict=True))
            if r.holder is not None and r.holder != dst and r.length
        }
        got, received = self._send(rows, moves)
        self.placed_bytes += received
        for k, (r, dst) in enumerate(zip(rows, ranks, strict=True)):
            if k in got:
                r.token_ids, r.logprobs = got[k].token_ids, got[k].logprobs
            elif self.rank != dst:
                r.token_ids, r.logprobs = [], []
            r.holder = dst

    def _hand_over(self, taken: list[PartialGroup]) -> list[list[Completion]]:
        """Collective: the taken groups' completions, as ``payload="owners"`` leaves a rollout: whole on
        ``COLLECTOR`` (it scores and logs them: sent there point to point) and on their holder's rank,
        which keeps each in the fleet's held completions (``payload_id``) until the update's plan sends
        it to the replica that trains it (``deliver_completions``); headers elsewhere."""
        responses = [r for g in taken for r in g.responses]
        got, _ = self._send(responses, _to_collector(responses))
        held = self.parts.rollout.fleet.held_completions
        out = []
        for k, r in enumerate(responses):
            whole = (
                dataclasses.replace(r, token_ids=got[k].token_ids, logprobs=got[k].logprobs)
                if k in got
                else r
            )
            c = whole.completion(here=k in got or r.here(self.rank))
            if r.holder is not None:
                c.payload_id = held.add(r.holder, header_of(c), c if r.holder == self.rank else None)
            out.append(c)
        n = self.pool.n
        return [out[i : i + n] for i in range(0, len(out), n)]

    def _collect_ahead(self, at: str = "take") -> None:
        """Collective: the round submitted ahead, if one is in flight, applied to the pool."""
        if self.in_flight is not None:
            round_, self.in_flight = self.in_flight, None
            self._collect(round_, at)
            self.ahead += 1

    def take(self, iteration: int, timer: Timer) -> Produced:
        parts, pool = self.parts, self.pool
        need = parts.train.prompts_per_iteration
        with timer("rollout"):
            self._collect_ahead()  # rollout.partial.overlap: generated while the last iteration trained
            regenerated = pool.regenerate_stale(self.version)
            if missing := pool.missing():
                pool.top_up(parts.sampler.next_indices(missing))
            rounds, self.ahead = self.ahead, 0  # at least one: every response in flight advances each time
            while pool.unfinished() and (rounds == 0 or pool.complete() < need):
                self._collect(self._submit(iteration, rounds), "take")
                rounds += 1
            taken = pool.take(need)
            completions = self._hand_over(taken)
        records = [parts.records[g.index] for g in taken]
        carried = float(sum(bool(r.versions) for _, r in pool.unfinished()))
        if self.overlap and iteration < parts.train.iterations:
            with timer("rollout"):  # the next iteration's first round, generated while this one trains
                if missing := pool.missing():
                    pool.top_up(parts.sampler.next_indices(missing))
                if pool.unfinished():
                    self.in_flight = self._submit(iteration + 1, 0)
        produced = fill_groups(parts, iteration, timer, first=(records, completions))
        produced.metrics |= take_metrics(self.version, taken) | {
            "partial/segments": float(rounds),
            "partial/regenerated": float(regenerated),
            "partial/carried": carried,
            "partial/pool_groups": float(len(pool.groups)),
        }
        # no routes held (r3 is refused); the taken completions, held until the update delivers them
        produced.release_routes = []
        produced.release_payloads = [c.payload_id for g in completions for c in g if c.payload_id is not None]
        return produced

    def before_sync(self) -> dict[str, float]:
        """Collective. Without rollout.partial.overlap nothing is in flight between two iterations (the
        pool waits on the trainer's side). With it, where a weight load waits for the generation in
        flight (``RolloutFleet.sync_waits_for_generation``: SGLang) the round submitted ahead is
        collected now, so the sync stream starts with idle engines; an engine process loads the new
        weights after it by itself. ``partial/drained``: 1 when a round was collected here."""
        if not self.overlap:
            return {}
        drained = self.in_flight is not None and self.parts.rollout.fleet.sync_waits_for_generation
        if drained:
            self._collect_ahead(at="before_sync")
        return {"partial/drained": float(drained)}

    def after_sync(self, version: int) -> None:
        self.version = version

    def state_dict(self) -> dict[str, Any]:
        """Collective: the pool as JSON text, whole on ``COLLECTOR`` (the rank that writes
        ``trainer_state.pt``): every other holder sends it a copy of its responses' tokens and logprobs,
        point to point, and keeps its own (the other ranks' text lacks them and is not written). A round
        in flight is collected into the pool first (what the next ``take`` would do: the same tokens,
        seeds and versions) and counted in ``ahead``."""
        self._collect_ahead()
        pool = self.pool
        responses = [r for g in pool.groups for r in g.responses]
        got, _ = self._send(responses, _to_collector(responses))
        whole = iter(
            dataclasses.replace(r, token_ids=got[k].token_ids, logprobs=got[k].logprobs) if k in got else r
            for k, r in enumerate(responses)
        )
        groups = [dataclasses.replace(g, responses=[next(whole) for _ in g.responses]) for g in pool.groups]
        ahead = {"ahead": self.ahead} if self.ahead else {}
        return {"partial_pool": json.dumps(dataclasses.replace(pool, groups=groups).to_json() | ahead)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved pool (every rank reads it whole), its begun responses held by ``COLLECTOR``: the
        other ranks drop their tokens and logprobs (``_place`` moves each to its engine's rank before
        its next segment)."""
        data = json.loads(state["partial_pool"])
        self.pool.load_json(data)
        self.ahead = int(data.get("ahead", 0))
        for r in (r for g in self.pool.groups for r in g.responses if r.length):
            r.holder = COLLECTOR
            if self.rank != COLLECTOR:
                r.token_ids, r.logprobs = [], []
