"""Containment of user reward code: what a reward worker does to itself before it imports any.

`enter_sandbox` runs first thing in every reward worker (pool.py), before the reward modules
are imported, and applies every protection the OS allows, in this order:

1. own session (setsid): the trainer's Ctrl-C and process-group signals do not reach it, and
   the pool can kill the worker with everything it started (killpg);
2. dies with its parent (PR_SET_PDEATHSIG) and is the OOM killer's first victim;
3. scrubbed environment: only PATH, PYTHONPATH, LANG, LC_ALL, TZ and `sandbox.keep_env` are
   kept, HOME and TMPDIR point at its scratch directory; the process's original environment
   block is zeroed too, so /proc/self/environ shows nothing of the trainer's (API keys live there);
4. resource limits (setrlimit): address space, file size, open files, no core dumps, a CPU
   back-stop per sample and, when it runs under a uid of its own, the process count;
5. namespaces (unshare): a network namespace with no interface up (no network at all) and a
   mount namespace in which every mount is read-only except the worker's scratch directory.
   As root this needs no user namespace; otherwise a user namespace is tried first;
6. when started as root, a uid of its own (no passwd entry needed; unique per trainer process
   and worker slot): it cannot signal or trace the trainer or the other workers, read their
   /proc/<pid>/environ, or write what root owns; no_new_privs keeps setuid binaries from
   giving privileges back.

What the OS refuses is reported, not fatal: the worker says which protections are active and
the pool logs that once. What is NOT isolated: reading files that the worker's uid may read
(the whole file system is visible, read-only), other processes' command lines in /proc, CPU
and memory bandwidth shared with the node, and, when not started as root, signals to processes
of the same uid (the trainer included).
"""

import ctypes
import math
import os
import re
import resource
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SandboxPlan", "SandboxReport", "enter_sandbox", "sandbox_uid"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 32, 1024, 2048, 4096, 16384
_MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38
# Per-mount flags that a read-only bind remount must repeat: the kernel refuses (EPERM) to
# clear ones that are locked, e.g. inherited into a user namespace.
_MOUNT_FLAGS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
    "strictatime": _MS_STRICTATIME,
}
_KEPT_ENV = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "TZ")
# Worker uids when started as root: far above any real account, one per (trainer pid, slot).
_UID_BASE = 1_000_000_000
_SLOTS_PER_TRAINER = 64


@dataclass(frozen=True)
class SandboxPlan:
    """What a worker applies to itself (built by the pool from RewardConfig; plain data)."""

    scratch_root: str
    """Existing directory; the worker makes its own writable sub-directory in it."""
    slot: int = 0
    """Worker slot in the pool: picks its uid when started as root."""
    trainer_pid: int = 0
    isolate: bool = True
    """Namespaces and the uid change; False keeps session, environment and limits only."""
    allow_network: bool = False
    memory_mb: int | None = None
    file_mb: int | None = 64
    max_processes: int | None = 1
    max_open_files: int | None = 256
    keep_env: tuple[str, ...] = ()


@dataclass
class SandboxReport:
    """What a worker managed to apply: sent to the pool with "ready" and logged once."""

    scratch: str = ""
    active: list[str] = field(default_factory=list)
    inactive: list[str] = field(default_factory=list)

    def line(self, what: str = "reward") -> str:
        off = "; NOT active: " + ", ".join(self.inactive) if self.inactive else ""
        return f"{what} sandbox: " + ", ".join(self.active) + off


def sandbox_uid(trainer_pid: int, slot: int) -> int:
    """The uid a worker takes when started as root (unique per trainer process and slot)."""
    return _UID_BASE + (trainer_pid % 1_000_000) * _SLOTS_PER_TRAINER + slot % _SLOTS_PER_TRAINER


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _scrub_environment(plan: SandboxPlan, scratch: str) -> None:
    kept = {k: os.environ[k] for k in (*_KEPT_ENV, *plan.keep_env) if k in os.environ}
    kept.update(
        HOME=scratch, TMPDIR=scratch, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1"
    )
    os.environ.clear()  # unsetenv each: the C-level environ no longer points at the original block
    os.environ.update(kept)
    # /proc/self/environ reads the block the process was exec'd with (fields 50-51 of
    # /proc/self/stat), which unsetenv does not touch: zero it.
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    env_start, env_end = int(fields[47]), int(fields[48])
    if 0 < env_start < env_end:
        ctypes.memset(env_start, 0, env_end - env_start)


def _set_limits(plan: SandboxPlan, own_uid: bool, report: SandboxReport) -> None:
    def cap(res: int, value: int) -> None:
        soft, hard = resource.getrlimit(res)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(res, (value, value))

    limits = []
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if plan.memory_mb is not None:
        cap(resource.RLIMIT_AS, plan.memory_mb * 1024 * 1024)
        limits.append(f"memory {plan.memory_mb} MiB")
    if plan.file_mb is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-big write raises OSError(EFBIG), no kill
        cap(resource.RLIMIT_FSIZE, plan.file_mb * 1024 * 1024)
        limits.append(f"file size {plan.file_mb} MiB")
    if plan.max_open_files is not None:
        cap(resource.RLIMIT_NOFILE, plan.max_open_files)
        limits.append(f"{plan.max_open_files} open files")
    if plan.max_processes is not None:
        if own_uid:  # RLIMIT_NPROC counts every process of the real uid: only meaningful for a uid of its own
            cap(resource.RLIMIT_NPROC, plan.max_processes)
            limits.append(f"{plan.max_processes} process(es) incl. threads")
        else:
            report.inactive.append("process limit (needs a uid of its own: start as root)")
    limits.append("CPU back-stop per sample")
    report.active.append("limits: " + ", ".join(limits))


def set_cpu_backstop(seconds: float) -> None:
    """Soft RLIMIT_CPU = CPU used so far + `seconds`: SIGXCPU ends a worker that spins past it even
    if the pool's wall-clock kill never comes (e.g. the trainer is stopped)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds) + 1  # whole seconds, never less than asked
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, per-mount flags) of every mount, parents before children."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])  # \040 is a space
            flags = sum(_MOUNT_FLAGS.get(opt, 0) for opt in parts[5].split(","))
            out.append((point, flags))
    return out


def _closed_ancestor(path: str) -> str | None:
    """The topmost directory above `path` that other users cannot enter (e.g. /root, 0700)."""
    parts = path.strip(os.sep).split(os.sep)
    for i in range(1, len(parts)):
        ancestor = os.sep + os.path.join(*parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _expose_python_paths(libc: ctypes.CDLL, report: SandboxReport) -> None:
    """Let a worker with a uid of its own import Python even when it lives under a directory
    closed to others (pyenv or conda under /root): in the worker's mount namespace that
    directory is covered by an empty tmpfs with only the import paths bound back into it, which
    also hides everything else in it (e.g. /root's credentials) from reward code."""
    roots = (*sys.path, sys.prefix, sys.base_prefix, sys.exec_prefix)
    needed = {os.path.realpath(p) for p in roots if p and os.path.isdir(p)}
    by_closed: dict[str, list[str]] = {}
    for path in needed:
        closed = _closed_ancestor(path)
        if closed is not None:
            by_closed.setdefault(closed, []).append(path)
    for closed, paths in sorted(by_closed.items()):
        outer = [p for p in paths if not any(p != q and p.startswith(q + os.sep) for q in paths)]
        fds = {p: os.open(p, os.O_PATH) for p in outer}  # still reachable once the tmpfs covers them
        try:
            _check(
                libc.mount(b"tmpfs", closed.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=755"), "tmpfs"
            )
            for path, fd in fds.items():
                os.makedirs(path, 0o755, exist_ok=True)
                _check(
                    libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, _MS_BIND | _MS_REC, None),
                    "bind",
                )
        finally:
            for fd in fds.values():
                os.close(fd)
        report.active.append(f"{closed} hidden except the Python paths in it")


def _read_only_view(libc: ctypes.CDLL, scratch: str, own_uid: bool, report: SandboxReport) -> None:
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make mounts private")
    if own_uid:
        _expose_python_paths(libc, report)
    _check(libc.mount(scratch.encode(), scratch.encode(), None, _MS_BIND, None), "bind scratch")
    failed = []
    for point, flags in _mount_points():
        if point == scratch:
            continue
        ret = libc.mount(None, point.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags, None)
        if ret != 0:
            failed.append(point)
    if "/" in failed:
        report.inactive.append("read-only file system (remount of / refused)")
    else:
        where = os.path.dirname(scratch)
        not_ro = f" (not: {', '.join(failed)})" if failed else ""
        report.active.append(
            f"read-only file system except a scratch directory per worker in {where}{not_ro}"
        )


def _enter_namespaces(libc: ctypes.CDLL, plan: SandboxPlan, as_root: bool, report: SandboxReport) -> bool:
    """Network and mount namespaces; True if the mount namespace was entered."""
    flags = _CLONE_NEWNS | (0 if plan.allow_network else _CLONE_NEWNET)
    if not as_root:
        uid, gid = os.getuid(), os.getgid()
        flags |= _CLONE_NEWUSER
    try:
        _check(libc.unshare(flags), "unshare")
        if not as_root:  # map ourselves to ourselves; the namespace's capabilities only reach its own mounts
            libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # /proc/self/*_map belong to root after a uid change
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"{uid} {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
    except OSError as err:
        report.inactive.append(f"namespaces ({err.strerror or err})")
        if not plan.allow_network:
            report.inactive.append("network isolation")
        report.inactive.append("read-only file system")
        return False
    if not plan.allow_network:
        report.active.append("no network (empty network namespace)")
    return True


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    """Clear every capability (those held in our own user namespace, when not root)."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (Data * 2)()
    _check(libc.capset(ctypes.byref(header), data), "capset")


def enter_sandbox(plan: SandboxPlan) -> SandboxReport:
    """Apply every protection the OS allows to the calling process (a fresh reward worker);
    return what is active. Raises only if the scratch directory cannot be made."""
    report = SandboxReport()
    libc = _libc()
    os.setsid()
    report.active.append("own session")
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:  # raising one's own score needs no privilege
            f.write("1000")
    except OSError:
        pass
    as_root = os.geteuid() == 0
    uid = sandbox_uid(plan.trainer_pid, plan.slot) if as_root and plan.isolate else os.getuid()
    scratch = os.path.join(plan.scratch_root, f"worker{plan.slot}-{os.getpid()}")
    os.mkdir(scratch, 0o700)
    if uid != os.getuid():
        os.chown(scratch, uid, uid)
    report.scratch = scratch
    _scrub_environment(plan, scratch)
    report.active.append("scrubbed environment")
    sys.dont_write_bytecode = True  # __pycache__ writes would fail on the read-only view anyway
    own_uid = as_root and plan.isolate
    _set_limits(plan, own_uid, report)
    if plan.isolate:
        if _enter_namespaces(libc, plan, as_root, report):
            _read_only_view(libc, scratch, own_uid, report)
    else:
        report.inactive.append("namespaces and uid change (reward.sandbox.isolate=false)")
    if own_uid:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # its own /proc files stay its own (the uid is unique)
        report.active.append(f"uid {uid} of its own (cannot signal the trainer or other workers)")
    elif plan.isolate:
        try:
            _drop_capabilities(libc)
        except OSError:
            pass
        report.inactive.append("signal isolation (not root: the worker keeps the trainer's uid)")
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.chdir(scratch)
    return report


def kill_worker(process: Any, conn: Any) -> None:
    """End a contained worker (a reward or tool worker) and everything it started: it leads its own
    session, so its process group goes with it; then close the trainer's end of its pipe."""
    pid = process.pid
    try:
        if pid is not None and os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        process.kill()
        process.join(timeout=1.0)
    except (OSError, ValueError, AttributeError, AssertionError):
        pass
    conn.close()
