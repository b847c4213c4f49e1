"""An HF model's checkpoint tensors under the names its checkpoint files use.

A checkpoint holds the model's persistent state: its parameters and its persistent buffers (GLM-4-MoE's
and DeepSeek-V3's router expert bias `mlp.gate.e_score_correction_bias` is a buffer), tied weights once.

transformers 5 fuses some checkpoint tensors into one parameter when it loads a model: Qwen3-MoE's
`mlp.experts.<e>.gate_proj.weight` and `up_proj.weight` of every expert become one
`mlp.experts.gate_up_proj` [experts, 2 x intermediate, hidden]. Refit sends the checkpoint's names
(what the bridge exports and vLLM loads), so an HF generation worker receives into views of its
fused parameters, one per checkpoint tensor. The fusions are transformers' own conversion mapping
(transformers.conversion_mapping), read here rather than restated.
"""

import torch


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{checkpoint name: the parameter or persistent buffer, or the view of a fused parameter, that
    holds it}; tied weights appear once, under the name the model registers first (as
    save_pretrained keeps them)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    state, held = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():  # persistent state, tied weights by identity
        if id(tensor) not in held:
            held.add(id(tensor))
            state[name] = tensor
    converters = [c for c in get_checkpoint_conversion_mapping(model.config.model_type) or []
                  if isinstance(c, WeightConverter)]
    named = {}
    for name, tensor in state.items():
        converter = next((c for c in converters if _is_target(name, c)), None)
        if converter is None:
            named[name] = tensor
            continue
        ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
        if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
            raise NotImplementedError(f"{name}: transformers fuses it from {converter.source_patterns} with "
                                      f"{converter.operations}; rlkit's HF worker receives only stacked experts")
        prefix = name[:-len(converter.target_patterns[0].lstrip("."))]
        sources = converter.source_patterns
        part = tensor.shape[1] // len(sources)  # the concatenated tensors are of one size (gate, up)
        for expert in range(tensor.shape[0]):
            for k, source in enumerate(sources):
                view = tensor[expert, k * part:(k + 1) * part] if len(sources) > 1 else tensor[expert]
                named[prefix + source.lstrip(".").replace("*", str(expert))] = view
    return named


def _is_target(name: str, converter) -> bool:
    target = converter.target_patterns[0].lstrip(".")
    return len(converter.target_patterns) == 1 and (name == target or name.endswith("." + target))
