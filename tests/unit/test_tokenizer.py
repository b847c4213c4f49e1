"""A checkpoint's tokenizer without a pad token (what many instruct models ship) pads with EOS,
said once; one with neither token is an error naming the directory."""

import logging

import pytest

from rlkit.config.schema import ConfigError
from rlkit.data.batch import right_pad
from rlkit.models.tiny import build_tokenizer
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
