"""HF <-> Megatron-Core: build GPTModel chunks from an HF checkpoint, load its weights, stream
HF-named tensors back out. The rest of rlkit sees only `ModelBridge` (base.py, with what each
backend is known to convert); policy.bridge picks the backend behind it (open_bridge):
  mbridge          mbridge 0.15.1 (mbridge_backend.py, its fixes in mbridge_compat.py)
  megatron_bridge  NVIDIA's Megatron-Bridge 0.3.1, AutoBridge (megatron_bridge_backend.py)
What both build the same way (RL settings, local layer spec, value and fp32 LM heads, row
export) lives in common.py."""

from typing import TYPE_CHECKING

from rlkit.bridge.base import BRIDGES, ModelBridge
from rlkit.config.schema import ConfigError, PeftConfig

if TYPE_CHECKING:
    import torch


def import_backend(bridge: str) -> None:
    """Import the policy.bridge backend's modules (and its library) ahead of open_bridge; an unknown
    name is left for open_bridge to refuse."""
    if bridge == "mbridge":
        import rlkit.bridge.mbridge_backend  # noqa: F401
    elif bridge == "megatron_bridge":
        import rlkit.bridge.megatron_bridge_backend  # noqa: F401


def open_bridge(bridge: str, hf_dir: str, params_dtype: "torch.dtype", attention_backend: str,
                peft: PeftConfig | None = None) -> ModelBridge:
    """The policy.bridge backend over the checkpoint in hf_dir; attention_backend (one of
    ATTENTION_BACKENDS) is the core attention of every model it builds where TransformerEngine is
    not installed (with it, the backend's TE spec brings TE's attention); peft (policy.peft) adds
    adapters to every model it builds. The config's rules (check_bridge, check_peft) checked these
    as it loaded."""
    if bridge == "mbridge":
        from rlkit.bridge.mbridge_backend import MBridge
        return MBridge(hf_dir, params_dtype, attention_backend)
    if bridge == "megatron_bridge":
        from rlkit.bridge.megatron_bridge_backend import MegatronBridge
        return MegatronBridge(hf_dir, params_dtype, attention_backend, peft)
    raise ConfigError(f"policy.bridge: must be one of {list(BRIDGES)} (got: {bridge!r}); pick one of those")

