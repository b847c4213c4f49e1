"""Throughput and model FLOPs utilisation (MFU) of a step's phases, from the architecture.

Model FLOPs of one forward pass over a sequence of s tokens (Qwen2 / Qwen3 / Llama-style
decoders: grouped-query attention, gated SiLU MLP):

    2 * (weights in matmuls) * s  +  2 * 2 * layers * heads * head_dim * s^2 / 2

The first term is every weight matmul: q, k, v, o and gate, up, down in each layer, and the LM
head (tied or not: it is a matmul either way; the embedding lookup is an index, no FLOPs). The
second is causal attention: the scores QK^T and their product with V, over the half of the
s x s matrix that the causal mask keeps. Norms, activations, rotary embeddings, softmax and
biases are elementwise and left out, as in the usual MFU accounting (PaLM, appendix B).
Training is 3x forward: the backward pass multiplies each matmul twice (the gradients of its
input and of its weight).

MFU = model FLOPs / (seconds * GPUs of the phase * the GPU's peak bf16 dense FLOP/s): padding
and recomputation are work the hardware did but the model did not need, so they do not count.
"""

import re
from dataclasses import dataclass

TRAIN_PASSES = 3  # forward + a backward of twice its FLOPs

# (pattern in torch.cuda.get_device_name(), peak bf16 dense tensor FLOP/s: NVIDIA's datasheets,
# without sparsity), first match wins; the NVL parts run at other clocks and are not listed
PEAK_BF16_DENSE = [
    (r"H100.*PCIe", 756e12),
    (r"H100.*(HBM3|SXM)", 989e12),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"H200(?!.*NVL)", 989e12),
    (r"A100", 312e12),
]


def peak_bf16_flops(device_name: str | None) -> float | None:
    """The device's peak; None for a CPU (device_name None) or a GPU not in the table, and then
    no MFU is logged rather than a wrong one."""
    if device_name is None:
        return None
    return next((flops for pattern, flops in PEAK_BF16_DENSE if re.search(pattern, device_name)), None)


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, hf_config: dict) -> "DecoderShape":
        """From an HF config.json's fields; head_dim and num_key_value_heads are optional there
        (absent: hidden / heads, and plain multi-head attention)."""
        c, heads = hf_config, hf_config["num_attention_heads"]
        return cls(c["num_hidden_layers"], c["hidden_size"], heads, c.get("num_key_value_heads") or heads,
                   c.get("head_dim") or c["hidden_size"] // heads, c["intermediate_size"], c["vocab_size"])

    def matmul_weights(self, lm_head: bool = True) -> int:
        """Weights each token is multiplied with (lm_head=False: a critic's trunk, whose value
        head is hidden x 1)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o; k, v
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        return self.layers * (attention + mlp) + (self.hidden * self.vocab if lm_head else 0)

    def attention_flops(self, s: int) -> float:
        """QK^T and the scores times V over the causal half of an s x s matrix, every layer."""
        return 2 * 2 * self.layers * self.heads * self.head_dim * s * s / 2


def forward_flops(shape: DecoderShape, lengths: list[int], lm_head: bool = True) -> float:
    """One forward pass over sequences of these real lengths (each attends to itself alone)."""
    return sum(2 * shape.matmul_weights(lm_head) * s + shape.attention_flops(s) for s in lengths)


def training_flops(shape: DecoderShape, lengths: list[int], lm_head: bool = True) -> float:
    return TRAIN_PASSES * forward_flops(shape, lengths, lm_head)


@dataclass(frozen=True)
class PhaseWork:
    """What one timed phase computed."""

    tokens: float  # the tokens it processed (or, generating, sampled)
    flops: float  # model FLOPs
    gpus: int  # the GPUs it ran on


def phase_metrics(work: dict[str, PhaseWork], seconds: dict[str, float], peak_flops: float | None) -> dict:
    """timing/{phase}_tokens_per_s (all of the phase's GPUs together) and, where the peak is
    known, timing/{phase}_mfu; seconds: a PhaseTimer's, timing/{phase}."""
    out = {}
    for phase, w in work.items():
        elapsed = seconds[f"timing/{phase}"]
        out[f"timing/{phase}_tokens_per_s"] = w.tokens / elapsed
        if peak_flops is not None:
            out[f"timing/{phase}_mfu"] = w.flops / (elapsed * w.gpus * peak_flops)
    return out
