"""policy.peft: which linear layers get LoRA adapters, in HF's names (q_proj, ..., down_proj), and
the Megatron modules those are (checked at config load, used by the backend at build); and the HF
PEFT adapter directory that HF peft and vLLM load.

Megatron fuses q/k/v into one linear_qkv and gate/up into one linear_fc1, and Megatron-Bridge's
LoRA puts one adapter on a fused layer: the fused names must be asked for together."""

import json
from pathlib import Path

from rlkit.config.schema import ConfigError, PeftConfig, check_choice

# policy.peft.type. Not DoRA: Megatron-Bridge 0.3.1's merged export folds every adapter as a plain
# LoRA, without DoRA's magnitude vector, so generation would get other weights than the policy's
PEFT_TYPES = ("lora",)
# HF module names -> the Megatron linear layer that computes them (local and TE layer specs alike)
MEGATRON_LINEAR = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
                   "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
                   "down_proj": "linear_fc2"}


def megatron_target_modules(target_modules: list[str]) -> list[str]:
    """The Megatron linear layers that cover exactly the HF modules named, in MEGATRON_LINEAR's
    order. A ConfigError naming policy.peft.target_modules for an unknown name, an empty list, or
    part of a fused layer."""
    unknown = [name for name in target_modules if name not in MEGATRON_LINEAR]
    if unknown or not target_modules:
        raise ConfigError(f"policy.peft.target_modules: must be a non-empty list of {list(MEGATRON_LINEAR)} "
                          f"(got: {list(target_modules)}); e.g. [q_proj, k_proj, v_proj, o_proj]")
    chosen = set(target_modules)
    targets = []
    for linear in dict.fromkeys(MEGATRON_LINEAR.values()):
        fused = {name for name, target in MEGATRON_LINEAR.items() if target == linear}
        if chosen & fused and not fused <= chosen:
            raise ConfigError(f"policy.peft.target_modules: Megatron computes {sorted(fused)} in one layer "
                              f"({linear}), which takes one adapter; name all of them or none (got: "
                              f"{list(target_modules)})")
        if chosen & fused:
            targets.append(linear)
    return targets


def check_peft(peft: PeftConfig | None, hidden_size: int = 0) -> None:
    """policy.peft against its own ranges and the model's hidden size (0: unknown), then its target
    modules against Megatron's fused layers: one ConfigError naming the key. Which backends build
    adapters: rlkit/bridge/base.py check_bridge."""
    if peft is None:
        return
    check_peft_ranges(peft, hidden_size)
    megatron_target_modules(peft.target_modules)


def check_peft_ranges(peft: PeftConfig, hidden_size: int = 0) -> None:
    """policy.peft's type, rank, alpha and dropout against their ranges and the model's hidden size
    (0: unknown), whichever backend builds the adapters."""
    check_choice("policy.peft.type", peft.type, PEFT_TYPES)
    if peft.rank < 1:
        raise ConfigError(f"policy.peft.rank: must be >= 1 (got: {peft.rank}); e.g. 8")
    if hidden_size and peft.rank >= hidden_size:
        # an update B @ A has rank at most the layer's width, so a rank past it adds no capacity,
        # only parameters: rank x (in + out) per layer, more than the weights it adapts
        raise ConfigError(f"policy.peft.rank: must be below the model's hidden size {hidden_size} (got: {peft.rank}): "
                          f"past it the adapters learn nothing more and hold more parameters than the weights they "
                          f"adapt; use a rank well below {hidden_size} (8 to 64 is usual), or policy.peft=null to "
                          f"train every weight")
    if peft.alpha <= 0:
        raise ConfigError(f"policy.peft.alpha: must be > 0 (got: {peft.alpha}); e.g. twice policy.peft.rank")
    if not 0 <= peft.dropout < 1:
        raise ConfigError(f"policy.peft.dropout: must lie in [0, 1) (got: {peft.dropout}); e.g. 0.0")


def check_init_from(peft: PeftConfig | None) -> None:
    """policy.peft.init_from: a policy.peft run's checkpoint whose adapters have this run's shape,
    read from the config it was saved with. Another rank failed as a shape traceback once workers
    had started; other target modules quietly left out the adapters this run does not name."""
    if peft is None or peft.init_from is None:
        return
    checkpoint = Path(peft.init_from)
    saved_file = checkpoint / "config.yaml"
    missing = next((name for name, there in [("policy/ folder", (checkpoint / "policy").is_dir()),
                                             ("config.yaml", saved_file.is_file())] if not there), None)
    if missing:
        raise ConfigError(f"policy.peft.init_from: {peft.init_from} is not a checkpoint (no {missing} in it); give "
                          f"a policy.peft run's .../checkpoints/step_N, or null")
    from omegaconf import OmegaConf

    saved = OmegaConf.select(OmegaConf.load(saved_file), "policy.peft")
    if saved is None:
        raise ConfigError(f"policy.peft.init_from: {peft.init_from} holds every weight (saved without policy.peft), "
                          f"not adapters; give a policy.peft run's checkpoint, or start from its weights with "
                          f"policy.model_path (after rlkit convert)")
    for key, before, now in [("rank", saved.rank, peft.rank),
                             ("target_modules", _as_override(saved.target_modules), _as_override(peft.target_modules))]:
        if before != now:
            raise ConfigError(f"policy.peft.{key}: the adapters in policy.peft.init_from={peft.init_from} were saved "
                              f"with policy.peft.{key}={before} and this run asks for {now}; they load only into "
                              f"adapters of the same shape: set policy.peft.{key}={before}, or policy.peft.init_from="
                              f"null to start new adapters")


def _as_override(names) -> str:
    """A list of module names as an override writes it: [k_proj,q_proj,v_proj]."""
    return f"[{','.join(sorted(names))}]"


def write_hf_peft_adapter(out_dir: str, adapters: dict, peft: PeftConfig, base_model: str) -> None:
    """An HF PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) of `adapters`,
    named as the bridge exports them (<HF module>.lora_A.weight / .lora_B.weight), over the HF
    checkpoint base_model."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # cloned: a fused layer's A is one tensor under each of its HF modules' names
    save_file({f"base_model.model.{name}": tensor.detach().cpu().clone() for name, tensor in adapters.items()},
              out / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
              "r": peft.rank, "lora_alpha": peft.alpha, "lora_dropout": peft.dropout,
              "target_modules": sorted(peft.target_modules), "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
