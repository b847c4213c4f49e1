"""How `rlkit train` ends on what stops a run, in one line each: an environment failure with
env_runner.fail_fast (exit status 1), and a signal during the start-up (128 + the signal). The run
itself is replaced by one that ends so at once: what is checked is the command line's answer."""

import os
import signal

import pytest

import rlkit.launch.run
from rlkit.cli import main
from rlkit.envs.runner import EnvironmentFailure
from rlkit.launch.interrupts import STARTING

FAILURE = ("environment tool_env.Flaky: tool divide raised ZeroDivisionError: division by zero (tool_env.py:7); "
           "env_runner.fail_fast is on: fix it, or set env_runner.fail_fast=false to answer such calls with an error "
           "and count them (tools/*)")


def fail_fast(*args, **kwargs):
    raise EnvironmentFailure(FAILURE)


def signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # as the start-up's handler has it: before the step loop's
    pytest.fail("the signal did not stop the run")


@pytest.mark.parametrize("train, code, said", [(fail_fast, 1, FAILURE),
                                               (signalled, 128 + signal.SIGTERM, f"stopped by SIGTERM {STARTING}")],
                         ids=["fail-fast environment", "signal during start-up"])
def test_what_stops_a_run_is_said_in_one_line(train, code, said, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(rlkit.launch.run, "train", train)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["train", "--config-name", "grpo_tiny_cpu", f"run.output_dir={tmp_path}",
                 "cluster.fork_workers=false"]) == code
    assert capsys.readouterr().err == f"rlkit: {said}\n"
    assert signal.getsignal(signal.SIGTERM) is before  # the process's own handler is back
