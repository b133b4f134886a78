"""DAPO dynamic sampling and soft overlong punishment."""

import pytest
import torch

from grpo_megatron.algorithm.batch_shaping import DynamicSampling, informative_groups, overlong_penalty


def test_informative_groups():
    rewards_b = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.1, 0.1, 0.1])
    assert informative_groups(rewards_b, 3).tolist() == [False, True, False]


class _Source:
    """Prompts whose groups are (all-correct, mixed, all-wrong, mixed, ...) in turn."""

    def __init__(self, limit: int = 1000):
        self.next_id, self.limit, self.calls = 0, limit, []

    def __call__(self, n: int):
        self.calls.append(n)
        out = []
        for _ in range(min(n, self.limit - self.next_id)):
            kind = self.next_id % 4
            rewards = {0: [1, 1, 1, 1], 1: [1, 0, 0, 1], 2: [0, 0, 0, 0], 3: [0, 1, 0, 0]}[kind]
            out.append((self.next_id, rewards))
            self.next_id += 1
        return out


def dynamic_sampling(source, num_groups: int, **kwargs):
    """The trainer's loop (training/grpo.py:run_iteration): ask, sample a round, add, until done."""
    ds = DynamicSampling(num_groups, lambda grp: grp[1], **kwargs)
    while n := ds.needed():
        ds.add(source(n))
    return ds.result()


def test_dynamic_sampling_refills_from_more_prompts():
    src = _Source()
    groups, m = dynamic_sampling(src, 4, max_tries=5)
    assert [gid for gid, _ in groups] == [1, 3, 5, 7]
    assert src.calls == [4, 2, 1, 1]  # asks only for what is missing
    assert m["dynamic_sampling/rounds"] == 4
    assert m["dynamic_sampling/groups_sampled"] == 8
    assert m["dynamic_sampling/groups_dropped"] == 4
    assert m["dynamic_sampling/kept_frac"] == 0.5
    assert m["dynamic_sampling/short"] == 0.0


def test_dynamic_sampling_cap_on_tries():
    src = _Source()
    groups, m = dynamic_sampling(src, 8, max_tries=1)
    assert len(groups) == 4 and m["dynamic_sampling/short"] == 1.0 and m["dynamic_sampling/rounds"] == 1


def test_dynamic_sampling_exhausted_source():
    groups, m = dynamic_sampling(_Source(limit=3), 4, max_tries=10)
    assert len(groups) == 1 and m["dynamic_sampling/rounds"] == 2


def test_dynamic_sampling_falls_back_to_the_last_round():
    """No group with reward variance in any round: the last round is trained on as it is."""
    groups, m = dynamic_sampling(lambda n: [(i, [1, 1]) for i in range(n)], 3, max_tries=2)
    assert len(groups) == 3 and m["dynamic_sampling/fallback"] == 1.0 and m["dynamic_sampling/rounds"] == 2


def test_dynamic_sampling_disabled_is_one_round_as_it_is():
    src = _Source()
    groups, m = dynamic_sampling(src, 4, enabled=False, max_tries=5)
    assert [gid for gid, _ in groups] == [0, 1, 2, 3] and src.calls == [4] and m == {}


def test_overlong_penalty_dapo():
    # L_max = 20, L_cache = 4: no penalty up to 16, linear to -1 at 20, -1 beyond.
    lengths_b = torch.tensor([10, 16, 17, 18, 20, 25])
    pen_b, m = overlong_penalty(lengths_b, max_len=20, buffer_len=4, penalty=1.0)
    torch.testing.assert_close(pen_b, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    assert m["overlong/penalized_frac"] == pytest.approx(4 / 6)
    assert m["overlong/truncated_frac"] == pytest.approx(2 / 6)
    assert m["overlong/penalty_mean"] == pytest.approx(-2.75 / 6)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths_b, max_len=4, buffer_len=4)
