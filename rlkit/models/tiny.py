"""Tiny HF checkpoints of real architectures (Qwen2, Qwen3, Qwen3-MoE, GLM-4-MoE, Llama; Phi-3, which no
Megatron bridge converts), built offline.

The tokenizer is a byte-level BPE trained on arithmetic-like text. It uses Qwen2's
pre-tokenizer regex because transformers 5 swaps that regex into any tokenizer loaded
from a directory whose config.json says qwen2; training with the same regex keeps the
ids identical whichever class AutoTokenizer picks. Digits are always single tokens.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

from rlkit.models.cache_entry import publish

ARCHITECTURES = ("qwen2", "qwen3", "qwen3_moe", "glm4_moe", "llama", "phi3")
TINY_HEADS = (4, 2)  # (attention heads, key/value heads) of every tiny model
TINY_EXPERTS = {"qwen3_moe": 4, "glm4_moe": 4}  # routed experts of each tiny MoE architecture (top-2 of them per token)
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_PRETOKENIZER = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# ChatML; with tools (apply_chat_template(tools=...)) a system turn lists them, and tool results
# come back as user turns holding a <tool_response>, as Qwen2.5's template writes them. The list
# is compact, name(parameters) per tool, where Qwen's holds whole JSON schemas: the tiny models
# have 256 positions
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}Tools: {% for t in tools %}{{ t.function.name }}({{ t.function.parameters.properties | join(',') }})"
    "{% if not loop.last %} {% endif %}{% endfor %}. Call: <tool_call>{\"name\":..,\"arguments\":{..}}</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZER), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
    corpus += [f"{a}-{b}={a - b}" for a in range(30) for b in range(30)]
    corpus += ["What is the answer? The answer is 42. Guess a number: higher, lower, correct!"] * 10
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                     bos_token=None, padding_side="left")
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def _hf_config(arch: str, vocab_size: int, pad_id: int, eos_id: int, hidden_size: int, num_layers: int):
    from transformers import Glm4MoeConfig, LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=TINY_HEADS[0], num_key_value_heads=TINY_HEADS[1],
                  max_position_embeddings=256, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None,
                  tie_word_embeddings=arch == "qwen2", rms_norm_eps=1e-6)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden_size // 4, **common)
    if arch == "qwen3_moe":
        # every layer sparse; top-k probabilities renormalised as in released Qwen3-MoE checkpoints
        return Qwen3MoeConfig(head_dim=hidden_size // 4, num_experts=TINY_EXPERTS[arch], num_experts_per_tok=2,
                              moe_intermediate_size=hidden_size, norm_topk_prob=True, **common)
    if arch == "glm4_moe":
        # GLM-4.5's shape in small: the first layer dense, then sigmoid routing over the experts with
        # an expert bias (e_score_correction_bias), one shared expert, q/k/v biases, half the head
        # dimensions rotated, routed weights scaled by 2.5; no multi-token-prediction layer
        return Glm4MoeConfig(n_routed_experts=TINY_EXPERTS[arch], num_experts_per_tok=2, n_shared_experts=1,
                             moe_intermediate_size=hidden_size, first_k_dense_replace=1, n_group=1, topk_group=1,
                             norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True,
                             num_mtp_layers=0, **common)
    if arch == "phi3":
        # fused q/k/v and gate/up projections (qkv_proj, gate_up_proj), which neither bridge converts
        return Phi3Config(original_max_position_embeddings=256, **common)
    return LlamaConfig(**common)


def parse_tiny(model_path: str) -> str | None:
    """'tiny://qwen3' -> 'qwen3'; None for a real checkpoint path."""
    return model_path.removeprefix("tiny://") if model_path.startswith("tiny://") else None


def build_tiny_model(arch: str, out_dir: str | os.PathLike, hidden_size: int = 64, num_layers: int = 2,
                     seed: int = 0) -> Path:
    """Write a random-init HF checkpoint + tokenizer to out_dir (atomically) and return it.

    The vocabulary is padded to a multiple of 64 (as real checkpoints do) so any TP <= 64 divides it.
    """
    import torch  # here, not at the top: config checks read this module's names
    from transformers import AutoModelForCausalLM

    if arch not in ARCHITECTURES:
        raise ValueError(f"tiny model arch '{arch}' is unknown; choose one of {ARCHITECTURES}")
    out_dir = Path(out_dir)
    tok = build_tokenizer()
    vocab_size = -(-len(tok) // 64) * 64
    config = _hf_config(arch, vocab_size, tok.pad_token_id, tok.eos_token_id, hidden_size, num_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # an expert bias starts at zero: random values make routing and refit depend on it
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "rlkit_tiny.json").write_text(json.dumps({"arch": arch, "hidden_size": hidden_size,
                                                          "num_layers": num_layers, "seed": seed}))
        publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
