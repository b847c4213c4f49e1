"""Synthetic arithmetic problems ("12+7=" -> "19"): lists of {"prompt", "answer"} rows; and the
synthetic set data.synthetic asks for, of either kind."""

import random

from rlkit.config.schema import ArithmeticSetConfig, ConfigError
from rlkit.data.word_problems import hard_word_problem_splits, word_problem_splits

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_splits(cfg: ArithmeticSetConfig) -> tuple[list[dict], list[dict]]:
    """Disjoint train / validation sets of {"prompt", "answer"} rows, deterministic in cfg.seed."""
    unknown = [op for op in cfg.operations if op not in OPERATIONS]
    if unknown:
        raise ConfigError(f"data.synthetic.operations: has {unknown}; choose from {list(OPERATIONS)}")
    problems = sorted({(a, op, b) for a in range(cfg.max_operand + 1) for b in range(cfg.max_operand + 1)
                       for op in cfg.operations})
    needed = cfg.train_size + cfg.val_size
    if needed > len(problems):
        raise ConfigError(f"data.synthetic.train_size: train_size + val_size = {needed} exceeds the {len(problems)} "
                          f"distinct problems with data.synthetic.max_operand={cfg.max_operand}; raise max_operand "
                          f"or lower the sizes")
    random.Random(cfg.seed).shuffle(problems)

    def rows(subset):
        return [{"prompt": f"{a}{op}{b}=", "answer": str(OPERATIONS[op](a, b))} for a, op, b in subset]

    return rows(problems[cfg.val_size:needed]), rows(problems[:cfg.val_size])


# data.synthetic.kind -> (config) -> (train rows, validation rows)
SYNTHETIC_SETS = {"arithmetic": arithmetic_splits, "word_problems": word_problem_splits,
                  "word_problems_hard": hard_word_problem_splits}


def synthetic_splits(cfg: ArithmeticSetConfig) -> tuple[list[dict], list[dict]]:
    """The (train, validation) rows of data.synthetic. Prompt and preference data name their
    kind; SFT sets (ArithmeticSetConfig, no kind) are always arithmetic. Generating takes
    milliseconds, so config validation generates once too: every problem of the set is found at load."""
    kind = getattr(cfg, "kind", "arithmetic")
    if kind not in SYNTHETIC_SETS:
        raise ConfigError(f"data.synthetic.kind: must be one of {list(SYNTHETIC_SETS)} (got: {kind!r}); pick one "
                          f"of those")
    return SYNTHETIC_SETS[kind](cfg)
