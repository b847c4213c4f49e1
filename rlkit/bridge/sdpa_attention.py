"""Megatron core attention through torch's fused scaled_dot_product_attention (policy.attention_backend=sdpa).

Megatron's local DotProductAttention materialises the [b, heads, s, s] scores (baddbmm, masked
softmax, bmm): about 16 TFLOPS forward+backward on an H100, against 336 for SDPA's cuDNN kernel
(benchmarks/results/kernel_probe_h100.md). This module is a drop-in for it in the local layer
spec: the same constructor and forward, the same shapes, the same result up to rounding.

Under context parallelism (rlkit/bridge/context_parallel.py) each rank's queries attend the whole
sequence's keys and values, gathered from every rank, through a mask of global positions.
"""

import math

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from rlkit.bridge.context_parallel import gather_sequence, positions_on_rank
from rlkit.config.schema import ConfigError
from rlkit.data.packing import packed_attention_mask

USE_LOCAL = "set policy.attention_backend=local (Megatron's unfused attention)"
USE_TE = "neither does Megatron's local attention: this needs TransformerEngine's layer spec"


def _refuse(what: str, fix: str = USE_LOCAL):
    raise ConfigError(f"policy.attention_backend: sdpa does not support {what}; {fix}")


class SDPAttention(MegatronModule):
    """DotProductAttention's interface (megatron-core 0.16.1) over torch SDPA. Causal attention
    without a mask is SDPA's is_causal; an explicit mask (Megatron's bool convention, True =
    masked out, e.g. packed rows) becomes SDPA's attn_mask. Grouped KV heads stay grouped
    (enable_gqa) rather than being repeated to the query heads. With context parallelism, keys
    and values are all-gathered over the CP group (their gradients reduce-scattered back)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            _refuse(f"sliding-window attention (window_size={config.window_size})")
        if config.softmax_type != "vanilla":
            _refuse(f"softmax_type={config.softmax_type!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:  # rlkit's bridge sets 0: RL needs deterministic forward passes
            _refuse(f"attention dropout ({dropout})")
        self.attn_mask_type = attn_mask_type
        # DotProductAttention divides the scale by layer_number under apply_query_key_layer_scaling
        # and multiplies the scores back before its fp32 softmax, to keep fp16 scores in range: the
        # product is this scale. SDPA's kernels accumulate in fp32, so they need no such split.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        """query [sq, b, heads, d], key and value [sk, b, kv heads, d] (this TP rank's heads);
        attention_mask None or bool [b or 1, 1, sq, sk], True = masked out. Returns
        [sq, b, heads * d]. Like DotProductAttention, the mask type is the one the layer was built
        with (attn_mask_type is ignored), and an explicit mask replaces the causal one. Under
        context parallelism the inputs are this rank's share of the sequence and an explicit mask
        is [b or 1, 1, sq, whole sequence]: this rank's queries' rows, keys in sequence order."""
        if packed_seq_params is not None:
            _refuse("packed_seq_params (THD packed sequences)", USE_TE)
        if attention_bias is not None:
            _refuse("attention_bias", USE_TE)
        if self.cp_group is not None:
            key, value = (gather_sequence(x, self.cp_group, sum_grads=True) for x in (key, value))
            if attention_mask is None and self.attn_mask_type == AttnMaskType.causal:
                # one sequence of segment 1: the causal mask, at this rank's global query positions
                queries = positions_on_rank(key.shape[0], self.cp_group.size(), self.cp_group.rank())
                attention_mask = packed_attention_mask(torch.ones(1, key.shape[0], dtype=torch.long,
                                                                  device=key.device), queries)
        causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal
        if causal and query.shape[0] != key.shape[0]:
            # SDPA's is_causal aligns the mask to the top left: wrong for queries after a KV cache
            _refuse(f"causal attention of {query.shape[0]} queries over {key.shape[0]} keys")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]: SDPA's layout
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask, is_causal=causal,
            scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
