"""The distillation teacher (``distill:``): a frozen model from its own Hugging Face directory, built
like the reference model (models/builder.py, bridge/hf_loader.py) at the student's parallel layout.

Any supported architecture and size, dense or MoE, as long as it shares the student's tokenizer
(data/tokenizer.py:``vocabulary_mismatch``, checked by ``grpo-megatron check`` and again at start).
Why the student's layout: megatron-core keeps one model-parallel state per process (its TP, PP, CP
and EP groups), which every layer reads when it is built and when it runs, so a second model in the
same processes takes the same layout (``distill.tp/pp/ep`` other than ``parallel.*`` are refused by
check). The teacher's own sizes only have to fit it: TP divides its heads, PP its layers, EP its
experts (config/validation.py:distill_errors).

The teacher pass (``time/teacher_logprob``, training/grpo.py) is a forward-only ``logprob_pass`` of
kind "teacher" at the rollout's temperature, with the teacher's own routing (no replay: the
engine's routes are the student's experts, not the teacher's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from grpo_megatron.distributed.bootstrap import ParallelState
    from grpo_megatron.models.builder import PolicySpec
    from grpo_megatron.models.config import ModelConfig
    from grpo_megatron.training.config import DistillConfig


@dataclass
class Teacher:
    """The frozen teacher on this rank: its shard, what the builder derived, its config.json."""

    model: torch.nn.Module
    spec: PolicySpec
    hf: dict[str, Any]
    on_cpu: bool = False
    """distill.on_cpu on a GPU job: the weights live in host memory outside the teacher pass."""

    @property
    def param_bytes(self) -> int:
        """Bytes of this rank's teacher parameters (the ``distill/teacher_bytes`` metric)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @contextmanager
    def on_device(self, device: torch.device) -> Iterator[torch.nn.Module]:
        """The teacher for the teacher pass: with ``on_cpu``, its weights visit ``device`` for the
        block only."""
        if self.on_cpu:
            self.model.to(device)
        try:
            yield self.model
        finally:
            if self.on_cpu:
                self.model.to("cpu")


def build_teacher(
    distill: DistillConfig, student: ModelConfig, ps: ParallelState, *, on_cpu: bool
) -> Teacher:
    """This rank's shard of the teacher, its weights read from ``distill.teacher_path`` (each rank
    reads only its slices), frozen and in eval mode; with ``on_cpu`` moved to host memory."""
    from grpo_megatron.bridge.hf_loader import load_hf_weights
    from grpo_megatron.models.builder import build_gpt_model

    model_cfg = distill.teacher_model(student)
    if not any(Path(model_cfg.hf_path).glob("*.safetensors")):
        raise FileNotFoundError(
            f"distill.teacher_path={model_cfg.hf_path} holds no *.safetensors: a teacher needs its trained "
            "weights (point it at the Hugging Face directory of the model to distill)"
        )
    hf = model_cfg.load_hf_config()
    model, spec = build_gpt_model(hf, model_cfg, ps)
    load_hf_weights(model, ps, model_cfg.hf_path, hf)
    model.requires_grad_(False)
    model.eval()
    if on_cpu:
        model.to("cpu")
    return Teacher(model, spec, hf, on_cpu=on_cpu)
