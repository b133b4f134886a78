"""A reward module whose import-time code sends the trainer a pickle through the worker's pipe
(tests/test_reward_wire.py): the object would create the file named by $GRPO_TEST_MARKER where
it is unpickled. The trainer must refuse the start, naming this component, and create nothing."""

import os

from grpo_megatron.rewards.base import RewardSample
from tests.reward_pipe_attacks import Touch, worker_frame

worker_frame().f_locals["conn"].send(Touch(os.environ["GRPO_TEST_MARKER"]))


def reward(sample: RewardSample) -> float:
    return 1.0
