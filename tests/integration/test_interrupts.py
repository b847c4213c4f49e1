"""SIGTERM / SIGINT, to the driver or to its whole process group (a terminal's Ctrl-C, a batch
system's cancel): the run says so in one line, checkpoints the step it was in (a second signal, or
checkpoint.interrupt_grace_s running out, stops it at once without one), stops every process it
started, forked workers or not, and removes its Ray session folder and its temporary files. During
the start-up (from the imports on) there is nothing to checkpoint: it stops at once, the same way."""

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
from rlkit.launch.interrupts import STARTING

pytestmark = pytest.mark.integration


def started_run(out_dir, cache_dir, ray_dir, *overrides) -> subprocess.Popen:
    """The run's stderr goes to out_dir/stderr.txt, read while it runs."""
    command = [sys.executable, "-m", "rlkit.cli", "train", "--config-name", "grpo_tiny_cpu", "algorithm.num_steps=50",
               "checkpoint.every=0", "algorithm.val_every=100", "algorithm.prompts_per_step=8",
               "policy.train_global_batch_size=64", "algorithm.warm_start.sft_steps=4", f"run.output_dir={out_dir}",
               f"run.cache_dir={cache_dir}", "logger.plots=false", *overrides]
    # a process group of its own (this test's is not signalled with it); its temporary files in ray_dir
    with open(out_dir / "stderr.txt", "w") as stderr:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, text=True, start_new_session=True,
                                env={**os.environ, "RAY_TMPDIR": str(ray_dir), "TMPDIR": str(ray_dir)})


def wait_for(process, out_dir: Path, said: str, timeout_s=240):
    """Until the run's stderr matches the pattern `said`."""
    stderr, deadline = out_dir / "stderr.txt", time.monotonic() + timeout_s
    while not re.search(said, stderr.read_text()):
        assert process.poll() is None, stderr.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{said!r} not said"
        time.sleep(0.1)


def wait_for_process(process, out_dir: Path, named: str, timeout_s=240):
    """Until the run has started a process whose name holds `named`."""
    driver, deadline = psutil.Process(process.pid), time.monotonic() + timeout_s
    while not any(named in name for name in process_names(driver)):
        assert process.poll() is None, (out_dir / "stderr.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {named} started"
        time.sleep(0.05)


def process_names(driver: psutil.Process) -> list[str]:
    names = []
    for p in driver.children(recursive=True):
        try:
            names.append(p.name())
        except psutil.NoSuchProcess:  # ended meanwhile
            pass
    return names


def stopped_by(process, signum, out_dir: Path, ray_dir: Path, to_group: bool, ray_started=True) -> str:
    """Send signum to the run's driver, or to its process group; returns the one line rlkit says, after
    checking the exit status, that there is no traceback, that every process the run started is gone
    and that it left no fork server socket or wandb folder in its temporary folder (ray_dir), nor a
    Ray session folder."""
    driver = psutil.Process(process.pid)
    started = [driver, *driver.children(recursive=True)]
    names = [p.name() for p in started]
    assert ray_started == ("raylet" in names and "gcs_server" in names)
    (os.killpg if to_group else os.kill)(process.pid, signum)  # the group's id is the driver's pid
    process.wait(timeout=180)
    stderr = (out_dir / "stderr.txt").read_text()
    said = [line for line in stderr.splitlines() if line.startswith("rlkit:")]
    assert process.returncode == 128 + signum and len(said) == 1 and "Traceback" not in stderr, stderr[-3000:]
    gone, alive = psutil.wait_procs(started, timeout=15)
    assert not alive, [p.info for p in alive]
    assert not [*ray_dir.glob("rlkit-fork-*"), *ray_dir.glob("*wandb*"), *ray_dir.glob("ray/session_*")]
    return said[0]


@pytest.mark.parametrize("signum, grace_s, to_group", [(signal.SIGINT, 300, True), (signal.SIGINT, 0.01, False)],
                         ids=["Ctrl-C (SIGINT to the process group) checkpoints the step",
                              "SIGINT to the driver past the grace period stops at once"])
def test_a_signal_stops_the_run_cleanly(tmp_path, cache_dir, signum, grace_s, to_group):
    ray_dir = Path(tempfile.mkdtemp(prefix="rk"))  # short: Ray's socket paths must fit 107 characters
    process = started_run(tmp_path, cache_dir, ray_dir, f"checkpoint.interrupt_grace_s={grace_s}")
    try:
        wait_for(process, tmp_path, r"step +2/50")
        said = stopped_by(process, signum, tmp_path, ray_dir, to_group)
        checkpoints = sorted((tmp_path / "grpo_tiny_cpu" / "checkpoints").glob("step_*"))
        if grace_s > 1:
            step = int(re.match(rf"rlkit: stopped by {signal.Signals(signum).name} after step (\d+), checkpointed in "
                                r".*; rerun the same command to continue", said).group(1))
            assert [p.name for p in checkpoints] == [f"step_{step:06d}"] and verify(checkpoints[0]) is None
        else:
            assert said.startswith("rlkit: stopped by SIGINT again, during a step, without a checkpoint")
            assert checkpoints == []
    finally:
        if process.poll() is None:  # a failed assertion: stop what the test started
            os.killpg(process.pid, signal.SIGKILL)
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_a_signal_during_the_warm_start_stops_it_at_once(tmp_path, cache_dir):
    """The warm start has no checkpoint to finish: the first signal (SIGTERM to the process group, as
    a batch system's cancel sends it; workers not forked) stops it, and its cache stays unwritten.
    One generation worker: a worker of each kind to stop, and each unforked one imports its libraries itself."""
    ray_dir, cached = Path(tempfile.mkdtemp(prefix="rk")), set(Path(cache_dir).glob("warm-start-*"))
    process = started_run(tmp_path, cache_dir, ray_dir, "algorithm.warm_start.sft_steps=100000",
                          "algorithm.warm_start.batch_size=16", "policy.micro_batch_size=8",
                          "cluster.fork_workers=false", "generation.num_workers=1")
    try:
        wait_for(process, tmp_path, "warm start SFT step 10/")
        said = stopped_by(process, signal.SIGTERM, tmp_path, ray_dir, to_group=True)
        assert said == ("rlkit: stopped by SIGTERM during the warm start, which is not checkpointed (the next run "
                        "redoes it); rerun the same command to continue")
        assert set(Path(cache_dir).glob("warm-start-*")) == cached  # nothing cached, nothing half-written
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        shutil.rmtree(ray_dir, ignore_errors=True)


@pytest.mark.parametrize("signum, moment", [(signal.SIGINT, "imports"), (signal.SIGTERM, "workers")],
                         ids=["Ctrl-C during the imports", "SIGTERM to the process group while the workers start"])
def test_a_signal_during_the_start_up_stops_it_at_once(tmp_path, cache_dir, signum, moment):
    """Nothing to checkpoint yet: the first signal stops the run where it is, before Ray has started
    (the fork server is importing beside the driver) or after (Ray's own SIGTERM handler set aside)."""
    ray_dir = Path(tempfile.mkdtemp(prefix="rk"))
    process = started_run(tmp_path, cache_dir, ray_dir)
    try:
        wait_for_process(process, tmp_path, "python" if moment == "imports" else "MegatronModelWorker")
        said = stopped_by(process, signum, tmp_path, ray_dir, to_group=True, ray_started=moment == "workers")
        assert said == f"rlkit: stopped by {signal.Signals(signum).name} {STARTING}"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        shutil.rmtree(ray_dir, ignore_errors=True)
