"""Arithmetic environment: exact-match verifier of the integer answer."""

import re

from rlkit.config.schema import EnvConfig

_INTEGER = re.compile(r"^\s*(-?\d+)\s*$")


class ArithmeticEnv:
    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg

    def score(self, responses: list[str], answers: list[str]) -> list[float]:
        """responses: decoded completions without special tokens; answers: ground truth."""
        return [self.cfg.correct_reward if is_correct(r, a) else self.cfg.wrong_reward
                for r, a in zip(responses, answers)]


def is_correct(response: str, answer: str) -> bool:
    match = _INTEGER.match(response)
    return bool(match) and int(match.group(1)) == int(answer)
