"""A model's shape as the config's rules need it (the parallel layouts must divide it, the bridge
must convert its architecture), read from an HF checkpoint's config.json or a tiny:// name
without loading the model: loading a config reads it."""

import json
from pathlib import Path
from typing import NamedTuple

from rlkit.config.schema import ConfigError
from rlkit.models.tiny import ARCHITECTURES, TINY_EXPERTS, TINY_HEADS, parse_tiny


class ModelShape(NamedTuple):
    """What the parallel layout must divide: attention heads, key/value heads, routed experts (0: dense),
    transformer layers (0: config.json does not say); the hidden size LoRA's rank stays below (0: unknown);
    and the HF model type (None: config.json does not say)."""
    heads: int
    kv_heads: int
    experts: int
    layers: int
    hidden: int = 0
    model_type: str | None = None


def model_shape(model_path: str, tiny_layers: int, tiny_hidden: int = 0) -> ModelShape:
    """The model's shape from an HF checkpoint's config.json, or from the tiny:// architecture."""
    arch = parse_tiny(model_path)
    if arch:
        return ModelShape(*TINY_HEADS, TINY_EXPERTS.get(arch, 0), tiny_layers, tiny_hidden, arch)
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        made_here = "; `rlkit pretrained smollm2-135m-instruct` makes it" if "SmolLM2" in model_path else ""
        raise ConfigError(f"policy.model_path: {config_file} does not exist; give an HF checkpoint directory "
                          f"or tiny://<{'|'.join(ARCHITECTURES)}>{made_here}")
    try:
        hf = json.loads(config_file.read_text())
        # Qwen-MoE and DeepSeek write num_experts / n_routed_experts; Mixtral and transformers 5 num_local_experts
        experts = next((hf[key] for key in ("num_experts", "num_local_experts", "n_routed_experts") if key in hf), 0)
        return ModelShape(hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"]), experts,
                          hf.get("num_hidden_layers", 0), hf.get("hidden_size", 0), hf.get("model_type"))
    except (json.JSONDecodeError, KeyError) as e:
        raise ConfigError(f"policy.model_path: {config_file} is not a usable HF config ({type(e).__name__}: {e}); "
                          f"point policy.model_path at a complete HF checkpoint directory") from None
