"""SmolLM2-135M-Instruct as a run's policy on CPU. Its own module so that test_pretrained.py's
TP=3 workers are shut down (module teardown) before this run asks the session cluster for room."""

import math

import pytest

pytestmark = pytest.mark.integration


def test_a_grpo_step_on_word_problems(warm_pool, make_cfg, smollm2):
    """The pretrained model as a run's policy: chat-templated GSM8K-format prompts, math-verify
    rewards, validation before and after a GRPO step, refit into the HF worker. fp32 on CPU, so the
    sampler's and the trainer's logprobs agree to float noise. One policy rank and one generation
    worker, one prompt of two samples, no checkpoint: the layouts, group sizes and
    checkpoints are proven on the tiny models, this test proves the 135M model's path (on 2 cores,
    its training step takes about 2 s per sampled answer)."""
    from rlkit.launch.run import train

    cfg, resolved = make_cfg(f"policy.model_path={smollm2}", "data=word_problems", "env=math",
                             "data.synthetic.train_size=32", "data.synthetic.val_size=2",
                             "algorithm.num_steps=1", "algorithm.val_every=1", "algorithm.prompts_per_step=1",
                             "algorithm.group_size=2", "policy.num_workers=1", "generation.num_workers=1",
                             "policy.train_global_batch_size=2", "policy.micro_batch_size=2",
                             "generation.max_new_tokens=24", "env_runner.max_total_tokens=24",
                             "checkpoint.enabled=false", "run.name=smollm2_grpo")
    result = train(cfg, resolved, pool=warm_pool)
    history = result.history
    assert not (result.run_dir / "checkpoints").exists()  # checkpoint.enabled=false: not even the last step's
    assert len(history) == 2 and "val/accuracy" in history[0] and "val/accuracy" in history[1]
    metrics = history[1]
    assert all(math.isfinite(metrics[k]) for k in ["train/reward", "train/loss", "train/grad_norm"])
    # a pretrained model's entropy, not a random one's (log 49152 = 10.8)
    assert metrics["train/entropy"] < 3.0
    assert metrics["refit/token_mult_prob_error"] < 1.001
