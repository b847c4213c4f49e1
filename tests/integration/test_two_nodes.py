"""A run across two Ray nodes: a head on 127.0.0.2 and a worker node on 127.0.0.3, each started
with `ray start` and one CPU (benchmarks/link.py), so disaggregated placement puts the policy on one node and the
generation worker on the other. Every step's refit crosses nodes through the CPU transport, its
buckets checksummed on both sides."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from link import NODES, token_env, two_local_nodes  # noqa: E402

pytestmark = pytest.mark.integration

HEAD, WORKER = NODES


@pytest.fixture
def two_nodes(tmp_path):
    env = token_env()
    with two_local_nodes(env, tmp_path) as address:
        yield address, env


def test_a_run_refits_across_two_nodes(two_nodes, cache_dir, tmp_path):
    address, env = two_nodes
    command = [sys.executable, "-m", "rlkit.cli", "train", "--config-name", "grpo_tiny_cpu",
               f"cluster.address={address}", "cluster.placement=disaggregated", "policy.num_workers=1",
               "generation.num_workers=1", "algorithm.num_steps=2", "algorithm.val_every=1000",
               "algorithm.warm_start.sft_steps=0", "checkpoint.every=0", f"run.cache_dir={cache_dir}",
               f"run.output_dir={tmp_path}", "run.name=two_nodes"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    # the worker node may take a moment to join: the run waits for the placement group
    assert f"nodes: policy ranks on {HEAD}; generation workers on {WORKER}" in run.stderr \
        or f"nodes: policy ranks on {WORKER}; generation workers on {HEAD}" in run.stderr, run.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "two_nodes" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["step"] >= 1] == [1, 2]
    # the first weights, and those step 1 trained (for step 2's rollout), crossed to the other node
    assert [m["step"] for m in metrics if "timing/refit_transfer" in m] == [0, 2]
