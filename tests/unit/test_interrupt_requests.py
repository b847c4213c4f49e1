"""A signal during a run (rlkit/launch/interrupts.py), in this process: with checkpoints the first one
asks for a stop at the next step boundary and the run goes on, its grace period's timer cancelled
once the run has stopped; with checkpoint.enabled=false there is nothing to finish, so it stops the
run where it is and says a rerun starts where this one did; the warm start's stop-at-once reason
holds within either and the run's own is back after it. Before the step loop (from the command's
first line) and after it, a signal stops at once and says where."""

import os
import signal

import pytest

from rlkit.algorithms.loop import RunStopped
from rlkit.config.schema import CheckpointConfig
from rlkit.launch.interrupts import STARTING, Stopped, stop_at_once_on_signals, stop_on_signals


def checkpoint_cfg(enabled: bool) -> CheckpointConfig:
    return CheckpointConfig(enabled=enabled, every=0, save_format="dist", background=True, keep_last=2,
                            resume="auto", dir=None, interrupt_grace_s=300)


def test_with_checkpoints_the_first_signal_asks_for_a_stop_at_the_step_boundary():
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals(checkpoint_cfg(True)) as stop_requested:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_requested() == "SIGTERM"  # the loop checkpoints this step, then stops
        assert stop_requested.grace_timer.is_alive()  # interrupt_grace_s bounds how long that may take
    assert signal.getsignal(signal.SIGTERM) is before  # the process's own handler is back
    # stopped in time: the grace period's timer is gone, and interrupts nothing this process does next
    stop_requested.grace_timer.join(timeout=5)
    assert not stop_requested.grace_timer.is_alive()


def test_without_checkpoints_the_first_signal_stops_at_once_and_a_rerun_starts_over():
    with pytest.raises(RunStopped) as stopped:
        with stop_on_signals(checkpoint_cfg(False)) as stop_requested:
            with stop_requested.stopping_at_once("during the warm start; rerun the same command to continue"):
                pass
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("the signal did not stop the run")
    assert stopped.value.reason == "SIGTERM"
    assert str(stopped.value) == ("stopped by SIGTERM with checkpoint.enabled=false, which saves nothing; rerun the "
                                  "same command to start again from where this run started")


def test_the_warm_starts_reason_names_the_stop_within_it():
    with pytest.raises(RunStopped, match=r"^stopped by SIGINT during the warm start; rerun the same command"):
        with stop_on_signals(checkpoint_cfg(False)) as stop_requested:
            with stop_requested.stopping_at_once("during the warm start; rerun the same command to continue"):
                os.kill(os.getpid(), signal.SIGINT)
                pytest.fail("the signal did not stop the run")


@pytest.mark.parametrize("ends_start_up, where", [(False, STARTING),
                                                  (True, "while the run stopped its workers; rerun the same command")],
                         ids=["after the warm start's workers: the start-up goes on", "after the step loop"])
def test_outside_the_step_loop_a_signal_stops_at_once_and_says_where(ends_start_up, where):
    with pytest.raises(Stopped) as stopped:
        with stop_at_once_on_signals(STARTING):
            with stop_on_signals(checkpoint_cfg(True), ends_start_up):
                pass
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("the signal did not stop the command")
    assert stopped.value.reason == "SIGTERM" and str(stopped.value).startswith(f"stopped by SIGTERM {where}")
