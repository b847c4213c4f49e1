"""A benchmarked framework's run as a process group of its own: its output to a log (each line also
handed to a callback as it comes), stopped at its time limit, and whatever of it is left once it
ends (Ray's or vLLM's processes) killed, so that the GPUs are free for what runs next."""

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path


def run_logged(command: list[str], env: dict | None, cwd: Path, log: Path, timeout_s: float,
               on_line=lambda line: None) -> tuple[int, bool]:
    """(returncode, timed out) of command; past timeout_s the group gets SIGTERM, then SIGKILL."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)

        def read():
            for line in proc.stdout:
                out.write(line)
                out.flush()
                on_line(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                _signal_group(proc.pid, sig)
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    pass
        kill_group(proc.pid, timeout_s=10)
        reader.join(timeout=10)
    return proc.returncode, timed_out


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _live_group_members(pgid: int) -> list[int]:
    """Processes of group pgid that still run (zombies hold no memory, so they do not count)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] not in "ZX":
                    members.append(int(entry.name))
    return members


def kill_group(pgid: int, timeout_s: float) -> None:
    """SIGKILL group pgid and wait until none of it runs: a kill is delivered asynchronously, and the GPU is
    free only once the processes holding it are gone."""
    _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while _live_group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
