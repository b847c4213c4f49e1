"""Preference pairs on word problems: chosen is the worked solution; rejected a near miss with a
wrong final number in the same format, or a malformed response at malformed_fraction; the prompt
is the one the GRPO recipe asks; the set is data=word_problems' problems, split the same way."""

import re
from pathlib import Path

from omegaconf import OmegaConf

from rlkit.config.schema import PreferenceSetConfig, SyntheticSetConfig
from rlkit.data.arithmetic import synthetic_splits
from rlkit.data.synthetic import preference_set
from rlkit.data.word_problem_pairs import word_problem_pairs

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "data"
FINAL = re.compile(r"\n#### (\d+)$")


def configured(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONFIGS / f"{name}.yaml"))


def pairs_config(**changes) -> PreferenceSetConfig:
    return PreferenceSetConfig(**{**configured("word_problem_preferences")["synthetic"], **changes})


def test_near_misses_keep_the_format_with_a_wrong_final_number():
    s = pairs_config(train_size=400, malformed_fraction=0.0)
    train, _ = synthetic_splits(s)
    records = preference_set(train, s)
    assert [r["chosen"] for r in records] == [row["answer"] for row in train]
    slips = short = 0
    for r in records:
        right, wrong = int(FINAL.search(r["chosen"]).group(1)), int(FINAL.search(r["rejected"]).group(1))
        assert wrong != right and f" has {wrong} " in r["rejected"].split("\n")[-2]
        chosen_steps, rejected_steps = r["chosen"].split("\n")[:-2], r["rejected"].split("\n")[:-2]
        if len(rejected_steps) == len(chosen_steps):  # the last step's result off by 1 to 3
            slips += 1
            assert rejected_steps[:-1] == chosen_steps[:-1] and 1 <= abs(wrong - right) <= 3
            assert rejected_steps[-1].endswith(f"={wrong}>>{wrong}")
        else:  # one step short: the count before the last step
            short += 1
            assert rejected_steps == chosen_steps[:-1] and chosen_steps[-1].startswith(f"{wrong} ")
    assert slips > 100 and short > 100


def test_malformed_responses_replace_near_misses_at_their_rate():
    s = pairs_config(train_size=400)
    train, _ = synthetic_splits(s)
    near = word_problem_pairs(train, s.seed, 0.0, s.prompt_format)
    mixed = preference_set(train, s)
    assert preference_set(train, s) == mixed
    malformed = [m["rejected"] for n, m in zip(near, mixed) if m["rejected"] != n["rejected"]]
    assert 0.4 < len(malformed) / len(mixed) < 0.6
    assert all(m["rejected"].strip() != m["chosen"] for m in mixed)
    assert "" in malformed and sum(FINAL.search(r) is None for r in malformed) > len(malformed) / 2
    assert any(r.count("####") > 1 for r in malformed)  # a solution repeated: length earns nothing


def test_the_prompt_is_the_policys_and_the_problems_are_data_word_problems():
    """The reward model must read what grpo_smollm2_gpu's policy is asked, and never the problems
    the GRPO run holds out."""
    s = pairs_config()
    assert s.prompt_format == configured("gsm8k")["prompt_format"]
    prompts = configured("word_problems")["synthetic"]
    rl_train, rl_val = synthetic_splits(SyntheticSetConfig(**prompts))
    train, val = synthetic_splits(s)
    assert val == rl_val and train == rl_train[:len(train)]
    record = preference_set(val[:1], s)[0]
    assert record["prompt"] == s.prompt_format.format(prompt=val[0]["question"])


def test_arithmetic_pairs_are_as_before_with_the_default_prompt():
    s = PreferenceSetConfig(train_size=20, val_size=4, max_operand=9, operations=["+"], seed=0)
    train, _ = synthetic_splits(s)
    assert [r["prompt"] for r in preference_set(train, s)] == [row["prompt"] for row in train]
