"""Preference pairs on GSM8K-format word problems (data.synthetic.kind word_problems with
data.name preference_files): chosen is the worked solution ending in the right `#### n`; rejected
is a near miss written as carefully (the last step's result off by 1 to 3, or the answer one step
short), or with probability malformed_fraction a malformed response: no final answer line, the
solution repeated or cut off, empty, random characters. A reward model trained on near misses alone
scores those at random, and RL on its scores finds them (docs/algorithms.md)."""

import random
import re

# a worked step as word_problems.annotated writes it: "a op b = <<a op b=r>>r"
_STEP = re.compile(r"^(\d+) ([-+*/]) (\d+) = <<[^>]*>>(-?\d+)$")
_CHARACTERS = "0123456789+-*=# abcdefghijklmnopqrstuvwxyz\n"


def word_problem_pairs(rows: list[dict], seed: int, malformed_fraction: float, prompt_format: str) -> list[dict]:
    """One {"prompt", "chosen", "rejected"} record per {"question", "answer"} row, the prompt the
    question through prompt_format (as the policy is asked it: data.prompt_format); deterministic in
    seed."""
    rng, malformed_rng = random.Random(seed), random.Random(seed + 1)
    records = []
    for row in rows:
        rejected = near_miss(row["answer"], rng)
        if malformed_fraction and malformed_rng.random() < malformed_fraction:
            rejected = malformed_solution(row["answer"], malformed_rng)
        records.append({"prompt": prompt_format.format(prompt=row["question"]), "chosen": row["answer"],
                        "rejected": rejected})
    return records


def near_miss(answer: str, rng: random.Random) -> str:
    """The worked solution with a wrong final number: half the time the last step's result off by
    1 to 3, else the last step left out and the count before it given as the answer."""
    *steps, closing, final = answer.split("\n")
    right = int(final.removeprefix("#### "))
    a, op, b, _ = _STEP.match(steps[-1]).groups()
    if rng.random() < 0.5:
        steps, wrong = steps[:-1], int(a)
    else:
        delta = rng.choice([-3, -2, -1, 1, 2, 3])
        wrong = right + delta if right + delta >= 0 else right - delta
        steps = steps[:-1] + [f"{a} {op} {b} = <<{a}{op}{b}={wrong}>>{wrong}"]
    closing = re.sub(r" has \d+ ", f" has {wrong} ", closing, count=1)
    return "\n".join([*steps, closing, f"#### {wrong}"])


def malformed_solution(answer: str, rng: random.Random) -> str:
    """Not the worked solution as asked: its steps without the final answer line, the solution
    repeated, cut off half way, empty, or 1-40 random characters."""
    steps = answer.split("\n")[:-2]
    forms = [lambda: "\n".join(steps), lambda: "\n".join([answer] * rng.randint(2, 3)),
             lambda: answer[:rng.randint(1, len(answer) // 2)], lambda: "",
             lambda: "".join(rng.choice(_CHARACTERS) for _ in range(rng.randint(1, 40)))]
    while True:
        response = rng.choice(forms)()
        if response.strip() != answer:
            return response
