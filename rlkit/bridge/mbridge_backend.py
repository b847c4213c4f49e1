"""policy.bridge=mbridge: HF <-> Megatron-Core through mbridge 0.15.1, with the fixes of
mbridge_compat.py, building Megatron's local (non-TE) layer spec where TransformerEngine is not
installed."""

from functools import partial
from typing import Iterator

import torch

from rlkit.bridge.base import ModelBridge, transformer_engine_installed
from rlkit.bridge.common import (RL_MODEL_SETTINGS, RowExport, core_attention, head_hooks, holds_every_weight,
                                 local_layer_spec, probe_rows, rope_settings_in_parameters, router_gemm_without_te,
                                 specs_take_vp_stage, unwrap, without_grad)
from rlkit.bridge.mbridge_compat import isolate_name_tables, local_names_as_te

def _creation_callback(hook):
    """A head hook (common.head_hooks) in mbridge's post_model_creation_callbacks form."""
    return lambda model, pre_process, post_process, config, hf_config: hook(model)


class MBridge(ModelBridge):
    """attention_backend (one of ATTENTION_BACKENDS) is the core attention of every model it builds
    where TransformerEngine is not installed; with it, mbridge's TE spec brings TE's attention."""

    def __init__(self, hf_dir: str, params_dtype: torch.dtype, attention_backend: str):
        from mbridge import AutoBridge
        from transformers import AutoConfig

        isolate_name_tables()
        self.hf_dir = str(hf_dir)
        self.hf_config = AutoConfig.from_pretrained(self.hf_dir)
        for key, value in rope_settings_in_parameters(self.hf_config).items():
            setattr(self.hf_config, key, value)
        self._bridge = AutoBridge.from_config(self.hf_config, dtype=params_dtype)
        self._bridge.set_extra_args(**RL_MODEL_SETTINGS)
        if not transformer_engine_installed():
            local_names_as_te()
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
              value_head: bool = False, fp32_lm_head: bool = False, value_bias: bool = True) -> list:
        return self._bridge.get_model(
            bf16=bf16, wrap_with_ddp=wrap_with_ddp, use_cpu_initialization=not torch.cuda.is_available(),
            ddp_config={"grad_reduce_in_fp32": True, "use_distributed_optimizer": use_distributed_optimizer},
            post_model_creation_callbacks=[_creation_callback(hook)
                                           for hook in head_hooks(value_head, fp32_lm_head, value_bias)])

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
