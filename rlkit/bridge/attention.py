"""Core attention through torch's scaled_dot_product_attention, for Megatron models built without
TransformerEngine.

Megatron's own DotProductAttention writes the full score matrix QK^T in the model's dtype before
its softmax: in bf16 a score of 20 is rounded by up to 0.06, which moves that token's attention
weight by up to 6% in every layer. vLLM's attention kernels (and TE's) keep the scores and the
softmax in fp32 inside the kernel; SDPA's flash and memory-efficient kernels do too, so the
trainer rounds where the sampler does, and never materializes the [b, n, s, s] scores.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SDPAttention(DotProductAttention):
    """Same interface, parameters and layout as DotProductAttention ([s, b, heads, head_dim] in,
    [s, b, heads * head_dim] out); attention_mask is None (causal) or Megatron's boolean mask
    where True means masked out."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if self.softmax_offset is not None or config.window_size is not None:
            raise ValueError("SDPAttention supports plain softmax attention only (softmax_type='vanilla', "
                             "no window_size)")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention takes no attention_bias or packed_seq_params; rlkit packs "
                             "sequences with a block-diagonal attention_mask")
        seq, batch = query.shape[0], query.shape[1]
        repeats = query.shape[2] // key.shape[2]  # grouped-query attention: each KV head serves `repeats` heads
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key.repeat_interleave(repeats, dim=2),
                                                    value.repeat_interleave(repeats, dim=2)))
        dropout = self.attention_dropout.p if self.training else 0.0
        if attention_mask is None:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                                     scale=self.softmax_scale)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, dropout_p=dropout,
                                                     scale=self.softmax_scale)
        # [b, n, s, d] -> [s, b, n * d]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)
