"""Three GRPO steps end to end on a real local Ray cluster, in both placements, on workers the
run starts itself (conftest.grpo_on_new_workers)."""

import json
import math

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_three_grpo_steps(grpo_on_new_workers, placement):
    result = grpo_on_new_workers(placement)
    assert len(result.history) == 4  # validation before training + 3 steps
    for metrics in result.history[1:]:
        for key in ["train/reward", "train/accuracy", "train/response_length", "train/clip_fraction", "train/kl",
                    "train/entropy", "train/grad_norm", "refit/token_mult_prob_error", "timing/generate",
                    "timing/reward", "timing/logprobs", "timing/train", "timing/refit"]:
            assert key in metrics and math.isfinite(metrics[key]), key
        tokens = {}
        for phase in ["generate", "logprobs", "train"]:
            per_s = metrics[f"timing/{phase}_tokens_per_s"]
            assert math.isfinite(per_s) and per_s > 0, phase
            tokens[phase] = per_s * metrics[f"timing/{phase}"]
        assert tokens["generate"] == pytest.approx(32 * metrics["train/response_length"])  # sampled, no padding
        assert tokens["logprobs"] == pytest.approx(2 * tokens["train"])  # the policy and the KL reference
        # on CPU there is no peak to divide by, and no GPU memory
        assert not [k for k in metrics if k.endswith("_mfu") or k.startswith("memory/")]
        # the generation workers hold exactly the policy's weights: logprobs agree to float noise
        assert metrics["refit/logprob_abs_error_max"] < 1e-4
    assert "val/accuracy" in result.history[2] and "val/accuracy" in result.history[3]
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]
    # where the start-up went, once, in the first row: the driver's phases and each group's parts
    startup = {k.removeprefix("timing/startup/"): v for k, v in result.history[0].items()
               if k.startswith("timing/startup/")}
    assert not [k for m in result.history[1:] for k in m if k.startswith("timing/startup/")]
    for phase in ["model_tokenizer_data", "ray", "generation_workers", "policy_workers",
                  "trainer_setup", "validation", "policy_workers/megatron_imports", "policy_workers/build",
                  "policy_workers/hf_load", "generation_workers/build"]:
        assert 0 < startup[phase] < startup["total"], phase
    # the tokenizer and data load while Ray starts
    driver = max(startup["model_tokenizer_data"], startup["ray"]) + sum(
        startup[p] for p in ["generation_workers", "policy_workers", "trainer_setup", "validation"])
    assert driver <= startup["total"] < driver + 10
