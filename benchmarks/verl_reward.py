"""The reward verl scores the e2e benchmark's word problems with (its reward.custom_reward_function),
loaded by verl from this file's path: it imports nothing from rlkit, whose install is not verl's.

Like rlkit's math environment in spirit, cheaper and without math-verify: the response's final
answer is the first number after its last `####`, or else its last number; it scores 1.0 when that
number equals the ground truth's (the `#### n` of the row's worked solution), else 0.0. rlkit's
SmolLM2 recipe adds a 0.1 format bonus and compares with math-verify; for timing the difference
does not matter (the benchmark fixes the response length), only that verl computes a reward."""

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> float | None:
    """The first number after the last `####`, else the last number in the text; None if none."""
    after = _NUMBER.findall(text.rpartition("####")[2]) if "####" in text else []
    found = after[:1] or _NUMBER.findall(text)[-1:]
    return float(found[0].replace(",", "")) if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward signature: 1.0 for the right final number, else 0.0."""
    answer = final_answer(solution_str)
    return 1.0 if answer is not None and answer == float(ground_truth) else 0.0
