"""Workers of tests/test_distill.py: the distillation teacher built by training/teacher.py from a
saved transformers model, its teacher pass (phases/logprob.py:teacher_pass) at several layouts in
one launch, against the one-process teacher and transformers' own logprobs."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_megatron.config import load_config, validate
from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed, world_size_from_env
from grpo_megatron.training.batching import make_samples
from grpo_megatron.training.phases.advantages import UpdatePlan
from grpo_megatron.training.phases.logprob import PassSettings, teacher_pass
from grpo_megatron.training.route_replay import RoutingReplay
from grpo_megatron.training.teacher import build_teacher
from tests.helpers.dist import CPU_JOB
from tests.workers.bridge_workers import batch_tokens

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe.yaml"
PROMPT = 5  # the first 5 tokens of each row are its prompt, the rest its response


def teacher_logprobs(teacher_dir: str, overrides: list[str]) -> torch.Tensor:
    """The teacher's logprobs of ``batch_tokens()``' responses, ``[rows, positions]``, at one layout
    (the student: examples/tiny_moe.yaml, the teacher: ``teacher_dir``)."""
    cfg = load_config(
        EXAMPLE,
        [
            *CPU_JOB,
            "parallel.use_distributed_optimizer=false",
            f"distill.teacher_path={teacher_dir}",
            "distill.coef=1.0",
            *overrides,
        ],
    )
    validate(cfg, world_size_from_env())
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    teacher = build_teacher(cfg.distill, cfg.model, ps, on_cpu=False)
    tokens = batch_tokens().tolist()
    samples = make_samples(
        [t[:PROMPT] for t in tokens],
        [t[PROMPT:] for t in tokens],
        [[0.0] * (len(t) - PROMPT) for t in tokens],
        [0.0] * len(tokens),
    )
    plan = UpdatePlan(rows=[[list(range(len(samples)))]], normalizers=[1.0], packed=True)
    # the student's settings (its vocabulary, r3 replay) must not reach the teacher's pass
    student_settings = PassSettings(ps, 0, 7, 1.0, RoutingReplay("r3", ps, 4))
    metrics = teacher_pass(teacher, samples, plan, student_settings)
    assert metrics["distill/teacher_bytes"] == teacher.param_bytes > 0
    out = torch.stack([s.teacher_logprobs_s for s in samples])  # type: ignore[misc]
    destroy_distributed(keep_process_group=True)
    return out


def layouts(teacher_dir: str, layouts: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    return {name: teacher_logprobs(teacher_dir, overrides) for name, overrides in layouts.items()}
