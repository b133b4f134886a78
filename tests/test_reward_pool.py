"""The sandboxed reward pool: hangs, crashes, exceptions, garbage values and runaway outputs
never stop scoring, and the call returns within timeout + 1 s."""

import time

import pytest

from grpo_megatron.rewards.base import RewardSample
from grpo_megatron.rewards.config import RewardComponentConfig as C
from grpo_megatron.rewards.config import RewardConfig
from grpo_megatron.rewards.pool import RewardPool

TIMEOUT = 0.5
H = "tests.reward_helpers:"


def _cfg(*functions: str, **kw) -> RewardConfig:
    comps = [C(name=f"c{i}", function=f) for i, f in enumerate(functions)]
    kw.setdefault("num_workers", 2)
    kw.setdefault("timeout_s", TIMEOUT)
    return RewardConfig(components=comps, **kw)


@pytest.fixture(scope="module")
def mixed_pool():
    with RewardPool(_cfg(H + "by_prompt", fallback=-1.0)) as pool:
        yield pool


def _timed(pool, samples, **kw):
    start = time.monotonic()
    batch = pool.score_detailed(samples, **kw)
    return batch, time.monotonic() - start


def test_every_sample_hangs_returns_within_timeout_plus_one(mixed_pool):
    batch, elapsed = _timed(mixed_pool, [RewardSample("hang", "r"), RewardSample("hang", "r")])
    assert elapsed < TIMEOUT + 1.0
    assert batch.rewards == [-1.0, -1.0] and batch.status == ["timeout", "timeout"]
    assert batch.metrics["reward_pool/timeouts"] == 2 and batch.metrics["reward_pool/worker_restarts"] == 2
    # the replaced workers score the next batch normally
    rewards, metrics = mixed_pool.score([RewardSample("ok", "abcd")] * 3)
    assert rewards == [4.0, 4.0, 4.0] and metrics["reward_pool/fallback"] == 0


def test_mixed_failures_in_one_batch(mixed_pool):
    prompts = ["ok", "raise", "nan", "hang", "exit", "str", "ok"]
    batch, elapsed = _timed(mixed_pool, [RewardSample(p, "abc") for p in prompts])
    assert batch.status == ["ok", "error", "invalid", "timeout", "error", "invalid", "ok"]
    assert batch.rewards == [3.0, -1.0, -1.0, -1.0, -1.0, -1.0, 3.0]
    m = batch.metrics
    assert (m["reward_pool/errors"], m["reward_pool/invalid"], m["reward_pool/timeouts"]) == (2, 2, 1)
    assert m["reward_pool/fallback"] == 5 and m["reward_pool/fallback_frac"] == pytest.approx(5 / 7)
    assert m["reward/c0"] == 3.0  # component means over the samples that scored
    assert any("reward code is broken" in e for e in batch.errors)
    assert elapsed < 2 * TIMEOUT + 1.0  # one hang among 7 samples on 2 workers


def test_hard_limit_for_whole_call(mixed_pool):
    samples = [RewardSample("hang", "r")] * 6  # 3 waves of timeouts without a batch limit
    batch, elapsed = _timed(mixed_pool, samples, batch_timeout_s=TIMEOUT)
    assert elapsed < TIMEOUT + 1.0
    assert batch.status == ["timeout"] * 6 and batch.rewards == [-1.0] * 6


@pytest.mark.parametrize(
    "function,status",
    [
        ("sleep_forever", "timeout"),
        ("busy_loop", "timeout"),
        ("raises", "error"),
        ("returns_nan", "invalid"),
        ("returns_inf", "invalid"),
        ("returns_none", "invalid"),
        ("hard_exit", "error"),
        ("system_exit", "error"),
    ],
)
def test_each_failure_gives_fallback(function, status):
    with RewardPool(_cfg(H + function)) as pool:
        (batch, elapsed) = _timed(pool, [RewardSample("q", "r"), RewardSample("q", "r")])
    assert batch.rewards == [0.0, 0.0] and batch.status == [status, status]
    assert elapsed < TIMEOUT + 1.0
    if status in ("timeout", "error"):
        assert batch.metrics["reward_pool/worker_restarts"] == 2


def test_one_megabyte_output_and_countdown_injection():
    # What is checked here is truncation and injection, not the time bound: a worker's first math-verify
    # call alone takes ~0.7 s, so a loaded machine needs more than the suite's 0.5 s per sample.
    cfg = _cfg("math_accuracy", "countdown", max_response_chars=100_000, timeout_s=10.0)
    big = "x" * 1_000_000 + "<answer>\\boxed{24}</answer>"
    evil = "<answer>__import__('os').system('touch /tmp/pwned_by_reward')</answer>"
    samples = [
        RewardSample("q", big, "24", {"numbers": [24]}),
        RewardSample("q", evil, "24", {"numbers": [24]}),
        RewardSample("q", "<answer>(25 - 1) * (3 - 2)</answer>", "24", {"numbers": [25, 1, 3, 2]}),
    ]
    with RewardPool(cfg) as pool:
        batch, elapsed = _timed(pool, samples)
    assert elapsed < cfg.timeout_s + 1.0
    assert batch.status == ["ok", "ok", "ok"]
    assert batch.rewards == [2.0, 0.0, 2.0]  # accuracy + countdown (math-verify evaluates 24 too)
    assert batch.components[1] == {"c0": 0.0, "c1": 0.0}
    assert batch.metrics["reward_pool/truncated"] == 1


def test_memory_limit_turns_a_memory_bomb_into_fallback():
    with RewardPool(_cfg(H + "allocate_too_much", num_workers=1, worker_memory_mb=1024)) as pool:
        batch = pool.score_detailed([RewardSample("q", "r")])
    assert batch.status == ["error"] and "MemoryError" in batch.errors[0]


def test_in_process_mode_still_falls_back():
    with RewardPool(_cfg(H + "by_prompt", num_workers=0, fallback=0.5)) as pool:
        rewards, metrics = pool.score([RewardSample(p, "ab") for p in ("ok", "raise", "nan", "str")])
    assert rewards == [2.0, 0.5, 0.5, 0.5]
    assert metrics["reward_pool/errors"] == 1 and metrics["reward_pool/invalid"] == 2


def test_spawn_context_and_worker_kept_on_error():
    cfg = _cfg(H + "raises", num_workers=1, mp_context="spawn", replace_worker_on_error=False)
    with RewardPool(cfg) as pool:
        batch = pool.score_detailed([RewardSample("q", "r")] * 3)
    assert batch.status == ["error"] * 3 and batch.metrics["reward_pool/worker_restarts"] == 0


def test_bad_function_fails_at_startup_and_close_is_final():
    with pytest.raises(ValueError, match=r"reward.components\[0\].function"):
        RewardPool(_cfg("tests.no_such_module:f"))
    pool = RewardPool(_cfg(H + "constant", num_workers=1))
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="after close"):
        pool.score([RewardSample("q", "r")])


def test_math_bombs_cost_no_timeout_and_no_restart():
    # Issue 17 finding 8: each bomb used to cost the full timeout_s and a worker restart.
    bombs = ["9^{9^{9}}", "10^{10^{10}}", "(10^{10})!", "9^{999999999}"] * 16
    samples = [RewardSample("q", f"so \\boxed{{{b}}}", "5") for b in bombs]
    with RewardPool(_cfg("math_accuracy", timeout_s=5.0)) as pool:
        batch = pool.score_detailed(samples)
    assert batch.status == ["ok"] * 64 and batch.rewards == [0.0] * 64
    assert batch.metrics["reward_pool/worker_restarts"] < 2


def test_default_batch_bound_from_timeout_and_workers():
    # 8 hanging samples on 2 workers: 4 waves of timeouts (2 s) without a bound; the default bound
    # timeout_s * (2 + ceil(8 / 2) / 8) = 1.25 s ends the call during the third wave.
    with RewardPool(_cfg(H + "sleep_forever")) as pool:
        batch = pool.score_detailed([RewardSample("q", "r")] * 8)
    assert batch.status == ["timeout"] * 8
    assert any("batch timeout" in e for e in batch.errors)
    assert batch.metrics["reward_pool/worker_restarts"] < 8


def test_a_chunk_settles_only_its_bad_samples():
    # One worker takes all 11 samples as one chunk: the hang times out on its own clock, the crash is
    # an error, and every other sample of the chunk is scored (re-queued after each kill).
    prompts = ["ok"] * 4 + ["hang"] + ["ok"] * 3 + ["exit"] + ["ok"] * 2
    with RewardPool(_cfg(H + "by_prompt", num_workers=1, fallback=-1.0)) as pool:
        batch, elapsed = _timed(pool, [RewardSample(p, "abc") for p in prompts])
    assert batch.status == ["ok"] * 4 + ["timeout"] + ["ok"] * 3 + ["error"] + ["ok"] * 2
    assert batch.metrics["reward_pool/worker_restarts"] == 2
    assert elapsed < TIMEOUT + 1.0
