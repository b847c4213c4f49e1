"""The base under an adapter checkpoint (rlkit/workers/policy/adapter_base.py): a resume or a
convert restores adapters only over the very weights they were trained on, and a checkpoint's
kind (adapters alone, or every weight) must match whether policy.peft is set."""

import pytest
import torch
from safetensors.torch import save_file

from rlkit.config.schema import ConfigError
from rlkit.workers.policy.adapter_base import check_base, record_base, recorded_base, weights_digest


@pytest.fixture
def base(tmp_path):
    directory = tmp_path / "base"
    directory.mkdir()
    save_file({"w": torch.arange(6.0)}, directory / "model.safetensors")
    return directory


def test_adapters_resume_over_the_weights_they_were_trained_on(base, tmp_path):
    record_base(tmp_path, str(base), weights_digest(str(base)))
    assert recorded_base(tmp_path) == str(base)
    check_base(tmp_path, str(base), True, "checkpoint.resume")


def test_other_base_weights_are_refused_by_key(base, tmp_path):
    record_base(tmp_path, str(base), weights_digest(str(base)))
    save_file({"w": torch.arange(6.0) + 1}, base / "model.safetensors")  # e.g. a warm start retrained
    with pytest.raises(ConfigError, match=r"^checkpoint.resume: the adapters in .* other weights"):
        check_base(tmp_path, str(base), True, "checkpoint.resume")


def test_a_checkpoint_of_another_kind_is_refused_by_key(base, tmp_path):
    assert recorded_base(tmp_path) is None
    check_base(tmp_path, str(base), False, "checkpoint.resume")
    with pytest.raises(ConfigError, match=r"^checkpoint.resume: .* every weight .* this run is with policy.peft"):
        check_base(tmp_path, str(base), True, "checkpoint.resume")
    record_base(tmp_path, str(base), weights_digest(str(base)))
    with pytest.raises(ConfigError, match=r"^rlkit convert: .* adapters alone .* this run is without policy.peft"):
        check_base(tmp_path, str(base), False, "rlkit convert")
