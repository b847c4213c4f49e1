"""The base under an adapter checkpoint. With policy.peft a checkpoint holds the adapters alone;
the frozen weights they were trained on are the HF checkpoint the policy loaded (the run's start,
e.g. its cached warm start). The checkpoint records that directory and its weight files' SHA-256,
so adapters are never restored onto other weights (a warm start retrained differently, a model
replaced in place): that would resume without an error and train a different policy."""

import hashlib
import json
from pathlib import Path

from rlkit.checkpoint import update_with_file
from rlkit.config.schema import ConfigError, RootConfig
from rlkit.models.resolve import resolve_model_dir

RECORD = "base.json"


def weights_digest(hf_dir: str) -> str:
    """SHA-256 over the names and bytes of an HF checkpoint's *.safetensors files."""
    sha = hashlib.sha256()
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        sha.update(path.name.encode())
        update_with_file(sha, path)
    return sha.hexdigest()


def record_base(checkpoint_dir: str, hf_dir: str, digest: str) -> None:
    (Path(checkpoint_dir) / RECORD).write_text(json.dumps({"hf_dir": str(hf_dir), "weights_sha256": digest}))


def recorded_base(checkpoint_dir: str) -> str | None:
    """The base directory an adapter checkpoint was trained on; None for a checkpoint of every weight."""
    path = Path(checkpoint_dir) / RECORD
    return json.loads(path.read_text())["hf_dir"] if path.is_file() else None


def check_base(checkpoint_dir: Path, hf_dir: str, with_adapters: bool, key: str) -> None:
    """Before a checkpoint's weights are restored over hf_dir's: a ConfigError naming `key` unless
    the checkpoint holds adapters exactly when with_adapters (policy.peft is set), and adapters
    trained on weights equal to hf_dir's."""
    path = Path(checkpoint_dir) / RECORD
    if path.is_file() != with_adapters:
        saved_as, now = ("adapters alone (saved with policy.peft)", "without") if path.is_file() else \
            ("every weight (saved without policy.peft)", "with")
        raise ConfigError(f"{key}: {checkpoint_dir} holds {saved_as} and this run is {now} policy.peft; use the "
                          f"policy.peft it was saved with, or start a new run (run.name)")
    if not with_adapters:
        return
    saved = json.loads(path.read_text())
    if saved["weights_sha256"] != weights_digest(hf_dir):
        raise ConfigError(f"{key}: the adapters in {checkpoint_dir} were trained on the weights of {saved['hf_dir']}, "
                          f"and the base here ({hf_dir}) has other weights; restore that checkpoint (a cached warm "
                          f"start is rebuilt only by the run that wrote it) or start a new run")


def restored_base(checkpoint: Path, saved: RootConfig, key: str) -> Path:
    """The HF directory a checkpoint's policy is rebuilt on before the checkpoint is restored over
    it (saved: the run's config): the run's model, or for adapters (policy.peft) the base they were
    trained on, checked to hold the same weights."""
    base = recorded_base(checkpoint / "policy")
    model_dir = resolve_model_dir(saved) if base is None else Path(base)
    check_base(checkpoint / "policy", str(model_dir), base is not None, key)
    return model_dir
