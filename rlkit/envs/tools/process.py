"""Tool calls in a child process that can be killed: Python cannot stop a thread, so a tool that
never returns would otherwise leave one behind per call, each holding whatever it holds.

One child per ToolBox (one per environment worker), forked at its first call and kept: a call
costs a round trip over a pipe, not a process start (tests/unit/test_tools.py measures it). A
call that runs past its time limit gets the child's whole process group killed (the tool's own
subprocesses too) and the next call forks a fresh one. Forked, not spawned: the tools need not
pickle, and the child starts with everything the worker has imported.

What this means for tools: a tool's changes to Python state stay in the child (score() does not
see them) and are lost when the child is killed; keep an episode's state in its messages and
metadata, as every environment must (docs/environments.md). A forked child cannot use a CUDA
context its parent opened: a tool that needs a GPU opens its own.
"""

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

_FORK = multiprocessing.get_context("fork")


class ToolArgumentError(ValueError):
    """What a tool raises to refuse the values it was called with (a division that is not exact):
    the model's mistake, answered and counted as bad arguments, never a fault of the tool."""


@dataclass(frozen=True)
class Reply:
    value: str | None  # the tool's return value as text; None when it failed
    failure: str | None = None  # "raised", "refused" (ToolArgumentError) or "timeout"
    error: str = ""  # what went wrong, in one line: "KeyError: 'x'"
    where: str = ""  # the line of the tool's code that raised: "my_tools.py:12"
    seconds: float = 0.0


class ToolProcess:
    """Runs `tools[name](**arguments)` in the child; `as_text` turns a return value into the
    tool message's text there (a value that cannot be sent back need never be)."""

    def __init__(self, tools: dict[str, Callable], as_text: Callable[[object], str]):
        self.tools, self.as_text = tools, as_text
        self.process, self.pipe = None, None
        # one call at a time on the pipe: a step abandoned at env_runner.timeout_s may still be in one
        self._lock = threading.Lock()

    def call(self, name: str, arguments: dict, timeout_s: float) -> Reply:
        with self._lock:
            return self._call(name, arguments, timeout_s)

    def _call(self, name: str, arguments: dict, timeout_s: float) -> Reply:
        if self.process is None or not self.process.is_alive():
            self._start()
        start = time.perf_counter()
        self.pipe.send((name, arguments))
        if not self.pipe.poll(timeout_s):
            self.stop()
            return Reply(None, "timeout", f"did not finish within {timeout_s:g} s", seconds=time.perf_counter() - start)
        try:
            value, failure, error, where = self.pipe.recv()
        except EOFError:  # the tool ended its own process (os._exit, a signal, a crash in native code)
            value, failure, where = None, "raised", ""
            error = f"nothing: its process ended with exit code {self.stop()}"
        return Reply(value, failure, error, where, time.perf_counter() - start)

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs."""
        return self.process.pid if self.process is not None else None

    def stop(self) -> int | None:
        """Kill the child and everything it started, and reap it; its exit code (None: none ran)."""
        if self.process is None:
            return None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # not its own group yet (killed as it started): kill it alone
            self.process.kill()
        self.process.join()
        self.pipe.close()
        code, self.process, self.pipe = self.process.exitcode, None, None
        return code

    def _start(self) -> None:
        self.pipe, child_end = _FORK.Pipe()
        self.process = _FORK.Process(target=_serve, args=(child_end, self.tools, self.as_text), daemon=True,
                                     name="rlkit-tools")
        self.process.start()
        child_end.close()


def _serve(pipe, tools: dict[str, Callable], as_text: Callable[[object], str]) -> None:
    """The child: answer calls until the parent closes the pipe (or dies)."""
    os.setpgid(0, 0)  # a group of its own, so that a kill reaches what the tool started
    # not the parent's handlers (a run's SIGTERM checkpoints and stops): multiprocessing ends a
    # forked child the parent still holds at exit with SIGTERM, and then waits for it
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_DFL)
    threading.Thread(target=_die_with_parent, daemon=True).start()
    while True:
        try:
            name, arguments = pipe.recv()
        except EOFError:
            return
        try:
            reply = (as_text(tools[name](**arguments)), None, "", "")
        except ToolArgumentError as e:
            reply = (None, "refused", str(e), "")
        except BaseException as e:  # noqa: BLE001 - the model's to see, SystemExit included
            frame = traceback.extract_tb(e.__traceback__)[-1]
            reply = (None, "raised", f"{type(e).__name__}: {e}", f"{os.path.basename(frame.filename)}:{frame.lineno}")
        pipe.send(reply)


def _die_with_parent() -> None:
    """A killed worker (ray.kill) takes its tool process along, even one stuck in a call."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os.killpg(0, signal.SIGKILL)

