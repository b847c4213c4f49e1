"""A reward model (reward_model_tiny_cpu, shortened) on the tiny CPU model: its pair accuracy
rises; a run killed with SIGKILL past a checkpoint and started again has exactly the metrics of
the same run uninterrupted; and `rlkit convert` exports its last checkpoint as an HF sequence
classifier that AutoModelForSequenceClassification loads and that scores each validation row as
rlkit's model does (fp32, 1e-5). The pairs and the warm start are dpo_tiny_cpu's (test_algorithms.py
trains that warm start: cached in the session's cache)."""

import types

import pytest
import torch
from run_metrics import last_logged_step
from test_checkpoint import kill_when, run_in_process, train_command
from transformers import AutoModelForSequenceClassification

from rlkit.algorithms.loop import RunContext
from rlkit.algorithms.registry import load_algorithm
from rlkit.algorithms.reward_model_trainer import RewardModelTrainer
from rlkit.cluster.groups import ModelWorkers
from rlkit.cluster.setup import model_worker_args
from rlkit.cluster.worker_group import free_address
from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config
from rlkit.launch.convert import REWARD_MODEL, export_hf
from rlkit.launch.evaluate import plan_eval
from rlkit.models.resolve import resolve_model_dir
from rlkit.models.tokenizer import load_tokenizer
from rlkit.workers.policy.megatron import MegatronModelWorker as Model

pytestmark = pytest.mark.integration
RECIPE = "reward_model_tiny_cpu"
# at a constant rate the first steps are the same whatever algorithm.num_steps: a resumed run may stop early
RUN = ("algorithm.num_steps=100", "algorithm.val_every=50", "data=arithmetic_preferences",
       "algorithm.warm_start.sft_steps=200", "policy.optimizer.lr_schedule=constant", "logger.plots=false")


def rlkit_rewards(warm_pool, cfg, checkpoint, tokenizer, val) -> tuple:
    """The validation rows as the trainer builds them, and each real row's reward from the reward
    model rebuilt on the session's pooled workers and loaded from the checkpoint."""
    args = model_worker_args(cfg, cfg.policy, str(resolve_model_dir(cfg)), "reward")
    group = warm_pool.take("policy", Model, cfg.policy.bridge, args, cfg.policy.num_workers, cfg.cluster.call_timeout_s)
    try:
        group.every_rank(Model.setup, *free_address())  # the session's one node is this process's
        policy = ModelWorkers(group)
        policy.load_checkpoint(str(checkpoint), "dist")
        ctx = RunContext(cfg, load_algorithm("reward_model"), types.SimpleNamespace(policy=policy), tokenizer,
                         types.SimpleNamespace(val=val), checkpoint)
        rows, _ = RewardModelTrainer(ctx).rows(val)
        values = policy.logprobs(rows.select("input_ids", "loss_mask"))
    finally:
        warm_pool.give_back(group)
    real = 2 * len(val)
    return rows.slice(0, real), (values * rows["loss_mask"]).sum(dim=1)[:real]


def test_a_reward_model_learns_resumes_exactly_after_sigkill_and_exports_for_hf(warm_pool, cache_dir,
                                                                              tmp_path_factory):
    uninterrupted = tmp_path_factory.mktemp("rm_uninterrupted")
    reference = run_in_process(warm_pool, RECIPE, uninterrupted, cache_dir, run=(*RUN, "checkpoint.every=0"))
    # at step 0 every reward is 0 (the head starts at zero): no pair is ordered yet
    assert reference[0]["val/preference_accuracy"] == 0.0 and reference[0]["val/loss"] == pytest.approx(0.6931, 1e-4)
    first, last = (sum(reference[s]["train/preference_accuracy"] for s in steps) / 20
                   for steps in (range(1, 21), range(81, 101)))
    assert last > first + 0.1 and reference[100]["val/preference_accuracy"] > 0.6, (first, last, reference[100])
    assert reference[100]["val/loss"] < 0.69 and reference[100]["val/reward_margin"] > 0

    killed = tmp_path_factory.mktemp("rm_killed")
    run_dir = killed / RECIPE
    kill_when(train_command(killed, cache_dir, recipe=RECIPE, run=(*RUN, "checkpoint.every=3")),
              lambda: last_logged_step(run_dir) >= 5, "after step 5", killed / "run.log")
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000003"]
    resumed = run_in_process(warm_pool, RECIPE, killed, cache_dir, run=(*RUN, "checkpoint.every=3",
                                                                      "algorithm.num_steps=9"))
    assert {step: resumed[step] for step in range(9)} == {step: reference[step] for step in range(9)}
    assert {k: v for k, v in resumed[9].items() if not k.startswith("val/")} == reference[9]  # its last validates

    last_checkpoint = uninterrupted / RECIPE / "checkpoints" / "step_000100"
    with pytest.raises(ConfigError, match="holds a reward model .*; export it with rlkit convert"):
        plan_eval(str(last_checkpoint), "grpo_tiny_cpu", [], None, None, None, None)
    out = killed / "hf_reward_model"
    exported = export_hf(last_checkpoint, out, pool=warm_pool)
    assert exported.kind == REWARD_MODEL and exported.path == out
    tokenizer = load_tokenizer(out)
    hf_model, loading = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32,
                                                                           output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading  # every weight, each named
    hf_model.eval()
    assert type(hf_model).__name__ == "Qwen2ForSequenceClassification" and hf_model.config.num_labels == 1
    assert hf_model.config.pad_token_id == tokenizer.pad_token_id and hf_model.score.bias is None

    cfg, _ = load_config(RECIPE, [*RUN, f"run.output_dir={uninterrupted}", f"run.cache_dir={cache_dir}"])
    val = load_algorithm("reward_model").load_data(cfg, tokenizer).val
    rows, rewards = rlkit_rewards(warm_pool, cfg, last_checkpoint, tokenizer, val)
    with torch.no_grad():  # HF reads each row at its last token that is not the pad token
        scores = hf_model(input_ids=rows["input_ids"]).logits[:, 0]
    assert (scores - rewards).abs().max().item() < 1e-5
    # the run's last validation read the same weights: its mean rewards are these
    assert scores[0::2].mean().item() == pytest.approx(reference[100]["val/reward_chosen"], abs=1e-5)
    assert scores[1::2].mean().item() == pytest.approx(reference[100]["val/reward_rejected"], abs=1e-5)
