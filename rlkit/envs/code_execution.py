"""Code-execution reward: the model's program runs against the sample's tests in the sandbox."""

import re

from rlkit.envs.base import EnvStep, Environment
from rlkit.envs.sandbox import SandboxLimits, SandboxUnavailable, check_sandbox, limits_problem, run_python

_FENCED = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def extract_program(response: str) -> str:
    """The last ```python fenced block, else the whole response."""
    blocks = _FENCED.findall(response)
    return blocks[-1] if blocks else response


class CodeExecutionEnv(Environment):
    """Reward 1 when the program followed by metadata["tests"] (e.g. asserts) exits cleanly.

    allow_weak_sandbox: where bubblewrap cannot run, accept the weak sandbox (not a security
    boundary) instead of refusing to start."""

    metadata_fields = ("tests",)

    @classmethod
    def check_host(cls, *, allow_weak_sandbox: bool, **_) -> str | None:
        try:
            check_sandbox(allow_weak_sandbox)
        except SandboxUnavailable as e:
            return str(e)
        return None

    @classmethod
    def check_arguments(cls, *, wall_s, cpu_s, memory_mb, processes, **_) -> str | None:
        problem = limits_problem(SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, processes=processes))
        return f"env.{problem}" if problem else None

    def __init__(self, wall_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512, processes: int = 32,
                 allow_weak_sandbox: bool = False):
        self.limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, processes=processes)
        self.allow_weak_sandbox = allow_weak_sandbox
        check_sandbox(allow_weak_sandbox)  # refuse here, before any training, not at the first reward

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        program = extract_program(messages[-1]["content"]) + "\n\n" + metadata["tests"] + "\n"
        result = run_python(program, self.limits, self.allow_weak_sandbox)
        return EnvStep(reward=1.0 if result.ok else 0.0, done=True, correct=result.ok)
