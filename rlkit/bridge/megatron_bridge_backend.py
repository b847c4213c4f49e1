"""policy.bridge=megatron_bridge: HF <-> Megatron-Core through NVIDIA's Megatron-Bridge 0.3.1
(AutoBridge), made to run on rlkit's stack by megatron_bridge_compat.py.

The bridge turns the HF config into a model provider (a TransformerConfig that builds GPTModel
chunks); rlkit sets the layout from megatron's parallel_state and its RL settings on it, then
builds (megatron_bridge_integration.py), policy.peft's LoRA adapters added by the bridge's PEFT
before DDP wraps the chunks. Loading and exporting go through the bridge's conversion tasks: one
task per Megatron weight, planned once per model and reused by every export, so the HF names come
out in one fixed order, one tensor at a time; with adapters, each weight comes out with its
adapter merged in."""

import weakref
from functools import partial
from typing import Iterator

import torch

from rlkit.bridge.base import ModelBridge, transformer_engine_installed
from rlkit.bridge.common import (RL_MODEL_SETTINGS, RowExport, core_attention, head_hooks, holds_every_weight,
                                 local_layer_spec, probe_rows, router_gemm_without_te, unwrap, without_grad)
from rlkit.bridge.megatron_bridge_compat import auto_bridge
from rlkit.bridge.megatron_bridge_integration import (adapter_state, configure_provider, create_ddp_config,
                                                      create_peft, create_peft_hook, load_adapter_state,
                                                      load_peft_adapter_checkpoint)
from rlkit.config.schema import ConfigError, PeftConfig


class MegatronBridge(ModelBridge):
    """attention_backend (one of ATTENTION_BACKENDS) is the core attention of every model it builds
    where TransformerEngine is not installed; with it, the bridge's TE spec brings TE's attention."""

    def __init__(self, hf_dir: str, params_dtype: torch.dtype, attention_backend: str, peft: PeftConfig | None = None):
        self.hf_dir = str(hf_dir)
        self._bridge = auto_bridge().from_hf_pretrained(self.hf_dir)  # the config now, tensors when converted
        self.hf_config = self._bridge.hf_pretrained.config
        provider = self._bridge.to_megatron_provider(load_weights=False)
        overrides = {**RL_MODEL_SETTINGS,
                     # the only MoE dispatcher Megatron runs with variable_seq_lengths (dense models too pass
                     # its check)
                     "moe_token_dispatcher_type": "alltoall",
                     # num_nextn_predict_layers: 0 maps to 0 MTP layers, which Megatron spells None
                     "mtp_num_layers": provider.mtp_num_layers or None}
        if not transformer_engine_installed():
            router_gemm_without_te()
            # grouped experts and the fused permutation need TE: one torch MLP per local expert
            # instead; the shared expert runs in line rather than overlapped on a side stream
            overrides.update(moe_grouped_gemm=False, moe_permute_fusion=False, moe_shared_expert_overlap=False,
                             transformer_layer_spec=partial(local_layer_spec,
                                                            core_attention=core_attention(attention_backend)))
        configure_provider(provider, params_dtype, overrides)
        self._provider = provider
        self._plans = weakref.WeakKeyDictionary()  # first chunk of a model -> its conversion tasks
        self._peft = create_peft(peft) if peft is not None else None

    @property
    def transformer_config(self):
        return self._provider  # the config every model built here holds

    @property
    def has_adapters(self) -> bool:
        return self._peft is not None

    def build(self, bf16: bool, wrap_with_ddp: bool, use_distributed_optimizer: bool = False,
              value_head: bool = False, fp32_lm_head: bool = False, value_bias: bool = True) -> list:
        hooks = [partial(_each_chunk, hook) for hook in head_hooks(value_head, fp32_lm_head, value_bias)]
        if self._peft is not None:
            hooks.append(create_peft_hook(self._peft))
        return self._provider.provide_distributed_model(
            ddp_config=create_ddp_config(use_distributed_optimizer), bf16=bf16, wrap_with_ddp=wrap_with_ddp,
            use_cpu_initialization=not torch.cuda.is_available(), pre_wrap_hook=hooks)

    def adapters_disabled(self, chunks: list):
        return self._peft.disable_adapter(chunks)

    def checkpointed_state(self, model) -> dict:
        state = model.sharded_state_dict()
        return state if self._peft is None else adapter_state(state)

    def load_model_state(self, model, state: dict):
        if self._peft is None:
            return super().load_model_state(model, state)
        load_adapter_state(model, state)

    def load_adapter_checkpoint(self, chunks: list, checkpoint_dir: str):
        for chunk in chunks:
            load_peft_adapter_checkpoint(unwrap(chunk), checkpoint_dir)

    def restart_adapters(self, chunks: list):
        # LoRA's B matrices (linear_out), zero as at creation: the adapters add nothing
        with torch.no_grad():
            for chunk in chunks:
                for module in unwrap(chunk).modules():
                    if isinstance(getattr(module, "adapter", None), torch.nn.Module):
                        module.adapter.linear_out.weight.zero_()

    def export_adapter_weights(self, chunks: list) -> list[tuple[str, torch.Tensor]]:
        """The adapters alone, under HF PEFT's module names (<hf module>.lora_A.weight, .lora_B.weight):
        a fused layer's adapter as one per HF module, sharing its A. Collective."""
        with torch.no_grad():
            return list(self._bridge.export_adapter_weights(chunks, cpu=False, show_progress=False))

    def load_hf_weights(self, chunks: list, hf_dir: str | None = None):
        self._conversion_tasks(chunks)  # every weight has a conversion, or the load is refused
        with torch.no_grad():
            self._bridge.load_hf_weights(chunks, str(hf_dir) if hf_dir else None)

    def export_hf_weights(self, chunks: list) -> Iterator[tuple[str, torch.Tensor]]:
        yield from without_grad(self._bridge.export_hf_weights(chunks, cpu=False, show_progress=False,
                                                               conversion_tasks=self._conversion_tasks(chunks)))

    def export_rows(self, chunks: list) -> RowExport | None:
        if not holds_every_weight(chunks) or self._peft is not None:  # merged adapters are computed, not moved
            return None
        tasks = self._conversion_tasks(chunks)
        if not all(isinstance(task.param_weight, torch.nn.Parameter) for task in tasks):
            return None  # state beyond parameters (e.g. MoE expert bias) is exported too
        return probe_rows((task.param_weight, partial(_converted, task)) for task in tasks)

    def save_hf_weights(self, chunks: list, out_dir: str):
        # no autograd, as in export_hf_weights: the bridge's gathers of parameters that require grad
        # would record graphs on them
        with torch.no_grad():
            self._bridge.save_hf_weights(chunks, str(out_dir), show_progress=False)
        if torch.distributed.get_rank() == 0:  # loading it back, some bridges read the config (GLM-4.5's)
            self.hf_config.save_pretrained(out_dir)

    def _conversion_tasks(self, chunks: list) -> list:
        """The bridge's conversion tasks for this model, planned at its first load or export. The
        bridge skips a weight it has no conversion for with a log line, which would leave it as
        initialised: refused here, naming the weights."""
        first = unwrap(chunks[0])
        if first not in self._plans:
            tasks = self._bridge.get_conversion_tasks(chunks)
            converted = {task.param_name for task in tasks if task is not None and task.megatron_module is not None}
            tied = self._provider.share_embeddings_and_output_weights  # the output layer loads from the embedding
            # adapters are exported merged into their base weight's conversion
            missing = [name for chunk in chunks for name, _ in unwrap(chunk).named_parameters()
                       if name not in converted and not (tied and name.startswith("output_layer."))
                       and ".adapter." not in name]
            if missing or None in tasks:
                raise ConfigError(f"policy.bridge: megatron_bridge has no conversion for {missing[:3] or 'some'} "
                                  f"weights of {self.hf_config.model_type} ({self.hf_dir}); use policy.bridge=mbridge")
            self._plans[first] = tasks
        return self._plans[first]


def _each_chunk(hook, chunks: list) -> list:
    """A head hook (common.head_hooks) as the provider's pre-wrap hook, which gets every chunk."""
    for chunk in chunks:
        hook(chunk)
    return chunks


def _converted(task, tensor: torch.Tensor):
    """(HF name, tensor) pairs the task's conversion makes of `tensor` in place of its weight."""
    return task.mapping.megatron_to_hf(tensor, task.megatron_module).items()
