"""The asynchronous arrangement of the GRPO phases (``rollout.embedded_process``, ``train.max_staleness``):
a producer of scored groups running ahead of the consumer that trains. Same phases, other order.

Synchronous (training/grpo.py, the engines in the trainer's processes)::

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
(rollout/sglang/engine.py: ``InFlight``), and its colocated memory is never released. Iteration j trains the policy of version j-1, so every trained sample lags it
by at most N versions (exactly N once the pipeline is full). The rollout phase's time
(``time/rollout``) is then only the wait for a batch that is not done yet; reward scoring stays
on the trainer's side (rank 0's reward pool) when the batch is taken.

With N = 0 the batch of iteration j is submitted after the sync of version j-1 and taken at once:
the synchronous loop, bit for bit (the same prompts, seeds and weights per batch).

Resume: a checkpoint keeps the batches already submitted (their prompt indices and completions, as
JSON text in ``trainer_state.pt``: nothing is unpickled), so a resumed run trains exactly what the
uninterrupted run would have, with the same staleness.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_megatron.rollout.engine_process import completions_from_json, completions_to_json
from grpo_megatron.training.phases.rollout import rollout_seed

if TYPE_CHECKING:
    from grpo_megatron.data import PromptSampler
    from grpo_megatron.rollout.engine import Completion
    from grpo_megatron.rollout.fleet import PendingRollout
    from grpo_megatron.training.job import Job, Timer
    from grpo_megatron.training.phases.reward import Group


@dataclass
class _Batch:
    """One iteration's submitted batch: its prompts (indices into the training records) and either the
    generation in flight or its completions."""

    indices: list[int]
    pending: PendingRollout | None = None
    completions: list[list[Completion]] | None = None


def give_back_submitted(sampler: PromptSampler, saved: dict[str, Any]) -> int:
    """A checkpoint of this loop resumed by the synchronous one (``train.max_staleness`` now 0, no
    engine processes): the prompts of its submitted batches (``GroupProducer.state_dict``), the last
    the sampler drew, go back to ``sampler``, so the synchronous loop draws them for the same
    iterations and generates them with the weights it trains (their stored completions, from older
    weights, are dropped). Returns how many batches."""
    batches = saved.get("batches", {})
    sampler.rewind(sum(len(b["indices"]) for b in batches.values()))
    return len(batches)


def staleness_metrics(trainer_version: int, completions: list[list[Completion]]) -> dict[str, float]:
    """``async/staleness/{mean,max,min}``: the trainer's version minus each completion's."""
    lags = [trainer_version - c.weight_version for group in completions for c in group]
    return {
        "async/staleness/mean": sum(lags) / max(len(lags), 1),
        "async/staleness/max": float(max(lags, default=0)),
        "async/staleness/min": float(min(lags, default=0)),
    }


class GroupProducer:
    """Submits each iteration's rollout ahead of time (at most ``max_staleness`` versions ahead) and
    hands the trainer scored groups (``take``). Every rank holds one and calls it together."""

    def __init__(self, job: Job, sampler: PromptSampler, max_staleness: int) -> None:
        self.job = job
        self.sampler = sampler
        self.max_staleness = max_staleness
        self.batches: dict[int, _Batch] = {}

    def _submit(self, iteration: int) -> None:
        cfg = self.job.cfg
        if iteration > cfg.train.iterations or iteration in self.batches:
            return
        indices = self.sampler.next_indices(cfg.train.prompts_per_iteration)
        rollout = self.job.rollout
        params = rollout.params(n=cfg.rollout.n_samples_per_prompt, seed=rollout_seed(cfg.train.seed, iteration))
        records = [self.job.train_records[i] for i in indices]
        pending = self.job.fleet.submit([list(r.prompt_ids) for r in records], params)
        self.batches[iteration] = _Batch(indices, pending)

    def start(self, version: int) -> None:
        """After the run's first sync (weights ``version``): the batches of iterations version+1 ..
        version+1+N, all sampled by ``version`` (those a resume restored are kept)."""
        for iteration in range(version + 1, version + 2 + self.max_staleness):
            self._submit(iteration)

    def after_sync(self, version: int) -> None:
        """The engines were sent ``version``: submit the batch that may lag it by N."""
        self._submit(version + 1 + self.max_staleness)

    def _completions(self, iteration: int) -> list[list[Completion]]:
        batch = self.batches[iteration]
        if batch.completions is None:
            assert batch.pending is not None
            keep_routes = self.job.cfg.algorithm.routing_replay == "r3"  # held until the plan (grpo.py)
            with self.job.long_phase("rollout (waiting for the engines)"):  # one call, as long as the batch takes
                completions = self.job.fleet.collect(batch.pending, keep_routes=keep_routes, payload="owners")
                batch.completions, batch.pending = completions, None
        return batch.completions

    def take(self, iteration: int, timer: Timer) -> tuple[list[Group], dict[str, float]]:
        """Iteration ``iteration``'s scored groups and their metrics (reward, staleness)."""
        with timer("rollout"):  # the wait for a batch the engines have not finished
            completions = self._completions(iteration)
        indices = self.batches.pop(iteration).indices
        records = [self.job.train_records[i] for i in indices]
        with timer("reward"):
            scored = self.job.scorer.score(records, completions)
        return scored.groups, scored.metrics | staleness_metrics(iteration - 1, completions)

    def state_dict(self) -> dict[str, Any]:
        """Collective: the submitted batches, as plain data (their generations are waited for; routes
        held on the engines' ranks are copied to every rank for it and stay held)."""
        batches = {it: self._completions(it) for it in sorted(self.batches)}
        held = [c.route_id for cs in batches.values() for g in cs for c in g if c.route_id is not None]
        everyone = range(self.job.ps.world_size)
        routes = self.job.fleet.deliver_routes({rid: everyone for rid in held}, release=()) if held else {}

        def with_routes(cs: list[list[Completion]]) -> list[list[Completion]]:
            def one(c: Completion) -> Completion:
                delivered = routes.get(c.route_id) if c.route_id is not None else None
                return dataclasses.replace(c, routed_experts=c.routed_experts if delivered is None else delivered,
                                           route_id=None)  # fmt: skip

            return [[one(c) for c in g] for g in cs]

        return {
            "batches": {
                str(it): {"indices": b.indices, "completions": json.dumps(completions_to_json(with_routes(batches[it])))}
                for it, b in sorted(self.batches.items())
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for it, b in state["batches"].items():
            completions = completions_from_json(json.loads(b["completions"]))
            self.batches[int(it)] = _Batch(list(b["indices"]), completions=completions)
