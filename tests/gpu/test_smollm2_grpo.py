"""The pretrained recipe, short: SmolLM2-135M-Instruct (materialized from its PyPI wheel) learning
GSM8K-format word problems with GRPO and colocated vLLM, gated by its metrics
(gates/smollm2_grpo.yaml): the reward rises, the sampler's and the trainer's logprobs stay within
the bound at every step, importance ratios stay near 1 and are rarely clipped, the reference is the
starting policy (KL 0 at step 1), and the step time is within the bound recorded for the machine."""

import os
import shutil

import pytest
import torch

from rlkit.launch.config import load_config
from rlkit.launch.run import train
from rlkit.models.pretrained import smollm2_135m_instruct
from rlkit.observability.gates import check, load_gates


# measured on one H100: about 100 s to materialize the model and start, then about 15 s a step
@pytest.mark.timeout(480)
def test_smollm2_grpo_passes_its_gates(ray_cluster, tmp_path):
    smollm2_135m_instruct(tmp_path)  # the recipe reads it from run.cache_dir/models
    cfg, resolved = load_config("grpo_smollm2_gpu", [
        f"run.cache_dir={tmp_path}", f"run.output_dir={tmp_path / 'outputs'}", "algorithm.num_steps=12",
        "algorithm.val_every=12", "checkpoint.every=0", "cluster.call_timeout_s=180",
        "cluster.collective_timeout_s=180", "algorithm.kl_coef=0.001"])
    result = train(cfg, resolved)
    if os.environ.get("RLKIT_TEST_METRICS"):  # the GPU session brings the metrics back
        os.makedirs(os.environ["RLKIT_TEST_METRICS"], exist_ok=True)
        shutil.copy(result.run_dir / "metrics.jsonl", os.path.join(os.environ["RLKIT_TEST_METRICS"], "smollm2_grpo.jsonl"))
    print("train reward per step:", ", ".join(f"{m['train/reward']:.3f}" for m in result.history[1:]))
    verdicts = check(result.history, load_gates(os.path.join(os.path.dirname(__file__), "gates", "smollm2_grpo.yaml")),
                     torch.cuda.get_device_name())
    print("\n".join(map(str, verdicts)))
    assert not [v for v in verdicts if v.passed is False]
