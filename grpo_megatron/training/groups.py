"""Where the GRPO loop's scored groups come from: one small interface, three arrangements of the
rollout and reward phases.

The loop (training/grpo.py) calls a ``GroupSource`` the same way whatever the arrangement::

    source.start(version)              after the run's first sync (weights ``version``)
    produced = source.take(it, timer)  iteration ``it``'s scored groups (times rollout and reward)
    ...                                advantages, passes, update, the sync of version ``it``
    source.after_sync(it)              the engines have version ``it``
    source.state_dict()                (collective) what a checkpoint keeps of it; None: nothing

- ``RolloutNow`` (synchronous): ``take`` generates iteration ``it``'s rollout now, scores it, and with
  DAPO dynamic sampling repeats rollout + reward for the groups still missing;
- ``GroupProducer`` (the asynchronous arrangement, ``JobConfig.producer_loop``: ``rollout.embedded_process``,
  or ``train.max_staleness`` > 0): the rollout of iteration ``it`` was submitted to the engines up to
  ``train.max_staleness`` versions ahead; ``take`` collects and scores it;
- ``PartialRollouts`` (continuous generation, ``rollout.partial.enabled``, training/partial.py): ``take``
  advances a pool of groups in flight by segments of ``rollout.partial.segment_tokens`` tokens until
  enough are complete and scores the oldest complete ones; responses left unfinished continue under
  the next weight version, each token keeping its version (``Completion.token_versions``) and its
  behaviour logprob, no token lagging more than ``train.max_staleness`` (else regenerated).

All go through the same ``Rollout`` (phases/rollout.py), ``Scorer`` (phases/reward.py) and
``fill_groups`` (DAPO's ``DynamicSampling``, one round when it is off): round 0 is the batch the source
has, further rounds are generated now. Which MoE routes the engines report and the fleet holds is
decided once, when the engines are built (``EngineSpec.record_routes``, ``RolloutFleet.routes``); every
training rollout asks for them through ``training_params``.

The first two arrangements in time (the third: training/partial.py). Synchronous (``RolloutNow``)::

    it k:  [rollout k][reward k][train k][sync v_k]
    it k+1:                                        [rollout k+1][reward k+1][train k+1][sync v_k+1]

Asynchronous, N = train.max_staleness (here 1; each engine generating in processes of its own:
``rollout.embedded_process``, or SGLang's schedulers)::

    engine:  [rollout k+1 (v_k-1)]  [load v_k][rollout k+2 (v_k)]     [load v_k+1][rollout k+3 ...
    trainer: [reward k][train k (v_k-1 -> v_k)][sync v_k][reward k+1][train k+1][sync v_k+1]

Iteration j's batch is submitted to the engines right after the sync of version max(start, j-1-N)
(the end of iteration j-1-N) and is generated with exactly those weights: the engine process serves
its requests in order and loads the weights it was sent between two of them (rollout/
engine_process.py); an SGLang engine's weight load waits for the generation in flight
(rollout/sglang/engine.py: its ``ServerGuard``), and its colocated memory is never released.
Iteration j trains the policy of version j-1, so every trained sample lags it by at most N versions
(exactly N once the pipeline is full). The rollout phase's time
(``time/rollout``) is then only the wait for a batch that is not done yet; reward scoring stays
on the trainer's side (rank 0's reward pool) when the batch is taken.

With N = 0 the batch of iteration j is submitted after the sync of version j-1 and taken at once:
the synchronous loop, bit for bit (the same prompts, seeds and weights per batch).

DAPO dynamic sampling, trainer offload and multi-turn episodes are not (yet) arranged asynchronously
(config/validation.py refuses them): a further DAPO round would draw prompts after the batches
already submitted, which a synchronous resume of the checkpoint gives back as the last drawn.

Resume: a checkpoint keeps the batches already submitted (their prompt indices and completions, as
JSON text in ``trainer_state.pt``: nothing is unpickled), so a resumed run trains exactly what the
uninterrupted run would have, with the same staleness.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from grpo_megatron.algorithm.batch_shaping import DynamicSampling
from grpo_megatron.rollout.engine_process import completions_from_json, completions_to_json
from grpo_megatron.training.phases.reward import Group
from grpo_megatron.training.phases.rollout import rollout_seed

if TYPE_CHECKING:
    from grpo_megatron.algorithm.config import DynamicSamplingConfig
    from grpo_megatron.data import PromptRecord, PromptSampler
    from grpo_megatron.rollout.engine import Completion, SamplingParams
    from grpo_megatron.rollout.fleet import PendingRollout
    from grpo_megatron.training.config import TrainConfig
    from grpo_megatron.training.phases.reward import Scorer
    from grpo_megatron.training.phases.rollout import Rollout
    from grpo_megatron.training.timing import Timer


@dataclass
class Produced:
    """One iteration's scored groups, from whichever source."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)
    """reward/* of the first round (the policy's own reward, before any filtering), dynamic_sampling/*,
    and the asynchronous producer's async/staleness/*."""
    release_routes: list[int] | None = None
    """Held engine routes to drop once this batch's are delivered (``deliver_engine_routes``); None:
    every held route (the synchronous source: DAPO's dropped groups and multi-turn's earlier turns
    hold some too). The asynchronous producer names its batch's only: its later batches' stay held."""
    release_payloads: list[int] | None = None
    """Held completions (``payload="owners"``) to drop once this batch's are delivered
    (``deliver_completions``); None: every held one. As ``release_routes``."""


class GroupSource(Protocol):
    """What the loop takes scored groups from (see the module docstring); every rank holds one and
    calls it together."""

    def start(self, version: int) -> None: ...
    def take(self, iteration: int, timer: Timer) -> Produced: ...
    def before_sync(self) -> dict[str, float]: ...
    def after_sync(self, version: int) -> None: ...
    def state_dict(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class SourceParts:
    """What a group source generates and scores its groups with, given explicitly (the factory,
    training/sources.py, takes them from the job): the rollout and reward phases' objects, the training
    prompts and their sampler, and the settings of a round (the train section: seed, prompts per
    iteration, iterations, max_staleness; DAPO's dynamic sampling)."""

    rollout: Rollout
    """The engines (``rollout.fleet``) and rollout.* sampling (``rollout.cfg``)."""
    scorer: Scorer
    records: Sequence[PromptRecord]
    """The training prompts, by index."""
    sampler: PromptSampler
    train: TrainConfig
    dynamic_sampling: DynamicSamplingConfig


def training_params(parts: SourceParts, iteration: int, round_index: int = 0) -> SamplingParams:
    """The sampling of one training rollout round: rollout.n_samples_per_prompt responses per prompt,
    seeded by ``rollout_seed``, with the engines' MoE routes where the job replays them."""
    rollout = parts.rollout
    return rollout.params(
        n=rollout.cfg.n_samples_per_prompt,
        seed=rollout_seed(parts.train.seed, iteration, round_index),
        routes=rollout.fleet.routes,
    )


def fill_groups(
    parts: SourceParts,
    iteration: int,
    timer: Timer,
    first: tuple[Sequence[PromptRecord], list[list[Completion]]] | None = None,
) -> Produced:
    """Iteration ``iteration``'s groups: rollout + reward rounds until DAPO's ``DynamicSampling`` has
    enough (one round when it is off). Round 0 is ``first`` (records and their completions, already
    generated) when given, else generated now from the sampler's next prompts like every later round."""
    ds = parts.dynamic_sampling
    dapo = DynamicSampling[Group](
        parts.train.prompts_per_iteration,
        lambda g: g.rewards,
        enabled=ds.enabled,
        max_tries=ds.max_tries,
        std_threshold=ds.std_threshold,
    )
    reward_metrics: dict[str, float] = {}
    while n := dapo.needed():
        if first is not None and dapo.rounds == 0:
            records, completions = first
        else:
            records = [parts.records[i] for i in parts.sampler.next_indices(n)]
            with timer("rollout"):
                # Rank 0 gets every response (rewards, sample log); the others their sizes, and each
                # replica its own responses once the update's plan says which (prepare_update).
                params = training_params(parts, iteration, dapo.rounds)
                completions = parts.rollout.generate(records, params, payload="owners")
        with timer("reward"):
            scored = parts.scorer.score(records, completions)
        reward_metrics = reward_metrics if dapo.rounds else scored.metrics
        dapo.add(scored.groups)
    groups, dapo_metrics = dapo.result()
    return Produced(groups, {**reward_metrics, **dapo_metrics})


class RolloutNow:
    """The synchronous source: each iteration's rollout generated when the loop takes it."""

    drops_batches = True
    """Nothing of a batch outlives its iteration: a signal before the update may drop it (the sampler's
    state from before it is the loop's to keep; training/grpo.py:Abandoned)."""

    def __init__(self, parts: SourceParts) -> None:
        self.parts = parts

    def start(self, version: int) -> None:
        return None

    def take(self, iteration: int, timer: Timer) -> Produced:
        return fill_groups(self.parts, iteration, timer)

    def before_sync(self) -> dict[str, float]:
        return {}  # nothing is in flight between two iterations

    def after_sync(self, version: int) -> None:
        return None

    def state_dict(self) -> dict[str, Any] | None:
        return None


def give_back_submitted(sampler: PromptSampler, saved: Mapping[str, Any]) -> int:
    """A checkpoint of the asynchronous loop resumed by the synchronous one (``train.max_staleness`` now 0,
    no engine processes): the prompts of its submitted batches (``GroupProducer.state_dict``), the last
    the sampler drew, go back to ``sampler``, so the synchronous loop draws them for the same iterations
    and generates them with the weights it trains (their stored completions, from older weights, are
    dropped). Returns how many batches."""
    batches = saved.get("batches", {})
    sampler.rewind(sum(len(b["indices"]) for b in batches.values()))
    return len(batches)


@dataclass
class _Batch:
    """One iteration's submitted batch: its prompts (indices into the training records) and either the
    generation in flight or its completions."""

    indices: list[int]
    pending: PendingRollout | None = None
    completions: list[list[Completion]] | None = None


def staleness_metrics(trainer_version: int, completions: list[list[Completion]]) -> dict[str, float]:
    """``async/staleness/{mean,max,min}``: the trainer's version minus each completion's."""
    lags = [trainer_version - c.weight_version for group in completions for c in group]
    return {
        "async/staleness/mean": sum(lags) / max(len(lags), 1),
        "async/staleness/max": float(max(lags, default=0)),
        "async/staleness/min": float(min(lags, default=0)),
    }


class GroupProducer:
    """The asynchronous ``GroupSource`` (training/groups.py): submits each iteration's rollout ahead of
    time (at most ``max_staleness`` versions ahead) and hands the trainer scored groups (``take``).
    Every rank holds one and calls it together."""

    def __init__(self, parts: SourceParts) -> None:
        self.parts = parts
        self.max_staleness = parts.train.max_staleness
        self.batches: dict[int, _Batch] = {}

    def _submit(self, iteration: int) -> None:
        if iteration > self.parts.train.iterations or iteration in self.batches:
            return
        indices = self.parts.sampler.next_indices(self.parts.train.prompts_per_iteration)
        records = [self.parts.records[i] for i in indices]
        pending = self.parts.rollout.submit(records, training_params(self.parts, iteration))
        self.batches[iteration] = _Batch(indices, pending)

    def start(self, version: int) -> None:
        """After the run's first sync (weights ``version``): the batches of iterations version+1 ..
        version+1+N, all sampled by ``version`` (those a resume restored are kept)."""
        for iteration in range(version + 1, version + 2 + self.max_staleness):
            self._submit(iteration)

    def before_sync(self) -> dict[str, float]:
        """Collective: where a weight load waits for the generation in flight
        (``RolloutFleet.sync_waits_for_generation``: SGLang), collect every submitted batch now, under
        the watchdog's long phase (``Rollout.collect``), so the sync stream starts with idle engines
        and no rank waits for a rollout inside it. The batches keep the version they were submitted
        under: this moves the wait, not what is generated. ``async/drained_batches``: how many."""
        in_flight = sorted(it for it, b in self.batches.items() if b.pending is not None)
        if not self.parts.rollout.fleet.sync_waits_for_generation:
            in_flight = []
        for iteration in in_flight:
            self._completions(iteration)
        return {"async/drained_batches": float(len(in_flight))}

    def after_sync(self, version: int) -> None:
        """The engines were sent ``version``: submit the batch that may lag it by N."""
        self._submit(version + 1 + self.max_staleness)

    def _completions(self, iteration: int) -> list[list[Completion]]:
        batch = self.batches[iteration]
        if batch.completions is None:
            assert batch.pending is not None  # under r3 its routes stay held until its plan (grpo.py)
            # the wait runs under the watchdog's long phase (Rollout.collect); the tokens as in fill_groups
            batch.completions, batch.pending = (
                self.parts.rollout.collect(batch.pending, payload="owners"),
                None,
            )
        return batch.completions

    def take(self, iteration: int, timer: Timer) -> Produced:
        """Iteration ``iteration``'s scored groups and their metrics (reward, staleness)."""
        with timer("rollout"):  # the wait for a batch the engines have not finished
            completions = self._completions(iteration)
        records = [self.parts.records[i] for i in self.batches.pop(iteration).indices]
        produced = fill_groups(self.parts, iteration, timer, first=(records, completions))
        produced.metrics |= staleness_metrics(iteration - 1, completions)
        produced.release_routes = [c.route_id for g in completions for c in g if c.route_id is not None]
        produced.release_payloads = [c.payload_id for g in completions for c in g if c.payload_id is not None]
        return produced

    def state_dict(self) -> dict[str, Any]:
        """Collective: the submitted batches, as plain data (their generations are waited for; routes
        held on the engines' ranks are copied to every rank for it and stay held)."""
        batches = {it: self._completions(it) for it in sorted(self.batches)}
        held = [c.route_id for cs in batches.values() for g in cs for c in g if c.route_id is not None]
        fleet = self.parts.rollout.fleet
        everyone = range(fleet.ps.world_size)
        routes = fleet.deliver_routes({rid: everyone for rid in held}, release=()) if held else {}

        def with_routes(cs: list[list[Completion]]) -> list[list[Completion]]:
            def one(c: Completion) -> Completion:
                delivered = routes.get(c.route_id) if c.route_id is not None else None
                return dataclasses.replace(
                    c, routed_experts=c.routed_experts if delivered is None else delivered, route_id=None
                )

            return [[one(c) for c in g] for g in cs]

        saved = {}
        for it in sorted(self.batches):
            completions = json.dumps(completions_to_json(with_routes(batches[it])))
            saved[str(it)] = {"indices": self.batches[it].indices, "completions": completions}
        return {"batches": saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for it, b in state["batches"].items():
            completions = completions_from_json(json.loads(b["completions"]))
            self.batches[int(it)] = _Batch(list(b["indices"]), completions=completions)
