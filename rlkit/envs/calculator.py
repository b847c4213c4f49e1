"""Arithmetic with a calculator the model calls as a tool: the answer must be exactly the integer
in metadata["answer"]; the tools compute exactly, so a model that learns to call them can be
right where its own arithmetic is not."""

import json
import re

from rlkit.envs.arithmetic import parse_integer
from rlkit.envs.base import EnvStep
from rlkit.envs.math_answers import MathEnv
from rlkit.envs.tools import ToolEnvironment


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


_PROBLEM = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*$")
_TOOL_OF = {"+": "add", "-": "subtract", "*": "multiply"}


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
        call = {"name": _TOOL_OF[op], "arguments": {"a": int(a), "b": int(b)}}
        return [f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>", str(metadata["answer"])]

    def score(self, answer: str, metadata: dict) -> EnvStep:
        correct = parse_integer(answer) == int(metadata["answer"])
        return EnvStep(reward=self.correct_reward if correct else self.wrong_reward, done=True, correct=correct)


class MathCalculatorEnv(ToolEnvironment):
    """Math answers checked as MathEnv checks them (the final \\boxed{} or "#### n", by
    math-verify), with the calculator's tools for the arithmetic on the way: word problems whose
    sums and products the model may hand to a tool instead of working them out itself."""

    metadata_fields = ("answer",)
    reference_response = staticmethod(MathEnv.reference_response)

    def __init__(self, correct_reward: float = 1.0, wrong_reward: float = 0.0, format_reward: float = 0.0,
                 tool_timeout_s: float = 5.0):
        self.answers = MathEnv(correct_reward, wrong_reward, format_reward)
        self.tool_timeout_s = tool_timeout_s

    def tools(self):
        return [add, subtract, multiply]

    def setup(self) -> None:
        super().setup()
        self.answers.setup()

    def score(self, answer: str, metadata: dict) -> EnvStep:
        return self.answers.step([{"role": "assistant", "content": answer}], metadata)
