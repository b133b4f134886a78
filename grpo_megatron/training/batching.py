"""From scored rollouts to training micro-batches: pure functions, no process groups.

Shape legend: B rows of a micro-batch, S = prompt + response - 1 positions (the last token is
never an input). Position ``j`` of a row predicts token ``j + 1`` of its sequence, so the response
tokens of a sequence with a P-token prompt are predicted at positions ``P - 1 ... L - 2``: that is
where ``mask_s`` is 1 and where rollout / reference / old logprobs are stored.

How a global batch is split (every rank computes the same split from the same data, so no
communication is needed to agree on it):
1. mini-batches: ``updates_per_iteration`` contiguous slices of the batch (groups stay whole);
2. data-parallel shares: within a mini-batch, samples go to the DP rank with the fewest tokens
   so far, longest first (balanced work, deterministic);
3. micro-batches: a rank's share, longest first, cut into runs of ``micro_batch_size`` rows or
   filled to ``max_tokens`` tokens; ranks with fewer micro-batches than the busiest one add empty
   ones (expert-parallel collectives need every rank in every micro-batch).

Packed (``train.packing``, the default): a micro-batch's rows become one sequence of
``sum(lengths)`` tokens (training/packing.py) and the token budget is filled by first-fit
decreasing. Padded: rows are right-padded to the longest, and the budget counts
``rows x longest row``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

import torch

from grpo_megatron.training.forward_backward import MicroBatch
from grpo_megatron.training.packing import PackedRows, first_fit_decreasing


@dataclass
class Sample:
    """One response with everything the update needs, as 1-D tensors over label positions."""

    tokens_s: torch.Tensor
    """Input token ids: prompt + response without its last token."""
    labels_s: torch.Tensor
    """Next-token targets: prompt + response shifted by one."""
    mask_s: torch.Tensor
    """1.0 where the label is a response token the engine sampled (the loss is taken there), else 0:
    prompt positions and a multi-turn trajectory's observation tokens (rollout/multiturn.py)."""
    advantage: float
    """The response's group-relative advantage (the same for all its tokens)."""
    rollout_logprobs_s: torch.Tensor
    """Engine logprobs of the sampled tokens at their label positions (0 elsewhere)."""
    ref_logprobs_s: torch.Tensor | None = None
    """The frozen reference's logprobs (ref_logprob phase; None when the KL penalty is off)."""
    old_logprobs_s: torch.Tensor | None = None
    """pi_old's logprobs before this iteration's first update (old_logprob phase; None when skipped)."""
    routes: dict[str, torch.Tensor] = field(default_factory=dict)
    """MoE routes ``[moe_layers, S, top_k]`` at the input positions: "engine" (the rollout engine's,
    ``Completion.routed_experts``), "old" (the old-policy pass's own, for R2; -1 on layers of other
    pipeline stages)."""

    @property
    def length(self) -> int:
        return int(self.tokens_s.numel())


def make_sample(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    rollout_logprobs: Sequence[float],
    advantage: float,
    routed_experts: torch.Tensor | None = None,
    response_mask: Sequence[int] | None = None,
) -> Sample:
    """Lay out one (prompt, response) pair for the trainer (see the module docstring); the engine's
    routes, if any, already cover exactly the input positions. ``response_mask`` (a multi-turn
    trajectory's ``Completion.loss_mask``): 0 at response tokens the engine did not sample
    (observations), which then get neither loss nor logprobs; None = all sampled."""
    return make_samples(
        [prompt_ids], [response_ids], [rollout_logprobs], [advantage], [routed_experts], [response_mask]
    )[0]


def make_samples(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    rollout_logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float],
    routed_experts: Sequence[torch.Tensor | None] | None = None,
    response_masks: Sequence[Sequence[int] | None] | None = None,
) -> list[Sample]:
    """``make_sample`` of each (prompts[i], responses[i], ...) at once: the whole batch is laid out as
    Python lists and becomes three tensors (tokens, masks, rollout logprobs), each sample's tensors
    views of them (the advantages phase makes one sample per response: per-sample tensors cost more
    than the layout)."""
    n = len(responses)
    routes = routed_experts if routed_experts is not None else [None] * n
    masks = response_masks if response_masks is not None else [None] * n
    if not len(prompts) == len(rollout_logprobs) == len(advantages) == len(routes) == len(masks) == n:
        raise ValueError("make_samples: one prompt, logprob list, advantage, route and mask per response")
    seq: list[int] = []
    seq_lengths: list[int] = []
    mask_l: list[float] = []
    rollout_l: list[float] = []
    for prompt_ids, response_ids, logprobs, response_mask in zip(
        prompts, responses, rollout_logprobs, masks, strict=True
    ):
        if not prompt_ids or not response_ids:
            raise ValueError("a training sample needs a non-empty prompt and response")
        if len(logprobs) != len(response_ids):
            raise ValueError(f"{len(logprobs)} rollout logprobs for {len(response_ids)} response tokens")
        if response_mask is not None and len(response_mask) != len(response_ids):
            raise ValueError(f"a loss mask of {len(response_mask)} for {len(response_ids)} response tokens")
        seq += prompt_ids
        seq += response_ids
        seq_lengths.append(len(prompt_ids) + len(response_ids))
        before = [0.0] * (len(prompt_ids) - 1)
        mask = [1.0] * len(response_ids) if response_mask is None else [float(m) for m in response_mask]
        mask_l += before
        mask_l += mask
        rollout_l += before
        # lp * m in float64 then rounded equals float32(lp) * m for m in {0, 1} (-0.0 included)
        rollout_l += [lp * m for lp, m in zip(logprobs, mask, strict=True)]
    positions = [length - 1 for length in seq_lengths]
    seqs = torch.tensor(seq, dtype=torch.long).split(seq_lengths)
    masks_s = torch.tensor(mask_l, dtype=torch.float32).split(positions)
    rollouts_s = torch.tensor(rollout_l, dtype=torch.float32).split(positions)
    samples = []
    for seq_l, mask_s, rollout_s, advantage, routed in zip(
        seqs, masks_s, rollouts_s, advantages, routes, strict=True
    ):
        sample = Sample(seq_l[:-1], seq_l[1:], mask_s, float(advantage), rollout_s)
        if routed is not None:
            set_engine_routes(sample, routed)
        samples.append(sample)
    return samples


def set_engine_routes(sample: Sample, routed_experts: torch.Tensor) -> None:
    """The engine's routes of ``sample`` (``Completion.routed_experts``: every input position)."""
    if routed_experts.dim() != 3 or routed_experts.shape[1] != sample.length:
        raise ValueError(
            f"routed experts {tuple(routed_experts.shape)} for {sample.length} input positions "
            "(expected [moe_layers, len(prompt) + len(response) - 1, top_k])"
        )
    sample.routes["engine"] = routed_experts


def minibatch_slices(num_samples: int, num_minibatches: int) -> list[range]:
    """Contiguous, near-equal slices of ``range(num_samples)`` (groups stay together when the batch
    is group-ordered and num_minibatches divides the number of groups)."""
    if not 1 <= num_minibatches <= num_samples:
        raise ValueError(
            f"train.updates_per_iteration={num_minibatches} must be in [1, {num_samples}] "
            "(the number of responses in the batch)"
        )
    bounds = [round(i * num_samples / num_minibatches) for i in range(num_minibatches + 1)]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def dp_shares(lengths: Sequence[int], indices: Sequence[int], dp_size: int) -> list[list[int]]:
    """Assign ``indices`` (into ``lengths``) to ``dp_size`` ranks, longest first to the least-loaded."""
    load = [0] * dp_size
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += lengths[i]
    return [sorted(s) for s in shares]


def microbatch_rows(
    lengths: Sequence[int],
    indices: Sequence[int],
    *,
    micro_batch_size: int,
    max_tokens: int | None,
    packing: bool = False,
) -> list[list[int]]:
    """Group ``indices`` into micro-batches: longest first, ``micro_batch_size`` rows each, or (when
    ``max_tokens`` is set) filled to the token budget: packed, by first-fit decreasing on
    ``sum(lengths) <= max_tokens``; padded, as many consecutive rows as fit
    ``rows * longest_row <= max_tokens``. A row over the budget goes alone."""
    ordered = sorted(indices, key=lambda i: (-lengths[i], i))
    if max_tokens is None:
        return [ordered[k : k + micro_batch_size] for k in range(0, len(ordered), micro_batch_size)]
    if packing:
        return first_fit_decreasing(lengths, ordered, max_tokens)
    groups: list[list[int]] = []
    for i in ordered:
        # Rows are sorted longest first, so the first row of a group sets its padded length.
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def all_rank_microbatches(
    lengths: Sequence[int],
    indices: Sequence[int],
    *,
    dp_size: int,
    micro_batch_size: int,
    max_tokens: int | None,
    packing: bool = False,
) -> list[list[list[int]]]:
    """Every DP rank's micro-batches of ``indices``: its token-balanced share (``dp_shares``) cut by
    ``microbatch_rows``, padded with empty micro-batches to the busiest rank's count (expert-parallel
    collectives span DP ranks, so every rank must run the same number)."""
    per_rank = [
        microbatch_rows(
            lengths, share, micro_batch_size=micro_batch_size, max_tokens=max_tokens, packing=packing
        )
        for share in dp_shares(lengths, indices, dp_size)
    ]
    count = max(len(r) for r in per_rank)
    return [r + [[] for _ in range(count - len(r))] for r in per_rank]


def rank_microbatches(
    lengths: Sequence[int],
    indices: Sequence[int],
    *,
    dp_size: int,
    dp_rank: int,
    micro_batch_size: int,
    max_tokens: int | None,
    packing: bool = False,
) -> list[list[int]]:
    """This DP rank's micro-batches of ``indices`` (see ``all_rank_microbatches``)."""
    return all_rank_microbatches(
        lengths,
        indices,
        dp_size=dp_size,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        packing=packing,
    )[dp_rank]


def processed_tokens(lengths: Sequence[int], rows: Sequence[int], packing: bool) -> int:
    """Token positions the model runs for micro-batch ``rows``: ``sum(lengths)`` packed,
    ``rows x longest`` padded, 1 for an empty placeholder (before the rounding to a multiple of TP
    that sequence parallelism adds, and the 2 x cp row multiples of context parallelism, in
    training/forward_backward.py)."""
    if not rows:
        return 1
    if packing:
        return sum(lengths[i] for i in rows)
    return len(rows) * max(lengths[i] for i in rows)


def batch_metrics(
    lengths: Sequence[int], per_rank: Sequence[Sequence[Sequence[int]]], packing: bool
) -> dict[str, float]:
    """``batch/padding_frac`` (padded tokens / all tokens processed) and ``batch/tokens_per_microbatch``
    (mean tokens processed per micro-batch) over every DP rank's micro-batches (``all_rank_microbatches``)."""
    microbatches = [rows for rank in per_rank for rows in rank]
    processed = sum(processed_tokens(lengths, rows, packing) for rows in microbatches)
    real = sum(lengths[i] for rows in microbatches for i in rows)
    return {
        "batch/padding_frac": 1.0 - real / max(processed, 1),
        "batch/tokens_per_microbatch": processed / max(len(microbatches), 1),
    }


@dataclass
class LossInputs:
    """The per-row inputs of the GRPO loss for one micro-batch. They travel in ``MicroBatch.extras``
    (forward_backward moves them to the device with the tokens): ``to_extras`` / ``of`` are the only
    places that know it is a dict."""

    mask_bs: torch.Tensor
    """1.0 at response label positions, 0 at prompt and padding positions."""
    rollout_logprobs_bs: torch.Tensor
    advantages_b: torch.Tensor
    old_logprobs_bs: torch.Tensor | None = None
    """None unless every row has ``Sample.old_logprobs_s``."""
    ref_logprobs_bs: torch.Tensor | None = None
    """None unless every row has ``Sample.ref_logprobs_s``."""

    def to_extras(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def of(cls, mb: MicroBatch) -> LossInputs:
        return cls(**mb.extras)


def pad_routes(routes_msk: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Per-row routes ``[M, S_i, K]`` as right-padded rows ``[M, B, length, K]``, -1 at padding."""
    first = routes_msk[0]
    routes_lbsk = torch.full((first.shape[0], len(routes_msk), length, first.shape[2]), -1, dtype=first.dtype)
    for b, r in enumerate(routes_msk):
        routes_lbsk[:, b, : r.shape[1]] = r
    return routes_lbsk


def collate(
    samples: Sequence[Sample],
    rows: Sequence[int],
    pad_id: int,
    routes: str | None = None,
    *,
    packed: bool = False,
) -> MicroBatch:
    """Micro-batch of ``samples[rows]``: right-padded rows, or with ``packed`` their tokens laid end
    to end in one ``[1, T]`` sequence (``MicroBatch.packed`` says where each row lies). The per-token
    ``extras`` (and the routes) are right-padded ``[B, S]`` rows either way: the logprobs reach the
    loss unpacked. An empty ``rows`` gives one all-masked row (a placeholder micro-batch that
    contributes nothing but joins the collectives). ``routes``: which ``Sample.routes`` to carry as
    ``routes_lbsk`` (-1 at padding), when every row has them."""
    if not rows:
        one_11 = torch.full((1, 1), pad_id, dtype=torch.long)
        zeros_11 = torch.zeros(1, 1)
        inputs = LossInputs(
            zeros_11, zeros_11, torch.zeros(1), old_logprobs_bs=zeros_11, ref_logprobs_bs=zeros_11
        )
        return MicroBatch(
            tokens_bs=one_11,
            labels_bs=one_11.clone(),
            extras=inputs.to_extras(),
            packed=PackedRows((1,)) if packed else None,
        )
    s = max(samples[i].length for i in rows)

    def stack(get: Callable[[Sample], torch.Tensor | None], fill: float) -> torch.Tensor:
        rows_t = [t for i in rows if (t := get(samples[i])) is not None]
        assert len(rows_t) == len(rows)  # the callers stack only what every row has
        out = torch.full((len(rows), s), fill, dtype=rows_t[0].dtype)
        for b, t in enumerate(rows_t):
            out[b, : t.numel()] = t
        return out

    inputs = LossInputs(
        mask_bs=stack(lambda x: x.mask_s, 0.0),
        rollout_logprobs_bs=stack(lambda x: x.rollout_logprobs_s, 0.0),
        advantages_b=torch.tensor([samples[i].advantage for i in rows], dtype=torch.float32),
    )
    if all(samples[i].old_logprobs_s is not None for i in rows):
        inputs.old_logprobs_bs = stack(lambda x: x.old_logprobs_s, 0.0)
    if all(samples[i].ref_logprobs_s is not None for i in rows):
        inputs.ref_logprobs_bs = stack(lambda x: x.ref_logprobs_s, 0.0)
    routes_lbsk = None
    if routes is not None and all(routes in samples[i].routes for i in rows):
        routes_lbsk = pad_routes([samples[i].routes[routes] for i in rows], s)
    if packed:
        layout = PackedRows(tuple(samples[i].length for i in rows))
        return MicroBatch(
            tokens_bs=torch.cat([samples[i].tokens_s for i in rows])[None],
            labels_bs=torch.cat([samples[i].labels_s for i in rows])[None],
            position_ids_bs=layout.position_ids()[None],
            extras=inputs.to_extras(),
            packed=layout,
            routes_lbsk=routes_lbsk,
        )
    return MicroBatch(
        tokens_bs=stack(lambda x: x.tokens_s, pad_id),
        labels_bs=stack(lambda x: x.labels_s, pad_id),
        extras=inputs.to_extras(),
        routes_lbsk=routes_lbsk,
    )


LogprobKind = Literal["ref", "old"]
"""Which trainer-side logprobs a forward pass fills in: the reference's or pi_old's."""


def scatter_logprobs(
    samples: Sequence[Sample],
    plan: Sequence[Sequence[int]],
    outputs_bs: Sequence[torch.Tensor],
    kind: LogprobKind,
) -> None:
    """Store each row of the forward pass's ``[B, S]`` outputs on its sample as ``ref_logprobs_s`` or
    ``old_logprobs_s`` (masked to the response positions; padding rows of placeholder micro-batches
    are skipped)."""
    for rows, out_bs in zip(plan, outputs_bs, strict=True):
        for b, i in enumerate(rows):
            sample = samples[i]
            logprobs_s = out_bs[b, : sample.length].detach().float().cpu() * sample.mask_s
            if kind == "ref":
                sample.ref_logprobs_s = logprobs_s
            else:
                sample.old_logprobs_s = logprobs_s
