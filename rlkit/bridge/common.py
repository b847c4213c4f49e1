"""What both bridge backends build the same way: the model settings RL needs, Megatron's local
layer spec with rlkit's attention, the value and fp32 LM heads, and the row export a refit copies
from where one rank holds every weight."""

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Iterator

import torch

# RL needs deterministic forward passes (train vs generation logprobs); fusions that need TE/Apex
# are off so the same model builds on CPU and GPU.
RL_MODEL_SETTINGS = dict(
    sequence_parallel=False, hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
    bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
    gradient_accumulation_fusion=False, persist_layer_norm=False,
    # micro-batches are cut to their longest row (rlkit/data/micro_batches.py): pipeline stages
    # exchange each one's shape
    variable_seq_lengths=True,
    # an expert bias (aux-loss-free balancing, GLM-4.5 / DeepSeek-V3) is the checkpoint's, frozen as
    # NeMo-RL's GRPO recipes and mbridge's GLM-4-MoE keep it: Megatron would move it after every step
    # by the sign of the batch's expert load, a pretraining device outside the RL loss and its trust
    # region (mbridge's DeepSeek-V3 and Mixtral bridges say 0.001)
    moe_router_bias_update_rate=0.0)


def rope_settings_in_parameters(hf_config) -> dict:
    """rope_theta and partial_rotary_factor, by name, where the config keeps them only in
    rope_parameters (transformers 5), where neither bridge's config mapping looks."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return {key: rope[key] for key in ("rope_theta", "partial_rotary_factor")
            if getattr(hf_config, key, None) is None and key in rope}


def core_attention(attention_backend: str) -> type:
    """policy.attention_backend's core attention for Megatron's local (non-TE) layer spec."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from rlkit.bridge.sdpa_attention import SDPAttention

    return {"sdpa": SDPAttention, "local": DotProductAttention}[attention_backend]


def specs_take_vp_stage() -> bool:
    """Whether this megatron-core's decoder block spec is built per virtual pipeline stage."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters


def local_layer_spec(config, core_attention: type, vp_stage=None):
    """Megatron's pure-torch decoder block spec for `config` (dense and MoE layers as the config
    lays them out, those of virtual stage vp_stage), with `core_attention` in every layer's attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    kwargs = {"vp_stage": vp_stage} if specs_take_vp_stage() else {}
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, **kwargs)
    for layer in spec.layer_specs:  # built fresh by each call: nothing shared to change
        layer.submodules.self_attention.submodules.core_attention = core_attention
    return spec


def router_gemm_without_te():
    """megatron-core 0.16.1's MoE router asks `te_general_gemm is not None`, a name its moe_utils
    defines only when TransformerEngine imports (NameError otherwise): define it as absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def head_hooks(value_head: bool, fp32_lm_head: bool, value_bias: bool = True) -> list[Callable]:
    """What to do to each freshly built GPTModel chunk, before DDP wraps it, for these head options."""
    if value_head:
        return [partial(attach_value_head, bias=value_bias)]
    return [lm_head_in_fp32] if fp32_lm_head else []


class ValueHead(torch.nn.Module):
    """Scalar value per position, replicated on every TP rank (its input, the final hidden state,
    is replicated too, so every rank computes the same gradient). Zero-initialised: the critic
    starts by predicting 0 and learns the scale of the rewards. Without a bias it is a reward
    model's head, as HF's sequence classifiers' `score` layer is: the Bradley-Terry loss is blind
    to a constant, so a bias would only drift on rounding noise. Called like Megatron's output
    layer: (hidden [s, b, h], weight=None, ...) -> ([s, b, 1], None)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, bias: bool = True):
        super().__init__()
        # named weight/bias like the LM head's, which Megatron's checkpointing code expects
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.register_parameter("bias", torch.nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None)

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def attach_value_head(model, bias: bool = True):
    """A critic (or without bias a reward model): the LM head of a GPTModel chunk swapped for
    ValueHead (on the last stage), before DDP wraps the model, so DDP and the optimizer see the
    head's parameters."""
    # on every pipeline stage: with the flag left on, the first stage would wait for an embedding
    # gradient all-reduce with a last stage that no longer takes part
    model.share_embeddings_and_output_weights = False
    if model.post_process:
        model.output_layer = ValueHead(model.config.hidden_size, model.config.params_dtype, bias).to(
            next(model.parameters()).device)


def copy_trunk(source: list, target: list) -> None:
    """Every weight but the output layer from the source chunks into the target's: a language
    model and a critic or reward model built alike, either way round."""
    for source_chunk, target_chunk in zip(source, target):
        trunk = {k: v for k, v in unwrap(source_chunk).state_dict().items() if not k.startswith("output_layer.")}
        missing, unexpected = unwrap(target_chunk).load_state_dict(trunk, strict=False)
        missing = [k for k in missing if not k.startswith("output_layer.") and not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"the trunks of a language model and a model of a scalar head do not match: missing "
                               f"{missing[:3]}, unexpected {unexpected[:3]}")


def lm_head_in_fp32(model):
    """The LM head as an fp32 product of the bf16 hidden states and weights. Logits rounded to
    bf16 are off by up to half a bf16 step (0.03 at a logit of 10), independently in the trainer
    and in vLLM: the largest part of a bf16 model's train-vs-generation logprob gap. vLLM computes
    its head the same way with hf_overrides head_dtype=float32. Gradients flow through the casts
    to the bf16 weights as before."""
    if not model.post_process:
        return
    layer, forward = model.output_layer, model.output_layer.forward

    def fp32_forward(input_, weight=None, runtime_gather_output=None):
        weight = layer.weight if weight is None else weight  # tied embeddings pass theirs
        return forward(input_.float(), weight=weight.float(), runtime_gather_output=runtime_gather_output)

    layer.forward = fp32_forward


def without_grad(items: Iterator):
    """The items of an export stream, each made with autograd off: the gathers and broadcasts
    inside must not record graphs on parameters that require grad. Per item, so grad mode never
    leaks into the consumer."""
    while True:
        with torch.no_grad():
            item = next(items, None)
        if item is None:
            return
        yield item


def holds_every_weight(chunks: list) -> bool:
    """Whether this rank holds the whole model: one chunk, TP = PP = EP = 1."""
    from megatron.core import parallel_state as mpu

    return len(chunks) == 1 and max(mpu.get_tensor_model_parallel_world_size(),
                                    mpu.get_pipeline_model_parallel_world_size(),
                                    mpu.get_expert_model_parallel_world_size()) == 1


def probe_rows(conversions: Iterable[tuple[torch.nn.Parameter, Callable]]) -> "RowExport | None":
    """The export as row moves, found by running a probe through each parameter's conversion:
    `conversions` gives, in export order, each parameter and a function from a tensor of its shape
    to the (HF name, tensor) pairs the bridge makes of it. The probe holds its own row index in
    every row, so fused layouts (qkv, gate/up) and vocab padding come out exactly as the bridge
    lays them out. None where a conversion does more than move rows (it computes on, or rejects,
    integer rows), or one parameter's rows are exported twice."""
    rows: dict[str, list[RowPiece]] = {}
    for param, convert in conversions:
        shape = tuple(param.shape) or (1,)
        probe = torch.arange(shape[0], dtype=torch.int32).view(-1, *[1] * (len(shape) - 1)).expand(shape)
        try:
            outputs = list(convert(probe))
        except Exception:  # a conversion that computes (casts, arithmetic) rejects integer rows
            return None
        for name, out in outputs:
            if name in rows or out.dtype != probe.dtype or tuple(out.shape[1:]) != shape[1:]:
                return None
            row_ids = out.reshape(out.shape[0], -1)[:, 0].tolist() if out.dim() else [int(out)]
            rows[name] = _runs(param, row_ids)
    try:
        return RowExport(rows)
    except ValueError:  # e.g. one parameter exported under two names
        return None


@dataclass(frozen=True)
class RowPiece:
    """Rows [source_row, source_row + rows) of a Megatron parameter fill rows
    [first_row, first_row + rows) of an exported HF tensor (a 0-d or 1-d one counts its elements)."""
    param: torch.nn.Parameter
    source_row: int
    rows: int
    first_row: int


class RowExport:
    """The row pieces of a bridge's export_rows as flat views of the parameters: one split per
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


def unwrap(chunk):
    while hasattr(chunk, "module"):  # DDP, Float16Module
        chunk = chunk.module
    return chunk
