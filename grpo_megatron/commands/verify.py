"""``grpo-megatron verify CONFIG``: do megatron and transformers agree on ``model.hf_path``'s weights?

Loads the HF safetensors into megatron at the configured layout (``parallel.*``, any number of
ranks under torchrun), runs one fixed random batch through megatron and, on rank 0, through
transformers (fp32, the whole model in host memory: a verifier, not a training path), and prints
the max and mean per-token logprob difference and, when the layout has one pipeline stage, the
max absolute logit difference. Exits non-zero when the max logprob or logit difference exceeds
the tolerance. Differences well above 1e-4 in fp32 mean a wrong config or weight mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from grpo_megatron.config import JobConfig


@dataclass(frozen=True)
class VerifyResult:
    max_logprob_diff: float
    mean_logprob_diff: float
    max_logit_diff: float | None  # None with several pipeline stages (logits live on the last)

    def within(self, tol: float) -> bool:
        diffs = [self.max_logprob_diff] + ([self.max_logit_diff] if self.max_logit_diff is not None else [])
        return all(d <= tol for d in diffs)


def _hf_reference(hf_path: str, tokens_bs: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens_bs).logits.float()


def verify(cfg: JobConfig, *, rows: int = 2, seq_len: int = 32, seed: int = 0) -> VerifyResult:
    """Compare megatron (at ``cfg.parallel``) with transformers on one batch; same result on every rank."""
    import torch.distributed as dist

    from grpo_megatron.bridge.hf_loader import load_hf_weights
    from grpo_megatron.distributed.bootstrap import init_distributed
    from grpo_megatron.models.builder import build_gpt_model
    from grpo_megatron.training.forward_backward import MicroBatch, forward_logprobs

    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    model, spec = build_gpt_model(hf, cfg.model, ps)
    load_hf_weights(model, ps, cfg.model.hf_path, hf)
    model.eval()
    tokens_bs = torch.randint(
        0, spec.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(seed)
    )
    (out,) = forward_logprobs(
        model, [MicroBatch(tokens_bs[:, :-1], tokens_bs[:, 1:])], ps, vocab_size=spec.vocab_size
    )
    logits_bsv = None
    if ps.pp == 1:
        with torch.no_grad():
            position_ids_bs = torch.arange(seq_len)[None].expand(rows, -1)
            logits_bsv = model(
                tokens_bs.to(ps.device), position_ids_bs.to(ps.device), None, runtime_gather_output=True
            )
            logits_bsv = logits_bsv[..., : spec.vocab_size].float().cpu()
    # [max logprob diff, mean logprob diff, max logit diff (-1: none)], computed on rank 0.
    summary = torch.zeros(3, dtype=torch.float64)
    if ps.rank == 0:
        ref_logits_bsv = _hf_reference(cfg.model.hf_path, tokens_bs)
        ref_logprobs_bs = torch.log_softmax(ref_logits_bsv[:, :-1], -1).gather(-1, tokens_bs[:, 1:, None])[
            ..., 0
        ]
        diff_bs = (out.logprobs_bs.float().cpu() - ref_logprobs_bs).abs()
        summary[0], summary[1] = diff_bs.max(), diff_bs.mean()
        summary[2] = -1.0 if logits_bsv is None else (logits_bsv - ref_logits_bsv).abs().max()
    summary = summary.to(ps.device)
    dist.broadcast(summary, src=0)  # every rank exits with the same code
    summary = summary.cpu()
    return VerifyResult(float(summary[0]), float(summary[1]), None if summary[2] < 0 else float(summary[2]))


def main(cfg: JobConfig, tol: float) -> int:
    import torch.distributed as dist

    from grpo_megatron.distributed.bootstrap import destroy_distributed

    result = verify(cfg)
    if dist.get_rank() == 0:
        logit = "n/a (pipeline-parallel)" if result.max_logit_diff is None else f"{result.max_logit_diff:.3g}"
        print(
            f"verify {cfg.model.hf_path} dtype={cfg.model.dtype} tp={cfg.parallel.tp} pp={cfg.parallel.pp} "
            f"ep={cfg.parallel.ep}: max |logit diff| {logit}, max |logprob diff| {result.max_logprob_diff:.3g}, "
            f"mean |logprob diff| {result.mean_logprob_diff:.3g} (tolerance {tol:g}): "
            + ("OK" if result.within(tol) else "FAILED")
        )
    destroy_distributed()
    return 0 if result.within(tol) else 1
