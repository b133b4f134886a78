"""Multi-turn episode helpers shared by tests/test_multiturn.py and the real-SGLang worker: a recorder of
what a real engine was asked and returned, an environment with known observations, and the rebuild of
each trajectory from those two alone (what the trainer must see, bit for bit)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo_megatron.data import PromptRecord
from grpo_megatron.rollout.engine import Completion, SamplingParams
from grpo_megatron.rollout.multiturn import Environment, StepResult, Trajectory


class RecordingEngine:
    """A real engine; every generate call's prompts and completions are kept."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.calls: list[tuple[list[list[int]], list[list[Completion]]]] = []
        self.budgets: list[list[int]] = []
        """Each call's per-prompt ``max_new_tokens`` (``SamplingParams.budgets``)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """As ``RolloutFleet.generate`` on one rank, except that routes stay on the completions
        (``params.routes`` has nothing to hold back)."""
        out = self.engine.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], out))
        self.budgets.append(params.budgets(len(prompts)))
        return out


class CountingEnvironment(Environment):
    """Answers turn k with ``template.format(k)`` tokenized on its own; done after ``turns`` steps."""

    def __init__(self, tokenizer: Any, turns: int, template: str = "<result>{}</result>"):
        self.tokenizer, self.turns, self.template = tokenizer, turns, template

    def observation(self, k: int) -> list[int]:
        return list(self.tokenizer.encode(self.template.format(k), add_special_tokens=False))

    def start(self, record: PromptRecord) -> dict[str, int]:
        return {"turn": 0}

    def step(self, states: Sequence[Any], turn_texts: Sequence[str]) -> list[StepResult]:
        out = []
        for s in states:
            s["turn"] += 1
            out.append(
                StepResult(
                    self.observation(s["turn"]), done=s["turn"] >= self.turns, reward=0.5, tool_calls=1
                )
            )
        return out


def rebuild(
    records: Sequence[PromptRecord],
    groups: Sequence[Sequence[Trajectory]],
    engine: RecordingEngine,
    env: CountingEnvironment,
) -> list[tuple[list[int], list[int], list[float]]]:
    """(ids, loss mask, logprobs) of every trajectory from the engine's recorded calls and the
    environment's observations only. Turn 1 is the first call's; the call of turn k + 1 has one row per
    episode still open, in prompt-and-sample order (those with more than k turns), and must have been
    asked to continue exactly the ids before it (asserted)."""
    flat = [
        (r, t, c)
        for r, g, cs in zip(records, groups, engine.calls[0][1], strict=True)
        for t, c in zip(g, cs, strict=True)
    ]
    out = []
    for i, (r, t, c) in enumerate(flat):
        ids, mask, logprobs = list(c.token_ids), [1] * len(c.token_ids), list(c.logprobs)
        for turn in range(1, t.turns):
            obs = env.observation(turn)
            ids, mask, logprobs = ids + obs, mask + [0] * len(obs), logprobs + [0.0] * len(obs)
            prompts, outs = engine.calls[turn]
            row = sum(1 for _, u, _ in flat[:i] if u.turns > turn)
            assert prompts[row] == list(r.prompt_ids) + ids, f"turn {turn + 1} did not continue the exact ids"
            (sampled,) = outs[row]
            ids, mask = ids + sampled.token_ids, mask + [1] * len(sampled.token_ids)
            logprobs = logprobs + sampled.logprobs
        out.append((ids, mask, logprobs))
    return out
