"""The phases of a GRPO iteration, one module each; training/grpo.py strings them together.

  rollout.py      ``Rollout``: sampling settings + the engines -> completions     (time/rollout)
  reward.py       ``Scorer``: records + completions -> ``Scored`` groups          (time/reward)
  advantages.py   groups -> ``Batch`` of ``Sample`` + ``UpdatePlan``              (time/advantages)
  logprob.py      frozen reference / pi_old forward -> ``Sample.ref/old_logprobs_s`` (time/ref_logprob,
                  time/old_logprob)
  train.py        ``Sample``s + plan -> one optimizer step per mini-batch, typed metrics (time/train)
  sync.py         trainer weights -> engines, then the mismatch probe             (time/sync)
  eval.py         held-out greedy pass@1 and mean@k                               (time/eval)
  bookkeeping.py  the loss check before saving, checkpoints, sample rows

Each function takes only what it uses (its config section and the objects it acts on), runs on every
rank with the same inputs and returns the same result everywhere (rollouts are gathered by the fleet,
rewards are broadcast from rank 0), except the logprob passes and the update, which work on this
rank's data-parallel share. The colocated memory moves (onload, offload) are training/offload.py's
``ColocatedMemory``.
"""
