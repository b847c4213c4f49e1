"""Math answers checked with HF's math-verify: the model's final answer (the last \\boxed{...},
else the text after the last `####`, as GSM8K writes it) against the ground truth, compared as
mathematics (72.0 == 72, 1,000 == 1000, \\frac{1}{2} == 0.5, x^2+2x+1 == (x+1)^2, units and
\\text{} dropped). A ground truth may be a whole GSM8K solution (its `#### n`) or a MATH one (its
\\boxed{}).

math-verify bounds its own work with signal.alarm, which only the main thread may use, and
environments run in worker threads; so each call is bounded by the runner instead
(env_runner.timeout_s: a stuck check is a recorded timeout, and its worker is replaced)."""

import logging
import re

from rlkit.envs.base import EnvStep, Environment

# it warns at every call that runs without its own timeout; the runner bounds calls here
logging.getLogger("math_verify").setLevel(logging.ERROR)
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


def _parsed(answer: str) -> list:
    """math-verify's reading of one final answer (as inline math: `$...$`)."""
    # imported at the first check, not where a config naming this environment is checked (sympy: ~1 s)
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    cleaned = answer.strip().strip("$").replace(",", "") if re.fullmatch(r"[\d,.$\s-]+", answer) else answer
    return parse(f"${cleaned}$", [LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None)


def answers_match(response: str, ground_truth: str) -> bool:
    """Whether the response's final answer (boxed or after `####`) equals the ground truth's."""
    from math_verify import verify

    answer, truth = extract_answer(response), extract_answer(ground_truth) or ground_truth
    if answer is None:
        return False
    gold, predicted = _parsed(truth), _parsed(answer)
    return bool(gold and predicted) and verify(gold, predicted, timeout_seconds=None)


class MathEnv(Environment):
    """Single turn: correct_reward when the final answer matches metadata["answer"], plus
    format_reward for giving a final answer (boxed or after `####`) at all."""

    metadata_fields = ("answer",)

    @staticmethod
    def reference_response(metadata: dict) -> str:
        """The ground truth's final answer in the form the ground truth gives it (MATH: \\boxed{},
        GSM8K: after ####), the one the preset prompts ask for."""
        truth = str(metadata["answer"])
        answer = extract_answer(truth) or truth.strip()
        return f"\\boxed{{{answer}}}" if "\\boxed{" in truth else f"#### {answer}"

    def __init__(self, correct_reward: float = 1.0, wrong_reward: float = 0.0, format_reward: float = 0.0):
        self.correct_reward, self.wrong_reward, self.format_reward = correct_reward, wrong_reward, format_reward

    def setup(self) -> None:
        import math_verify  # noqa: F401 - sympy's import, before the first timed check

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        response = messages[-1]["content"]
        correct = answers_match(response, str(metadata["answer"]))
        formatted = self.format_reward if extract_answer(response) is not None else 0.0
        return EnvStep(reward=(self.correct_reward if correct else self.wrong_reward) + formatted, done=True,
                       correct=correct)
