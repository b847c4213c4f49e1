"""The environment of the multi-turn benchmark (multi_turn.py) and its slow-tool test: episodes
whose turns are the benchmark's choice, not the model's. Imported by environment workers as
benchmarks.tool_turns (a run started from the repository root)."""

import hashlib
import time

from rlkit.envs.base import EnvStep
from rlkit.envs.calculator import MathCalculatorEnv
from rlkit.envs.tools import ToolCall, tool_metrics


def review(seconds: float) -> str:
    """Review a draft answer: check each step with the calculator before answering again.

    Args:
        seconds: how long the review takes
    """
    time.sleep(seconds)
    return "Check every step with the calculator, then give the final answer as: #### <number>"


def is_slow(metadata: dict, slow_one_in: int) -> bool:
    """One problem in slow_one_in, by a hash of its worked solution (the same in every run)."""
    digest = hashlib.blake2b(str(metadata["answer"]).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % slow_one_in == 0


class ToolTurns(MathCalculatorEnv):
    """Episodes of `turns` model turns whatever the model writes: a turn's tool calls are answered;
    before the last turn, a turn without calls (a draft) is answered by a review call the
    environment makes itself, run in the tool process as the model's calls are; the last turn is
    scored as MathCalculatorEnv scores it. The review sleeps `sleep_s` for the episodes of one
    problem in `slow_one_in` (is_slow)."""

    def __init__(self, turns: int = 3, sleep_s: float = 0.0, slow_one_in: int = 16, correct_reward: float = 1.0,
                 wrong_reward: float = 0.0, format_reward: float = 0.0, tool_timeout_s: float = 5.0):
        super().__init__(correct_reward, wrong_reward, format_reward, tool_timeout_s)
        self.turns, self.sleep_s, self.slow_one_in = turns, sleep_s, slow_one_in

    def tools(self):
        return [*super().tools(), review]

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        step = super().step(messages, metadata)
        if not step.done or sum(m["role"] == "assistant" for m in messages) >= self.turns:
            return step
        seconds = self.sleep_s if is_slow(metadata, self.slow_one_in) else 0.0
        result = self.toolbox.call(ToolCall("review", {"seconds": seconds}, "review"))
        return EnvStep(0.0, False, tool_messages=[result.message()], counts=tool_metrics([result]))
