"""A run's console is rlkit's own account of it: every line it prints, on stdout and stderr, to a
console that is not a terminal, is a line rlkit wrote (its logger's, a "rlkit: ..." line, or a line
rlkit's worker code printed, which Ray forwards as "(Worker pid=...) ..."). What other libraries log
(Ray's start-up, matplotlib building its font cache in a new home) is in the run's log file instead,
and Ray keeps its authentication token out of the user's home."""

import os
import re
import subprocess
import sys

import pytest

from rlkit.observability.console import LOG_FILE, RLKIT_WORKER_LINE

pytestmark = pytest.mark.integration

RLKIT_LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<message>.*)$")
WORKER_LINE = re.compile(r"^\(\w+ pid=\d+\) (?P<line>.*)$")
RUN_LOG_RECORD = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?P<name>[\w.]+): (?P<message>.*)$")
# where a user's environment could point Ray, matplotlib or huggingface elsewhere than the home given
ELSEWHERE = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_ADDRESS", "MPLCONFIGDIR",
             "XDG_CACHE_HOME", "XDG_CONFIG_HOME")


def rlkits_records(run_log: str) -> set[str]:
    """The messages of the run log's records that rlkit's console shows: rlkit's loggers' and errors."""
    records = [RUN_LOG_RECORD.match(line) for line in run_log.splitlines()]
    return {r["message"] for r in records if r and (r["name"].split(".")[0] == "rlkit" or r["level"] in
                                                     ("ERROR", "CRITICAL"))}


def test_a_run_prints_only_rlkits_lines(cache_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out"
    # the warm start's settings are test_interrupts' runs', so one of them trains it for the session
    argv = [sys.executable, "-m", "rlkit.cli", "train", "--config-name", "grpo_tiny_cpu", "algorithm.num_steps=2",
            "algorithm.val_every=2", "algorithm.val_before_training=false", "algorithm.prompts_per_step=8",
            "policy.train_global_batch_size=64", "algorithm.warm_start.sft_steps=4", f"run.cache_dir={cache_dir}",
            f"run.output_dir={out}"]
    env = {key: value for key, value in os.environ.items() if key not in ELSEWHERE}
    result = subprocess.run(argv, env={**env, "HOME": str(home)}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]

    run_log = (out / "grpo_tiny_cpu" / LOG_FILE).read_text()
    shown = rlkits_records(run_log)
    foreign = []
    for line in (result.stdout + result.stderr).splitlines():
        rlkits = RLKIT_LINE.match(line)
        worker = WORKER_LINE.match(line)
        if rlkits:
            mine = rlkits["message"] in shown
        elif worker:  # what rlkit's worker code prints: "[policy] refit export: ..."
            mine = RLKIT_WORKER_LINE.match(worker["line"]) is not None
        else:
            mine = line.startswith("rlkit: ")
        if not mine:
            foreign.append(line)
    assert not foreign, "\n".join(foreign)
    assert "step   2/2 [" in result.stderr
    # what the console left out is in the run log
    for said in ["Started a local Ray instance", "matplotlib.font_manager: generated new fontManager",
                 "number of parameters on (tensor, pipeline) model parallel rank"]:
        assert said in run_log, said
    assert not (home / ".ray").exists()
