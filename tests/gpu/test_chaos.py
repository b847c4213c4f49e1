"""Chaos on GPU: the vLLM engine killed mid-step ends the run at once with one error naming the
generation worker and the step, and the run then resumes from its last checkpoint exactly: the step
it redoes draws the same samples (the same rewards, lengths and environment results) as the killed
run did, and its training metrics agree to GPU-atomics noise (a bf16 backward is not bitwise
repeatable)."""

import os
import re
import signal
import threading
import time

import psutil
import pytest
import ray
from run_metrics import logged_steps

from rlkit.cluster.worker_group import WorkerError
from rlkit.launch.run import train

# the engine core in a process of its own, which is what dies here (in the worker's process, the
# worker itself would die, as any worker can)
RUN = ["algorithm.num_steps=5", "checkpoint.every=2", "algorithm.val_every=100", "algorithm.warm_start.sft_steps=20",
       "cluster.call_timeout_s=120", "run.name=gpu_chaos", "generation.vllm.engine_process=true"]


def engine_processes() -> list[psutil.Process]:
    """vLLM's engine-core processes: the children of this session's generation worker actors."""
    actors = ray._private.state.actors().values()
    workers = [a["Pid"] for a in actors if a["ActorClassName"] == "VLLMGenerationWorker" and a["State"] == "ALIVE"]
    return [child for pid in workers for child in psutil.Process(pid).children(recursive=True)]


@pytest.mark.timeout(480)
def test_killed_vllm_engine_is_named_and_the_run_resumes_exactly(ray_cluster, make_cfg, tmp_path):
    cfg, resolved = make_cfg(*RUN, f"run.output_dir={tmp_path}")
    run_dir = tmp_path / cfg.run.name
    killed, killed_at = [], []

    def kill_the_engine_after_step_3():
        while not any(m["step"] == 3 for m in logged_steps(run_dir)):
            time.sleep(0.05)
        for process in engine_processes():
            killed.append(process.pid)
            os.kill(process.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    threading.Thread(target=kill_the_engine_after_step_3, daemon=True).start()
    with pytest.raises(WorkerError) as error:
        train(cfg, resolved)
    message = str(error.value)
    assert killed, "no vLLM engine process was found to kill"
    after_kill = time.monotonic() - killed_at[0]
    print(f"killed engine processes {killed}; the run ended {after_kill:.1f} s later with: {message[:400]}")
    # named by the engine's own call, or by the policy's refit sender when the kill lands mid-refit
    assert re.match(r"step 4: (generation worker 0 failed in '\w+'.*EngineDeadError|policy worker 0 failed in "
                    r"'send_refit'.*generation worker 0 went away)", message, re.DOTALL), message
    assert after_kill < 30  # not cluster.call_timeout_s (120 s): the dead engine is noticed
    assert "last complete checkpoint is" in message and "step_000002" in message
    before = {m["step"]: m for m in logged_steps(run_dir)}

    # resumed: from step 2, so step 3 is done again; it must match what the killed run logged
    history = train(*make_cfg(*RUN, f"run.output_dir={tmp_path}")).history
    assert [m["step"] for m in history] == [0, 1, 2, 3, 4, 5]
    redone, first = history[3], before[3]
    sampled = [k for k in first if k.startswith(("env/", "train/reward", "train/accuracy", "train/response_length"))]
    assert sampled and {k: redone[k] for k in sampled} == {k: first[k] for k in sampled}
    trained = ["train/loss", "train/grad_norm", "train/entropy", "train/importance_ratio", "refit/token_mult_prob_error"]
    assert all(redone[k] == pytest.approx(first[k], rel=1e-2, abs=1e-4) for k in trained)
    print("step 3 before the kill / after the resume:",
          ", ".join(f"{k} {first[k]:.6g}/{redone[k]:.6g}" for k in sorted(sampled + trained)))
