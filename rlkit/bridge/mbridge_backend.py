"""policy.bridge=mbridge: HF <-> Megatron-Core through mbridge 0.15.1, patched to build and map
Megatron's local (non-TE) layer spec where TransformerEngine is not installed."""

import importlib.util
import re
from functools import partial
from typing import Iterator

import torch

from rlkit.bridge import ModelBridge
from rlkit.bridge.common import (RL_MODEL_SETTINGS, RowExport, core_attention, head_hooks, holds_every_weight,
                                 local_layer_spec, probe_rows, rope_settings_in_parameters, router_gemm_without_te,
                                 specs_take_vp_stage, unwrap, without_grad)

_patched = set()


def _isolate_name_tables():
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


def _local_names_as_te():
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


def _creation_callback(hook):
    """A head hook (common.head_hooks) in mbridge's post_model_creation_callbacks form."""
    return lambda model, pre_process, post_process, config, hf_config: hook(model)


class MBridge(ModelBridge):
    """attention_backend (one of ATTENTION_BACKENDS) is the core attention of every model it builds
    where TransformerEngine is not installed; with it, mbridge's TE spec brings TE's attention."""

    def __init__(self, hf_dir: str, params_dtype: torch.dtype, attention_backend: str):
        from mbridge import AutoBridge
        from transformers import AutoConfig

        _isolate_name_tables()
        self.hf_dir = str(hf_dir)
        self.hf_config = AutoConfig.from_pretrained(self.hf_dir)
        for key, value in rope_settings_in_parameters(self.hf_config).items():
            setattr(self.hf_config, key, value)
        self._bridge = AutoBridge.from_config(self.hf_config, dtype=params_dtype)
        self._bridge.set_extra_args(**RL_MODEL_SETTINGS)
        if importlib.util.find_spec("transformer_engine") is None:
            _local_names_as_te()
            router_gemm_without_te()
            # grouped experts need TE (or the grouped_gemm package): one torch MLP per local expert instead
            self._bridge.set_extra_args(moe_grouped_gemm=False)
            attention = core_attention(attention_backend)
            # this bridge's own spec, so two models in one process may use different attention
            self._bridge._get_transformer_layer_spec = lambda vp_stage=None: local_layer_spec(
                self._bridge.config, attention, vp_stage)
            # which mbridge's own spec method records, and its model provider reads under virtual stages
            self._bridge.has_vp_stage = specs_take_vp_stage()

    @property
    def transformer_config(self):
        return self._bridge.config

    def build(self, bf16: bool, wrap_with_ddp: bool, use_distributed_optimizer: bool = False,
              value_head: bool = False, fp32_lm_head: bool = False) -> list:
        return self._bridge.get_model(
            bf16=bf16, wrap_with_ddp=wrap_with_ddp, use_cpu_initialization=not torch.cuda.is_available(),
            ddp_config={"grad_reduce_in_fp32": True, "use_distributed_optimizer": use_distributed_optimizer},
            post_model_creation_callbacks=[_creation_callback(hook) for hook in head_hooks(value_head, fp32_lm_head)])

    def load_hf_weights(self, chunks: list, hf_dir: str | None = None):
        self._bridge.load_weights(chunks, str(hf_dir or self.hf_dir))

    def export_hf_weights(self, chunks: list) -> Iterator[tuple[str, torch.Tensor]]:
        # under PP the last stage of a model with tied embeddings holds a copy of the embedding as its
        # output layer (kept equal by Megatron), which mbridge exports under the embedding's name a
        # second time: each name once (the stream is still run to its end, it is collective)
        exported = set()
        for name, tensor in without_grad(self._bridge.export_weights(chunks)):
            if name not in exported:
                exported.add(name)
                yield name, tensor

    def export_rows(self, chunks: list) -> RowExport | None:
        if not holds_every_weight(chunks):
            return None
        model = unwrap(chunks[0])
        to_global = self._bridge._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
        if set(to_global) != {name for name, _ in model.named_parameters()}:
            return None  # state beyond parameters (e.g. MoE expert bias) is exported too
        return probe_rows((param, partial(self._converted, to_global[name]))
                          for name, param in model.named_parameters())

    def _converted(self, global_name: str, tensor: torch.Tensor):
        return zip(*self._bridge._weight_to_hf_format(global_name, tensor))

    def save_hf_weights(self, chunks: list, out_dir: str):
        # no autograd, as in export_hf_weights: mbridge's broadcasts of parameters that require grad
        # would otherwise record c10d::broadcast_ nodes, which the next backward warns about
        # ("an autograd kernel was not registered ... silently incorrect behavior")
        with torch.no_grad():
            self._bridge.save_weights(chunks, str(out_dir))
