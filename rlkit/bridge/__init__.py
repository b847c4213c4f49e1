"""HF <-> Megatron-Core through mbridge: build a GPTModel from an HF config, load HF weights,
stream HF-named tensors back out. The rest of rlkit sees only `ModelBridge`."""

import importlib.util
import inspect
import re
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch

from rlkit.config.schema import ConfigError

_patched = set()
# policy.attention_backend: torch SDPA (sdpa_attention.py) or Megatron's unfused DotProductAttention
ATTENTION_BACKENDS = ("sdpa", "local")


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


def _router_gemm_without_te():
    """megatron-core 0.16.1's MoE router asks `te_general_gemm is not None`, a name its moe_utils
    defines only when TransformerEngine imports (NameError otherwise): define it as absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _local_layer_spec(bridge, core_attention: type, vp_stage=None):
    """Without TransformerEngine, mbridge 0.15.1 still builds TE layer specs (NameError: TENorm):
    build Megatron's pure-torch spec instead, with `core_attention` in every layer's attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    kwargs = {"vp_stage": vp_stage} if "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters else {}
    spec = get_gpt_decoder_block_spec(bridge.config, use_transformer_engine=False, **kwargs)
    for layer in spec.layer_specs:  # built fresh by each call: nothing shared to change
        layer.submodules.self_attention.submodules.core_attention = core_attention
    return spec


class ModelBridge:
    """One HF checkpoint directory seen as Megatron model chunks. Create it after
    megatron's parallel_state is initialized: the bridge reads TP/PP/EP from it.
    attention_backend (one of ATTENTION_BACKENDS) is the core attention of every model it builds
    where TransformerEngine is not installed; with it, mbridge's TE spec brings TE's attention."""

    def __init__(self, hf_dir: str, params_dtype: torch.dtype, attention_backend: str):
        from mbridge import AutoBridge
        from transformers import AutoConfig

        _isolate_name_tables()
        self.hf_dir = str(hf_dir)
        self.hf_config = AutoConfig.from_pretrained(self.hf_dir)
        for key in ("rope_theta", "partial_rotary_factor"):  # transformers 5 moved them into rope_parameters
            if not hasattr(self.hf_config, key) and key in self.hf_config.rope_parameters:
                setattr(self.hf_config, key, self.hf_config.rope_parameters[key])
        self._bridge = AutoBridge.from_config(self.hf_config, dtype=params_dtype)
        # RL needs deterministic forward passes (train vs generation logprobs); fusions that need
        # TE/Apex are off so the same model builds on CPU and GPU.
        self._bridge.set_extra_args(sequence_parallel=False, hidden_dropout=0.0, attention_dropout=0.0,
                                    masked_softmax_fusion=False, bias_activation_fusion=False,
                                    bias_dropout_fusion=False, apply_rope_fusion=False,
                                    gradient_accumulation_fusion=False, persist_layer_norm=False,
                                    # micro-batches are cut to their longest row (rlkit/data/micro_batches.py):
                                    # pipeline stages exchange each one's shape
                                    variable_seq_lengths=True,
                                    # an expert bias (aux-loss-free balancing, GLM-4.5 / DeepSeek-V3) is the
                                    # checkpoint's, frozen as NeMo-RL's GRPO recipes and mbridge's GLM-4-MoE
                                    # keep it: Megatron would move it after every step by the sign of the
                                    # batch's expert load, a pretraining device outside the RL loss and its
                                    # trust region (mbridge's DeepSeek-V3 and Mixtral bridges say 0.001)
                                    moe_router_bias_update_rate=0.0)
        if importlib.util.find_spec("transformer_engine") is None:
            from megatron.core.transformer.dot_product_attention import DotProductAttention

            from rlkit.bridge.sdpa_attention import SDPAttention

            _local_names_as_te()
            _router_gemm_without_te()
            # grouped experts need TE (or the grouped_gemm package): one torch MLP per local expert instead
            self._bridge.set_extra_args(moe_grouped_gemm=False)
            core_attention = {"sdpa": SDPAttention, "local": DotProductAttention}[attention_backend]
            # this bridge's own spec, so two models in one process may use different attention
            self._bridge._get_transformer_layer_spec = partial(_local_layer_spec, self._bridge, core_attention)
        elif self._bridge.config.context_parallel_size > 1:
            # the worker splits rows and cuts packed masks the way rlkit/bridge/context_parallel.py attends;
            # TE's context-parallel attention takes neither, and this pairing has never run
            raise ConfigError(f"policy.context_parallel_size: context parallelism runs on rlkit's SDPA attention, "
                              f"which TransformerEngine's layer spec replaces (TE is installed here; got "
                              f"context_parallel_size={self._bridge.config.context_parallel_size}); set "
                              f"policy.context_parallel_size=1 or run without transformer_engine")

    @property
    def transformer_config(self):
        return self._bridge.config

    def build(self, bf16: bool, wrap_with_ddp: bool, use_distributed_optimizer: bool = False,
              value_head: bool = False, fp32_lm_head: bool = False) -> list:
        """Model chunks of this rank; value_head=True swaps the LM head for ValueHead (a critic)
        before DDP wraps the model, so DDP and the optimizer see the head's parameters;
        fp32_lm_head computes the logits in fp32 (_lm_head_in_fp32)."""
        callbacks = [_attach_value_head] if value_head else [_lm_head_in_fp32] if fp32_lm_head else []
        return self._bridge.get_model(
            bf16=bf16, wrap_with_ddp=wrap_with_ddp, use_cpu_initialization=not torch.cuda.is_available(),
            ddp_config={"grad_reduce_in_fp32": True, "use_distributed_optimizer": use_distributed_optimizer},
            post_model_creation_callbacks=callbacks)

    def load_trunk_weights(self, critic_chunks: list, bf16: bool):
        """Initialise a critic from the HF checkpoint: every weight but the LM head (which the
        critic replaced). Goes through a temporary LM so the bridge's own name mapping is used."""
        lm = self.build(bf16=bf16, wrap_with_ddp=False)
        self.load_hf_weights(lm)
        for lm_chunk, critic_chunk in zip(lm, critic_chunks):
            trunk = {k: v for k, v in _unwrap(lm_chunk).state_dict().items() if not k.startswith("output_layer.")}
            missing, unexpected = _unwrap(critic_chunk).load_state_dict(trunk, strict=False)
            missing = [k for k in missing if not k.startswith("output_layer.") and not k.endswith("_extra_state")]
            if missing or unexpected:
                raise RuntimeError(f"critic trunk does not match the policy's: missing {missing[:3]}, "
                                   f"unexpected {unexpected[:3]}")

    def load_hf_weights(self, chunks: list, hf_dir: str | None = None):
        self._bridge.load_weights(chunks, str(hf_dir or self.hf_dir))

    def export_hf_weights(self, chunks: list) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, tensor) gathered across TP/PP, one tensor at a time. Collective:
        every model-parallel rank must iterate it to the end. No autograd: the broadcasts and
        gathers inside must not record graphs on parameters that require grad."""
        exported = self._bridge.export_weights(chunks)
        while True:
            with torch.no_grad():  # per item, so grad mode never leaks into the consumer
                item = next(exported, None)
            if item is None:
                return
            yield item

    def export_rows(self, chunks: list) -> "RowExport | None":
        """The export as row moves: for each HF tensor, in export order, the Megatron parameter
        rows it is made of. Found by running a probe (every row holding its own index) through the
        bridge's own conversion, so fused layouts (qkv, gate/up) and vocab padding come out exactly
        as the bridge lays them out. Only where this rank holds every weight (TP=PP=EP=1, one
        chunk); None otherwise, or where a conversion does more than move rows. The caller
        checks the result against a real export before trusting it (see policy refit_manifest)."""
        from megatron.core import parallel_state as mpu

        if len(chunks) != 1 or max(mpu.get_tensor_model_parallel_world_size(),
                                   mpu.get_pipeline_model_parallel_world_size(),
                                   mpu.get_expert_model_parallel_world_size()) > 1:
            return None
        model = _unwrap(chunks[0])
        to_global = self._bridge._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
        if set(to_global) != {name for name, _ in model.named_parameters()}:
            return None  # state beyond parameters (e.g. MoE expert bias) is exported too
        rows: dict[str, list[RowPiece]] = {}
        for local_name, param in model.named_parameters():
            shape = tuple(param.shape) or (1,)
            probe = torch.arange(shape[0], dtype=torch.int32).view(-1, *[1] * (len(shape) - 1)).expand(shape)
            try:
                names, outputs = self._bridge._weight_to_hf_format(to_global[local_name], probe)
            except Exception:  # a conversion that computes (casts, arithmetic) rejects integer rows
                return None
            for name, out in zip(names, outputs):
                if name in rows or out.dtype != probe.dtype or tuple(out.shape[1:]) != shape[1:]:
                    return None
                row_ids = out.reshape(out.shape[0], -1)[:, 0].tolist() if out.dim() else [int(out)]
                rows[name] = _runs(param, row_ids)
        try:
            return RowExport(rows)
        except ValueError:  # e.g. one parameter exported under two names
            return None

    def save_hf_weights(self, chunks: list, out_dir: str):
        # no autograd, as in export_hf_weights: mbridge's broadcasts of parameters that require grad
        # would otherwise record c10d::broadcast_ nodes, which the next backward warns about
        # ("an autograd kernel was not registered ... silently incorrect behavior")
        with torch.no_grad():
            self._bridge.save_weights(chunks, str(out_dir))


@dataclass(frozen=True)
class RowPiece:
    """Rows [source_row, source_row + rows) of a Megatron parameter fill rows
    [first_row, first_row + rows) of an exported HF tensor (a 0-d or 1-d one counts its elements)."""
    param: torch.nn.Parameter
    source_row: int
    rows: int
    first_row: int


class RowExport:
    """The row pieces of ModelBridge.export_rows as flat views of the parameters: one split per
    parameter, because refit time at this size is per-tensor Python, not bytes. The views are
    kept while every parameter keeps its storage (sleep/wake resizes storages in place, which
    views follow); a parameter given new storage gets fresh views."""

    def __init__(self, rows: dict[str, list[RowPiece]]):
        by_param: dict[int, tuple[torch.nn.Parameter, list[tuple[str, RowPiece]]]] = {}
        for name, pieces in rows.items():
            for piece in pieces:
                by_param.setdefault(id(piece.param), (piece.param, []))[1].append((name, piece))
        self.names = list(rows)
        self._splits = []  # (parameter, split sizes alternating gap / piece, [(hf name, first row)])
        for param, named in by_param.values():
            named.sort(key=lambda item: item[1].source_row)
            row_numel = param[0].numel() if param.dim() else 1
            sizes, position = [], 0
            for name, piece in named:
                if piece.source_row < position:
                    raise ValueError(f"{name} shares rows of one parameter with another exported tensor")
                sizes += [(piece.source_row - position) * row_numel, piece.rows * row_numel]
                position = piece.source_row + piece.rows
            sizes.append(param.numel() - position * row_numel)
            self._splits.append((param, sizes, [(name, piece.first_row) for name, piece in named]))
        self._sources, self._storages = None, None

    def sources(self) -> dict[str, list[tuple[torch.Tensor, int]]]:
        """{hf name: [(flat rows, first row)]}, the form RefitPlan.pack takes; the same object
        as long as the parameters keep their storages."""
        storages = [param.untyped_storage()._cdata for param, _, _ in self._splits]
        if storages != self._storages:
            self._sources = {name: [] for name in self.names}
            for param, sizes, targets in self._splits:
                for (name, first_row), rows in zip(targets, param.detach().view(-1).split(sizes)[1::2]):
                    self._sources[name].append((rows, first_row))
            self._storages = storages
        return self._sources


def _runs(param: torch.nn.Parameter, row_ids: list[int]) -> list[RowPiece]:
    """Consecutive source rows merged into one piece each."""
    pieces, start = [], 0
    for i in range(1, len(row_ids) + 1):
        if i == len(row_ids) or row_ids[i] != row_ids[i - 1] + 1:
            pieces.append(RowPiece(param, row_ids[start], i - start, start))
            start = i
    return pieces


class ValueHead(torch.nn.Module):
    """Scalar value per position, replicated on every TP rank (its input, the final hidden state,
    is replicated too, so every rank computes the same gradient). Zero-initialised: the critic
    starts by predicting 0 and learns the scale of the rewards. Called like Megatron's output
    layer: (hidden [s, b, h], weight=None, ...) -> ([s, b, 1], None)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        # named weight/bias like the LM head's, which Megatron's checkpointing code expects
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def _attach_value_head(model, pre_process, post_process, config, hf_config):
    # on every pipeline stage: with the flag left on, the first stage would wait for an embedding
    # gradient all-reduce with a last stage that no longer takes part
    model.share_embeddings_and_output_weights = False
    if post_process:
        model.output_layer = ValueHead(config.hidden_size, config.params_dtype).to(
            next(model.parameters()).device)


def _lm_head_in_fp32(model, pre_process, post_process, config, hf_config):
    """The LM head as an fp32 product of the bf16 hidden states and weights. Logits rounded to
    bf16 are off by up to half a bf16 step (0.03 at a logit of 10), independently in the trainer
    and in vLLM: the largest part of a bf16 model's train-vs-generation logprob gap. vLLM computes
    its head the same way with hf_overrides head_dtype=float32. Gradients flow through the casts
    to the bf16 weights as before."""
    if not post_process:
        return
    layer, forward = model.output_layer, model.output_layer.forward

    def fp32_forward(input_, weight=None, runtime_gather_output=None):
        weight = layer.weight if weight is None else weight  # tied embeddings pass theirs
        return forward(input_.float(), weight=weight.float(), runtime_gather_output=runtime_gather_output)

    layer.forward = fp32_forward


def _unwrap(chunk):
    while hasattr(chunk, "module"):  # DDP, Float16Module
        chunk = chunk.module
    return chunk
