"""A run across two Ray nodes: a head on 127.0.0.2 and a worker node on 127.0.0.3, each started
with `ray start` and one CPU, so disaggregated placement puts the policy on one node and the
generation worker on the other. Every step's refit crosses nodes through the CPU transport, its
buckets checksummed on both sides."""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ports import unused_ports

pytestmark = pytest.mark.integration

HEAD, WORKER = "127.0.0.2", "127.0.0.3"


def _stop(process: subprocess.Popen) -> None:
    """`ray start --block` leads its node's processes in a session of their own: end the group."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def two_nodes(tmp_path):
    ray_cli = str(Path(sys.executable).parent / "ray")
    # Ray's socket paths live under its temp dir and may not exceed 107 bytes: pytest's tmp_path is too deep
    ray_dir = tempfile.mkdtemp(prefix="rlkit-2n-", dir="/tmp")
    # Ray's token authentication, as a real cluster runs it: every process of this cluster holds the token
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    common = ["--block", "--num-cpus=1", "--disable-usage-stats"]
    nodes = []
    try:
        # a port can still be taken between the check and the head's bind: a head that exits is started
        # again on another port
        for attempt in range(3):
            [port] = unused_ports(HEAD)
            with open(tmp_path / "head.log", "w") as log:
                head = subprocess.Popen(
                    [ray_cli, "start", "--head", f"--node-ip-address={HEAD}", f"--port={port}",
                     "--include-dashboard=false", f"--temp-dir={ray_dir}", *common],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            nodes.append(head)
            deadline = time.monotonic() + 60
            while head.poll() is None and subprocess.run([ray_cli, "status", f"--address={HEAD}:{port}"],
                                                         capture_output=True, env=env).returncode:
                assert time.monotonic() < deadline, (tmp_path / "head.log").read_text()[-2000:]
                time.sleep(1)
            if head.poll() is None:
                break
            assert attempt < 2, (tmp_path / "head.log").read_text()[-2000:]
        with open(tmp_path / "worker.log", "w") as log:
            nodes.append(subprocess.Popen(
                [ray_cli, "start", f"--address={HEAD}:{port}", f"--node-ip-address={WORKER}", *common],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        yield f"{HEAD}:{port}", env
    finally:
        for node in reversed(nodes):
            _stop(node)
        shutil.rmtree(ray_dir, ignore_errors=True)


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
