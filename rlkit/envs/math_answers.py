"""Math answer verifier: \\boxed{...} and GSM8K's `#### n`, numbers compared after normalisation
(72.0 == 72, 1,000 == 1000, 0.5 == 1/2)."""

import re
from fractions import Fraction

from rlkit.envs.base import EnvStep, Environment

_HASHES = re.compile(r"####\s*([^\n]+)")


def extract_answer(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces allowed), else the text after the
    last `####`, else None."""
    start = text.rfind("\\boxed{")
    if start != -1:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
        return None
    matches = _HASHES.findall(text)
    return matches[-1].strip() if matches else None


def normalize(answer: str) -> str:
    """Canonical string: numbers (with thousands separators, trailing zeros, $ or %, simple
    fractions) become their exact rational value; anything else is whitespace-collapsed."""
    cleaned = answer.strip().strip("$").rstrip("%").replace(",", "").replace(" ", "")
    cleaned = re.sub(r"^\\frac\{(-?\d+)\}\{(\d+)\}$", r"\1/\2", cleaned)
    try:
        return str(Fraction(cleaned))
    except (ValueError, ZeroDivisionError):
        return " ".join(answer.split())


def answers_match(response: str, ground_truth: str) -> bool:
    extracted = extract_answer(response)
    return extracted is not None and normalize(extracted) == normalize(ground_truth)


class MathEnv(Environment):
    """Single turn: reward 1 when the final answer matches metadata["answer"]."""

    def __init__(self, correct_reward: float = 1.0, wrong_reward: float = 0.0):
        self.correct_reward, self.wrong_reward = correct_reward, wrong_reward

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        correct = answers_match(messages[-1]["content"], str(metadata["answer"]))
        return EnvStep(reward=self.correct_reward if correct else self.wrong_reward, done=True, correct=correct)
