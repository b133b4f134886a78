"""Multi-turn episodes with exact tokens: the model acts, an environment answers, the model goes on.

How a trajectory is made (``EpisodeRunner.run``, every rank; ``rollout.multiturn``):

1. turn 1: the fleet samples G responses per prompt, as in a single-turn rollout;
2. rank 0's environment gets each episode's last turn as text (``Environment.step``, batched) and
   answers with an observation as token ids, tokenized once and on its own (never a re-tokenized
   transcript), a done flag and optionally a reward; the result is broadcast to every rank;
3. an episode goes on unless the environment said done, its last turn ended with a stop token (EOS),
   it has had ``max_turns`` turns, or the observation would leave no room in ``max_total_tokens``;
4. the observation ids are appended, then the fleet continues every open episode from its token ids
   (prompt + everything so far: the engines take ids, SGLang as ``input_ids``), n = 1 each, each at
   most its own budget left (``SamplingParams.max_new_tokens_each``: asking every episode for the
   largest would pass the context of the ones furthest along, and SGLang refuses the whole batch;
   SGLang's adapter also keeps each within the engine's context); back to 2.

A trajectory (``Trajectory``, a ``Completion``) is therefore exactly the ids the engine sampled with the
observation ids between them; ``loss_mask`` is 1 at sampled tokens and 0 at observation tokens, whose
logprobs are 0.0 (the trainer neither trains on them nor compares logprobs there:
``training/batching.py:make_sample``); the routes are the last turn's (``route_id``: held on the engine's
rank, ``rollout/results.py``), which cover every input position of the whole trajectory (that turn's
prompt is all that came before it).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_megatron.distributed.collectives import on_rank0
from grpo_megatron.rollout.engine import Completion, SamplingParams

if TYPE_CHECKING:
    from grpo_megatron.data import PromptRecord
    from grpo_megatron.rewards.tools import ToolPool
    from grpo_megatron.rollout.config import MultiTurnConfig
    from grpo_megatron.rollout.fleet import RolloutFleet

__all__ = [
    "StepResult",
    "Environment",
    "ToolEnvironment",
    "Trajectory",
    "EpisodeRunner",
    "trajectory_metrics",
]

TOOL_NAME = "tool"
"""The name the environment's tool has in its ``ToolPool`` (``rollout.multiturn.tool`` says what it is)."""
# Seed offset of turn k > 1 (turn 1 uses the rollout's own seed).
_TURN_SEED_STRIDE = 1_000_033


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one model turn."""

    observation_ids: list[int]
    """Token ids to append (ignored when ``done``)."""
    done: bool
    reward: float | None = None
    """Added to the episode's reward (``Trajectory.env_reward``); None = no reward from this step."""
    tool_calls: int = 0
    tool_errors: int = 0
    """Calls that failed (raised, bad output, the worker died, timed out): their observation shows
    ``error_text``."""
    tool_timeouts: int = 0
    """Of the errors, calls killed at ``rollout.multiturn.tool_timeout_s``."""
    tool_truncated: int = 0
    """Calls whose output was cut to ``rollout.multiturn.max_tool_output_chars``."""


class Environment(abc.ABC):
    """What answers a model turn. Only global rank 0 holds one (it may own processes, e.g. a
    ``ToolPool``); ``EpisodeRunner`` broadcasts its answers."""

    def start(self, record: PromptRecord) -> Any:
        """An episode's initial state (passed back to ``step``); default None."""
        return None

    @abc.abstractmethod
    def step(self, states: Sequence[Any], turn_texts: Sequence[str]) -> list[StepResult]:
        """One answer per open episode, given its state and its last turn's decoded text."""

    def close(self) -> None:
        return None


class ToolEnvironment(Environment):
    """A turn that ends with ``<call_open>ARGUMENT<call_close>`` (``<calc>12*34</calc>``) gets the tool's
    output as ``<result_open>OUTPUT<result_close>`` (``<result>408</result>``); a failed call shows
    ``error_text`` in its place (and counts in tool/errors); a turn without a call ends the episode.
    The tool runs in ``pool``'s sandboxed workers; nothing of the model's text is evaluated here."""

    def __init__(self, cfg: MultiTurnConfig, tokenizer: Any, pool: ToolPool):
        self.cfg, self.tokenizer, self.pool = cfg, tokenizer, pool

    def parse_call(self, text: str) -> str | None:
        """The argument of the call ``text`` ends with (trailing whitespace allowed), else None."""
        body = text.rstrip()
        if not body.endswith(self.cfg.call_close):
            return None
        body = body[: -len(self.cfg.call_close)]
        start = body.rfind(self.cfg.call_open)
        return None if start < 0 else body[start + len(self.cfg.call_open) :]

    def observation_ids(self, output: str) -> list[int]:
        text = f"{self.cfg.result_open}{output}{self.cfg.result_close}"
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def step(self, states: Sequence[Any], turn_texts: Sequence[str]) -> list[StepResult]:
        calls = [self.parse_call(t) for t in turn_texts]
        asked = [(TOOL_NAME, c) for c in calls if c is not None]
        results = iter(self.pool.run(asked))
        out = []
        for call in calls:
            if call is None:
                out.append(StepResult([], done=True))
                continue
            r = next(results)
            out.append(
                StepResult(
                    self.observation_ids(r.output),
                    False,
                    None,
                    tool_calls=1,
                    tool_errors=int(r.status != "ok"),
                    tool_timeouts=int(r.status == "timeout"),
                    tool_truncated=int(r.truncated),
                )
            )
        return out

    def close(self) -> None:
        self.pool.close()


@dataclass
class Trajectory(Completion):
    """A multi-turn episode: sampled and observation ids in order (``loss_mask`` says which is which)."""

    turns: int = 1
    """Model turns."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_truncated: int = 0
    env_reward: float | None = None
    """Sum of the environment's step rewards; None when it gave none."""

    def add(self, c: Completion, *, sampled: bool) -> None:
        self.token_ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs if sampled else [0.0] * len(c.token_ids))
        assert self.loss_mask is not None
        self.loss_mask.extend([int(sampled)] * len(c.token_ids))
        if sampled:
            self.finish_reason, self.routed_experts = c.finish_reason, c.routed_experts
            self.route_id = c.route_id


@dataclass
class EpisodeRunner:
    """Runs multi-turn episodes on every rank (see the module docstring)."""

    fleet: RolloutFleet
    cfg: MultiTurnConfig
    tokenizer: Any
    env: Environment | None
    """Rank 0's environment; None on the other ranks."""

    def run(self, records: Sequence[PromptRecord], params: SamplingParams) -> list[list[Trajectory]]:
        """With ``params.routes`` every turn's routes stay held (``RolloutFleet.generate``); a
        trajectory's ``route_id`` is its last turn's, the earlier turns' are never delivered."""
        limit = self.cfg.max_total_tokens
        first = self.fleet.generate(
            [list(r.prompt_ids) for r in records],
            dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, limit)),
        )
        groups = [[Trajectory([], [], c.finish_reason, None, []) for c in cs] for cs in first]
        for g, cs in zip(groups, first, strict=True):
            for t, c in zip(g, cs, strict=True):
                t.add(c, sampled=True)
        flat = [(r, t) for r, g in zip(records, groups, strict=True) for t in g]
        states: list[Any] = []  # rank 0's only (never broadcast: a state need not pickle)
        on_rank0(lambda: states.extend(self._env.start(r) for r, _ in flat), "starting episodes")
        open_ = [i for i, (_, t) in enumerate(flat) if not self._stopped(t, params)]
        for turn in range(2, self.cfg.max_turns + 1):
            open_ = self._observe(flat, states, open_)
            if not open_:
                break
            prompts = [list(flat[i][0].prompt_ids) + flat[i][1].token_ids for i in open_]
            budgets = tuple(min(params.max_new_tokens, limit - len(flat[i][1].token_ids)) for i in open_)
            seed = None if params.seed is None else params.seed + _TURN_SEED_STRIDE * (turn - 1)
            turn_params = dataclasses.replace(
                params, n=1, seed=seed, max_new_tokens=max(budgets), max_new_tokens_each=budgets
            )
            outs = self.fleet.generate(prompts, turn_params)
            for i, (c,) in zip(open_, outs, strict=True):
                flat[i][1].add(c, sampled=True)
                flat[i][1].turns += 1
            open_ = [i for i in open_ if not self._stopped(flat[i][1], params)]
        return groups

    @property
    def _env(self) -> Environment:
        assert self.env is not None, "the environment lives on global rank 0"
        return self.env

    def _stopped(self, t: Trajectory, params: SamplingParams) -> bool:
        """Ended by a stop token (EOS), or no room left for another token."""
        ended = bool(t.token_ids) and t.token_ids[-1] in params.stop_token_ids
        return ended or len(t.token_ids) >= self.cfg.max_total_tokens

    def _observe(
        self, flat: list[tuple[PromptRecord, Trajectory]], states: list[Any], open_: list[int]
    ) -> list[int]:
        """Rank 0's environment answers every open episode's last turn; the ones that go on get their
        observation ids appended. Returns them."""
        if not open_:
            return []

        def answer() -> list[StepResult]:
            texts = [
                self.tokenizer.decode(self._last_turn(flat[i][1]), skip_special_tokens=True) for i in open_
            ]
            return self._env.step([states[i] for i in open_], texts)

        steps = on_rank0(answer, "the environment's step")
        going = []
        for i, step in zip(open_, steps, strict=True):
            t = flat[i][1]
            t.tool_calls += step.tool_calls
            t.tool_errors += step.tool_errors
            t.tool_timeouts += step.tool_timeouts
            t.tool_truncated += step.tool_truncated
            if step.reward is not None:
                t.env_reward = (t.env_reward or 0.0) + step.reward
            if step.done or len(t.token_ids) + len(step.observation_ids) >= self.cfg.max_total_tokens:
                continue
            t.add(Completion(list(step.observation_ids), [], "stop"), sampled=False)
            going.append(i)
        return going

    @staticmethod
    def _last_turn(t: Trajectory) -> list[int]:
        assert t.loss_mask is not None
        k = len(t.loss_mask)
        while k > 0 and t.loss_mask[k - 1] == 1:
            k -= 1
        return t.token_ids[k:]


def trajectory_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """``turns/mean``, and over multi-turn trajectories the sums ``tool/calls``, ``tool/errors`` (failed
    calls, timeouts included), ``tool/timeouts`` and ``tool/truncated`` (outputs cut to
    ``rollout.multiturn.max_tool_output_chars``); {} for single-turn completions."""
    ts = [c for c in completions if isinstance(c, Trajectory)]
    if not ts:
        return {}
    return {
        "turns/mean": sum(t.turns for t in ts) / len(ts),
        "tool/calls": float(sum(t.tool_calls for t in ts)),
        "tool/errors": float(sum(t.tool_errors for t in ts)),
        "tool/timeouts": float(sum(t.tool_timeouts for t in ts)),
        "tool/truncated": float(sum(t.tool_truncated for t in ts)),
    }
