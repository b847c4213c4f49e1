"""The tokenizer of a model directory, ready for batching: right padding needs a pad token, and
many instruct checkpoints ship without one."""

import logging
from pathlib import Path

from rlkit.config.schema import ConfigError

log = logging.getLogger("rlkit")


def load_tokenizer(model_dir: str | Path):
    """AutoTokenizer of model_dir; without a pad token it pads with EOS (said once here, on the
    controller). Neither token is an error naming the directory."""
    from transformers import AutoTokenizer, PreTrainedConfig

    try:
        # the generic config carries what AutoTokenizer reads (model_type, tokenizer_class); AutoConfig
        # would import the model's configuration module, and with it much of transformers' modelling
        # code (2-3 s of a driver that builds no model)
        config = PreTrainedConfig.from_dict(PreTrainedConfig.get_config_dict(str(model_dir))[0])
    except (OSError, ValueError):  # no config.json: AutoTokenizer finds its way from the tokenizer's files
        config = None
    tokenizer = AutoTokenizer.from_pretrained(model_dir, config=config)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"policy.model_path: the tokenizer in {model_dir} has neither a pad nor an EOS token; "
                              f"set pad_token in its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
        log.info("tokenizer of %s has no pad token: padding with EOS (%r)", model_dir, tokenizer.eos_token)
    return tokenizer
