"""Megatron policy logprobs agree across parallel layouts and with HF transformers.

Tolerance: 1e-5 absolute on token logprobs (fp32; measured differences are ~1e-6, from
different reduction orders in TP matmuls and the vocab-parallel softmax)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlkit.data.batch import Batch

pytestmark = pytest.mark.integration
TOLERANCE = 1e-5


def _hf_logprobs(model_dir, input_ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


@pytest.fixture(scope="module")
def sequences(tiny_qwen2):
    g = torch.Generator().manual_seed(0)
    return Batch({"input_ids": torch.randint(0, 300, (8, 12), generator=g)})


def _policy_logprobs(model_workers, make_cfg, model_dir, batch, overrides):
    cfg, _ = make_cfg(*overrides)
    return model_workers.start(cfg, model_dir).logprobs(batch)


@pytest.mark.parametrize("layout", [["policy.num_workers=1"],
                                    ["policy.num_workers=2", "policy.tensor_parallel_size=2"],
                                    ["policy.num_workers=2", "policy.pipeline_parallel_size=2"],
                                    ["policy.num_workers=1", "policy.attention_backend=local"]],
                         ids=["tp1", "tp2", "pp2", "tp1-local-attention"])
def test_logprobs_match_hf(model_workers, make_cfg, tiny_qwen2, sequences, layout):
    reference = _hf_logprobs(tiny_qwen2, sequences["input_ids"])
    overrides = [*layout, "policy.micro_batch_size=4", "policy.train_global_batch_size=128"]
    logprobs = _policy_logprobs(model_workers, make_cfg, tiny_qwen2, sequences, overrides)
    assert logprobs.shape == reference.shape
    assert (logprobs - reference).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("layout", [["policy.num_workers=1"],
                                    ["policy.num_workers=2", "policy.pipeline_parallel_size=2"]], ids=["tp1", "pp2"])
def test_micro_batches_cut_to_their_rows_keep_every_read_logprob(model_workers, make_cfg, tiny_qwen2, layout):
    """Rows ending at different lengths (their response masks), grouped by a token budget into
    micro-batches each cut to its longest row: every logprob up to a row's end is HF's, at PP=2
    too (the stages exchange each micro-batch's shape)."""
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, 300, (8, 12), generator=g)
    ends = [12, 4, 7, 3, 12, 9, 5, 6]
    mask = torch.zeros(8, 12)
    for r, end in enumerate(ends):
        mask[r, 2:end] = 1.0
    reference = _hf_logprobs(tiny_qwen2, input_ids)
    logprobs = _policy_logprobs(model_workers, make_cfg, tiny_qwen2,
                                Batch({"input_ids": input_ids, "response_mask": mask}),
                                [*layout, "policy.max_tokens_per_microbatch=24"])
    for r, end in enumerate(ends):
        assert (logprobs[r, :end] - reference[r, :end]).abs().max().item() < TOLERANCE, r
    # the budget of 24 tokens groups rows [0, 4] (12 long), [5, 2] (9) and [7, 6, 1, 3] (6): the last
    # group was cut at 6 tokens, nothing past that was computed
    assert not logprobs[[7, 6, 1, 3], 6:].any() and logprobs[[7, 6, 1, 3], 5].all()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_other_architectures_match_hf(model_workers, make_cfg, cache_dir, sequences, arch):
    """Qwen3 (q/k norms, untied) and Llama load through the bridge and agree with HF at TP=2."""
    from rlkit.models.resolve import resolve_model_dir

    cfg, _ = make_cfg(f"policy.model_path=tiny://{arch}")
    model_dir = resolve_model_dir(cfg)
    reference = _hf_logprobs(model_dir, sequences["input_ids"])
    logprobs = _policy_logprobs(model_workers, make_cfg, model_dir, sequences,
                                [f"policy.model_path=tiny://{arch}", "policy.num_workers=2",
                                 "policy.tensor_parallel_size=2", "policy.micro_batch_size=4"])
    assert (logprobs - reference).abs().max().item() < TOLERANCE


def test_packed_rows_give_each_sequence_its_unpacked_logprobs(model_workers, make_cfg, tiny_qwen2):
    """Packing keeps attention inside each sequence and restarts positions: every sequence's
    logprobs in a packed row equal its logprobs alone in a row (at TP=2, where the mask meets the
    tensor-parallel attention)."""
    from rlkit.data.packing import pack_sequences

    g = torch.Generator().manual_seed(1)
    examples = [(torch.randint(0, 300, (n,), generator=g).tolist(), [1] * n) for n in [9, 4, 7, 3, 12, 5, 6, 2]]
    packed = pack_sequences(examples, max_length=16, pad_id=0, pack=True)
    alone = pack_sequences(examples, max_length=16, pad_id=0, pack=False)
    assert len(packed) < len(alone)
    cfg, _ = make_cfg("policy.num_workers=2", "policy.tensor_parallel_size=2", "policy.micro_batch_size=2")
    policy = model_workers.start(cfg, tiny_qwen2)
    packed_lp = policy.logprobs(packed.slice(0, len(packed) - len(packed) % 2))
    alone_lp = policy.logprobs(alone)

    def per_sequence(batch, logprobs):
        out = {}
        for r in range(len(logprobs)):
            for segment in batch["segment_ids"][r].unique().tolist():
                if segment:
                    span = batch["segment_ids"][r] == segment
                    out[tuple(batch["input_ids"][r][span].tolist())] = logprobs[r][span][1:]  # first: no context
        return out

    packed_seqs, alone_seqs = per_sequence(packed, packed_lp), per_sequence(alone, alone_lp)
    assert packed_seqs and set(packed_seqs) <= set(alone_seqs)
    for ids, lp in packed_seqs.items():
        assert (lp - alone_seqs[ids]).abs().max().item() < TOLERANCE, ids


def test_critic_starts_from_the_policy_trunk_and_learns_values(model_workers, make_cfg, tiny_qwen2):
    """The critic (value head on the policy's trunk) predicts 0 at first (zero-initialised head)
    and regresses per-token returns with the clipped value loss."""
    from rlkit.data.batch import batch_totals
    from rlkit.algorithms.objectives import ValueRegression

    cfg, _ = make_cfg("algorithm=ppo", "algorithm.prompts_per_step=128", "policy.train_global_batch_size=128",
                      "policy.micro_batch_size=4", "algorithm.critic.lr=1e-3")
    critic = model_workers.start(cfg, tiny_qwen2, head="value")
    g = torch.Generator().manual_seed(0)
    batch = Batch({"input_ids": torch.randint(0, 300, (8, 10), generator=g), "response_mask": torch.ones(8, 10)})
    values = critic.logprobs(batch)  # the critic's head: token-aligned values
    assert values.shape == (8, 10) and values.abs().max().item() == 0.0
    returns = torch.linspace(-1, 1, 8).unsqueeze(1).expand(8, 10).contiguous()
    batch = batch.with_fields(returns=returns, old_values=values)
    losses = [critic.train(batch, batch_totals(batch["response_mask"]), ValueRegression(0.0, "token-mean"))["loss"]
              for _ in range(30)]
    assert losses[-1] < 0.3 * losses[0], losses
