"""`ray job submit -- rlkit train ...` against a running cluster: the test starts `ray start
--head` on 127.0.0.1, submits a 2-step run, reads its logs, and stops the cluster by process group."""

import os
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
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture
def ray_head():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    gcs_port, dashboard_port, *others = unused_ports("127.0.0.1", 9)
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    # every port chosen unused, so this cluster never collides with another one on the machine
    agent_ports = [f"--{flag}={port}" for flag, port in zip((
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
        "ray-client-server-port", "node-manager-port", "object-manager-port"), others)]
    head = subprocess.Popen([RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                             f"--port={gcs_port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
                             *agent_ports, "--num-cpus=4", f"--temp-dir={temp_dir}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(f"{temp_dir}/start.log", "w"),
                            start_new_session=True)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 120
        while subprocess.run([RAY, "job", "list", "--address", address], env=env,
                             capture_output=True).returncode != 0:
            assert head.poll() is None and time.monotonic() < deadline, \
                "ray start --head did not come up:\n" + Path(f"{temp_dir}/start.log").read_text()[-3000:]
            time.sleep(1)
        yield address, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # the head and everything it started share its process group
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_runs_a_recipe(ray_head, tmp_path):
    address, env = ray_head
    command = [RAY, "job", "submit", "--address", address, "--", sys.executable, "-m", "rlkit.cli", "train",
               "--config-name", "grpo_tiny_cpu", "algorithm.num_steps=2", "algorithm.val_every=2",
               "algorithm.warm_start.sft_steps=2", "algorithm.prompts_per_step=8", "policy.train_global_batch_size=64",
               f"run.output_dir={tmp_path / 'out'}", f"run.cache_dir={tmp_path / 'cache'}"]
    for _ in range(30):  # the head's job agent starts a little after its dashboard answers
        submitted = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if "No available agent" not in submitted.stderr:
            break
        time.sleep(2)
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    job_id = next(line.split("'")[1] for line in submitted.stdout.splitlines() if "submitted successfully" in line)
    logs = subprocess.run([RAY, "job", "logs", "--address", address, job_id], env=env, capture_output=True,
                          text=True, timeout=120).stdout
    assert "joining Ray cluster" in logs  # it used the running cluster, not a new local one
    assert "step   2/2" in logs and "done: val/reward" in logs
    assert (tmp_path / "out" / "grpo_tiny_cpu" / "metrics.jsonl").is_file()
