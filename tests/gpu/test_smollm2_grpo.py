"""The pretrained recipe, short: SmolLM2-135M-Instruct (materialized from its PyPI wheel) learning
GSM8K-format word problems with GRPO and colocated vLLM. The reward rises and the sampler's and
the trainer's logprobs stay within the bound at every step."""

import statistics

import pytest

from rlkit.launch.config import load_config
from rlkit.launch.run import train
from rlkit.models.pretrained import smollm2_135m_instruct


# measured on one H100: about 100 s to materialize the model and start, then about 15 s a step
@pytest.mark.timeout(480)
def test_smollm2_grpo_reward_rises(ray_cluster, tmp_path):
    smollm2_135m_instruct(tmp_path)  # the recipe reads it from run.cache_dir/models
    cfg, resolved = load_config("grpo_smollm2_gpu", [
        f"run.cache_dir={tmp_path}", f"run.output_dir={tmp_path / 'outputs'}", "algorithm.num_steps=12",
        "algorithm.val_every=12", "checkpoint.every=0", "cluster.call_timeout_s=180",
        "cluster.collective_timeout_s=180"])
    history = train(cfg, resolved).history
    rewards = [m["train/reward"] for m in history[1:]]
    print("train reward per step:", ", ".join(f"{r:.3f}" for r in rewards))
    assert statistics.mean(rewards[-4:]) > statistics.mean(rewards[:4])
    assert all(m["refit/token_mult_prob_error"] <= 1.05 for m in history[1:])
