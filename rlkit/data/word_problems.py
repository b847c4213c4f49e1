"""Synthetic GSM8K-format word problems: {"question", "answer"} rows whose answer is a worked
solution with GSM8K's calculator annotations (`12 * 3 = <<12*3=36>>36`) ending in `#### <number>`.
Each step is an operation from `operations`; two kinds (data.synthetic.kind):

word_problems       one or two steps on counts up to `max_operand`, multipliers 2 to 4: small
                    enough for a 135M instruct model to solve some of them before RL, so the
                    reward starts between 0 and 1
word_problems_hard  a product of two numbers from 12 to `max_operand`, then one to three steps
                    (multiplying or exactly dividing by such a number, adding, subtracting): the
                    multi-digit arithmetic a 135M model gets wrong on its own, where a calculator
                    tool matters
"""

import random
from dataclasses import dataclass

from rlkit.config.schema import ArithmeticSetConfig, ConfigError

NAMES = ["Tom", "Ana", "Sam", "Mia", "Leo", "Zoe", "Ben", "Ivy", "Max", "Eva"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "cards"]
STEPS = {"+": "{name} gets {b} more.", "-": "{name} gives {b} away.",
         "*": "Then {name} ends up with {b} times as many.",
         "/": "Then {name} splits them into {b} equal piles and keeps one pile."}
APPLY = {"+": lambda x, b: x + b, "-": lambda x, b: x - b, "*": lambda x, b: x * b, "/": lambda x, b: x // b}
MAX_COUNT = 1_000_000  # no step multiplies a count past this: answers stay GSM8K-sized


@dataclass(frozen=True)
class Difficulty:
    steps: tuple[int, int]  # fewest and most steps after the opening sentence
    smallest_factor: int  # multipliers and divisors run from this to largest_factor
    largest_factor: int | None  # None: max_operand
    opens_with_product: bool  # "buys a boxes with b in each" (a, b factors) instead of "has n"


EASY = Difficulty(steps=(1, 2), smallest_factor=2, largest_factor=4, opens_with_product=False)
HARD = Difficulty(steps=(1, 3), smallest_factor=12, largest_factor=None, opens_with_product=True)


def annotated(a: int, op: str, b: int, result: int) -> str:
    """A worked step as GSM8K writes it, the calculator annotation between << >>."""
    return f"{a} {op} {b} = <<{a}{op}{b}={result}>>{result}"


def word_problem(rng: random.Random, cfg: ArithmeticSetConfig, level: Difficulty = EASY) -> dict:
    """One problem; every count stays positive and every division exact."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    factors = range(level.smallest_factor, (level.largest_factor or cfg.max_operand) + 1)
    if level.opens_with_product:
        boxes, each = rng.randint(factors.start, factors.stop - 1), rng.randint(factors.start, factors.stop - 1)
        total = boxes * each
        sentences, lines = [f"{name} buys {boxes} boxes of {item} with {each} {item} in each box."], [
            annotated(boxes, "*", each, total)]
    else:
        total = rng.randint(2, max(cfg.max_operand, 2))
        sentences, lines = [f"{name} has {total} {item}."], []
    for _ in range(rng.randint(*level.steps)):
        op = rng.choice([op for op in cfg.operations if _operands(op, total, factors, cfg.max_operand)] or ["+"])
        b = _draw(rng, op, _operands(op, total, factors, cfg.max_operand))
        new = APPLY[op](total, b)
        sentences.append(STEPS[op].format(name=name, b=b))
        lines.append(annotated(total, op, b, new))
        total = new
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    answer = "\n".join(lines) + f"\n{name} has {total} {item} now.\n#### {total}"
    return {"question": question, "answer": answer}


def _operands(op: str, total: int, factors: range, max_operand: int) -> range | list[int]:
    """The second operands `op` may take on `total` (empty: op is not possible now)."""
    if op == "+":
        return range(1, max_operand + 1)
    if op == "-":
        return range(1, total)
    if op == "*":
        return factors if total * (factors.stop - 1) <= MAX_COUNT else range(0)
    return [d for d in factors if total % d == 0 and total // d >= 2]


def _draw(rng: random.Random, op: str, operands: range | list[int]) -> int:
    # a range is drawn with randint, as before "/" existed: the same seed gives the same set
    return rng.randint(operands.start, operands.stop - 1) if isinstance(operands, range) else rng.choice(operands)


def word_problem_splits(cfg: ArithmeticSetConfig) -> tuple[list[dict], list[dict]]:
    """data.synthetic.kind=word_problems: disjoint train / validation sets."""
    return _splits(cfg, EASY)


def hard_word_problem_splits(cfg: ArithmeticSetConfig) -> tuple[list[dict], list[dict]]:
    """data.synthetic.kind=word_problems_hard: disjoint train / validation sets."""
    if cfg.max_operand < HARD.smallest_factor:
        raise ConfigError(f"data.synthetic.max_operand: word_problems_hard multiplies numbers from "
                          f"{HARD.smallest_factor} to max_operand (got: {cfg.max_operand}); set it to 99 for "
                          f"two-digit factors")
    return _splits(cfg, HARD)


def _splits(cfg: ArithmeticSetConfig, level: Difficulty) -> tuple[list[dict], list[dict]]:
    """Disjoint train / validation sets (no question in both), deterministic in cfg.seed."""
    unknown = [op for op in cfg.operations if op not in APPLY]
    if unknown:
        raise ConfigError(f"data.synthetic.operations: has {unknown}; choose from {list(APPLY)}")
    rng, questions, rows = random.Random(cfg.seed), set(), []
    needed = cfg.train_size + cfg.val_size
    for _ in range(needed * 50):  # distinct questions are plentiful unless max_operand is tiny
        row = word_problem(rng, cfg, level)
        if row["question"] not in questions:
            questions.add(row["question"])
            rows.append(row)
            if len(rows) == needed:
                return rows[cfg.val_size:], rows[:cfg.val_size]
    raise ConfigError(f"data.synthetic.max_operand: only {len(rows)} distinct word problems with max_operand="
                      f"{cfg.max_operand}; raise max_operand or lower train_size + val_size ({needed})")
