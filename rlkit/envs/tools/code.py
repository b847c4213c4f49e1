"""Code execution as a tool: the model's programs run in rlkit's sandbox (rlkit/envs/sandbox.py),
under the same limits as code rewards. A program that fails, runs out of time or memory, or tries
to leave the sandbox is the model's to read about in the tool message, not a failed call.

    def tools(self):
        return [PythonSandbox(SandboxLimits(wall_s=5)).run_python, ...]
"""

from rlkit.envs.sandbox import SandboxLimits, check_limits, check_sandbox, run_python

_TAIL_CHARS = 1000  # of stderr, where a failing program's traceback ends


class PythonSandbox:
    def __init__(self, limits: SandboxLimits = SandboxLimits(), allow_weak_sandbox: bool = False):
        self.limits, self.allow_weak = limits, allow_weak_sandbox
        check_limits(limits)  # refuse now, before any training, a limit that is none
        check_sandbox(allow_weak_sandbox)  # and where bubblewrap cannot run

    def run_python(self, code: str) -> str:
        """Run a Python program in a sandbox (no network, no files outside its own folder) and return what it printed.

        Args:
            code: the program's source code
        """
        result = run_python(code, self.limits, self.allow_weak)
        if result.ok:
            return result.stdout
        stopped = {"timeout": f"stopped after {self.limits.wall_s:g} s", "cpu": "stopped: out of CPU time",
                   "memory": f"stopped: over {self.limits.memory_mb} MB of memory"}.get(
            result.reason, f"exit code {result.exit_code}")
        return f"{result.stdout}[{stopped}]\n{result.stderr[-_TAIL_CHARS:]}"
