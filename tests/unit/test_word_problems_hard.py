"""data=word_problems_hard (rlkit/data/word_problems.py): GSM8K-format problems of two-digit
products, exact divisions and 2 to 4 steps, each worked step's annotation right, the held-out
split disjoint from the training one."""

import re

import pytest

from rlkit.config.schema import ConfigError, SyntheticSetConfig
from rlkit.data.arithmetic import synthetic_splits
from rlkit.launch.config import load_config

STEP = re.compile(r"^(\d+) ([-+*/]) (\d+) = <<(\d+)([-+*/])(\d+)=(\d+)>>(\d+)$")
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def hard_set(**changes) -> SyntheticSetConfig:
    settings = dict(train_size=600, val_size=100, max_operand=99, operations=["+", "-", "*", "/"], seed=0,
                    kind="word_problems_hard")
    return SyntheticSetConfig(**{**settings, **changes})


def worked_steps(answer: str) -> list[tuple[int, str, int, int]]:
    """(a, op, b, result) of each worked line, checked to be written the same twice, in order."""
    *lines, sentence, final = answer.splitlines()
    steps = []
    for line in lines:
        match = STEP.match(line)
        assert match, line
        a, op, b, a2, op2, b2, result, result2 = match.groups()
        assert (a, op, b, result) == (a2, op2, b2, result2), line
        steps.append((int(a), op, int(b), int(result)))
    assert final == f"#### {steps[-1][3]}" and f" has {steps[-1][3]} " in sentence
    return steps


def test_every_step_is_right_and_every_division_exact():
    train, val = synthetic_splits(hard_set())
    operations = set()
    for row in train + val:
        steps = worked_steps(row["answer"])
        assert 2 <= len(steps) <= 4
        first = steps[0]
        assert first[1] == "*" and 12 <= first[0] <= 99 and 12 <= first[2] <= 99  # a two-digit product to start
        assert f"buys {first[0]} boxes" in row["question"] and row["question"].endswith("have now?")
        for (a, op, b, result), earlier in zip(steps, [None, *steps]):
            assert earlier is None or a == earlier[3]  # each step works on the count so far
            if op == "/":
                assert b >= 12 and a % b == 0 and result == a // b >= 2
            else:
                assert result == APPLY[op](a, b) and result > 0
            operations.add(op)
    assert operations == {"+", "-", "*", "/"}


def test_held_out_rows_are_disjoint_and_the_set_is_deterministic():
    train, val = synthetic_splits(hard_set())
    assert len(train) == 600 and len(val) == 100
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    assert (train, val) == synthetic_splits(hard_set())
    assert synthetic_splits(hard_set(seed=1))[1] != val


def test_the_hard_set_is_a_data_group():
    cfg, _ = load_config("grpo_tiny_cpu", ["data=word_problems_hard", "data.chat_template=true"])
    assert cfg.data.synthetic.kind == "word_problems_hard" and cfg.data.synthetic.max_operand == 99
    assert cfg.data.train_path.endswith("word_problems_hard_train.jsonl") and cfg.data.answer_field == "answer"


@pytest.mark.parametrize("changes, message", [
    (dict(max_operand=9), r"^data.synthetic.max_operand: word_problems_hard multiplies numbers from 12 to max_operand "
                          r"\(got: 9\); set it to 99"),
    (dict(operations=["*", "%"]), r"^data.synthetic.operations: has \['%'\]; choose from"),
])
def test_a_set_that_cannot_be_made_is_one_line(changes, message):
    with pytest.raises(ConfigError, match=message):
        synthetic_splits(hard_set(**changes))
