"""Synthetic arithmetic problems ("12+7=" -> "19"): lists of {"prompt", "answer"} rows."""

import random

from rlkit.config.schema import ArithmeticSetConfig

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_splits(cfg: ArithmeticSetConfig) -> tuple[list[dict], list[dict]]:
    """Disjoint train / validation sets of {"prompt", "answer"} rows, deterministic in cfg.seed."""
    unknown = [op for op in cfg.operations if op not in OPERATIONS]
    if unknown:
        raise ValueError(f"data.operations has {unknown}; choose from {list(OPERATIONS)}")
    problems = sorted({(a, op, b) for a in range(cfg.max_operand + 1) for b in range(cfg.max_operand + 1)
                       for op in cfg.operations})
    needed = cfg.train_size + cfg.val_size
    if needed > len(problems):
        raise ValueError(f"data.train_size + data.val_size = {needed} exceeds the {len(problems)} distinct "
                         f"problems with data.max_operand={cfg.max_operand}; raise max_operand or lower the sizes")
    random.Random(cfg.seed).shuffle(problems)

    def rows(subset):
        return [{"prompt": f"{a}{op}{b}=", "answer": str(OPERATIONS[op](a, b))} for a, op, b in subset]

    return rows(problems[cfg.val_size:needed]), rows(problems[:cfg.val_size])
