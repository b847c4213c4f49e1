"""A checkpoint's tokenizer without a pad token (what many instruct models ship) pads with EOS,
said once; one with neither token is an error naming the directory. The tokenizer is
AutoTokenizer's for every architecture, though read without the model's config class."""

import logging

import pytest

from rlkit.config.schema import ConfigError
from rlkit.data.batch import right_pad
from rlkit.models.tiny import ARCHITECTURES, _hf_config, build_tokenizer
from rlkit.models.tokenizer import load_tokenizer


def saved_without(tmp_path, *tokens: str):
    tokenizer = build_tokenizer()
    for token in tokens:
        setattr(tokenizer, token, None)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_missing_pad_token_falls_back_to_eos_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="rlkit"):
        tokenizer = load_tokenizer(saved_without(tmp_path, "pad_token"))
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    assert [r.getMessage() for r in caplog.records] == [
        f"tokenizer of {tmp_path} has no pad token: padding with EOS ('<|endoftext|>')"]
    assert right_pad([[1, 2], [3]], tokenizer.pad_token_id).tolist() == [[1, 2], [3, tokenizer.eos_token_id]]


def test_a_tokenizer_with_its_pad_token_is_left_alone(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="rlkit"):
        tokenizer = load_tokenizer(saved_without(tmp_path))
    assert tokenizer.pad_token == "<|pad|>" and not caplog.records


def test_neither_pad_nor_eos_names_the_directory(tmp_path):
    with pytest.raises(ConfigError, match=f"^policy.model_path: the tokenizer in {tmp_path} has neither"):
        load_tokenizer(saved_without(tmp_path, "pad_token", "eos_token"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_tokenizer_is_autotokenizers(tmp_path, arch):
    from transformers import AutoTokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    _hf_config(arch, 128, tokenizer.pad_token_id, tokenizer.eos_token_id, 64, 2).save_pretrained(tmp_path)
    ours, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours) is type(auto) and ours.special_tokens_map == auto.special_tokens_map
    text = ours.apply_chat_template([{"role": "user", "content": "What is 12 + 35?"}], add_generation_prompt=True,
                                    tokenize=False)
    assert text == auto.apply_chat_template([{"role": "user", "content": "What is 12 + 35?"}],
                                            add_generation_prompt=True, tokenize=False)
    assert ours(text)["input_ids"] == auto(text)["input_ids"]


def test_a_directory_without_a_config_loads_its_tokenizer(tmp_path):
    build_tokenizer().save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path).pad_token == "<|pad|>"
