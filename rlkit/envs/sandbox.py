"""Run untrusted Python (model-written code) where it cannot reach the network, the host's files or
processes, or more than its share of CPU, memory, disk, processes and time.

Layers, outermost first:
- bubblewrap (bwrap): fresh mount, PID, network, IPC and UTS namespaces. The mount namespace holds
  /usr, /etc, /lib* and the Python installation read-only, an empty /tmp and the scratch directory
  (the only writable place, removed afterwards); the host's home, /tmp and project directories are
  not there at all. The network namespace has only its own loopback. The PID namespace hides host
  processes, and everything in it dies when bwrap's program exits or bwrap is killed (the wall-clock
  limit): no process outlives a run.
- an unprivileged uid: as root, bwrap runs without a user namespace keeping only CAP_SETUID and
  CAP_SETGID, and the launcher (_sandbox_boot.py) switches to a random uid of no account, which drops
  every capability. A uid of its own is what makes RLIMIT_NPROC bite (root is exempt, and a user
  namespace's uid would map back to root) and keeps concurrent sandboxes' process counts apart.
  Not as root, bwrap's user namespace already makes the program an unprivileged uid.
- rlimits, set by that launcher inside the sandbox rather than in a preexec_fn (unsafe: environments
  run in threads): CPU time, address space, file size, processes and open files.

Without a usable bwrap, run_python refuses unless allowed the weak mode: the same launcher in a plain
process, with the rlimits and a Python audit hook refusing sockets, new processes, native code and
writes outside the scratch directory. Audit hooks are not a security boundary (CPython's docs say
so), hence opt-in and a warning.
"""

import functools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

BWRAP = shutil.which("bwrap") or "/usr/bin/bwrap"
_BOOT = str(Path(__file__).with_name("_sandbox_boot.py"))
_BOOT_INSIDE = "/tmp/rlkit_sandbox_boot.py"
_SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# uids far above any account's; each run draws its own, so RLIMIT_NPROC counts only that run's processes
# (a rare clash of two concurrent runs only makes them share one budget)
_SANDBOX_UIDS = range(1 << 24, 1 << 30)
_OUTPUT_CHARS = 65536

log = logging.getLogger("rlkit")


class SandboxUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512  # address space
    max_file_mb: int = 16  # per file written
    processes: int = 32  # processes and threads together, the first one included
    open_files: int = 64


# the least of each limit a program can run under: Python itself needs about 16 MB of address
# space to start, and any program one process and a moment
_MINIMUM = {"wall_s": 0.1, "cpu_s": 1, "memory_mb": 32, "max_file_mb": 1, "processes": 1, "open_files": 8}


def limits_problem(limits: SandboxLimits) -> str | None:
    """The first limit out of its range, in one line naming it ('memory_mb: ...'), or None. A limit
    of 0 or less would fail every program, or (memory_mb=-1) lift the limit altogether."""
    for name, least in _MINIMUM.items():
        value = getattr(limits, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value < float("inf"):
            return (f"{name}: must be a finite number >= {least} (got: {value!r}); give the sandbox a real limit "
                    f"(default {getattr(SandboxLimits, name)})")
    return None


def check_limits(limits: SandboxLimits) -> None:
    problem = limits_problem(limits)
    if problem:
        raise ValueError(f"sandbox limit {problem}")


@dataclass(frozen=True)
class SandboxResult:
    reason: str  # ok | error | timeout | cpu | memory
    exit_code: int | None
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def run_python(source: str, limits: SandboxLimits = SandboxLimits(), allow_weak: bool = False) -> SandboxResult:
    """Run `source` as a program in the sandbox. Raises SandboxUnavailable when bubblewrap cannot run
    here, unless allow_weak lets the weak mode stand in, and ValueError for a limit out of its range."""
    check_limits(limits)
    weak = check_sandbox(allow_weak)
    return _run(source, limits, bwrap=None if weak else BWRAP)


def check_sandbox(allow_weak: bool) -> bool:
    """Whether code will run in the weak mode (warned once); raises SandboxUnavailable if it would have
    to and `allow_weak` is off. Cheap after the first call: the bwrap check runs once per process."""
    problem = _bwrap_problem(BWRAP)
    if problem is None:
        return False
    if not allow_weak:
        raise SandboxUnavailable(
            f"code sandbox: {problem}. Untrusted code runs only inside bubblewrap: install it "
            "(apt-get install bubblewrap), or accept the weak mode, which is not a security boundary, with "
            "env.allow_weak_sandbox=true (CodeExecutionEnv(allow_weak_sandbox=True), run_python(..., allow_weak=True))")
    _warn_weak(problem)
    return True


@functools.cache
def _bwrap_problem(bwrap: str) -> str | None:
    """Why `bwrap` cannot sandbox code here, or None: a trial run, once per process and path."""
    if not os.access(bwrap, os.X_OK):
        return f"bubblewrap not found at {bwrap}"
    trial = _run("print('ok')", SandboxLimits(), bwrap)
    if trial.stdout.strip() != "ok":
        # its last line says why (e.g. "bwrap: setting up uid map: Permission denied"); one line, as errors are
        last = trial.stderr.strip().splitlines()[-1][-300:] if trial.stderr.strip() else trial.reason
        return f"{bwrap} cannot start a sandbox here ({last})"
    return None


@functools.cache
def _warn_weak(problem: str):
    log.warning("code sandbox: %s; running untrusted code in the WEAK mode (rlimits and a Python audit hook in a "
                "plain process), which is not a security boundary", problem)


def _run(source: str, limits: SandboxLimits, bwrap: str | None) -> SandboxResult:
    """One run: inside bwrap at `bwrap`, or in the weak mode when None."""
    scratch = tempfile.mkdtemp(prefix="rlkit-sandbox-")
    try:
        Path(scratch, "program.py").write_text(source)
        # the scratch directory as the program sees it; its unique name stays in every command line
        inside = f"/tmp/{os.path.basename(scratch)}" if bwrap else scratch
        uid = secrets.choice(_SANDBOX_UIDS) if bwrap and os.geteuid() == 0 else None
        if uid is not None:
            os.chown(scratch, uid, uid)
        settings = {"rlimits": _rlimits(limits, weak=bwrap is None), "uid": uid, "audit_hook": bwrap is None}
        command = [sys.executable, "-I", "-B", _BOOT_INSIDE if bwrap else _BOOT, json.dumps(settings),
                   f"{inside}/program.py"]
        if bwrap:
            command = _bwrap_args(bwrap, scratch, inside) + command
        proc = subprocess.Popen(command, env={"PATH": "/usr/bin:/bin", "HOME": inside, "TMPDIR": inside},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            # with bwrap this kills the PID namespace's init, and with it every process inside
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
        stdout = out.decode(errors="replace")[-_OUTPUT_CHARS:]
        stderr = err.decode(errors="replace")[-_OUTPUT_CHARS:]
        code = proc.returncode
        # a program killed by signal N: a plain child's status is -N, bwrap exits with 128 + N
        signalled = -code if code < 0 else code - 128 if bwrap and code > 128 else None
        if timed_out:
            reason = "timeout"
        elif signalled in (signal.SIGXCPU, signal.SIGKILL):  # RLIMIT_CPU's soft, then hard, limit
            reason = "cpu"
        elif "MemoryError" in stderr:
            reason = "memory"
        else:
            reason = "ok" if code == 0 else "error"
        return SandboxResult(reason, None if timed_out else code, stdout, stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _rlimits(limits: SandboxLimits, weak: bool) -> dict[str, tuple[int, int]]:
    """(soft, hard) per resource name; the CPU soft limit sends SIGXCPU, the hard one a second later SIGKILL."""
    rlimits = {"RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),
               "RLIMIT_AS": (limits.memory_mb << 20,) * 2,
               "RLIMIT_FSIZE": (limits.max_file_mb << 20,) * 2,
               "RLIMIT_NOFILE": (limits.open_files,) * 2}
    if not weak:
        # the weak mode's program shares the host's uid, whose every process RLIMIT_NPROC would count;
        # its audit hook forbids new processes instead
        rlimits["RLIMIT_NPROC"] = (limits.processes,) * 2
    return rlimits


def _bwrap_args(bwrap: str, scratch: str, inside: str) -> list[str]:
    """The bwrap command line up to the program: namespaces, then the filesystem it sees."""
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
            "--new-session", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    if os.geteuid() == 0:
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    for path in _SYSTEM_DIRS:
        args += ["--ro-bind-try", path, path]
    for path in _python_dirs():
        # bwrap would create the missing parents (e.g. /root for a pyenv Python) mode 0700, closed
        # to the unprivileged program; the home directory itself stays hidden: only this path is bound
        for parent in reversed(Path(path).parents[:-1]):
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", path, path]
    return args + ["--ro-bind", _BOOT, _BOOT_INSIDE, "--bind", scratch, inside, "--remount-ro", "/",
                   "--chdir", "/", "--"]


def _python_dirs() -> list[str]:
    """The interpreter's (and its venv's) directories, as named and resolved, not already bound."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    bound: list[str] = []
    for path in sorted({p for prefix in prefixes for p in (os.path.abspath(prefix), os.path.realpath(prefix))}):
        if not any(path == outer or path.startswith(outer + "/") for outer in (*_SYSTEM_DIRS, *bound)):
            bound.append(path)
    return bound
