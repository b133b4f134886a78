"""Sharded forward (and backward) over many micro-batches, producing per-token logprobs.

Shape legend: B micro-batch size, S sequence length (padded up to a multiple of TP for sequence
parallelism, and cut back before anything leaves this module), T packed length.

A packed micro-batch (``MicroBatch.packed``, training/packing.py) runs as one ``[1, T]`` sequence
with megatron's ``PackedSeqParams``; its logprobs and entropy are unpacked to right-padded
``[B, S]`` rows before ``loss_fn`` sees them and before they are returned, so callers handle
packed and padded micro-batches alike.

One function serves the three trainer passes of a GRPO iteration:
- reference logprobs and old-policy logprobs: ``forward_logprobs`` (forward only);
- the policy update: ``forward_backward`` with a loss function of (logprobs, entropy, batch).

Both run megatron's pipeline schedule (``get_forward_backward_func``), so PP stages exchange
activations the usual way; logits exist only on the last stage, and what they produce (logprobs
or loss metrics) is broadcast over the pipeline group so every rank returns the same list.

Loss normalisation: megatron is configured with ``calculate_per_token_loss=True`` and our
``finalize_model_grads`` wrapper passes no token count, so megatron neither divides by the number
of micro-batches nor averages over data-parallel ranks: gradients are plain sums. ``loss_fn``
must therefore return each micro-batch's contribution to the *global* loss (e.g. token sums
divided by the global token count), which makes results independent of how the global batch is
split over micro-batches and DP ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from grpo_megatron.algorithm.truncation import Truncation
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.distributed.collectives import collective_device
from grpo_megatron.distributed.context_parallel import gather_outputs, local_index
from grpo_megatron.models.logprobs import vocab_parallel_logprobs
from grpo_megatron.models.routing import RoutingPass
from grpo_megatron.training.packing import PackedRows, packed_seq_params

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig


@dataclass
class MicroBatch:
    """One micro-batch. ``labels_bs[:, i]`` is the token whose log-prob position ``i`` predicts."""

    tokens_bs: torch.Tensor
    labels_bs: torch.Tensor
    position_ids_bs: torch.Tensor | None = None
    """None: 0..S-1 per row. Packed sequences restart positions at each row start."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token or per-sequence inputs of ``loss_fn`` (advantages, old logprobs, masks...), as
    right-padded ``[B, S]`` rows also when the micro-batch is packed."""
    packed: PackedRows | None = None
    """None: ``tokens_bs`` holds right-padded rows. Else ``tokens_bs`` is ``[1, T]``: these rows end
    to end, run with megatron's PackedSeqParams (attention never crosses rows)."""
    routes_lbsk: torch.Tensor | None = None
    """MoE expert ids per MoE layer, row, position and top-k slot (-1 at padding), as right-padded rows
    also when the micro-batch is packed: the routes a ``RoutingPass`` replays or compares against
    (``models/routing.py``); they are padded, packed and split over CP ranks with the tokens."""


@dataclass
class LogprobOutput:
    logprobs_bs: torch.Tensor
    entropy_bs: torch.Tensor | None


LossFn = Callable[
    [torch.Tensor, torch.Tensor | None, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]
]


@dataclass
class _Padded:
    """A micro-batch padded to its target shape (and, with context parallelism, cut to this rank's
    chunks), with what its outputs are cut back to."""

    mb: MicroBatch
    source: MicroBatch
    """The caller's micro-batch."""
    rows: int
    """B of the outputs (rows of the caller's micro-batch)."""
    length: int
    """S of the outputs (the longest row)."""
    layout: PackedRows | None = None
    """Where the rows lie in the packed sequence the model runs (slots padded for CP)."""
    packed_seq_params: Any = None
    """megatron's PackedSeqParams of a packed micro-batch."""

    @property
    def real(self) -> tuple[int, int]:
        """The part of ``mb.tokens_bs`` that holds real rows: ``(rows, length)``, or ``(1, tokens)``
        of the packed sequence."""
        return (self.rows, self.length) if self.layout is None else (1, self.layout.total)


def _cp_multiple(ps: ParallelState) -> int:
    """Packed lengths: a multiple of TP under sequence parallelism, and with context parallelism
    every segment a multiple of 2 x cp (the load-balanced chunks) and each rank's share of TP."""
    tp = ps.tp if ps.sequence_parallel else 1
    return tp if ps.cp == 1 else 2 * ps.cp * tp


def _layout(mb: MicroBatch, ps: ParallelState) -> PackedRows | None:
    if mb.packed is None or ps.cp == 1:
        return mb.packed
    return mb.packed.padded_to(2 * ps.cp)


def _pad(mb: MicroBatch, rows: int, length: int, ps: ParallelState) -> _Padded:
    """Pad a micro-batch to ``[rows, length]``. Padding rows/columns are cut from every output; a
    packed micro-batch's padded tail is one more attention segment (``PackedRows.cu_seqlens``), and
    with context parallelism this rank keeps its chunks of every segment."""
    device = ps.device
    extras = {k: v.to(device) for k, v in mb.extras.items()}
    b, s = mb.tokens_bs.shape
    if mb.packed is None:
        pad_s, pad_b = length - s, rows - b
        position_ids_bs = (
            mb.position_ids_bs if mb.position_ids_bs is not None else torch.arange(s).expand(b, s)
        )
        routes = mb.routes_lbsk
        padded = MicroBatch(
            tokens_bs=F.pad(mb.tokens_bs, (0, pad_s, 0, pad_b)).to(device),
            labels_bs=F.pad(mb.labels_bs, (0, pad_s, 0, pad_b)).to(device),
            position_ids_bs=F.pad(position_ids_bs, (0, pad_s, 0, pad_b)).to(device),
            extras=extras,
            routes_lbsk=None if routes is None else F.pad(routes, (0, 0, 0, pad_s, 0, pad_b), value=-1),
        )
        return _Padded(padded, mb, b, s)
    if b != 1 or s != mb.packed.total:
        raise ValueError(
            f"a packed micro-batch has tokens [1, {mb.packed.total}], got {list(mb.tokens_bs.shape)}"
        )
    packed, layout = mb.packed, _layout(mb, ps)
    assert layout is not None

    def lay_out(x_t: torch.Tensor) -> torch.Tensor:
        x_t = x_t if layout is packed else layout.pack(packed.unpack(x_t))
        return F.pad(x_t, (0, length - layout.total))

    cp_group = ps.cp_group if ps.cp > 1 else None
    params = packed_seq_params(layout, length, device, cp_group)
    tokens_t, labels_t = lay_out(mb.tokens_bs[0]), lay_out(mb.labels_bs[0])
    position_ids_t = F.pad(layout.position_ids(), (0, length - layout.total))
    routes_tlk = None
    if mb.routes_lbsk is not None:  # rows [L, B, S, K] -> the packed order [T, L, K], -1 in padding
        routes_tlk = layout.pack(mb.routes_lbsk.permute(1, 2, 0, 3), fill=-1)
        routes_tlk = F.pad(routes_tlk, (0, 0, 0, 0, 0, length - layout.total), value=-1)
    if cp_group is not None:
        index_l = local_index(params.cu_seqlens_q_padded.cpu(), ps.cp, ps.cp_rank)
        tokens_t, labels_t, position_ids_t = tokens_t[index_l], labels_t[index_l], position_ids_t[index_l]
        routes_tlk = None if routes_tlk is None else routes_tlk[index_l]
    padded = MicroBatch(
        tokens_bs=tokens_t[None].to(device),
        labels_bs=labels_t[None].to(device),
        position_ids_bs=position_ids_t[None].to(device),
        extras=extras,
        packed=mb.packed,
        routes_lbsk=None if routes_tlk is None else routes_tlk.permute(1, 0, 2)[:, None],
    )
    return _Padded(padded, mb, len(packed.lengths), packed.max_length, layout, params)


def _as_packed(mb: MicroBatch) -> MicroBatch:
    """Right-padded rows as a packed micro-batch of rows as long as the padded length."""
    if mb.packed is not None:
        return mb
    b, s = mb.tokens_bs.shape
    return MicroBatch(
        mb.tokens_bs.reshape(1, -1),
        mb.labels_bs.reshape(1, -1),
        extras=mb.extras,
        packed=PackedRows((s,) * b),
        routes_lbsk=mb.routes_lbsk,
    )


def _padded_shapes(
    microbatches: Sequence[MicroBatch], ps: ParallelState, uniform: bool
) -> list[tuple[int, int]]:
    """Target ``(rows, length)`` per micro-batch, before any CP split: lengths a multiple of TP
    under sequence parallelism (of ``_cp_multiple`` when packed); with ``uniform``, the largest
    shape over all ranks (see ``_Runner.run``)."""
    shapes_n2 = torch.tensor(
        [
            [1, layout.total] if (layout := _layout(mb, ps)) else list(mb.tokens_bs.shape)
            for mb in microbatches
        ],
        dtype=torch.long,
    )
    if uniform:
        shapes_n2 = shapes_n2.to(collective_device())
        dist.all_reduce(shapes_n2, op=dist.ReduceOp.MAX)
        shapes_n2 = shapes_n2.cpu()
    tp = ps.tp if ps.sequence_parallel else 1
    for n, mb in enumerate(microbatches):
        multiple = _cp_multiple(ps) if mb.packed is not None else tp
        shapes_n2[n, 1] = (shapes_n2[n, 1] + multiple - 1) // multiple * multiple
    return [(int(b), int(s)) for b, s in shapes_n2]


class _Runner:
    """Shared plumbing of the forward-only and the forward-backward passes."""

    def __init__(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        ps: ParallelState,
        *,
        vocab_size: int,
        temperature: float,
        with_entropy: bool,
        routing: RoutingPass | None = None,
        truncation: Truncation | None = None,
    ) -> None:
        self.chunks = model if isinstance(model, list) else [model]
        self.ps = ps
        self.vocab_size = vocab_size
        self.temperature = temperature
        self.truncation = truncation
        self.with_entropy = with_entropy
        self.routing = routing

    def logprobs(self, logits_bsvt: torch.Tensor, p: _Padded) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropy) of ``p``'s labels as ``[B, S]`` rows (unpacked when packed)."""
        mb = p.mb
        vocab_start = self.ps.tp_rank * logits_bsvt.shape[-1]
        logprobs_bs, entropy_bs = vocab_parallel_logprobs(
            logits_bsvt,
            mb.labels_bs,
            tp_group=self.ps.tp_group,
            vocab_start=vocab_start,
            temperature=self.temperature,
            truncation=self.truncation,
            with_entropy=self.with_entropy,
            vocab_size=self.vocab_size,
        )
        if p.layout is not None:
            return self.unpack(logprobs_bs[0], p), None if entropy_bs is None else self.unpack(
                entropy_bs[0], p
            )
        return logprobs_bs[: p.rows, : p.length], None if entropy_bs is None else entropy_bs[
            : p.rows, : p.length
        ]

    def unpack(self, x_l: torch.Tensor, p: _Padded) -> torch.Tensor:
        """Per-token outputs of the packed sequence (this rank's chunks of it under CP) -> ``[B, S]``."""
        assert p.layout is not None
        if self.ps.cp > 1:  # every CP rank gets every token, and computes the same loss from them
            x_l = gather_outputs(x_l, p.packed_seq_params.cu_seqlens_q_padded, self.ps.cp_group)
        return p.layout.unpack(x_l)

    def run(self, microbatches: Sequence[MicroBatch], loss_func_for: Callable, *, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # megatron's allgather MoE dispatcher all-gathers tokens over the expert-parallel group,
        # whose ranks hold different data-parallel micro-batches: their shapes must agree.
        config: TransformerConfig = self.chunks[0].config
        uniform = (
            bool(config.num_moe_experts)
            and config.moe_token_dispatcher_type == "allgather"
            and self.ps.ep > 1
        )
        if self.ps.cp > 1:
            # Context parallelism splits packed sequences only: right-padded rows (the mismatch
            # probe, verify) run as packed rows of their padded length, which is exact.
            microbatches = [_as_packed(mb) for mb in microbatches]
        shapes = _padded_shapes(microbatches, self.ps, uniform)
        padded = [_pad(mb, b, s, self.ps) for mb, (b, s) in zip(microbatches, shapes, strict=True)]

        def step(data_iterator: Iterator[_Padded], model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
            p = next(data_iterator)
            if self.routing is not None:  # targets for this micro-batch's routers on this stage
                rows, length = p.mb.tokens_bs.shape
                self.routing.before_microbatch(p.mb.routes_lbsk, (rows, length), p.real)
            if p.packed_seq_params is None:
                output = model(p.mb.tokens_bs, p.mb.position_ids_bs, None)
            else:
                output = model(
                    p.mb.tokens_bs, p.mb.position_ids_bs, None, packed_seq_params=p.packed_seq_params
                )
            return output, partial(loss_func_for, p)

        results = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(padded),
            model=self.chunks,
            num_microbatches=len(padded),
            seq_length=max(p.mb.tokens_bs.shape[1] for p in padded),
            micro_batch_size=max(p.mb.tokens_bs.shape[0] for p in padded),
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )
        return self.broadcast_from_last_stage(list(results) if self.ps.is_last_pp_stage else None)

    def broadcast_from_last_stage(self, results: list | None) -> list:
        """Every pipeline stage gets the last stage's per-micro-batch results."""
        if self.ps.pp == 1:
            assert results is not None
            return results
        box = [results]
        dist.broadcast_object_list(box, src=self.ps.last_pp_stage_global_rank, group=self.ps.pp_group)
        received = box[0]
        assert received is not None  # the last stage's list, not this rank's None
        return [_to_device(r, self.ps.device) for r in received]


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


@torch.no_grad()
def forward_logprobs(
    model: torch.nn.Module | list[torch.nn.Module],
    microbatches: Sequence[MicroBatch],
    ps: ParallelState,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    routing: RoutingPass | None = None,
    truncation: Truncation | None = None,
) -> list[LogprobOutput]:
    """Forward-only logprobs (and entropy) of each micro-batch's labels, on every rank. ``routing``:
    the MoE routing of the pass (replay, recording), see ``models/routing.py``. ``truncation``: the
    logprobs of the sampler's truncated distribution (``algorithm/truncation.py``)."""
    runner = _Runner(
        model,
        ps,
        vocab_size=vocab_size,
        temperature=temperature,
        with_entropy=with_entropy,
        routing=routing,
        truncation=truncation,
    )

    def loss_func(
        p: _Padded, logits_bsvt: torch.Tensor, non_loss_data: bool = True
    ) -> dict[str, torch.Tensor]:
        logprobs_bs, entropy_bs = runner.logprobs(logits_bsvt, p)
        out = {"logprobs": logprobs_bs}
        if entropy_bs is not None:
            out["entropy"] = entropy_bs
        return out

    for chunk in runner.chunks:
        chunk.eval()
    results = runner.run(microbatches, loss_func, forward_only=True)
    return [LogprobOutput(r["logprobs"], r.get("entropy")) for r in results]


@torch.no_grad()
def forward_last_logits(
    model: torch.nn.Module, microbatches: Sequence[MicroBatch], ps: ParallelState
) -> list[torch.Tensor]:
    """Forward-only, packed micro-batches: the logits at each row's last token, ``[B, Vt]`` (this TP
    rank's vocabulary slice), on every rank, through the same padding and model call as the trainer's
    passes: what a decode step of ``training/policy_engine.py`` samples from."""
    runner = _Runner(model, ps, vocab_size=0, temperature=1.0, with_entropy=False)

    def loss_func(
        p: _Padded, logits_bsvt: torch.Tensor, non_loss_data: bool = True
    ) -> dict[str, torch.Tensor]:
        if p.layout is None or ps.cp > 1:
            raise ValueError("forward_last_logits takes packed micro-batches without context parallelism")
        sizes = torch.tensor(p.layout.sizes)
        ends_b = sizes.cumsum(0) - sizes + torch.tensor(p.layout.lengths) - 1
        return {"logits": logits_bsvt[0, ends_b.to(logits_bsvt.device)]}

    model.eval()
    return [r["logits"] for r in runner.run(microbatches, loss_func, forward_only=True)]


@dataclass
class TrainerForward:
    """The trainer's model as the policy engine sees it (``rollout/policy_engine.py:PolicyForward``):
    rows packed into one micro-batch, as a training pass packs them; collective over every rank."""

    model: torch.nn.Module
    ps: ParallelState
    vocab_size: int

    def last_logits(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        packed = PackedRows(tuple(len(r) for r in rows))
        tokens_t = torch.tensor([t for r in rows for t in r])
        mb = MicroBatch(tokens_t[None], torch.zeros_like(tokens_t)[None], packed=packed)
        return forward_last_logits(self.model, [mb], self.ps)[0]

    def logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> list[list[float]]:
        packed = PackedRows(tuple(len(s) - 1 for s in sequences))
        inputs_t = torch.tensor([t for s in sequences for t in s[:-1]])
        labels_t = torch.tensor([t for s in sequences for t in s[1:]])
        mb = MicroBatch(inputs_t[None], labels_t[None], packed=packed)
        (out,) = forward_logprobs(
            self.model, [mb], self.ps, vocab_size=self.vocab_size, temperature=temperature
        )
        rows = out.logprobs_bs.tolist()
        return [row[n - 1 : len(s) - 1] for row, s, n in zip(rows, sequences, prompt_lens, strict=True)]


def forward_backward(
    model: torch.nn.Module | list[torch.nn.Module],
    microbatches: Sequence[MicroBatch],
    ps: ParallelState,
    loss_fn: LossFn,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    routing: RoutingPass | None = None,
    truncation: Truncation | None = None,
) -> list[dict[str, float]]:
    """Forward and backward of ``loss_fn`` over all micro-batches; gradients accumulate in the model
    (``param.main_grad`` under megatron's DDP). Returns each micro-batch's metrics on every rank.
    ``routing``: the MoE routing of the pass (replay, recording), see ``models/routing.py``.
    ``truncation``: the logprobs of the sampler's truncated distribution (``algorithm/truncation.py``)."""
    runner = _Runner(
        model,
        ps,
        vocab_size=vocab_size,
        temperature=temperature,
        with_entropy=with_entropy,
        routing=routing,
        truncation=truncation,
    )

    def loss_func(
        p: _Padded, logits_bsvt: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        logprobs_bs, entropy_bs = runner.logprobs(logits_bsvt, p)
        mb, src = p.mb, p.source
        if src.packed is None:
            unpadded = MicroBatch(
                mb.tokens_bs[: p.rows, : p.length], mb.labels_bs[: p.rows, : p.length], extras=mb.extras
            )
        else:  # the loss sees rows, as without packing
            tokens_bs, labels_bs = src.packed.unpack(src.tokens_bs[0]), src.packed.unpack(src.labels_bs[0])
            unpadded = MicroBatch(
                tokens_bs.to(mb.tokens_bs.device), labels_bs.to(mb.tokens_bs.device), extras=mb.extras
            )
        loss, metrics = loss_fn(logprobs_bs, entropy_bs, unpadded)
        reported = {k: float(v.detach()) for k, v in metrics.items()} | {"loss": float(loss.detach())}
        # The middle value is megatron's token count; ours is folded into the loss (see module doc).
        return loss, torch.ones((), dtype=torch.int, device=loss.device), reported

    for chunk in runner.chunks:
        chunk.train()
    return runner.run(microbatches, loss_func, forward_only=False)
