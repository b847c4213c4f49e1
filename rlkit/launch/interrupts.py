"""SIGINT / SIGTERM during a run: finish the step, checkpoint it, stop cleanly.

The first signal asks the step loop to stop at the next step boundary (it checkpoints that step and
raises RunStopped); checkpoint.interrupt_grace_s bounds how long that may take. A second signal, or
the grace period running out, interrupts the run where it is, without a checkpoint. Either way the
run's `finally` blocks stop its workers and its Ray cluster. Work with no checkpoint to finish
(the warm start, a run with checkpoint.enabled=false) stops at the first signal."""

import _thread
import contextlib
import logging
import signal
import threading

from rlkit.algorithms.loop import RunStopped
from rlkit.config.schema import CheckpointConfig

log = logging.getLogger("rlkit")


NOTHING_SAVED = ("with checkpoint.enabled=false, which saves nothing; rerun the same command to start again from "
                 "where this run started")


class StopRequest:
    def __init__(self, grace_s: float, uncheckpointed: str | None = None):
        self.grace_s, self.reason = grace_s, None
        self.uncheckpointed = uncheckpointed  # why a signal now stops at once, e.g. "during the warm start ..."
        self.grace_timer: threading.Timer | None = None

    def __call__(self) -> str | None:
        """The signal's name once one arrived, else None (run_steps' stop_requested)."""
        return self.reason

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.reason is not None:
            log.warning("%s again: stopping now, without a checkpoint", name)
            raise KeyboardInterrupt(f"{name} again")
        self.reason = name
        if self.uncheckpointed:
            raise RunStopped(name, f"stopped by {name} {self.uncheckpointed}")
        log.warning("%s: finishing this step and checkpointing it (within checkpoint.interrupt_grace_s=%g s); "
                    "send it again to stop at once", name, self.grace_s)
        self.grace_timer = threading.Timer(self.grace_s, self._grace_over)
        self.grace_timer.daemon = True
        self.grace_timer.start()

    @contextlib.contextmanager
    def stopping_at_once(self, why: str):
        """Within: the first signal stops the run where it is (nothing here can be checkpointed);
        why completes "stopped by SIGTERM ...", with what to do next."""
        outer, self.uncheckpointed = self.uncheckpointed, why
        try:
            yield
        finally:
            self.uncheckpointed = outer

    def _grace_over(self):
        log.warning("checkpoint.interrupt_grace_s=%g s passed: stopping without a checkpoint", self.grace_s)
        _thread.interrupt_main(signal.SIGINT)  # runs handle() in the main thread, as a second signal


@contextlib.contextmanager
def stop_on_signals(cfg: CheckpointConfig):
    """Within: SIGINT and SIGTERM request a stop (StopRequest; at once where checkpoint.enabled is
    false: there is no checkpoint to finish). Install after Ray has started, whose own SIGTERM
    handler would otherwise end the driver with a C++ stack dump."""
    request = StopRequest(cfg.interrupt_grace_s, None if cfg.enabled else NOTHING_SAVED)
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield request
        return
    previous = {s: signal.signal(s, request.handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        if request.grace_timer is not None:  # the run stopped in time: its grace period must not
            request.grace_timer.cancel()  # interrupt what this process does next
        for s, handler in previous.items():
            signal.signal(s, handler)
