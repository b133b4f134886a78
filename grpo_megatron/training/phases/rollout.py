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
    from grpo_megatron.rollout.fleet import RolloutFleet


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

    def params(self, *, n: int, seed: int, greedy: bool = False) -> SamplingParams:
        r = self.cfg
        return SamplingParams(
            n=n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=(self.eos_id,),
            stop_strings=(r.multiturn.call_close,) if r.multiturn.enabled else (),
            seed=seed,
            greedy=greedy,
        )

    def generate(
        self, records: Sequence[PromptRecord], params: SamplingParams, *, keep_routes: bool = False,
        payload: Payload = "everywhere",
    ) -> list[list[Completion]]:
        """``params.n`` completions per prompt, in prompt order, on every rank; with rollout.multiturn,
        multi-turn trajectories (rollout/multiturn.py). With ``keep_routes`` the engines keep their
        routes for ``phases/advantages.py:deliver_engine_routes``. ``payload``: where the tokens and
        logprobs go (``RolloutFleet.generate``; "owners": ``phases/advantages.py:prepare_update``
        delivers them); multi-turn episodes have them on every rank (each turn's prompts are made
        there)."""
        with self._waiting():
            if self.cfg.multiturn.enabled:
                runner = EpisodeRunner(self.fleet, self.cfg.multiturn, self.tokenizer, self.env)
                return [list[Completion](g) for g in runner.run(records, params, keep_routes=keep_routes)]
            return self.fleet.generate([list(r.prompt_ids) for r in records], params, keep_routes=keep_routes,
                                       payload=payload)  # fmt: skip
