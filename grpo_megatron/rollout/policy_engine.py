"""The rollout engine of ``rollout.true_on_policy``: the trainer's own megatron-core model generates.

Every rank holds one (``rollout/placement.py`` puts an engine on each) and every rank runs each
decode step together: tensor-parallel peers on the same rows (each rank's share of the prompts
gathered over its TP group, ``_replica_share``), expert-parallel peers through the MoE all-to-all,
each data-parallel replica on its own prompts, in lockstep until no rank has a row left. A step is
one forward of every active row's tokens so far, packed as the trainer packs a micro-batch (the job's
``PolicyForward``: ``training/forward_backward.py:forward_last_logits``, the same padding and model
call as a training pass), under ``BatchInvariantMode`` and the model's batch-invariant attention
(``models/batch_invariant.py``): the logits of a row's last token are then bit for bit those the
trainer's forward of the whole response computes at that position. The next token is sampled in
fp32 from ``softmax(logits / T)`` over the whole vocabulary (the TP slices gathered; the same
generator on every TP peer), and its logprob is ``models/logprobs.py:vocab_parallel_logprobs`` of
those logits, the function every trainer pass calls: the behaviour logprob equals the trainer's,
bitwise, at the same weights (``tests/test_true_on_policy.py``). The engine holds no weights: it
uses the policy's own, so a weight sync moves no bytes (``weight_needs``) and only sets its version.

No KV cache: a step recomputes every prefix (O(length^2) per response; ``bench/true_on_policy.py``
measures it): exactness needs every key computed as the trainer's forward computes it.

Shape legend: R rows of a step, Vt this TP rank's vocabulary slice, V the padded vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from grpo_megatron.algorithm.truncation import keep_mask
from grpo_megatron.models.batch_invariant import BatchInvariantMode
from grpo_megatron.models.logprobs import vocab_parallel_logprobs
from grpo_megatron.rollout.engine import Bucket, Completion, RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from grpo_megatron.distributed.bootstrap import ParallelState


class PolicyForward(Protocol):
    """What the policy engine asks of the trainer's model (``training/job.py`` gives it); both
    collective over every rank."""

    def last_logits(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[R, Vt]``: each row's logits at its last token, the rows packed as a training pass packs."""
        ...

    def logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> list[list[float]]:
        """The trainer's logprobs of each sequence's tokens after its prompt."""
        ...


@dataclass
class _Row:
    """One response being generated."""

    prompt: int
    tokens: list[int]
    budget: int
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


def _gather_vocab(logits_rvt: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Every TP rank's vocabulary slice of ``[R, Vt]`` logits, ``[R, V]``."""
    if ps.tp == 1:
        return logits_rvt
    parts = [torch.empty_like(logits_rvt) for _ in range(ps.tp)]
    dist.all_gather(parts, logits_rvt.contiguous(), group=ps.tp_group)
    return torch.cat(parts, dim=-1)


def sample_next(
    logits_rvt: torch.Tensor,
    ps: ParallelState,
    params: SamplingParams,
    vocab_size: int,
    generator: torch.Generator,
) -> tuple[list[int], list[float]]:
    """(next token, its logprob) of each row from its last-token logits: sampled in fp32 from
    ``softmax(logits / T)`` (greedy: the argmax), the logprob by the trainer's function."""
    z_rv = _gather_vocab(logits_rvt, ps).float()[:, :vocab_size]
    truncation = None if params.greedy or not params.truncation.active else params.truncation
    if params.greedy:
        tokens_r = z_rv.argmax(dim=-1)
    else:
        z_rv = z_rv / params.temperature
        kept_rv = (
            z_rv if truncation is None else z_rv.masked_fill(~keep_mask(z_rv, truncation), float("-inf"))
        )
        tokens_r = torch.multinomial(torch.softmax(kept_rv, dim=-1), 1, generator=generator).squeeze(-1)
    logprobs_r, _ = vocab_parallel_logprobs(
        logits_rvt[:, None],
        tokens_r[:, None].to(logits_rvt.device),
        tp_group=ps.tp_group,
        vocab_start=ps.tp_rank * logits_rvt.shape[-1],
        temperature=params.temperature,
        vocab_size=vocab_size,
        truncation=truncation,
    )
    return tokens_r.tolist(), logprobs_r[:, 0].tolist()


def _any_rank(flag: bool, ps: ParallelState) -> bool:
    """Collective over the world: whether any rank still has rows (the steps go on in lockstep)."""
    flag_t = torch.tensor([int(flag)], dtype=torch.int64, device=ps.device)
    dist.all_reduce(flag_t, op=dist.ReduceOp.MAX)
    return bool(flag_t.item())


def policy_generate(
    last_logits: Callable[[Sequence[Sequence[int]]], torch.Tensor],
    ps: ParallelState,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    vocab_size: int,
) -> list[list[Completion]]:
    """Collective over every rank: ``params.n`` responses to each of ``prompts`` (this rank's replica's:
    TP peers pass the same), each step's logits from ``last_logits``. A rank whose rows all ended joins
    the others' steps with one row, whose output it drops."""
    if params.stop_strings:
        raise ValueError(
            "rollout.true_on_policy: the policy engine ends responses on stop token ids, not strings"
        )
    generator = torch.Generator(device=ps.device).manual_seed(0 if params.seed is None else params.seed)
    budgets = params.budgets(len(prompts))
    rows = [_Row(i, list(p), budgets[i]) for i, p in enumerate(prompts) for _ in range(params.n)]
    stops = set(params.stop_token_ids)
    with BatchInvariantMode():
        while _any_rank(any(r.finish is None for r in rows), ps):
            active = [r for r in rows if r.finish is None]
            step = active or [_Row(0, list(prompts[0]) if prompts else [0], 1)]
            tokens, logprobs = sample_next(
                last_logits([r.tokens for r in step]), ps, params, vocab_size, generator
            )
            for row, token, logprob in zip(active, tokens, logprobs, strict=False):
                row.tokens.append(token)
                row.response.append(token)
                row.logprobs.append(logprob)
                if token in stops:
                    row.finish = "stop"
                elif len(row.response) >= row.budget:
                    row.finish = "length"
    groups: list[list[Completion]] = [[] for _ in prompts]
    for row in rows:
        groups[row.prompt].append(
            Completion(row.response, row.logprobs, "stop" if row.finish == "stop" else "length")
        )
    return groups


def _nothing(name: str) -> bool:
    """The policy engine's weight needs: none (it generates with the policy's own weights)."""
    return False


class PolicyEngine(RolloutEngine):
    """``rollout.true_on_policy``'s engine on one rank (module docstring)."""

    collective = True

    def __init__(self, forward: PolicyForward, ps: ParallelState, vocab_size: int):
        self.forward, self.ps, self.vocab_size = forward, ps, vocab_size

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Collective: this rank's share of a fleet request (``RolloutFleet.submit`` gives every rank
        one, empty ones too), generated with its TP peers' shares as one replica's."""
        replica, mine, params = self._replica_share(prompts, params)
        groups = policy_generate(
            self.forward.last_logits, self.ps, replica, params, vocab_size=self.vocab_size
        )
        return groups[mine[0] : mine[1]]

    def _replica_share(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> tuple[list[list[int]], tuple[int, int], SamplingParams]:
        """(the prompts of this rank's TP group in TP-rank order, where this rank's lie among them, the
        group's sampling: its first rank's seed, every prompt's own limit)."""
        if self.ps.tp == 1:
            return [list(p) for p in prompts], (0, len(prompts)), params
        shares: list[tuple[list[list[int]], SamplingParams] | None] = [None] * self.ps.tp
        dist.all_gather_object(shares, ([list(p) for p in prompts], params), group=self.ps.tp_group)
        replica = [p for share in shares if share is not None for p in share[0]]
        start = sum(len(share[0]) for share in shares[: self.ps.tp_rank] if share is not None)
        first = next((share[1] for share in shares if share is not None and share[0]), params)
        budgets = [b for share in shares if share is not None for b in share[1].budgets(len(share[0]))]
        return (
            replica,
            (start, start + len(prompts)),
            dataclasses.replace(first, max_new_tokens_each=tuple(budgets)),
        )

    def score(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> list[list[float]]:
        with BatchInvariantMode():
            return self.forward.logprobs(sequences, prompt_lens, temperature)

    def weight_needs(self) -> Callable[[str], bool]:
        return _nothing

    def update_weights(self, bucket: Bucket, *, version: int, last: bool) -> None:
        if last:
            self.weight_version = version
