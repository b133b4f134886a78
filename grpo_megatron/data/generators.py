"""Procedural task generators: seeded problems with exact answers and gold solutions, no downloads.

A generator is a module-level function ``fn(rng: random.Random, **kwargs) -> Problem`` drawing one
problem; ``GENERATORS`` maps its exact name to it. ``generate_splits`` turns one into a held-out set
(distinct problems) and a training set that never repeats a held-out prompt, both determined by the
seed alone. Pure Python (no torch, no transformers): config validation imports this module.

- ``arithmetic``: fixed-width addition with the sum zero-padded to digits+1 and written
  least-significant digit first (``042+317=`` -> ``9530``; GUIDE section 7). Reward: ``exact_match``.
- ``tool_arithmetic``: ``a*b=`` written the usual way, solved with one calculator call of a multi-turn
  tool episode (``<calc>a*b</calc><result>R</result>R``). Reward: ``exact_match`` after ``</result>``.
- ``countdown``: reach a target with each given number used exactly once and + - * / (TinyZero's
  task). Prompt ``3,5,7:56=``; gold ``<answer>(3+5)*7</answer>``; metadata ``numbers`` and
  ``target`` for the ``countdown`` reward.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

__all__ = [
    "Problem",
    "GENERATORS",
    "DEFAULT_NUM_TRAIN",
    "DEFAULT_NUM_EVAL",
    "arithmetic",
    "countdown",
    "tool_arithmetic",
    "generate_splits",
    "generator_kwargs_errors",
]

DEFAULT_NUM_TRAIN = 50_000
DEFAULT_NUM_EVAL = 200
# Draws allowed per wanted problem before a split is declared impossible (the problem space is too
# small for the requested sizes); generous, since a rejection costs microseconds.
_DRAWS_PER_PROBLEM = 50


@dataclass(frozen=True)
class Problem:
    """One generated problem."""

    prompt: str
    """The task text before any template."""
    answer: str
    """The exact reference answer (the reward's label)."""
    solution: str
    """A gold response for supervised cold start (without EOS: the dataset appends it)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Task data the reward reads (countdown: numbers, target)."""


def arithmetic(
    rng: random.Random, digits: int = 3, reverse_answer: bool = True, reverse_operands: bool = False
) -> Problem:
    """`a+b=` with both operands zero-padded to `digits`; the answer is the sum zero-padded to
    digits+1 and, with `reverse_answer`, written least-significant digit first (a left-to-right model
    then produces each digit after the carry it depends on). With `reverse_operands` the operands are
    written least-significant digit first too ("042+317=" becomes "240+713="): answer digit i then
    sits at a fixed distance from the operand digits it sums, whatever i, a pattern attention with
    relative positions (RoPE) learns much sooner than one whose distance changes with i."""
    if not isinstance(digits, int) or isinstance(digits, bool) or not 1 <= digits <= 18:
        raise ValueError(f"digits={digits!r} must be an integer in [1, 18]")
    for name, flag in (("reverse_answer", reverse_answer), ("reverse_operands", reverse_operands)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={flag!r} must be true or false")
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    total = f"{a + b:0{digits + 1}d}"
    answer = total[::-1] if reverse_answer else total
    a_s, b_s = f"{a:0{digits}d}", f"{b:0{digits}d}"
    if reverse_operands:
        a_s, b_s = a_s[::-1], b_s[::-1]
    return Problem(prompt=f"{a_s}+{b_s}=", answer=answer, solution=answer, metadata={"a": a, "b": b})


def tool_arithmetic(rng: random.Random, digits: int = 3, op: str = "*") -> Problem:
    """`a*b=` (or `+`, `-`) with operands of up to `digits` digits, written the usual way; the answer is
    the exact result. The gold solution calls the calculator of a multi-turn tool episode
    (rollout.multiturn, default call format) and copies its result:
    ``<calc>a*b</calc><result>R</result>R``. Reward: ``exact_match`` with ``after: "</result>"``."""
    if not isinstance(digits, int) or isinstance(digits, bool) or not 1 <= digits <= 9:
        raise ValueError(f"digits={digits!r} must be an integer in [1, 9]")
    if op not in ("+", "-", "*"):
        raise ValueError(f"op={op!r} must be one of + - *")
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    expr = f"{a}{op}{b}"
    return Problem(
        prompt=f"{expr}=",
        answer=str(value),
        solution=f"<calc>{expr}</calc><result>{value}</result>{value}",
        metadata={"a": a, "b": b},
    )


_COUNTDOWN_OPS = ("+", "-", "*", "/")
_MAX_COUNTDOWN_TRIES = 10_000


def countdown(
    rng: random.Random, num_numbers: int = 3, max_number: int = 20, max_target: int = 100
) -> Problem:
    """`num_numbers` integers in [1, max_number] and a target in [1, max_target] reachable by using
    each exactly once with + - * / (every division in the gold solution is exact). The gold expression
    is built first, so every problem has a solution."""
    for name, given, low in (
        ("num_numbers", num_numbers, 2),
        ("max_number", max_number, 1),
        ("max_target", max_target, 1),
    ):
        if not isinstance(given, int) or isinstance(given, bool) or given < low:
            raise ValueError(f"{name}={given!r} must be an integer >= {low}")
    if num_numbers > 6:
        raise ValueError(
            f"num_numbers={num_numbers} must be <= 6 (the countdown reward's expressions stay short)"
        )
    for _ in range(_MAX_COUNTDOWN_TRIES):
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        expr, value = _random_expression(rng, numbers)
        if value is not None and value.denominator == 1 and 1 <= value <= max_target:
            shown = list(numbers)
            rng.shuffle(shown)
            target = int(value)
            return Problem(
                prompt=f"{','.join(map(str, shown))}:{target}=",
                answer=str(target),
                solution=f"<answer>{expr}</answer>",
                metadata={"numbers": shown, "target": target},
            )
    raise ValueError(
        f"no countdown problem with num_numbers={num_numbers}, max_number={max_number} reaches a target "
        f"in [1, max_target={max_target}] in {_MAX_COUNTDOWN_TRIES} tries: raise max_target"
    )


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, Fraction | None]:
    """A random expression tree over all `numbers` (each once): its text (inner nodes parenthesised)
    and exact value; value None when a division is not exact or divides by zero."""
    items: list[tuple[str, Fraction, bool]] = [
        (str(n), Fraction(n), True) for n in numbers
    ]  # (text, value, leaf)
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (ta, va, la), (tb, vb, lb) = items[i], items[j]
        op = rng.choice(_COUNTDOWN_OPS)
        if op == "/":
            if vb == 0 or (va / vb).denominator != 1:
                return "", None
            value = va / vb
        else:
            value = {"+": va + vb, "-": va - vb, "*": va * vb}[op]
        text = f"{ta if la else f'({ta})'}{op}{tb if lb else f'({tb})'}"
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [(text, value, False)]
    return items[0][0], items[0][1]


GENERATORS: dict[str, Callable[..., Problem]] = {
    "arithmetic": arithmetic,
    "countdown": countdown,
    "tool_arithmetic": tool_arithmetic,
}


def _kwarg_names(fn: Callable[..., Problem]) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "rng"]


def generator_kwargs_errors(name: str, kwargs: Mapping[str, Any]) -> list[str]:
    """Problems with `data.generator` / `data.generator_kwargs`, each naming the field and the fix
    (empty when fine). Draws one problem to check the values."""
    if name not in GENERATORS:
        return [f"data.generator={name!r} is not a generator: use one of {', '.join(GENERATORS)}"]
    fn = GENERATORS[name]
    allowed = _kwarg_names(fn)
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        return [
            f"data.generator_kwargs has {unknown} which generator {name!r} does not take: use only {allowed}"
        ]
    try:
        fn(random.Random(0), **kwargs)
    except ValueError as err:
        return [f"data.generator_kwargs={dict(kwargs)!r}: {err}"]
    return []


def generate_splits(
    name: str, kwargs: Mapping[str, Any], seed: int, num_train: int, num_eval: int
) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) problems of generator `name`, determined by (name, kwargs, seed, sizes).

    Eval problems have distinct prompts; train problems are drawn independently (repeats allowed,
    as in a stream) but never with a held-out prompt. The eval set depends only on the seed and
    num_eval, so changing num_train keeps the same held-out prompts.
    """
    errors = generator_kwargs_errors(name, kwargs)
    if errors:
        raise ValueError("\n".join(errors))
    fn = GENERATORS[name]
    # String seeds are hashed with sha512 by random.Random: stable across runs and Python versions.
    eval_rng = random.Random(f"{name}:{seed}:eval")
    train_rng = random.Random(f"{name}:{seed}:train")

    eval_problems: list[Problem] = []
    held_out: set[str] = set()
    for _ in range(_DRAWS_PER_PROBLEM * num_eval):
        if len(eval_problems) == num_eval:
            break
        p = fn(eval_rng, **kwargs)
        if p.prompt not in held_out:
            held_out.add(p.prompt)
            eval_problems.append(p)
    if len(eval_problems) < num_eval:
        raise ValueError(
            f"data.num_eval_prompts={num_eval}: generator {name!r} with {dict(kwargs)} found only "
            f"{len(eval_problems)} distinct problems: lower data.num_eval_prompts or make the task larger"
        )

    train_problems: list[Problem] = []
    for _ in range(_DRAWS_PER_PROBLEM * num_train):
        if len(train_problems) == num_train:
            break
        p = fn(train_rng, **kwargs)
        if p.prompt not in held_out:
            train_problems.append(p)
    if len(train_problems) < num_train:
        raise ValueError(
            f"data.num_train_prompts={num_train}: the held-out set of generator {name!r} covers almost every "
            "problem: lower data.num_eval_prompts or make the task larger"
        )
    return train_problems, eval_problems
