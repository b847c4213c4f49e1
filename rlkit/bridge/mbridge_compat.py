"""mbridge 0.15.1 on rlkit's stack: megatron-core 0.16.1, with or without TransformerEngine. The
backend (mbridge_backend.py) applies these fixes, each once per process:

1. `isolate_name_tables`: mbridge's Qwen2 bridge rewrites its class-level `_DIRECT_MAPPING` for tied
   embeddings, so a tied model built earlier in the process broke every later untied one (their
   LM head loaded from the embedding).
2. `local_names_as_te`: without TransformerEngine, Megatron's local layer spec names its weights
   otherwise than the TE spec that mbridge's name tables expect (norms fused into linear_qkv and
   linear_fc1, experts as TEGroupedMLP's): the local spec's weights are given the TE names where
   mbridge maps names, so loading, exporting and row exports find them.
"""

import re

_patched = set()


def isolate_name_tables():
    """mbridge's Qwen2 bridge rewrites its class-level `_DIRECT_MAPPING` for tied embeddings,
    so a tied model built earlier in the process breaks every later untied one. Give each
    bridge instance its own copy before it adjusts it."""
    if "name_tables" in _patched:
        return
    from mbridge.core.bridge import Bridge

    adjust = Bridge.__init__

    def init_with_own_tables(self, *args, **kwargs):
        self._DIRECT_MAPPING = dict(type(self)._DIRECT_MAPPING)
        adjust(self, *args, **kwargs)

    Bridge.__init__ = init_with_own_tables
    _patched.add("name_tables")


# SequentialMLP's name for an expert's weight (the local spec); TEGroupedMLP's is experts.linear_fc1.weight<i>
_SEQUENTIAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def local_names_as_te():
    """Without TransformerEngine, mbridge 0.15.1's name tables still expect the TE spec's names.
    Where mbridge maps a model's parameter names to global ones (loading, exporting, export_rows),
    give the local spec's weights the names TE's spec has for them:
    - the attention norm fused into linear_qkv, and the MLP norm fused into linear_fc1 in a dense
      layer (an MoE layer keeps its own pre_mlp_layernorm under TE too);
    - an expert's weights as TEGroupedMLP's, numbered by this rank's own expert index where mbridge
      adds the EP offset itself (consider_ep=False: the export), by the global index otherwise.
    Loading then splits these experts over the TP group rather than the expert-TP group: the same
    ranks while expert TP = TP, Megatron's default, which rlkit keeps."""
    if "local_names" in _patched:
        return
    from mbridge.core.bridge import Bridge

    to_global = Bridge._weight_name_mapping_mcore_local_to_global

    def te_names(self, model, consider_ep=True):
        names = to_global(self, model, consider_ep)
        moe_layers = {name.split(".mlp.router.")[0] for name in names.values() if ".mlp.router." in name}
        first_expert = 0
        if consider_ep and moe_layers:
            first_expert = self.mpu.ep_rank * self.config.num_moe_experts // self.mpu.ep_size

        def te_name(name):
            name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
            layer = name.split(".pre_mlp_layernorm.")[0]
            if layer != name and layer not in moe_layers:
                name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
            return _SEQUENTIAL_EXPERT.sub(lambda m: f".mlp.experts.{m[2]}.weight{first_expert + int(m[1])}", name)

        return {local: te_name(name) for local, name in names.items()}

    Bridge._weight_name_mapping_mcore_local_to_global = te_names
    _patched.add("local_names")
