"""Arithmetic environments with an exact integer verifier."""

import re

from rlkit.envs.base import EnvStep, Environment

_INTEGER = re.compile(r"^\s*(-?\d+)\s*$")


def parse_integer(response: str) -> int | None:
    match = _INTEGER.match(response)
    return int(match.group(1)) if match else None


class ArithmeticEnv(Environment):
    """Single turn: the answer must be exactly the integer in metadata["answer"]."""

    metadata_fields = ("answer",)

    @staticmethod
    def reference_response(metadata: dict) -> str:
        return str(metadata["answer"])

    def __init__(self, correct_reward: float = 1.0, wrong_reward: float = 0.0):
        self.correct_reward, self.wrong_reward = correct_reward, wrong_reward

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        correct = parse_integer(messages[-1]["content"]) == int(metadata["answer"])
        return EnvStep(reward=self.correct_reward if correct else self.wrong_reward, done=True, correct=correct)


class GuessSumEnv(Environment):
    """Multi-turn number guessing: the secret is the answer to the prompt. A wrong guess gets
    "higher" or "lower" (or "a number please") and another try; a right one ends the episode
    with a reward that is smaller for later turns."""

    metadata_fields = ("answer",)

    def __init__(self, turn_discount: float = 0.5):
        self.turn_discount = turn_discount

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        guess, secret = parse_integer(messages[-1]["content"]), int(metadata["answer"])
        turn = sum(m["role"] == "assistant" for m in messages)
        if guess == secret:
            return EnvStep(reward=self.turn_discount ** (turn - 1), done=True, correct=True)
        feedback = "a number please" if guess is None else ("higher" if guess < secret else "lower")
        question = next(m["content"] for m in messages if m["role"] == "user")
        return EnvStep(reward=0.0, done=False, observation=f" {feedback}\n{question}", correct=False)
