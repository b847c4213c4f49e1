"""With TransformerEngine installed (its layer spec replaces rlkit's SDPA attention), a run that
needs rlkit's attention (context parallelism, packed rows) is refused at config load, in one line."""

import pytest

import rlkit.bridge.base
from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config

NEEDS_SDPA = [
    ("sft_tiny_cpu", [], "data.pack: packed rows", "set data.pack=false"),
    ("grpo_tiny_cpu", [], "algorithm.warm_start.sft_steps: packed rows",
     "set algorithm.warm_start.sft_steps=0"),
    ("dpo_tiny_cpu", ["algorithm.warm_start.sft_steps=2"], "algorithm.warm_start.sft_steps: packed rows",
     "set algorithm.warm_start.sft_steps=0"),
    ("grpo_tiny_cpu", ["policy.context_parallel_size=2", "policy.num_workers=2", "algorithm.warm_start.sft_steps=0"],
     "policy.context_parallel_size: context parallelism runs on rlkit's SDPA attention",
     "set policy.context_parallel_size=1 or run without transformer_engine"),
]


@pytest.mark.parametrize("recipe, overrides, starts, fix", NEEDS_SDPA)
def test_a_run_that_needs_rlkits_attention_is_refused_where_te_is_installed(monkeypatch, recipe, overrides, starts,
                                                                           fix):
    load_config(recipe, overrides)  # without TransformerEngine (this machine) it loads
    monkeypatch.setattr(rlkit.bridge.base, "transformer_engine_installed", lambda: True)
    with pytest.raises(ConfigError) as refused:
        load_config(recipe, overrides)
    message = str(refused.value)
    assert message.startswith(starts) and fix in message and "\n" not in message


def test_runs_that_pack_nothing_load_with_te(monkeypatch):
    monkeypatch.setattr(rlkit.bridge.base, "transformer_engine_installed", lambda: True)
    load_config("grpo_tiny_cpu", ["algorithm.warm_start.sft_steps=0"])
    load_config("sft_tiny_cpu", ["data.pack=false"])
    load_config("dpo_tiny_cpu", ["algorithm.warm_start.sft_steps=0"])
