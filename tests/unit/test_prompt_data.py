"""RL prompt data: files and presets through `datasets`, the field mapping, bad rows, the length
limit, chat-templated rendering and multi-turn appends (rlkit/data/prompts.py)."""

import json
import logging
import re

import datasets
import pytest

from rlkit.config.schema import ArithmeticSetConfig, ConfigError, PromptDataConfig, SyntheticSetConfig
from rlkit.data.prompts import PromptRenderer, load_prompt_splits
from rlkit.data.word_problems import word_problem_splits
from rlkit.envs.math_answers import answers_match
from rlkit.launch.config import load_config
from rlkit.models.tiny import build_tokenizer

GSM8K_ROWS = [{"question": "Ana has 3 apples and gets 4 more. How many now?", "answer": "3 + 4 = 7\n#### 7",
               "source": "unit"},
              {"question": "Tom has 9 books and gives 2 away. How many now?", "answer": "9 - 2 = 7\n#### 7",
               "source": "unit"}]
# a Llama-3-style template: no newline after the end-of-turn token, a different end marker
EOT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def data_config(path, **overrides) -> PromptDataConfig:
    base = dict(name="prompts", train_path=str(path), val_path=None, subset=None, train_split="train",
                val_split="test", val_size=None, prompt_field="question", answer_field="answer",
                max_prompt_tokens=1024, max_row_bytes=1 << 20, chat_template=True, system_prompt=None, prompt_format="{prompt}",
                synthetic=None)
    return PromptDataConfig(**{**base, **overrides})


def renderer(tokenizer, d: PromptDataConfig, observation_format="{observation}") -> PromptRenderer:
    return PromptRenderer.of(tokenizer, d, observation_format)


def write(path, rows):
    if path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_every_file_format_maps_prompt_and_answer(tmp_path, tokenizer, suffix):
    d = data_config(write(tmp_path / f"gsm8k{suffix}", GSM8K_ROWS))
    train, val = load_prompt_splits(d, renderer(tokenizer, d))
    assert val == [] and len(train) == 2
    first = train[0]
    assert first.messages == [{"role": "user", "content": GSM8K_ROWS[0]["question"]}]
    # every other field reaches the environment; the ground truth also under "answer"
    assert first.metadata == {"answer": GSM8K_ROWS[0]["answer"], "source": "unit"}


def test_chat_prompt_ids_equal_the_tokenizers_own_rendering(tmp_path, tokenizer):
    d = data_config(write(tmp_path / "t.jsonl", GSM8K_ROWS), system_prompt="Be brief.",
                    prompt_format="{prompt} Answer after ####.")
    prompt = load_prompt_splits(d, renderer(tokenizer, d))[0][0]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": GSM8K_ROWS[0]["question"] + " Answer after ####."}]
    assert prompt.messages == messages
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert prompt.token_ids == expected["input_ids"]
    assert tokenizer.decode(prompt.token_ids).endswith("<|im_start|>assistant\n")


def test_raw_prompts_are_the_text_alone(tmp_path, tokenizer):
    d = data_config(write(tmp_path / "a.jsonl", [{"prompt": "12+7=", "answer": "19"}]), prompt_field="prompt",
                    chat_template=False)
    prompt = load_prompt_splits(d, renderer(tokenizer, d))[0][0]
    assert prompt.token_ids == tokenizer("12+7=")["input_ids"] and prompt.metadata == {"answer": "19"}


def test_messages_field_keeps_the_conversation(tmp_path, tokenizer):
    history = [{"role": "system", "content": "You add."}, {"role": "user", "content": "1+1="},
               {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="}]
    d = data_config(write(tmp_path / "m.jsonl", [{"messages": history, "answer": "4"}]), prompt_field="messages",
                    prompt_format="{prompt} Just the number.")
    prompt = load_prompt_splits(d, renderer(tokenizer, d))[0][0]
    assert prompt.messages[:3] == history[:3] and prompt.messages[3]["content"] == "2+2= Just the number."
    rendered = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
    assert prompt.token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("row, message", [
    ({"answer": "#### 7"}, "has no field 'question' (data.prompt_field)"),
    ({"question": "q?"}, "has no field 'answer' (data.answer_field)"),
    ({"question": ["q?"], "answer": "7"}, "field 'question' (data.prompt_field) must be a string or a list of"),
])
def test_a_bad_row_names_file_row_and_field(tmp_path, tokenizer, row, message):
    path = write(tmp_path / "bad.jsonl", [GSM8K_ROWS[0], row])
    d = data_config(path)
    with pytest.raises(ConfigError, match=re.escape(f"{path} row 1") + ".*" + re.escape(message)):
        load_prompt_splits(d, renderer(tokenizer, d))


def test_messages_need_the_chat_template(tmp_path, tokenizer):
    d = data_config(write(tmp_path / "m.jsonl", [{"q": [{"role": "user", "content": "hi"}], "answer": "1"}]),
                    prompt_field="q", chat_template=False)
    with pytest.raises(ConfigError, match=r"row 0: field 'q' is a messages list, which needs data.chat_template"):
        load_prompt_splits(d, renderer(tokenizer, d))


def test_overlong_prompts_are_dropped_and_counted(tmp_path, tokenizer, caplog):
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "1+1=" * 40, "answer": "2"}]
    d = data_config(write(tmp_path / "long.jsonl", rows), max_prompt_tokens=30)
    with caplog.at_level(logging.INFO, logger="rlkit"):
        train, _ = load_prompt_splits(d, renderer(tokenizer, d))
    assert [p.messages[-1]["content"] for p in train] == ["1+1="]
    assert "dropped 1 of 2 prompts" in caplog.text and "data.max_prompt_tokens=30" in caplog.text
    d = data_config(d.train_path, max_prompt_tokens=3)
    with pytest.raises(ConfigError, match="every prompt of .* is longer than data.max_prompt_tokens=3"):
        load_prompt_splits(d, renderer(tokenizer, d))


def test_a_huge_prompt_is_tokenized_only_in_part_and_dropped(tmp_path, tokenizer, tokenized_lengths):
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "one more word " * 60_000, "answer": "2"}]
    d = data_config(write(tmp_path / "huge.jsonl", rows), max_prompt_tokens=30)
    train, _ = load_prompt_splits(d, renderer(tokenizer, d))
    assert [p.messages[-1]["content"] for p in train] == ["1+1="]
    assert max(tokenized_lengths) < 1000  # characters, of a 780,000-character prompt


def test_a_row_over_the_byte_limit_names_file_row_and_field(tmp_path, tokenizer):
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "1+1=", "answer": "2", "notes": "x" * 2000}]
    d = data_config(write(tmp_path / "big.jsonl", rows), max_row_bytes=1000)
    with pytest.raises(ConfigError, match=r"data.train_path: .*big.jsonl row 1: 2005 bytes of text, over "
                                          r"data.max_row_bytes=1000 \(field 'notes' holds 2000\)"):
        load_prompt_splits(d, renderer(tokenizer, d))


def test_val_size_takes_the_first_rows(tmp_path, tokenizer):
    path = write(tmp_path / "v.jsonl", [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(5)])
    d = data_config(path, val_path=str(path), val_size=2)
    train, val = load_prompt_splits(d, renderer(tokenizer, d))
    assert len(train) == 5 and [p.metadata["answer"] for p in val] == ["1", "2"]


@pytest.mark.parametrize("template", [None, EOT_TEMPLATE])
def test_turns_are_appended_as_the_template_renders_them(tokenizer, template):
    """Prompt + the model's tokens + the observation's tokens == the template's rendering of the
    whole conversation, whether or not the model generated the end-of-turn token itself."""
    tok = build_tokenizer()
    if template:
        tok.chat_template = template
    d = data_config("unused")
    r = renderer(tok, d)
    messages = r.messages("3+4=")
    end = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "7"}],
                                  tokenize=False).rsplit("7", 1)[1]
    turn_end = tok(end, add_special_tokens=False)["input_ids"][:1]  # the end-of-turn token
    for generated in [tok("7", add_special_tokens=False)["input_ids"] + turn_end,  # stopped at end-of-turn
                      tok("7", add_special_tokens=False)["input_ids"]]:  # ran out of tokens
        ids = r.prompt_ids(messages) + generated + r.appended_ids(generated, [{"role": "user", "content": "lower"}])
        whole = messages + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "lower"}]
        rendered = tok.apply_chat_template(whole, tokenize=False, add_generation_prompt=True)
        assert ids == tok(rendered, add_special_tokens=False)["input_ids"]


def test_raw_observations_use_the_observation_format(tokenizer):
    r = renderer(tokenizer, data_config("unused", chat_template=False), observation_format=" {observation}\n")
    assert r.appended_ids([5, 6], [{"role": "user", "content": "higher"}]) == tokenizer(" higher\n", add_special_tokens=False)["input_ids"]


def test_word_problems_are_gsm8k_format_deterministic_and_disjoint():
    cfg = ArithmeticSetConfig(train_size=300, val_size=50, max_operand=20, operations=["+", "-", "*"], seed=3)
    train, val = word_problem_splits(cfg)
    assert (train, val) == word_problem_splits(cfg) and len(train) == 300 and len(val) == 50
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    for row in train[:50]:
        final = int(row["answer"].rsplit("#### ", 1)[1])
        assert final > 0 and answers_match(f"So the answer is \\boxed{{{final}}}.", row["answer"])
        assert not answers_match(f"#### {final + 1}", row["answer"])


def test_generated_sets_are_rewritten_only_when_they_change(tmp_path, tokenizer):
    synthetic = SyntheticSetConfig(train_size=20, val_size=5, max_operand=9, operations=["+"], seed=0,
                                   kind="arithmetic")
    d = data_config(tmp_path / "train.jsonl", val_path=str(tmp_path / "val.jsonl"), prompt_field="prompt",
                    chat_template=False, synthetic=synthetic)
    train, val = load_prompt_splits(d, renderer(tokenizer, d))
    assert (len(train), len(val)) == (20, 5)
    written = (tmp_path / "train.jsonl").stat().st_mtime_ns
    load_prompt_splits(d, renderer(tokenizer, d))
    assert (tmp_path / "train.jsonl").stat().st_mtime_ns == written
    synthetic.seed = 1
    again, _ = load_prompt_splits(d, renderer(tokenizer, d))
    assert [p.messages for p in again] != [p.messages for p in train]


def test_generated_set_never_overwrites_a_users_file(tmp_path, tokenizer):
    """data.train_path pointed at one's own file with data.synthetic still set used to overwrite the
    file with the generated set and train on it."""
    mine = write(tmp_path / "train.jsonl", GSM8K_ROWS).read_text()
    synthetic = SyntheticSetConfig(train_size=20, val_size=5, max_operand=9, operations=["+"], seed=0,
                                   kind="arithmetic")
    d = data_config(tmp_path / "train.jsonl", synthetic=synthetic)
    with pytest.raises(ConfigError, match=r"^data.train_path / data.synthetic: .*train.jsonl exists and rlkit did not "
                                          r"generate it .*set data.synthetic=null to train on that file"):
        load_prompt_splits(d, renderer(tokenizer, d))
    assert (tmp_path / "train.jsonl").read_text() == mine


@pytest.mark.parametrize("group, prompt_field, answer_field", [
    ("gsm8k", "question", "answer"), ("math", "problem", "solution"), ("word_problems", "question", "answer"),
    ("arithmetic", "prompt", "answer")])
def test_presets_compose_with_an_rl_recipe(group, prompt_field, answer_field):
    cfg, _ = load_config("grpo_tiny_cpu", [f"data={group}"])
    assert (cfg.data.name, cfg.data.prompt_field, cfg.data.answer_field) == ("prompts", prompt_field, answer_field)
    assert "{prompt}" in cfg.data.prompt_format and cfg.data.chat_template == (group != "arithmetic")


@pytest.mark.parametrize("overrides, key, fragment", [
    (["data.prompt_format=Solve it."], "data.prompt_format", "must contain {prompt}"),
    (["data.prompt_format='{prompt} {answer}'"], "data.prompt_format", "no other fields"),
    (["data.system_prompt=Be brief."], "data.system_prompt", "needs data.chat_template=true"),
    (["data.max_prompt_tokens=0"], "data.max_prompt_tokens", "must be >= 1"),
    (["data=arithmetic_sft"], "data.name", "trains on data of kind 'prompts'"),
])
def test_bad_prompt_settings_name_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError, match=rf"^{key}: .*{fragment}"):
        load_config("grpo_tiny_cpu", overrides)
