"""Fixtures shared by the unit tests."""

import pytest


@pytest.fixture
def tokenized_lengths(tokenizer, monkeypatch) -> list[int]:
    """Lengths of the texts the test module's `tokenizer` is asked to tokenize from now on: bounded
    work is shown by what the tokenizer was given, whatever the input's size."""
    seen, tokenize = [], type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__",
                        lambda self, text, **kw: seen.append(len(text)) or tokenize(self, text, **kw))
    return seen
