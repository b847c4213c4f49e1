"""Metric gates: a healthy history passes every gate, and each gate fails on the fault it is for."""

import json

import pytest
from omegaconf.errors import ConfigKeyError

from rlkit.observability.gates import MetricGates, StepTimeGate, check, load_gates, main

MACHINE = "NVIDIA H100 80GB HBM3"
GATES = MetricGates(reward_rises_over=2, max_token_mult_prob_error=1.05, max_clip_fraction=0.05,
                    importance_ratio_within=0.05, first_step_reference_kl=0.0,
                    step_time=StepTimeGate(last_steps=2, seconds={MACHINE: 20.0}))


def healthy() -> list[dict]:
    history = [{"step": 0, "val/reward": 0.1, "timing/step": 30.0}]
    for step in range(1, 7):
        history.append({"step": step, "train/reward": 0.1 * step, "refit/token_mult_prob_error": 1.02,
                        "train/clip_fraction": 0.004, "train/importance_ratio": 1.001,
                        "train/reference_kl": 0.0 if step == 1 else 0.002, "timing/step": 15.0})
    return history


def test_a_healthy_run_passes_every_gate():
    verdicts = check(healthy(), GATES, MACHINE)
    assert [v.passed for v in verdicts] == [True] * 6, "\n".join(map(str, verdicts))


@pytest.mark.parametrize("gate, step, key, value", [
    ("reward rises", None, "train/reward", 0.5),
    ("train-vs-generation", 4, "refit/token_mult_prob_error", 1.06),
    ("clipped ratios", 2, "train/clip_fraction", 0.3),
    ("importance ratio", 5, "train/importance_ratio", 0.9),
    ("reference is the start", 1, "train/reference_kl", 1e-7),
    ("step time", 6, "timing/step", 40.0),
])
def test_each_gate_fails_on_its_fault(gate, step, key, value):
    history = healthy()
    for metrics in history[1:]:
        if step is None or metrics["step"] == step:
            metrics[key] = value
    failed = [v for v in check(history, GATES, MACHINE) if v.passed is False]
    assert [v.gate for v in failed] == [gate]
    assert key in failed[0].detail


def test_a_missing_metric_fails_its_gate_and_an_unknown_machine_skips_step_time():
    history = healthy()
    del history[3]["train/importance_ratio"]
    verdicts = {v.gate: v for v in check(history, GATES, "some other GPU")}
    assert verdicts["importance ratio"].passed is False and "missing at steps [3]" in verdicts["importance ratio"].detail
    assert verdicts["step time"].passed is None and "none recorded" in verdicts["step time"].detail


def test_gate_files_load_and_unknown_keys_are_errors(tmp_path):
    gates = load_gates("tests/gpu/gates/smollm2_grpo.yaml")
    assert gates.max_token_mult_prob_error == 1.05 and gates.step_time.seconds[MACHINE] > 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("reward_rises_over: 4\nmax_token_mult_prob_eror: 1.05\n")
    with pytest.raises(ConfigKeyError, match="max_token_mult_prob_eror"):
        load_gates(bad)


def test_the_command_line_exits_nonzero_on_a_failed_gate(tmp_path, capsys):
    history = healthy()
    history[2]["refit/token_mult_prob_error"] = 1.2
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(m) + "\n" for m in history))
    assert main([str(metrics), "tests/gpu/gates/smollm2_grpo.yaml", "--machine", MACHINE]) == 1
    assert "FAIL train-vs-generation" in capsys.readouterr().out
