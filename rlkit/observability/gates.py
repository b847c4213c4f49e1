"""Metric gates: thresholds a run's metrics must meet, checked over its history (metrics.jsonl).
The GPU tests gate themselves with them; a user can gate a run of their own:

    python -m rlkit.observability.gates outputs/<run>/metrics.jsonl tests/gpu/gates/smollm2_grpo.yaml
"""

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import MISSING, OmegaConf


@dataclass
class StepTimeGate:
    last_steps: int = MISSING
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class MetricGates:
    reward_rises_over: Optional[int] = MISSING
    max_token_mult_prob_error: Optional[float] = MISSING
    max_clip_fraction: Optional[float] = MISSING
    importance_ratio_within: Optional[float] = MISSING
    first_step_reference_kl: Optional[float] = MISSING
    step_time: Optional[StepTimeGate] = MISSING


@dataclass(frozen=True)
class Verdict:
    gate: str
    passed: Optional[bool]  # None: not applicable here (e.g. no step-time bound for this machine)
    detail: str

    def __str__(self) -> str:
        mark = {True: "PASS", False: "FAIL", None: "skip"}[self.passed]
        return f"{mark} {self.gate}: {self.detail}"


def load_gates(path: str | Path) -> MetricGates:
    """The gates of a YAML file; an unknown or missing key is an error naming it."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MetricGates), OmegaConf.load(path)))


def check(history: list[dict], gates: MetricGates, machine: str) -> list[Verdict]:
    """One verdict per gate that is set, over the training steps (step >= 1) of `history`."""
    steps = [m for m in history if m["step"] >= 1 and "train/reward" in m]
    if not steps:
        return [Verdict("history", False, "no training step in the metrics")]
    verdicts = []

    def gate(name: str, key: str, judge):
        """judge(values per step) -> (passed, detail), when every step has the metric."""
        lacking = [m["step"] for m in steps if key not in m]
        verdicts.append(Verdict(name, False, f"{key} missing at steps {lacking[:5]}" + ("..." if len(lacking) > 5 else "")) if lacking
                        else Verdict(name, *judge([m[key] for m in steps])))

    def worst(values, badness):
        k = max(range(len(values)), key=lambda i: badness(values[i]))
        return values[k], steps[k]["step"]

    if gates.reward_rises_over is not None:
        n = gates.reward_rises_over
        gate("reward rises", "train/reward", lambda v: (
            statistics.mean(v[-n:]) > statistics.mean(v[:n]),
            f"mean train/reward of the first {n} steps {statistics.mean(v[:n]):.4f}, of the last {n} "
            f"{statistics.mean(v[-n:]):.4f}"))
    for name, key, bound, badness in [
            ("train-vs-generation", "refit/token_mult_prob_error", gates.max_token_mult_prob_error, lambda x: x),
            ("clipped ratios", "train/clip_fraction", gates.max_clip_fraction, lambda x: x),
            ("importance ratio", "train/importance_ratio", gates.importance_ratio_within, lambda x: abs(x - 1))]:
        if bound is not None:
            gate(name, key, lambda v, key=key, bound=bound, badness=badness: (
                badness(worst(v, badness)[0]) <= bound,
                f"{key} worst {worst(v, badness)[0]:.5f} (step {worst(v, badness)[1]}), bound {bound}"
                + (" from 1" if key == "train/importance_ratio" else "")))
    if gates.first_step_reference_kl is not None:
        gate("reference is the start", "train/reference_kl", lambda v: (
            abs(v[0]) <= gates.first_step_reference_kl,
            f"train/reference_kl at step {steps[0]['step']}: {v[0]}, bound {gates.first_step_reference_kl}"))
    if gates.step_time is not None:
        n, bound = gates.step_time.last_steps, gates.step_time.seconds.get(machine)
        gate("step time", "timing/step", lambda v: (
            None if bound is None else statistics.mean(v[-n:]) <= bound,
            f"mean timing/step of the last {n} steps {statistics.mean(v[-n:]):.2f} s on {machine!r}, bound "
            + (f"{bound} s" if bound is not None else "none recorded for this machine")))
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="check a run's metrics.jsonl against metric gates")
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("gates", help="a gates YAML file, e.g. tests/gpu/gates/smollm2_grpo.yaml")
    parser.add_argument("--machine", default="", help="the machine's name as the gates' step_time.seconds has it")
    args = parser.parse_args(argv)
    history = [json.loads(line) for line in Path(args.metrics).read_text().splitlines()]
    verdicts = check(history, load_gates(args.gates), args.machine)
    print("\n".join(map(str, verdicts)))
    return 1 if any(v.passed is False for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
