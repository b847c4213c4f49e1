"""Everything a GPU run starts listens on loopback only: the policy's store and NCCL, the vLLM
engine core and its workers, the refit channel."""

import os
import signal
import subprocess
import sys

from process_tree import ProcessTree


def test_a_vllm_run_listens_on_loopback_only(tmp_path):
    command = [sys.executable, "-m", "rlkit.cli", "train", "--config-name", "grpo_tiny_gpu", "algorithm.num_steps=2",
               "algorithm.val_every=2", "checkpoint.every=2", "algorithm.warm_start.sft_steps=4",
               "cluster.placement=colocated", "refit=cuda_ipc", f"run.output_dir={tmp_path}",
               f"run.cache_dir={tmp_path / 'cache'}"]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                                   env={**os.environ, "RAY_ADDRESS": ""})
    tree = ProcessTree(process.pid)
    try:
        tree.watch(until=lambda: process.poll() is not None, timeout_s=500)
        assert process.returncode == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
        print("listening:", sorted(tree.listening))
        assert any("MegatronModelWorker" in entry[0] for entry in tree.listening), sorted(tree.listening)
        assert tree.exposed() == [], f"listening beyond loopback: {tree.exposed()}"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        assert tree.still_alive() == []
