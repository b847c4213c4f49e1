"""Run untrusted Python in a separate process with CPU, memory, output and wall-time limits, no
network, no writes outside a temporary working directory (removed afterwards).

Layers: resource limits (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE); a process group
killed at the wall-time limit; an irremovable Python audit hook (_sandbox_boot.py) refusing
sockets, subprocesses, native code and writes outside the directory; and, where the kernel
allows it, a fresh network namespace with no interfaces up.
"""

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_BOOT = str(Path(__file__).with_name("_sandbox_boot.py"))
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_file_mb: int = 16


@dataclass(frozen=True)
class SandboxResult:
    reason: str  # ok | error | timeout | cpu | memory
    exit_code: int | None
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def _confine(limits: SandboxLimits):
    """Runs in the child between fork and exec."""
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    memory = limits.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    file_size = limits.max_file_mb << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    # a new network namespace has no usable interface; refused without CAP_SYS_ADMIN, in which
    # case the audit hook's socket ban is the network barrier
    ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNET)


def run_python(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    workdir = tempfile.mkdtemp(prefix="rlkit-sandbox-")
    try:
        program = os.path.join(workdir, "program.py")
        Path(program).write_text(source)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen([sys.executable, "-I", "-B", _BOOT, workdir, program], cwd=workdir, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=lambda: _confine(limits), start_new_session=True)
        try:
            out, err = proc.communicate(timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
        stdout, stderr = out.decode(errors="replace")[-65536:], err.decode(errors="replace")[-65536:]
        code = proc.returncode
        if timed_out:
            reason = "timeout"
        elif code in (-signal.SIGXCPU, -signal.SIGKILL):
            reason = "cpu"
        elif "MemoryError" in stderr:
            reason = "memory"
        else:
            reason = "ok" if code == 0 else "error"
        return SandboxResult(reason, None if timed_out else code, stdout, stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
