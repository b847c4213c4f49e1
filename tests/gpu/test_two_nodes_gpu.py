"""Two Ray nodes on one GPU host, as two machines would be: a head on 127.0.0.2 holding GPU 0 and a
worker node on 127.0.0.3 holding GPU 1, each seeing only its own GPU. A disaggregated GRPO run
joins that cluster: the policy lands on one node and the vLLM engine on the other, and every
refit goes over NCCL between the two node addresses (refit.channel_host=node_ip)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from link import NODES, token_env, two_local_nodes  # noqa: E402

HEAD, WORKER = NODES


@pytest.mark.gpus(2)
def test_a_disaggregated_run_refits_over_nccl_between_two_nodes(tmp_path):
    env = token_env()
    env.pop("RAY_ADDRESS", None)
    with two_local_nodes(env, tmp_path, cpus_per_node=4, gpus_per_node=1) as address:
        run = subprocess.run(
            [sys.executable, "-m", "rlkit.cli", "train", "--config-name", "grpo_tiny_gpu", f"cluster.address={address}",
             "cluster.placement=disaggregated", "refit=nccl", "refit.channel_host=node_ip", "algorithm.num_steps=2",
             "algorithm.val_every=2", "algorithm.warm_start.sft_steps=0", "checkpoint.every=0",
             "cluster.call_timeout_s=300", f"run.cache_dir={tmp_path / 'cache'}", f"run.output_dir={tmp_path}",
             "run.name=two_nodes"], env=env, capture_output=True, text=True, timeout=900)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "joining Ray cluster" in log, log[-3000:]
    assert (f"nodes: policy ranks on {HEAD}; generation workers on {WORKER}" in log
            or f"nodes: policy ranks on {WORKER}; generation workers on {HEAD}" in log), log[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "two_nodes" / "metrics.jsonl").read_text().splitlines()]
    refits = [m for m in metrics if "timing/refit_transfer" in m]
    assert [m["step"] for m in refits] == [0, 2]  # the first weights and step 1's, each across the nodes
    assert all(m["refit/bytes"] > 0 for m in refits)
    assert all(m["refit/token_mult_prob_error"] <= 1.05 for m in metrics if "refit/token_mult_prob_error" in m)
