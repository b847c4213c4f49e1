"""Reward models (rlkit/algorithms/reward_model.py): the Bradley-Terry loss against hand-computed
values, the objective that reads each row's reward where its mask is 1, the rows the trainer builds
(read after the last token that is not the pad token, as HF reads it), the per-row margin, and the
config errors a reward-model recipe can meet, each one line naming its key and fix."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlkit.algorithms.losses import bradley_terry_loss
from rlkit.algorithms.objectives import BradleyTerry
from rlkit.algorithms.registry import load_algorithm
from rlkit.algorithms.reward_model import Pair, check_exportable, tokenize_pair
from rlkit.algorithms.reward_model_trainer import RewardModelTrainer
from rlkit.config.schema import ConfigError
from rlkit.data.batch import Batch, BatchTotals
from rlkit.launch.config import load_config
from rlkit.models.tiny import build_tokenizer

RECIPE = "reward_model_tiny_cpu"
LORA = "policy.peft={type: lora, rank: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, v_proj]}"


def test_bradley_terry_loss_matches_hand_computed_values():
    """-log sigmoid(r_c - r_r - m) = log(1 + exp(-(r_c - r_r - m))): pair 1 has a gap of 1 and no
    margin, pair 2 a gap of -1 and a margin of 0.5, pair 3 a tie."""
    chosen, rejected = torch.tensor([2.0, 0.5, 0.3], requires_grad=True), torch.tensor([1.0, 1.5, 0.3])
    loss, metrics = bradley_terry_loss(chosen, rejected, torch.tensor([0.0, 0.5, 0.0]))
    expected = [math.log(1 + math.exp(-1.0)), math.log(1 + math.exp(1.5)), math.log(2.0)]
    assert loss.tolist() == pytest.approx(expected, abs=1e-6)  # 0.3133, 1.7014, 0.6931
    assert metrics["accuracy"].tolist() == [1.0, 0.0, 0.0]  # a tie is no correct preference
    assert metrics["reward_margin"].tolist() == pytest.approx([1.0, -1.0, 0.0])
    assert metrics["reward_chosen"].tolist() == pytest.approx([2.0, 0.5, 0.3])
    assert metrics["reward_rejected"].tolist() == pytest.approx([1.0, 1.5, 0.3])
    loss.sum().backward()
    # d/dr_c = -sigmoid(-(gap - m)): a wider gap pulls less
    assert chosen.grad.tolist() == pytest.approx([-1 / (1 + math.e), -1 / (1 + math.exp(-1.5)), -0.5], abs=1e-6)


def test_the_objective_reads_each_rows_reward_at_its_mask_and_skips_filler_pairs():
    """Rows chosen, rejected, chosen, rejected, then an all-padding pair: the rewards are the values
    where the mask is 1, the loss the mean over the two real pairs (totals.num_sequences)."""
    values = torch.tensor([[9.0, 2.0, 9.0], [9.0, 1.0, 9.0], [0.5, 9.0, 9.0], [1.5, 9.0, 9.0], [9.0, 9.0, 9.0],
                           [9.0, 9.0, 9.0]])
    mask = torch.zeros(6, 3)
    mask[0, 1] = mask[1, 1] = mask[2, 0] = mask[3, 0] = 1
    batch = Batch({"loss_mask": mask, "margins": torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0])})
    loss, sums = BradleyTerry()(values, batch, BatchTotals(num_tokens=4.0, num_sequences=2.0))
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1.0)) + math.log(1 + math.exp(1.5))) / 2, abs=1e-6)
    assert sums["accuracy"].item() == 1.0 and sums["reward_margin"].item() == pytest.approx(0.0)
    assert sums["reward_chosen"].item() == pytest.approx(2.5) and sums["reward_rejected"].item() == pytest.approx(2.5)
    assert BradleyTerry().fields == ("loss_mask", "margins")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_rows_read_each_reward_after_its_last_token_that_is_not_the_pad_token(tokenizer):
    cfg, _ = load_config(RECIPE, ["data.max_length=5", "policy.micro_batch_size=4"])
    pad = tokenizer.pad_token_id
    trainer = RewardModelTrainer(SimpleNamespace(
        cfg=cfg, tokenizer=tokenizer, data=SimpleNamespace(val=[]),
        workers=SimpleNamespace(policy=SimpleNamespace(layout=SimpleNamespace(dp_size=2)))))
    # the second's pad tokens end it (a model whose pad token is EOS); the third is cut to data.max_length
    pairs = [Pair([5, 6, 7], [1, 1, 1], [5, 6], [1, 1], 0.0), Pair([5, 6, pad, pad], [1] * 4, [8], [1], 2.0),
             Pair([1, 2, 3, 4, 5, 6, 7], [1] * 7, [9, 9], [1, 1], 0.5)]
    rows, totals = trainer.rows(pairs)
    assert len(rows) == 8 and totals == BatchTotals(num_tokens=6.0, num_sequences=3.0)  # a filler pair: DP x 4 rows
    assert rows["loss_mask"].argmax(dim=1).tolist()[:6] == [3, 2, 2, 1, 5, 2]
    assert rows["loss_mask"].sum(dim=1).tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    assert rows["input_ids"][4].tolist() == [1, 2, 3, 4, 5, pad]
    assert rows["input_ids"][2].tolist() == [5, 6, pad, pad, pad, pad]
    assert rows["margins"].tolist() == [0.0, 0.0, 2.0, 2.0, 0.5, 0.5, 0.0, 0.0]


def test_a_rows_margin_replaces_the_configs_and_a_bad_one_names_the_row(tokenizer):
    row = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}
    assert tokenize_pair(tokenizer, 0.25, row, "f row 0", 64).margin == 0.25
    assert tokenize_pair(tokenizer, 0.25, {**row, "margin": 2}, "f row 0", 64).margin == 2.0
    for bad in ["2", -1.0, float("nan"), True]:
        with pytest.raises(ValueError, match=r"^f row 3: 'margin' must be a finite number >= 0 \(got: "):
            tokenize_pair(tokenizer, 0.0, {**row, "margin": bad}, "f row 3", 64)


def test_the_algorithm_trains_a_reward_head_on_preference_files():
    cfg, _ = load_config(RECIPE, [])
    spec = load_algorithm("reward_model")
    assert type(cfg.algorithm) is spec.config and spec.head == "reward" and spec.data == "preference_files"
    assert not spec.rollouts and not spec.critic and cfg.generation is None


# (id, overrides, offending key, fragments of the message (problem and fix), overrides that fix it)
ERRORS = [
    ("prompt-data", ["data=arithmetic"], "data.name",
     ["trains on data of kind 'preference_files'", "(got: 'prompts')", "data=arithmetic_preferences"], []),
    ("generation-section", ["+generation=hf"], "generation",
     ["generates no rollouts", "remove /generation"], []),
    ("env-section", ["+env=arithmetic"], "env", ["generates no rollouts", "remove /env"], []),
    ("negative-margin", ["algorithm.margin=-0.5"], "algorithm.margin", ["must be >= 0", "(got: -0.5)"],
     ["algorithm.margin=0.5"]),
    ("infinite-margin", ["algorithm.margin=inf"], "algorithm.margin", ["finite"], ["algorithm.margin=1.0"]),
    ("lora", ["policy.bridge=megatron_bridge", LORA], "policy.peft", ["scalar head", "policy.peft=null"],
     ["policy.bridge=megatron_bridge"]),
    ("hf-checkpoints", ["checkpoint.save_format=hf"], "checkpoint.save_format",
     ["checkpoint.save_format=dist", "rlkit convert"], ["checkpoint.save_format=dist"]),
    ("odd-micro-batch", ["policy.micro_batch_size=3", "policy.train_global_batch_size=48",
                         "algorithm.warm_start.batch_size=48"],
     "policy.micro_batch_size", ["a reward model keeps each chosen/rejected pair", "must be even", "(got: 3)"],
     ["policy.micro_batch_size=4", "policy.train_global_batch_size=48", "algorithm.warm_start.batch_size=48"]),
    ("token-budget", ["policy.max_tokens_per_microbatch=256"], "policy.max_tokens_per_microbatch",
     ["a token budget would split", "set it to 0"], ["policy.max_tokens_per_microbatch=0"]),
    ("warm-start-steps", ["algorithm.warm_start.sft_steps=-1"], "algorithm.warm_start.sft_steps",
     ["must be >= 0"], ["algorithm.warm_start.sft_steps=0"]),
]


@pytest.mark.parametrize("overrides, key, fragments, fixed", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_config_errors_name_the_key_and_the_fix(overrides, key, fragments, fixed):
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, overrides)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}: "), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message!r}"
    load_config(RECIPE, fixed)  # the fix the message points at loads


def test_an_architecture_without_an_hf_sequence_classifier_is_refused_before_any_worker():
    cfg, _ = load_config(RECIPE, ["policy.model_path=tiny://glm4_moe"])
    with pytest.raises(ConfigError, match=r"^policy.model_path: a reward model is exported as an HF sequence "
                                          r"classifier, which transformers has none of for glm4_moe models"):
        check_exportable(cfg)
    check_exportable(load_config(RECIPE, [])[0])
