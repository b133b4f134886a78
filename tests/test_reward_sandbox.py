"""Reward containment (issue 17): real worker processes run hostile reward functions
(tests/reward_attacks.py) and each test checks one protection of rewards/sandbox.py. A test
skips, naming the reason, only where this OS does not provide the protection (the pool's start-up
report says which are active); on Linux as root (CI, containers) all of them are."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from grpo_megatron.rewards.base import RewardSample
from grpo_megatron.rewards.config import RewardComponentConfig as C
from grpo_megatron.rewards.config import RewardConfig
from grpo_megatron.rewards.pool import (
    RewardFailureError,
    RewardPool,
    RewardStartupError,
    check_reward_imports,
    report_failures,
)

ATTACK = "tests.reward_attacks:by_prompt"
SECRET = "sk-test-9f3a1c-not-a-real-key"


@pytest.fixture(scope="module")
def pool():
    # spawn: the workers start from this process's environment, which holds the secret, so a
    # leak through /proc/self/environ would be visible (a forkserver started earlier might not).
    os.environ["GRPO_TEST_API_KEY"] = SECRET
    try:
        cfg = RewardConfig(
            components=[C(name="attack", function=ATTACK)], num_workers=2, mp_context="spawn", timeout_s=10.0
        )
        with RewardPool(cfg, log=None) as p:
            yield p
    finally:
        del os.environ["GRPO_TEST_API_KEY"]


def _require(pool: RewardPool, protection: str) -> None:
    assert pool.sandbox is not None
    if not any(protection in line for line in pool.sandbox.active):
        pytest.skip(f"this OS does not provide '{protection}': {pool.sandbox.line()}")


def _attack(pool: RewardPool, prompt: str, **metadata) -> float:
    batch = pool.score_detailed([RewardSample(prompt, "r", metadata=metadata)])
    assert batch.status == ["ok"], batch.errors  # the attack ran to its end: the sandbox refused, not a crash
    return batch.rewards[0]


def test_startup_report_names_the_protections(pool):
    line = pool.sandbox.line()
    assert line.startswith("reward sandbox: own session, scrubbed environment, limits: memory 4096 MiB")


def test_module_level_code_runs_only_in_workers(pool):
    # protection: user modules are imported by the workers, never by the trainer
    pid = _attack(pool, "imported_in")
    assert int(pid) in pool.worker_pids() and int(pid) != os.getpid()
    assert "tests.reward_attacks" not in sys.modules


def test_environment_is_scrubbed(pool):
    # protection: scrubbed environment and zeroed environ block (the workers were started with the
    # secret); another process's /proc/<pid>/environ is closed to the worker's uid. A process
    # launched with the secret stands in for the trainer: this process set it at run time, which
    # its own /proc/<pid>/environ (the block it was started with) does not show.
    stand_in = subprocess.Popen(["sleep", "60"], env={"GRPO_TEST_API_KEY": SECRET})
    try:
        assert _attack(pool, "secrets", secret=SECRET, trainer_pid=stand_in.pid) == 0.0
    finally:
        stand_in.kill()
        stand_in.wait()


def test_files_closed_to_others_are_denied(pool, tmp_path):
    # protection: a uid of its own (files like /etc/shadow or a 0700 home stay closed)
    _require(pool, "of its own")
    closed = tmp_path / "home"
    closed.mkdir(mode=0o700)
    (closed / "credentials").write_text(SECRET)
    assert _attack(pool, "closed_file", path=str(closed / "credentials")) == 0.0


def test_commands_do_not_run(pool):
    # protection: process limit (no fork, so neither os.system nor subprocess starts anything)
    _require(pool, "process(es)")
    assert _attack(pool, "commands") == 0.0


def test_no_network(pool):
    # protection: empty network namespace; the trainer listens, nothing may connect
    _require(pool, "no network")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert _attack(pool, "connect", port=server.getsockname()[1]) == 0.0


def test_writes_outside_scratch_fail(pool, tmp_path):
    # protection: read-only file system except the scratch directory (the target is world-writable,
    # so file permissions alone would not stop it)
    _require(pool, "read-only file system")
    target = tmp_path / "run_dir"
    target.mkdir()
    target.chmod(0o777)
    assert _attack(pool, "write", dir=str(target)) == 0.0
    assert not (target / "pwned.txt").exists()


def test_cannot_signal_the_trainer_or_other_workers(pool):
    # protection: a uid of its own per worker (signal 0 is the permission check of SIGKILL)
    _require(pool, "cannot signal")
    assert _attack(pool, "signal", pids=[os.getpid(), *pool.worker_pids()]) == 0.0


def test_an_import_that_hangs_fails_at_startup_naming_the_field():
    cfg = RewardConfig(
        components=[
            C(name="ok", function="format"),
            C(name="slow", function="tests.reward_hang_import:reward"),
        ],
        num_workers=1,
        startup_timeout_s=3.0,
    )
    with pytest.raises(
        RewardStartupError,
        match=r"reward\.components\[1\]\.function='tests\.reward_hang_import"
        r":reward': importing it did not finish within reward\.startup_timeout_s=3 s",
    ):
        check_reward_imports(cfg, log=None)
    assert "tests.reward_hang_import" not in sys.modules


def test_check_reward_imports_gives_one_line_naming_field_module_and_cause():
    cfg = RewardConfig(
        components=[C(name="a", function="format"), C(name="b", function="tests.no_such_mod:f")]
    )
    with pytest.raises(RewardStartupError) as err:
        check_reward_imports(cfg, log=None)
    message = str(err.value)
    assert "\n" not in message
    assert "reward.components[1].function='tests.no_such_mod:f'" in message
    assert "cannot import module 'tests.no_such_mod'" in message and "No module named" in message


# ---- finding 7: failures are counted, printed and stop the run past reward.max_error_frac ----


def test_a_reward_that_always_raises_stops_the_run_with_its_message(capsys):
    cfg = RewardConfig(components=[C(name="broken", function="tests.reward_helpers:raises")], num_workers=1)
    with RewardPool(cfg, log=None) as p:
        batch = p.score_detailed([RewardSample("q", "r")] * 4)
    assert batch.metrics["reward/broken/error_frac"] == 1.0
    with pytest.raises(
        RewardFailureError, match=r"4/4 samples .* reward code is broken .* reward\.max_error_frac=0\.5"
    ):
        report_failures(batch, cfg)
    assert capsys.readouterr().out.count("reward code is broken") == 1  # printed once


def test_occasional_failures_are_printed_and_counted_per_component(capsys):
    cfg = RewardConfig(
        components=[
            C(name="len", function="tests.reward_helpers:by_prompt"),
            C(name="one", function="format"),
        ],
        num_workers=0,
    )
    with RewardPool(cfg, log=None) as p:
        batch = p.score_detailed([RewardSample("ok", "abc")] * 3 + [RewardSample("raise", "abc")])
    assert batch.status == ["ok", "ok", "ok", "error"]
    assert batch.metrics["reward/len/error_frac"] == 0.25 and batch.metrics["reward/one/error_frac"] == 0.0
    report_failures(batch, cfg)  # 25% <= 50%: goes on
    out = capsys.readouterr().out
    assert out.startswith(
        "[reward] 1/4 samples got the fallback reward 0 (1 error); first: reward component 'len'"
    )


def test_cli_check_imports_the_rewards_in_a_worker(capsys):
    from grpo_megatron.cli import main
    from tests.helpers.dist import REPO_ROOT

    example = str(REPO_ROOT / "examples" / "tiny_moe.yaml")
    tokenizer = (
        f"data.tokenizer_path={REPO_ROOT / 'examples' / 'demo'}"  # tiny_moe/ has none; train needs one
    )
    assert main(["check", example, tokenizer, "reward.components[0].function=tests.no_such_mod:f"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert (
        "reward.components[0].function='tests.no_such_mod:f': cannot import module 'tests.no_such_mod'" in err
    )
    assert (
        main(["check", example, tokenizer, "reward.components[0].function=tests.reward_attacks:imported_in"])
        == 0
    )
    assert "tests.reward_attacks" not in sys.modules


@pytest.mark.launches
def test_train_stops_on_a_reward_that_cannot_import_or_always_raises(tmp_path):
    # Issue 17 findings 2 and 10: the import ran in the trainer, after the model was built, and only
    # on rank 0. Finding 7: a reward raising on every sample finished with exit 0 and reward 0.0000.
    from tests.helpers.runs import SMALL, launch

    proc = launch(
        "train", [*SMALL, f"logging.run_dir={tmp_path / 'bad'}", "reward.components[0].function=no_such:f"]
    )
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "reward.components[0].function='no_such:f': cannot import module 'no_such'" in out
    assert "[job]" not in out  # stopped before the model was built

    overrides = [
        *SMALL,
        "train.iterations=1",
        f"logging.run_dir={tmp_path / 'run'}",
        "reward.components[0].function=tests.reward_helpers:raises",
    ]
    proc = launch("train", overrides)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "reward code is broken" in out and "reward.max_error_frac=0.5" in out
    assert "[reward] reward sandbox: own session" in out  # the one start-up line


def test_without_root_a_user_namespace_still_gives_no_network_and_a_read_only_view():
    # protection: the non-root path of sandbox.py (user + network + mount namespaces). Simulated
    # by a forked child that drops to uid 65534 before entering the sandbox.
    import json

    from grpo_megatron.rewards.sandbox import SandboxPlan, enter_sandbox

    if os.geteuid() != 0:
        pytest.skip("needs root to simulate a non-root trainer (setuid in a child)")
    tmp_path = Path(tempfile.mkdtemp())  # pytest's tmp_path sits under a 0700 directory
    tmp_path.chmod(0o777)
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o777)
    outside.chmod(0o777)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: never returns into pytest
            result: dict = {}
            try:
                os.setgroups([])
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)
                report = enter_sandbox(SandboxPlan(scratch_root=str(tmp_path)))
                result["active"] = report.active
                for name, attempt in (
                    ("write", lambda: open(outside / "pwned", "w").close()),  # noqa: SIM115
                    ("connect", lambda: socket.socket().connect(server.getsockname())),  # no idna lookup
                    ("scratch", lambda: open("scratch_ok", "w").close()),  # noqa: SIM115
                ):
                    try:
                        attempt()
                        result[name] = "ok"
                    except OSError as err:
                        result[name] = err.strerror
            except BaseException as err:  # noqa: BLE001
                result["error"] = repr(err)
            os.write(write_fd, json.dumps(result).encode())
            os._exit(0)
        os.close(write_fd)
        with os.fdopen(read_fd) as f:
            result = json.loads(f.read() or "{}")
        os.waitpid(pid, 0)
    shutil.rmtree(tmp_path, ignore_errors=True)
    assert "error" not in result, result
    if not any("read-only" in a for a in result["active"]):
        pytest.skip(f"this OS refuses unprivileged user namespaces: {result['active']}")
    assert result["write"] == "Read-only file system" and not (outside / "pwned").exists()
    assert result["connect"] == "Network is unreachable"
    assert result["scratch"] == "ok"
