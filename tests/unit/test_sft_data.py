"""SFT / preference rows: loading through datasets, loss masks from the chat template, clear errors,
and the synthetic arithmetic writers."""

import json
import re

import datasets
import pandas as pd
import pytest

from rlkit.data.files import load_rows
from rlkit.data.sft import tokenize_preference_row, tokenize_sft_row
from rlkit.data.synthetic import write_arithmetic_preferences, write_arithmetic_sft
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
    # datasets fills a column a row lacks with None; tokenizing must treat None as absent
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
    broken.write_text('{"prompt": "1+1=", "response": \n')
    with pytest.raises(ValueError, match="broken.jsonl: could not be read as json"):
        load_rows(str(broken), ROW_BYTES)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl"):
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
    with pytest.raises(ValueError, match=r"train.jsonl row 2 lacks 'response' \(a string\)"):
        tokenize_sft_row(tokenizer, {"prompt": "1+1=", "response": 2}, "train.jsonl row 2", MAX_TOKENS)


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


# synthetic writers

@pytest.mark.parametrize("chat", [False, True])
def test_arithmetic_sft_file_loads_and_trains_on_the_answer(tmp_path, tokenizer, chat):
    path = write_arithmetic_sft(tmp_path / "sub" / "sft.jsonl", ARITHMETIC, chat=chat)
    rows = load_rows(str(path), ROW_BYTES)
    assert ("messages" in rows[0]) == chat and len(rows) == len(ARITHMETIC)
    texts = [masked_text(tokenizer, *pair) for pair in tokenize_file(tokenizer, str(path))]
    assert texts == [r["answer"] + "<|im_end|>" for r in ARITHMETIC]
    assert [p.name for p in path.parent.iterdir()] == ["sft.jsonl"]  # no temporary file left behind


def test_arithmetic_preferences_are_deterministic_and_differ(tmp_path, tokenizer):
    path = write_arithmetic_preferences(tmp_path / "prefs.jsonl", ARITHMETIC, seed=3)
    rows = load_rows(str(path), ROW_BYTES)
    assert [r["chosen"] for r in rows] == [r["answer"] for r in ARITHMETIC]
    assert all(r["rejected"] != r["chosen"] and 1 <= abs(int(r["rejected"]) - int(r["chosen"])) <= 3 for r in rows)
    again = write_arithmetic_preferences(tmp_path / "again.jsonl", ARITHMETIC, seed=3)
    assert again.read_text() == path.read_text()
    for i, row in enumerate(rows):
        chosen_ids, _, rejected_ids, _ = tokenize_preference_row(tokenizer, row, f"{path} row {i}", MAX_TOKENS)
        assert chosen_ids != rejected_ids


def test_rewrite_replaces_the_file_whole(tmp_path):
    path = write_arithmetic_sft(tmp_path / "sft.jsonl", ARITHMETIC, chat=False)
    write_arithmetic_sft(path, ARITHMETIC[:1], chat=False)
    assert load_rows(str(path), ROW_BYTES) == [{"prompt": "12+7=", "response": "19"}]
