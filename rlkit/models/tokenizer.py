"""The tokenizer of a model directory, ready for batching: right padding needs a pad token, and
many instruct checkpoints ship without one."""

import logging
from pathlib import Path

from rlkit.config.schema import ConfigError

log = logging.getLogger("rlkit")


def load_tokenizer(model_dir: str | Path):
    """AutoTokenizer of model_dir; without a pad token it pads with EOS (said once here, on the
    controller). Neither token is an error naming the directory."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"policy.model_path: the tokenizer in {model_dir} has neither a pad nor an EOS token; "
                              f"set pad_token in its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
        log.info("tokenizer of %s has no pad token: padding with EOS (%r)", model_dir, tokenizer.eos_token)
    return tokenizer
