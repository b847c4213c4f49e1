"""The generated sets data.synthetic asks for, as the records each kind of data reads: RL prompts
as generated (arithmetic or word problems), SFT chats of arithmetic problems, preference pairs of either;
and writing them to data.train_path / data.val_path, marked as rlkit's, never over a file rlkit
did not write."""

import dataclasses
import logging
import random

from rlkit.config.schema import ConfigError, FileDataConfig, PreferenceSetConfig, PromptDataConfig
from rlkit.data.arithmetic import synthetic_splits
from rlkit.data.files import write_generated
from rlkit.data.word_problem_pairs import word_problem_pairs

log = logging.getLogger("rlkit")


def sft_records(rows: list[dict], chat: bool) -> list[dict]:
    """One record per row: {"messages": [user prompt, assistant answer]} if chat, else {"prompt", "response"}."""
    if chat:
        return [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}]}
                for r in rows]
    return [{"prompt": r["prompt"], "response": r["answer"]} for r in rows]


def preference_records(rows: list[dict], seed: int, malformed_fraction: float = 0.0) -> list[dict]:
    """One record per row: {"prompt", "chosen": the answer, "rejected": the answer off by 1 to 3, or
    with probability malformed_fraction a malformed response}, drawn deterministically from seed. A
    reward model that has seen only near misses scores what it never saw at random, and a policy
    trained on its scores finds those responses (docs/algorithms.md)."""
    rng, malformed_rng = random.Random(seed), random.Random(seed + 1)
    records = []
    for r in rows:
        rejected = str(int(r["answer"]) + rng.choice([-3, -2, -1, 1, 2, 3]))
        if malformed_fraction and malformed_rng.random() < malformed_fraction:
            rejected = malformed_response(r["answer"], malformed_rng)
        records.append({"prompt": r["prompt"], "chosen": r["answer"], "rejected": rejected})
    return records


_CHARACTERS = "0123456789+-*= abcdefghijklmnopqrstuvwxyz"


def malformed_response(answer: str, rng: random.Random) -> str:
    """Not the answer alone: repeated, a character before or after it, trailing text, empty, or
    1-6 random characters."""
    forms = [lambda: answer * rng.randint(2, 3), lambda: rng.choice(_CHARACTERS) + answer,
             lambda: answer + rng.choice(_CHARACTERS), lambda: answer + rng.choice(" =+") + str(rng.randrange(100)),
             lambda: "", lambda: "".join(rng.choice(_CHARACTERS) for _ in range(rng.randint(1, 6)))]
    while True:
        response = rng.choice(forms)()
        if response.strip() != answer:
            return response


def preference_set(rows: list[dict], s: PreferenceSetConfig) -> list[dict]:
    """The pairs of data.synthetic's kind: arithmetic answers, or worked word-problem solutions."""
    if s.kind.startswith("word_problems"):
        return word_problem_pairs(rows, s.seed, s.malformed_fraction, s.prompt_format)
    return [{**r, "prompt": s.prompt_format.format(prompt=r["prompt"])}
            for r in preference_records(rows, s.seed, s.malformed_fraction)]


def generated_sets(d: PromptDataConfig | FileDataConfig) -> list[tuple[str, str, list[dict]]]:
    """(config key, path, records) of each split data.synthetic writes: data.train_path, and
    data.val_path unless it is null. Generating runs the generator's checks (ConfigError)."""
    as_records = {"prompts": lambda rows: rows, "sft_files": lambda rows: sft_records(rows, chat=True),
                  "preference_files": lambda rows: preference_set(rows, d.synthetic)}[d.name]
    train, val = synthetic_splits(d.synthetic)
    return [(key, path, as_records(rows)) for key, path, rows in [("data.train_path", d.train_path, train),
                                                                   ("data.val_path", d.val_path, val)]
            if path is not None]


def refused(key: str, problem: str) -> str:
    """The error for a generated set that would overwrite a file rlkit did not write."""
    return (f"{key} / data.synthetic: {problem}, and the set data.synthetic generates is never written over "
            f"such a file; set data.synthetic=null to train on that file, or move it away to have the set "
            f"generated there")


def write_generated_sets(d: PromptDataConfig | FileDataConfig) -> dict[str, list[dict]]:
    """The data.synthetic set in data.train_path / data.val_path, rewritten only when it changes.
    Returns the records by config key: the run trains on these, never on what it reads back (a
    run generating another set may have rewritten the file since)."""
    origin = {"data.name": d.name, "data.synthetic": dataclasses.asdict(d.synthetic)}
    written = {}
    for key, path, records in generated_sets(d):
        try:
            if write_generated(path, records, origin):
                log.info("data: wrote the generated set (data.synthetic) to %s", path)
        except FileExistsError as e:
            raise ConfigError(refused(key, str(e))) from None
        written[key] = records
    return written
