"""Rollout phase (``time/rollout``): the engines generate G responses per prompt."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_megatron.rollout.engine import Completion, SamplingParams
from grpo_megatron.rollout.multiturn import Environment, EpisodeRunner
from grpo_megatron.rollout.results import Payload

if TYPE_CHECKING:
    from grpo_megatron.data import PromptRecord
    from grpo_megatron.distributed.watchdog import ProgressWatchdog
    from grpo_megatron.rollout.config import RolloutConfig
    from grpo_megatron.rollout.fleet import PendingRollout, RolloutFleet


def rollout_seed(train_seed: int, iteration: int, round_index: int = 0) -> int:
    """The sampling seed of one rollout round (DAPO may run several per iteration); evaluation uses
    ``round_index=0`` (greedy) and ``+1`` (sampled) of the same formula."""
    return train_seed * 1_000_003 + iteration + 7919 * round_index


@dataclass
class Rollout:
    """What the rollout (and eval) phase acts on: the engines and the sampling settings."""

    fleet: RolloutFleet
    cfg: RolloutConfig
    eos_id: int
    tokenizer: Any = None
    """Decodes a turn for the environment (rollout.multiturn only)."""
    env: Environment | None = None
    """rollout.multiturn: rank 0's environment (None on the other ranks)."""
    watchdog: ProgressWatchdog | None = None
    """This rank's progress watchdog: the wait for the engines runs under its long phase, since a
    rank waiting for its engine's rollout blocks in one call for as long as the rollout takes."""
    long_phase_s: float = 3600.0
    """The watchdog's bound for that wait (parallel.long_phase_timeout_s), not progress_timeout_s."""

    def _waiting(self) -> AbstractContextManager[None]:
        if self.watchdog is None:
            return nullcontext()
        return self.watchdog.long_phase("rollout (waiting for the engines)", self.long_phase_s)

    def params(self, *, n: int, seed: int, greedy: bool = False, routes: bool = False) -> SamplingParams:
        """rollout.* sampling for ``n`` responses per prompt; ``routes``: the engines report (and the
        fleet holds) each response's MoE routes, for the training rollouts of a job that replays them
        (``RolloutFleet.routes``)."""
        r = self.cfg
        return SamplingParams(
            n=n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            min_p=r.min_p,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=(self.eos_id,),
            stop_strings=(r.multiturn.call_close,) if r.multiturn.enabled else (),
            seed=seed,
            greedy=greedy,
            routes=routes,
        )

    def generate(
        self, records: Sequence[PromptRecord], params: SamplingParams, *, payload: Payload = "everywhere"
    ) -> list[list[Completion]]:
        """``params.n`` completions per prompt, in prompt order, on every rank; with rollout.multiturn,
        multi-turn trajectories (rollout/multiturn.py). With ``params.routes`` the engines keep their
        routes for ``phases/advantages.py:deliver_engine_routes``. ``payload``: where the tokens and
        logprobs go (``RolloutFleet.generate``; "owners": ``phases/advantages.py:prepare_update``
        delivers them); multi-turn episodes have them on every rank (each turn's prompts are made
        there)."""
        if self.cfg.multiturn.enabled:
            with self._waiting():  # every turn's generation (submit and collect wait under it alike)
                runner = EpisodeRunner(self.fleet, self.cfg.multiturn, self.tokenizer, self.env)
                return [list[Completion](g) for g in runner.run(records, params)]
        return self.collect(self.submit(records, params), payload=payload)

    def submit(self, records: Sequence[PromptRecord], params: SamplingParams) -> PendingRollout:
        """Start a single-turn rollout and return at once where the engines generate in processes of
        their own (the asynchronous loop); ``collect`` (collective) takes its completions."""
        if self.cfg.multiturn.enabled:
            raise ValueError("multi-turn episodes are generated turn by turn: they cannot be submitted ahead")
        with self._waiting():  # an engine in this process (``RolloutEngine.submit``'s default) generates here
            return self.fleet.submit([list(r.prompt_ids) for r in records], params)

    def collect(self, pending: PendingRollout, *, payload: Payload = "everywhere") -> list[list[Completion]]:
        """Collective: the completions of ``submit``, in prompt order, on every rank, placed as
        ``payload`` says (``RolloutFleet.collect``). The wait for the engines (the asynchronous loop's
        batches, submitted ahead, end here) runs under the watchdog's long phase: a rank blocks in
        one call for as long as the rollout takes."""
        with self._waiting():
            return self.fleet.collect(pending, payload=payload)
