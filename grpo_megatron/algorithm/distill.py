"""On-policy distillation: the per-token reverse KL of the policy against a frozen teacher, on the
policy's own samples, as a token advantage (``distill:``; training/teacher.py builds the teacher).

Shape legend: B responses, T response tokens (padded), ``mask_bt`` 1 on sampled response tokens.

With y_t the token the student sampled at position t, pi_S the student (the policy before this
iteration's update, pi_old) and pi_T the teacher, both at the rollout's temperature:

    A^distill_t = log pi_T(y_t | y_<t) - log pi_S(y_t | y_<t)                     (discount 0)
    A_t         = reward_coef * A^GRPO_i + coef * A^distill_t

and the clipped surrogate of algorithm/policy_loss.py takes A_t per token. Why this is the reverse
KL: per position, E_{y ~ pi_S}[log pi_S(y) - log pi_T(y)] = KL(pi_S || pi_T), and its gradient is

    grad KL(pi_S || pi_T) = E_{y ~ pi_S}[(log pi_S(y) - log pi_T(y)) grad log pi_S(y)]

(the score-function identity; E[grad log pi_S] = 0 absorbs the grad of log pi_S inside the KL).
So the policy gradient with advantage -(log pi_S(y_t) - log pi_T(y_t)) = A^distill_t is an
unbiased estimate of -grad of the per-token reverse KL, summed over positions, each position's
term taken alone (discount 0: a token is not credited for the KL of the tokens after it).
``tests/test_distill.py`` checks that identity exactly: the expectation of our loss's gradient
over every token of the vocabulary, weighted by pi_S, equals the gradient of the full-vocabulary
reverse KL computed in plain PyTorch and TRL's GKD loss at its reverse-KL end (``beta=1`` of its
generalized JSD: TRL 1.16, trl/experimental/gkd/gkd_trainer.py:GKDTrainer.generalized_jsd_loss),
on the same logits.

Sources: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD, ICLR 2024; reverse KL on student samples); Gu et al. 2024, MiniLLM
(reverse KL by policy gradient); Thinking Machines Lab, "On-Policy Distillation" (Lu et al., Oct
2025: per-token reverse-KL advantage ``log pi_teacher - log pi_sampler``, discount 0, importance
sampling loss), as slime's and miles' on-policy distillation compute it.
"""

from __future__ import annotations

import torch

__all__ = ["distill_advantages", "mixed_advantages", "sampled_reverse_kl"]


def distill_advantages(
    teacher_logprobs_bt: torch.Tensor, student_logprobs_bt: torch.Tensor, mask_bt: torch.Tensor
) -> torch.Tensor:
    """``A^distill_t = log pi_T(y_t) - log pi_S(y_t)`` on the sampled tokens (0 elsewhere), in fp32 and
    detached: an advantage, never differentiated through."""
    mask_f_bt = mask_bt.to(torch.float32)
    diff_bt = teacher_logprobs_bt.detach().float() - student_logprobs_bt.detach().float()
    return diff_bt * mask_f_bt


def sampled_reverse_kl(
    teacher_logprobs_bt: torch.Tensor, student_logprobs_bt: torch.Tensor, mask_bt: torch.Tensor
) -> torch.Tensor:
    """The sampled-token estimate of KL(pi_S || pi_T), ``log pi_S(y_t) - log pi_T(y_t)`` (Schulman's
    k1), as a mean over the sampled tokens of the batch (``distill/reverse_kl``; 0 without tokens).
    Unbiased for the per-token reverse KL when y_t ~ pi_S; one sample can be negative."""
    mask_f_bt = mask_bt.to(torch.float32)
    k1_bt = -distill_advantages(teacher_logprobs_bt, student_logprobs_bt, mask_f_bt)
    return k1_bt.sum() / mask_f_bt.sum().clamp(min=1.0)


def mixed_advantages(
    advantages_b: torch.Tensor,
    distill_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    reward_coef: float,
    coef: float,
) -> torch.Tensor:
    """Per-token ``A_t = reward_coef * A^GRPO_i + coef * A^distill_t`` (module docstring), 0 off the
    sampled tokens; ``advantages_b`` the responses' group-relative advantages, ``distill_bt`` from
    ``distill_advantages``."""
    mask_f_bt = mask_bt.to(torch.float32)
    reward_bt = advantages_b.detach().float()[:, None] * mask_f_bt
    return (reward_coef * reward_bt + coef * distill_bt.detach().float()) * mask_f_bt
