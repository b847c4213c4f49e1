"""Arithmetic with a calculator the model calls as a tool: the answer must be exactly the integer
in metadata["answer"]; the tools compute exactly, so a model that learns to call them can be
right where its own arithmetic is not. For word problems: the same tools with a math-answer check
(MathCalculatorEnv), or a Python sandbox as the tool (MathCodeEnv)."""

import json
import re

from rlkit.envs.arithmetic import parse_integer
from rlkit.envs.base import EnvStep
from rlkit.envs.code_execution import CodeExecutionEnv
from rlkit.envs.math_answers import MathEnv
from rlkit.envs.sandbox import SandboxLimits, limits_problem
from rlkit.envs.tools import ToolArgumentError, ToolEnvironment, load_parser
from rlkit.envs.tools.code import PythonSandbox


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def subtract(a: int, b: int) -> int:
    """Subtract the second integer from the first.

    Args:
        a: the number to subtract from
        b: the number to subtract
    """
    return a - b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def divide(a: int, b: int) -> int:
    """Divide the first integer by the second, exactly: the quotient must be a whole number.

    Args:
        a: the number to divide
        b: the number to divide by
    """
    if b == 0 or a % b:  # the model's to read, as a tool message, never a run's crash
        raise ToolArgumentError("cannot divide by 0" if b == 0 else f"{a} / {b} is not a whole number "
                                                                   f"(remainder {a % b})")
    return a // b


_PROBLEM = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*$")
_TOOL_OF = {"+": add, "-": subtract, "*": multiply, "/": divide}
# GSM8K's calculator annotation "<<48/2=24>>", and an expression in it that is one operation on two integers
_ANNOTATION = re.compile(r"<<([^<>=]*)=[^<>]*>>")
_ONE_OPERATION = re.compile(r"\s*(-?\d+)\s*([-+*/])\s*(-?\d+)\s*")


class CalculatorEnv(ToolEnvironment):
    metadata_fields = ("answer",)

    def __init__(self, correct_reward: float = 1.0, wrong_reward: float = 0.0, tool_timeout_s: float = 5.0):
        self.correct_reward, self.wrong_reward, self.tool_timeout_s = correct_reward, wrong_reward, tool_timeout_s

    @staticmethod
    def reference_response(metadata: dict) -> str:
        return str(metadata["answer"])

    def tools(self):
        return [add, subtract, multiply]

    def reference_turns(self, messages: list[dict], metadata: dict) -> list[str] | None:
        """For "a<op>b=" prompts: call the operation's tool, then answer what it returned."""
        match = _PROBLEM.search(messages[-1]["content"]) if messages else None
        if match is None:
            return None
        a, op, b = match.groups()
        call = {"name": _TOOL_OF[op].__name__, "arguments": {"a": int(a), "b": int(b)}}
        return [f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>", str(metadata["answer"])]

    def score(self, answer: str, metadata: dict) -> EnvStep:
        correct = parse_integer(answer) == int(metadata["answer"])
        return EnvStep(reward=self.correct_reward if correct else self.wrong_reward, done=True, correct=correct)


def solution_steps(solution: str) -> list[tuple[int, str, int]]:
    """The (a, op, b) of each calculator annotation in a GSM8K worked solution that a tool can
    compute: one operation on two integers, a division only where it is exact; in order."""
    steps = []
    for expression in _ANNOTATION.findall(solution):
        match = _ONE_OPERATION.fullmatch(expression)
        if match is not None:
            a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
            if op != "/" or (b != 0 and a % b == 0):
                steps.append((a, op, b))
    return steps


class MathCalculatorEnv(ToolEnvironment):
    """Math answers checked as MathEnv checks them (the final \\boxed{} or "#### n", by
    math-verify), with the calculator's tools for the arithmetic on the way: word problems whose
    sums, products and quotients the model may hand to a tool instead of working them out itself."""

    metadata_fields = ("answer",)
    reference_response = staticmethod(MathEnv.reference_response)

    def __init__(self, correct_reward: float = 1.0, wrong_reward: float = 0.0, format_reward: float = 0.0,
                 tool_timeout_s: float = 5.0):
        self.answers = MathEnv(correct_reward, wrong_reward, format_reward)
        self.tool_timeout_s = tool_timeout_s

    def tools(self):
        return [add, subtract, multiply, divide]

    def tool_call(self, a: int, op: str, b: int) -> tuple[str, dict]:
        """The call (tool name, arguments) that computes `a op b`."""
        return _TOOL_OF[op].__name__, {"a": a, "b": b}

    def reference_turns(self, messages: list[dict], metadata: dict) -> list[str]:
        """For a worked solution (metadata["answer"], GSM8K's format): a tool call for each of its
        annotations a tool can compute (solution_steps), in order, written as the parser reads
        them; calls that need no result of the turn's earlier calls share a turn. Then the
        solution itself, the final answer. A solution with no such step: the solution alone."""
        solution, write = str(metadata["answer"]), load_parser(self.parser).format_call
        turns, results = [], set()  # results: those of the last turn's calls
        for a, op, b in solution_steps(solution):
            call = write(*self.tool_call(a, op, b))
            if turns and not {a, b} & results:
                turns[-1] += "\n" + call
            else:
                turns.append(call)
                results = set()
            results.add(_TOOL_OF[op](a, b))
        return turns + [solution]

    def setup(self) -> None:
        super().setup()
        self.answers.setup()

    def score(self, answer: str, metadata: dict) -> EnvStep:
        return self.answers.step([{"role": "assistant", "content": answer}], metadata)


class MathCodeEnv(MathCalculatorEnv):
    """MathCalculatorEnv with a Python sandbox as its one tool (run_python, rlkit/envs/tools/code.py):
    the model's programs run under the code sandbox's limits (wall_s, cpu_s, memory_mb, processes;
    no network, no files outside its own folder), and what they print is the tool's result. Its
    reference calls print each step's result (`print(1410 // 30)`)."""

    @classmethod
    def check_host(cls, *, allow_weak_sandbox: bool, **_) -> str | None:
        return CodeExecutionEnv.check_host(allow_weak_sandbox=allow_weak_sandbox)

    @classmethod
    def check_arguments(cls, **kwargs) -> str | None:
        limits = SandboxLimits(**{key: kwargs[key] for key in ("wall_s", "cpu_s", "memory_mb", "processes")})
        problem = limits_problem(limits)
        if problem:
            return f"env.{problem}"
        problem = super().check_arguments(**kwargs)  # tool_timeout_s among them: a positive number
        if problem is None and kwargs["tool_timeout_s"] <= limits.wall_s:
            return (f"env.tool_timeout_s: must exceed env.wall_s ({limits.wall_s:g}), or the tool process is killed "
                    f"before the sandbox can say the program ran out of time (got: {kwargs['tool_timeout_s']:g}); "
                    f"e.g. env.wall_s + 5")
        return problem

    def __init__(self, correct_reward: float = 1.0, wrong_reward: float = 0.0, format_reward: float = 0.0,
                 wall_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 512, processes: int = 32,
                 allow_weak_sandbox: bool = False, tool_timeout_s: float = 10.0):
        super().__init__(correct_reward, wrong_reward, format_reward, tool_timeout_s)
        self.sandbox = PythonSandbox(SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb,
                                                   processes=processes), allow_weak_sandbox)

    def tools(self):
        return [self.sandbox.run_python]

    def tool_call(self, a: int, op: str, b: int) -> tuple[str, dict]:
        return "run_python", {"code": f"print({a} {'//' if op == '/' else op} {b})"}
