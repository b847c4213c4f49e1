"""Synthetic GSM8K-format word problems: {"question", "answer"} rows whose answer is a worked
solution ending in `#### <number>`, as GSM8K writes it. One or two steps, each an operation from
`operations` with operands up to `max_operand`: small enough for a 135M instruct model to solve
some of them before RL, so the reward starts between 0 and 1."""

import random

from rlkit.config.schema import ArithmeticSetConfig, ConfigError

NAMES = ["Tom", "Ana", "Sam", "Mia", "Leo", "Zoe", "Ben", "Ivy", "Max", "Eva"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "cards"]
STEPS = {"+": "{name} gets {b} more.", "-": "{name} gives {b} away.",
         "*": "Then {name} ends up with {b} times as many."}
APPLY = {"+": lambda x, b: x + b, "-": lambda x, b: x - b, "*": lambda x, b: x * b}


def word_problem(rng: random.Random, cfg: ArithmeticSetConfig) -> dict:
    """One problem of 1 or 2 steps; every count stays positive, and multipliers are 2 to 4."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(2, max(cfg.max_operand, 2))
    sentences, lines = [f"{name} has {total} {item}."], []
    for _ in range(rng.randint(1, 2)):
        op = rng.choice([op for op in cfg.operations if op != "-" or total > 1] or ["+"])
        b = {"+": lambda: rng.randint(1, cfg.max_operand), "-": lambda: rng.randint(1, total - 1),
             "*": lambda: rng.randint(2, 4)}[op]()
        new = APPLY[op](total, b)
        sentences.append(STEPS[op].format(name=name, b=b))
        lines.append(f"{total} {op} {b} = <<{total}{op}{b}={new}>>{new}")
        total = new
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    answer = "\n".join(lines) + f"\n{name} has {total} {item} now.\n#### {total}"
    return {"question": question, "answer": answer}


def word_problem_splits(cfg: ArithmeticSetConfig) -> tuple[list[dict], list[dict]]:
    """Disjoint train / validation sets (no question in both), deterministic in cfg.seed."""
    unknown = [op for op in cfg.operations if op not in APPLY]
    if unknown:
        raise ConfigError(f"data.synthetic.operations: has {unknown}; choose from {list(APPLY)}")
    rng, questions, rows = random.Random(cfg.seed), set(), []
    needed = cfg.train_size + cfg.val_size
    for _ in range(needed * 50):  # distinct questions are plentiful unless max_operand is tiny
        row = word_problem(rng, cfg)
        if row["question"] not in questions:
            questions.add(row["question"])
            rows.append(row)
            if len(rows) == needed:
                return rows[cfg.val_size:], rows[:cfg.val_size]
    raise ConfigError(f"data.synthetic.max_operand: only {len(rows)} distinct word problems with max_operand="
                      f"{cfg.max_operand}; raise max_operand or lower train_size + val_size ({needed})")
