"""SIGTERM / SIGINT: the run says so in one line, checkpoints the step it was in (a second signal, or
checkpoint.interrupt_grace_s running out, stops it at once without one), stops every process it
started and removes its Ray session folder."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from rlkit.checkpoint import verify

pytestmark = pytest.mark.integration


def started_run(out_dir, cache_dir, ray_dir, *overrides) -> subprocess.Popen:
    """The run's stderr goes to out_dir/stderr.txt, read while it runs."""
    command = [sys.executable, "-m", "rlkit.cli", "train", "--config-name", "grpo_tiny_cpu", "algorithm.num_steps=50",
               "checkpoint.every=0", "algorithm.val_every=100", "algorithm.prompts_per_step=8",
               "policy.train_global_batch_size=64", "algorithm.warm_start.sft_steps=4", f"run.output_dir={out_dir}",
               f"run.cache_dir={cache_dir}", "logger.plots=false", *overrides]
    with open(out_dir / "stderr.txt", "w") as stderr:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, text=True, start_new_session=True,
                                env={**os.environ, "RAY_TMPDIR": str(ray_dir)})


def wait_for(process, out_dir: Path, said: str, timeout_s=240):
    """Until the run's stderr matches the pattern `said`."""
    stderr, deadline = out_dir / "stderr.txt", time.monotonic() + timeout_s
    while not re.search(said, stderr.read_text()):
        assert process.poll() is None, stderr.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{said!r} not said"
        time.sleep(0.1)


def stopped_by(process, signum, out_dir: Path) -> str:
    """Send signum to the run; returns the one line rlkit says, after checking the exit status, that
    there is no traceback and that every process the run started is gone."""
    driver = psutil.Process(process.pid)
    started = [driver, *driver.children(recursive=True)]
    assert any("raylet" in p.name() for p in started) and any("gcs_server" in p.name() for p in started)
    os.kill(process.pid, signum)
    process.wait(timeout=180)
    stderr = (out_dir / "stderr.txt").read_text()
    said = [line for line in stderr.splitlines() if line.startswith("rlkit:")]
    assert process.returncode == 128 + signum and len(said) == 1 and "Traceback" not in stderr, stderr[-3000:]
    gone, alive = psutil.wait_procs(started, timeout=15)
    assert not alive, [p.info for p in alive]
    return said[0]


@pytest.mark.parametrize("signum, grace_s", [(signal.SIGTERM, 300), (signal.SIGINT, 0.01)],
                         ids=["SIGTERM checkpoints the step", "SIGINT past the grace period stops at once"])
def test_a_signal_stops_the_run_cleanly(tmp_path, cache_dir, signum, grace_s):
    ray_dir = Path(tempfile.mkdtemp(prefix="rk"))  # short: Ray's socket paths must fit 107 characters
    process = started_run(tmp_path, cache_dir, ray_dir, f"checkpoint.interrupt_grace_s={grace_s}")
    try:
        wait_for(process, tmp_path, r"step +2/50")
        said = stopped_by(process, signum, tmp_path)
        checkpoints = sorted((tmp_path / "grpo_tiny_cpu" / "checkpoints").glob("step_*"))
        if grace_s > 1:
            step = int(re.match(r"rlkit: stopped by SIGTERM after step (\d+), checkpointed in .*; rerun the same "
                                r"command to continue", said).group(1))
            assert [p.name for p in checkpoints] == [f"step_{step:06d}"] and verify(checkpoints[0]) is None
        else:
            assert said.startswith("rlkit: stopped during a step") and checkpoints == []
        assert not list((ray_dir / "ray").glob("session_*"))  # the run's Ray session folder is removed
    finally:
        if process.poll() is None:  # a failed assertion: stop what the test started
            os.killpg(process.pid, signal.SIGKILL)
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_a_signal_during_the_warm_start_stops_it_at_once(tmp_path, cache_dir):
    """The warm start has no checkpoint to finish: the first signal stops it, and its cache stays unwritten."""
    ray_dir, cached = Path(tempfile.mkdtemp(prefix="rk")), set(Path(cache_dir).glob("warm-start-*"))
    process = started_run(tmp_path, cache_dir, ray_dir, "algorithm.warm_start.sft_steps=100000",
                          "algorithm.warm_start.batch_size=64")
    try:
        wait_for(process, tmp_path, "warm start SFT step 10/")
        said = stopped_by(process, signal.SIGTERM, tmp_path)
        assert said == ("rlkit: stopped by SIGTERM during the warm start, which is not checkpointed (the next run "
                        "redoes it); rerun the same command to continue")
        assert set(Path(cache_dir).glob("warm-start-*")) == cached  # nothing cached, nothing half-written
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        shutil.rmtree(ray_dir, ignore_errors=True)
