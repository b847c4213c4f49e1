"""`ray job submit -- rlkit train ...` to a running cluster of two Ray nodes: a head on 127.0.0.2
(with Ray's dashboard, whose job API takes the submission) and a worker node on 127.0.0.3, each
started with `ray start`, one CPU each and Ray's token authentication on (benchmarks/link.py). The
job joins that cluster rather than starting one; disaggregated placement puts the policy on one node
and the generation worker on the other, so every step's refit crosses nodes through the CPU
transport, its buckets checksummed on both sides."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import unused_ports

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from link import NODES, token_env, two_local_nodes  # noqa: E402

pytestmark = pytest.mark.integration

HEAD, WORKER = NODES
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture
def two_nodes(tmp_path):
    """The cluster's job API address and the environment (its token) that reaches it."""
    env = token_env()
    env.pop("RAY_ADDRESS", None)
    ports = unused_ports("127.0.0.1", 3)  # unused on every loopback address: below Linux's ephemeral range
    with two_local_nodes(env, tmp_path, dashboard_ports=ports):
        address, deadline = f"http://{HEAD}:{ports[0]}", time.monotonic() + 120
        while subprocess.run([RAY, "job", "list", "--address", address], env=env, capture_output=True).returncode:
            assert time.monotonic() < deadline, "the head's dashboard did not answer:\n" + \
                (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(1)
        yield address, env


def test_a_submitted_job_joins_the_cluster_and_refits_across_its_two_nodes(two_nodes, cache_dir, tmp_path):
    address, env = two_nodes
    command = [RAY, "job", "submit", "--address", address, "--", sys.executable, "-m", "rlkit.cli", "train",
               "--config-name", "grpo_tiny_cpu", "cluster.placement=disaggregated", "policy.num_workers=1",
               "generation.num_workers=1", "algorithm.num_steps=2", "algorithm.val_every=2",
               "algorithm.warm_start.sft_steps=0", "checkpoint.every=0", f"run.cache_dir={cache_dir}",
               f"run.output_dir={tmp_path}", "run.name=two_nodes"]
    for _ in range(30):  # the head's job agent starts a little after its dashboard answers
        submitted = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if "No available agent" not in submitted.stderr:
            break
        time.sleep(2)
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    job_id = next(line.split("'")[1] for line in submitted.stdout.splitlines() if "submitted successfully" in line)
    logs = subprocess.run([RAY, "job", "logs", "--address", address, job_id], env=env, capture_output=True,
                          text=True, timeout=120).stdout
    assert "joining Ray cluster" in logs, logs[-3000:]  # it used the running cluster, not a new local one
    assert "step   2/2" in logs and "done: val/reward" in logs, logs[-3000:]
    # the worker node may take a moment to join: the run waits for the placement group
    assert f"nodes: policy ranks on {HEAD}; generation workers on {WORKER}" in logs \
        or f"nodes: policy ranks on {WORKER}; generation workers on {HEAD}" in logs, logs[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "two_nodes" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["step"] >= 1] == [1, 2]
    # the first weights, and those step 1 trained (for step 2's rollout), crossed to the other node
    assert [m["step"] for m in metrics if "timing/refit_transfer" in m] == [0, 2]
