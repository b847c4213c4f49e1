"""SFT / preference rows: loading files (json as written, parquet through datasets), loss masks from
the chat template, clear errors naming file, row or line, and the generated arithmetic sets, which
never overwrite a file rlkit did not write."""

import functools
import json
import re

import datasets
import pandas as pd
import pytest

from rlkit.config.schema import ArithmeticSetConfig, ConfigError, FileDataConfig, SFTDataConfig
from rlkit.data.files import GENERATED_MARKER, load_rows
from rlkit.data.sft import load_tokenized_splits, tokenize_preference_row, tokenize_sft_row
from rlkit.data.synthetic import preference_records, sft_records
from rlkit.models.tiny import build_tokenizer

ROWS = [
    {"messages": [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3-1="},
                  {"role": "assistant", "content": "2"}]},
]
ROW_BYTES = 1 << 20
MAX_TOKENS = 64
ARITHMETIC = [{"prompt": "12+7=", "answer": "19"}, {"prompt": "3-5=", "answer": "-2"},
              {"prompt": "4*6=", "answer": "24"}, {"prompt": "0+0=", "answer": "0"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tokenize_file(tokenizer, path):
    """What a recipe does: every row of a file, named by file and row in errors."""
    rows = load_rows(path, ROW_BYTES)
    return [tokenize_sft_row(tokenizer, row, f"{path} row {i}", MAX_TOKENS) for i, row in enumerate(rows)]


def masked_text(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


# loading

def test_json_jsonl_parquet_load_the_same_rows(tmp_path):
    jsonl = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    pd.DataFrame(ROWS).to_parquet(tmp_path / "rows.parquet")
    loaded = [load_rows(p, ROW_BYTES) for p in (jsonl, str(tmp_path / "rows.json"), str(tmp_path / "rows.parquet"))]
    assert loaded[0] == ROWS
    assert loaded[1] == ROWS and loaded[2] == ROWS


def test_mixed_formats_in_one_file_load_and_tokenize(tmp_path, tokenizer):
    # a field a row lacks is absent (json) or None (parquet, hub datasets): tokenizing treats both alike
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "1+1=", "response": "2"}, ROWS[0]])
    assert [masked_text(tokenizer, *pair) for pair in tokenize_file(tokenizer, path)] == \
        ["2<|im_end|>", "19<|im_end|>"]


def test_missing_file_names_it(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=f"{missing}: no such file"):
        load_rows(missing, ROW_BYTES)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_rows("./not/here", ROW_BYTES)


def test_unsupported_and_malformed_files_name_the_file(tmp_path):
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,response\n1+1=,2\n")
    with pytest.raises(ValueError, match=r"rows.csv: unsupported file type '\.csv'; give a \.json"):
        load_rows(str(csv), ROW_BYTES)

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1=", "response": "2"}\n\n{"prompt": "1+1=", "response": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl line 3: not valid JSON \(Expecting value, column 32\); fix "
                                         r"that line"):
        load_rows(str(broken), ROW_BYTES)


def test_malformed_json_list_names_its_line(tmp_path):
    broken = tmp_path / "rows.json"
    broken.write_text('[\n {"prompt": "1+1=", "response": "2"},\n {"prompt": "2+2=" "response": "4"}\n]\n')
    with pytest.raises(ValueError, match=r"rows.json line 3: not valid JSON \(Expecting ',' delimiter, column 20\)"):
        load_rows(str(broken), ROW_BYTES)


def test_a_row_that_is_no_object_names_its_line(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [ROWS[0], ["1+1=", "2"]])
    with pytest.raises(ValueError, match=r"rows.jsonl line 2: is a JSON list, not an object of the row's fields"):
        load_rows(path, ROW_BYTES)


@pytest.mark.parametrize("text, message", [("", "the file is empty"), ("\n\n", "has no rows")],
                         ids=["zero-bytes", "blank-lines"])
def test_an_empty_file_says_so(tmp_path, text, message):
    """An empty file used to say "could not be read as json (StopIteration: )"."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    with pytest.raises(ValueError, match=f"empty.jsonl: {message}; give a file with at least one row"):
        load_rows(str(empty), ROW_BYTES)


def test_hub_name_failure_says_what_to_do(monkeypatch):
    def unreachable(name, subset, split):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(ValueError, match=r"someorg/chat: not a local file, and loading it as a Hugging Face hub "
                                         r"dataset \(split 'test'\) failed .*give a local \.json"):
        load_rows("someorg/chat", ROW_BYTES, split="test")


# loss masks

def test_prompt_response_mask_covers_the_response_and_end_of_turn(tokenizer):
    ids, mask = tokenize_sft_row(tokenizer, {"prompt": "12+7=", "response": "19"}, "row 0", MAX_TOKENS)
    messages = [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}]
    full = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert ids == full["input_ids"] and len(mask) == len(ids)
    prompt = tokenizer(tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    target = tokenizer("19<|im_end|>", add_special_tokens=False)["input_ids"]
    # prompt (+ generation header), then the trained target, then the template's trailing "\n"
    assert ids[:len(prompt)] == prompt and ids[len(prompt):len(prompt) + len(target)] == target
    assert mask == [0] * len(prompt) + [1] * len(target) + [0] * (len(ids) - len(prompt) - len(target))
    assert masked_text(tokenizer, ids, mask) == "19<|im_end|>"


def test_two_turn_messages_mask_every_assistant_turn(tokenizer):
    row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+7="},
                        {"role": "assistant", "content": "19"}, {"role": "user", "content": "and 3-1="},
                        {"role": "assistant", "content": "The answer is 2"}]}
    ids, mask = tokenize_sft_row(tokenizer, row, "row 0", MAX_TOKENS)
    assert ids == tokenizer(tokenizer.apply_chat_template(row["messages"], tokenize=False),
                            add_special_tokens=False)["input_ids"]
    spans, start = [], None  # maximal runs of mask 1
    for t, m in enumerate(mask + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            spans.append(tokenizer.decode(ids[start:t]))
            start = None
    assert spans == ["19<|im_end|>", "The answer is 2<|im_end|>"]


def test_response_starting_with_a_newline_is_located_exactly(tokenizer):
    # "assistant\n" + "\nok" would merge into one "\n\n" token if tokenized as one text
    ids, mask = tokenize_sft_row(tokenizer, {"prompt": "hi", "response": "\nok"}, "row 0", MAX_TOKENS)
    assert masked_text(tokenizer, ids, mask) == "\nok<|im_end|>"
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\nok"}], tokenize=False)


def test_template_that_is_not_prefix_stable_is_refused(tokenizer):
    unstable = build_tokenizer()
    unstable.chat_template = "{{ messages | length }}" + unstable.chat_template  # a turn count rewrites the start
    with pytest.raises(ValueError, match="row 4: the tokenizer's chat template is not prefix-stable"):
        tokenize_sft_row(unstable, {"prompt": "1+1=", "response": "2"}, "row 4", MAX_TOKENS)


def test_preference_row_masks_only_the_final_response(tokenizer):
    row = {"prompt": "12+7=", "chosen": "19", "rejected": "18"}
    chosen_ids, chosen_mask, rejected_ids, rejected_mask = tokenize_preference_row(tokenizer, row, "row 0", MAX_TOKENS)
    assert (chosen_ids, chosen_mask) == tokenize_sft_row(tokenizer, {"prompt": "12+7=", "response": "19"}, "row 0", MAX_TOKENS)
    assert masked_text(tokenizer, rejected_ids, rejected_mask) == "18<|im_end|>"
    history = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
               {"role": "user", "content": "12+7="}]
    ids, mask, _, _ = tokenize_preference_row(tokenizer, {**row, "prompt": history}, "row 0", MAX_TOKENS)
    assert masked_text(tokenizer, ids, mask) == "19<|im_end|>"  # not the earlier assistant turn


# errors

@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+1="}, r"row 1 lacks 'response' \(a string\); give each row prompt\+response or messages"),
    ({"response": "2"}, r"row 1 lacks 'prompt'"),
    ({"messages": [{"role": "user", "content": "1+1="}, {"role": "bot", "content": "2"}]},
     r"row 1: 'messages'\[1\] has role 'bot'; use one of system, user, assistant, tool"),
    ({"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant"}]},
     r"row 1: 'messages'\[1\] lacks 'content'"),
    ({"messages": [{"role": "user", "content": "1+1="}]}, r"row 1: 'messages' has no assistant message"),
    ({"messages": [{"role": "assistant", "content": "2"}]}, r"row 1: 'messages'\[0\] is an assistant message"),
    ({"messages": []}, r"row 1: 'messages' must be a non-empty list"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, tokenizer, row, message):
    good = {"prompt": "1+1=", "response": "2"} if "messages" not in row else ROWS[0]
    path = write_jsonl(tmp_path / "train.jsonl", [good, row])
    with pytest.raises(ValueError, match=re.escape(path) + " " + message):
        tokenize_file(tokenizer, path)


def test_non_string_response_is_refused(tokenizer):
    with pytest.raises(ValueError, match=r"train.jsonl row 2 has 'response' of type int \(2\), not a string; quote it"):
        tokenize_sft_row(tokenizer, {"prompt": "1+1=", "response": 2}, "train.jsonl row 2", MAX_TOKENS)


def test_a_bad_preference_row_in_a_file_is_named_by_its_own_number(tmp_path, tokenizer):
    """Row 4's unquoted number used to make `datasets` read every row's 'chosen' as a number, so the
    error named row 0; each row now keeps its own types."""
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(6)]
    rows[4]["chosen"] = 5
    path = write_jsonl(tmp_path / "prefs.jsonl", rows)
    d = FileDataConfig(name="preference_files", train_path=path, val_path=None, max_length=MAX_TOKENS,
                       max_row_bytes=ROW_BYTES, synthetic=None)
    with pytest.raises(ConfigError, match=r"^data.train_path: .*prefs.jsonl row 4 has 'chosen' of type int \(5\)"):
        load_tokenized_splits(d, functools.partial(tokenize_preference_row, tokenizer))


@pytest.mark.parametrize("row, field", [
    ({"chosen": "2", "rejected": "3"}, "prompt"),
    ({"prompt": "1+1=", "rejected": "3"}, "chosen"),
    ({"prompt": "1+1=", "chosen": "2"}, "rejected"),
])
def test_bad_preference_rows_name_the_field(tokenizer, row, field):
    with pytest.raises(ValueError, match=f"prefs.jsonl row 7 lacks '{field}'"):
        tokenize_preference_row(tokenizer, row, "prefs.jsonl row 7", MAX_TOKENS)


# bounded work on any row

def test_a_long_response_is_cut_before_tokenizing_with_the_same_first_tokens(tokenizer, tokenized_lengths):
    row = {"prompt": "Tell me a story.", "response": "once upon a time there was a fox. " * 20_000}
    ids, mask = tokenize_sft_row(tokenizer, row, "row 0", MAX_TOKENS)
    assert max(tokenized_lengths) < 2000  # characters, of a 700,000-character response
    whole_ids, whole_mask = tokenize_sft_row(tokenizer, row, "row 0", 10**9)
    assert len(ids) > MAX_TOKENS and (ids[:MAX_TOKENS], mask[:MAX_TOKENS]) == (whole_ids[:MAX_TOKENS], whole_mask[:MAX_TOKENS])


def test_a_row_over_the_byte_limit_names_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [ROWS[0], {"prompt": "1+1=", "response": "é" * 600}])
    with pytest.raises(ValueError, match=re.escape(path) + r" row 1: 1204 bytes of text, over data.max_row_bytes=1000 "
                                         r"\(field 'response' holds 1200\); shorten or drop the row"):
        load_rows(path, 1000)


# generated sets

@pytest.mark.parametrize("chat", [False, True])
def test_arithmetic_sft_records_load_and_train_on_the_answer(tmp_path, tokenizer, chat):
    path = write_jsonl(tmp_path / "sft.jsonl", sft_records(ARITHMETIC, chat=chat))
    rows = load_rows(path, ROW_BYTES)
    assert ("messages" in rows[0]) == chat and len(rows) == len(ARITHMETIC)
    texts = [masked_text(tokenizer, *pair) for pair in tokenize_file(tokenizer, path)]
    assert texts == [r["answer"] + "<|im_end|>" for r in ARITHMETIC]


def test_malformed_rejected_responses_replace_near_misses_at_their_rate():
    near = preference_records(ARITHMETIC * 50, seed=3)
    mixed = preference_records(ARITHMETIC * 50, seed=3, malformed_fraction=0.5)
    assert preference_records(ARITHMETIC * 50, seed=3, malformed_fraction=0.5) == mixed
    malformed = [m["rejected"] for n, m in zip(near, mixed) if m["rejected"] != n["rejected"]]
    assert 0.35 < len(malformed) / len(mixed) < 0.65
    # never the answer, and not a number either: a reward model learns that only the bare answer is right
    assert all(m["rejected"].strip() != m["chosen"] for m in mixed)
    assert sum(not r.strip().lstrip("-").isdigit() for r in malformed) > len(malformed) / 2
    assert "" in malformed and any(len(r) > 3 for r in malformed)


def test_arithmetic_preferences_are_deterministic_and_differ(tokenizer):
    records = preference_records(ARITHMETIC, seed=3)
    assert [r["chosen"] for r in records] == [r["answer"] for r in ARITHMETIC]
    assert all(r["rejected"] != r["chosen"] and 1 <= abs(int(r["rejected"]) - int(r["chosen"])) <= 3 for r in records)
    assert preference_records(ARITHMETIC, seed=3) == records
    for i, row in enumerate(records):
        chosen_ids, _, rejected_ids, _ = tokenize_preference_row(tokenizer, row, f"row {i}", MAX_TOKENS)
        assert chosen_ids != rejected_ids


def sft_data(tmp_path) -> SFTDataConfig:
    generated = ArithmeticSetConfig(train_size=12, val_size=4, max_operand=9, operations=["+"], seed=0)
    return SFTDataConfig(name="sft_files", train_path=str(tmp_path / "train.jsonl"),
                         val_path=str(tmp_path / "val.jsonl"), max_length=MAX_TOKENS, max_row_bytes=ROW_BYTES,
                         pack=False, synthetic=generated)


def load_sft(d, tokenizer):
    return load_tokenized_splits(d, functools.partial(tokenize_sft_row, tokenizer))


def test_generated_set_is_written_marked_and_rewritten_when_its_config_changes(tmp_path, tokenizer):
    d = sft_data(tmp_path)
    train, val = load_sft(d, tokenizer)
    assert (len(train), len(val)) == (12, 4)
    marker = json.loads((tmp_path / f"train.jsonl{GENERATED_MARKER}").read_text())
    assert marker["generated_by"] == "rlkit" and marker["data.synthetic"]["train_size"] == 12
    written = (tmp_path / "train.jsonl").stat().st_mtime_ns
    load_sft(d, tokenizer)  # unchanged: left alone
    assert (tmp_path / "train.jsonl").stat().st_mtime_ns == written
    d.synthetic.train_size = 20  # its own file: rewritten (the set used to stay stale until deleted by hand)
    assert len(load_sft(d, tokenizer)[0]) == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl", f"train.jsonl{GENERATED_MARKER}",
                                                          "val.jsonl", f"val.jsonl{GENERATED_MARKER}"]


def test_generated_set_never_overwrites_a_users_file(tmp_path, tokenizer):
    mine = '{"prompt": "my question", "response": "my answer"}\n'
    (tmp_path / "train.jsonl").write_text(mine)
    with pytest.raises(ConfigError, match=r"^data.train_path / data.synthetic: .*train.jsonl exists and rlkit did not "
                                          r"generate it .*set data.synthetic=null to train on that file"):
        load_sft(sft_data(tmp_path), tokenizer)
    assert (tmp_path / "train.jsonl").read_text() == mine


def test_generated_set_never_overwrites_its_file_once_changed_by_hand(tmp_path, tokenizer):
    d = sft_data(tmp_path)
    load_sft(d, tokenizer)
    edited = (tmp_path / "val.jsonl").read_text() + '{"prompt": "my question", "response": "my answer"}\n'
    (tmp_path / "val.jsonl").write_text(edited)
    d.synthetic.seed = 1
    with pytest.raises(ConfigError, match=r"^data.val_path / data.synthetic: .*val.jsonl was changed since rlkit "
                                          r"generated it"):
        load_sft(d, tokenizer)
    assert (tmp_path / "val.jsonl").read_text() == edited


def test_an_unmarked_file_holding_the_set_already_is_taken_over(tmp_path, tokenizer):
    """Sets written before rlkit marked its files hold exactly the generated records: kept, and marked."""
    d = sft_data(tmp_path)
    load_sft(d, tokenizer)
    (tmp_path / f"train.jsonl{GENERATED_MARKER}").unlink()
    load_sft(d, tokenizer)
    assert (tmp_path / f"train.jsonl{GENERATED_MARKER}").is_file()
