"""SIGINT / SIGTERM during a run: finish the step, checkpoint it, stop cleanly.

The first signal asks the step loop to stop at the next step boundary (it checkpoints that step and
raises RunStopped); checkpoint.interrupt_grace_s bounds how long that may take. A second signal, or
the grace period running out, interrupts the run where it is, without a checkpoint. Either way the
run's `finally` blocks stop its workers and its Ray cluster. Work with no checkpoint to finish
(the warm start, a run with checkpoint.enabled=false) stops at the first signal.

Before that, from the command's first line (stop_at_once_on_signals: the start-up, Ray's included; and
the commands that save nothing as they go, as `rlkit eval`), a signal stops the command where it is:
Stopped, which the command line says in one line. Light to import: the command installs it before
its heavy imports."""

import _thread
import contextlib
import logging
import signal
import threading

from rlkit.config.schema import CheckpointConfig

log = logging.getLogger("rlkit")


NOTHING_SAVED = ("with checkpoint.enabled=false, which saves nothing; rerun the same command to start again from "
                 "where this run started")
STARTING = ("during start-up, before the first step, with nothing to checkpoint yet; rerun the same command to "
            "continue from the last checkpoint, if any")
AGAIN = "again, during a step, without a checkpoint; rerun the same command to continue from the last one, if any"
STOPPING = "while the run stopped its workers; rerun the same command to continue from the last checkpoint, if any"


class Stopped(KeyboardInterrupt):
    """A signal stopped the command where it was: reason, the signal's name; where, e.g. STARTING."""
    last: "Stopped | None" = None  # the last one raised (see stop_at_once_on_signals)

    def __init__(self, reason: str, where: str):
        super().__init__(f"stopped by {reason} {where}")
        self.reason, self.where = reason, where
        Stopped.last = self


class StopAtOnce:
    """A signal handler that raises Stopped; where: what to tell, e.g. STARTING."""

    def __init__(self, where: str):
        self.where = where

    def __call__(self, signum, frame):
        raise Stopped(signal.Signals(signum).name, self.where)


@contextlib.contextmanager
def stop_at_once_on_signals(where: str):
    """Within (the main thread): SIGINT and SIGTERM raise Stopped, and so does whatever stops on the
    way out. A local Ray cluster's start keeps this handler in place of Ray's own
    (rlkit/cluster/ray_runtime.py)."""
    handler, Stopped.last = StopAtOnce(where), None
    with _handling(handler):
        try:
            yield handler
        except KeyboardInterrupt as interrupted:
            if isinstance(interrupted, Stopped):
                raise
            # Ray's waits raise a KeyboardInterrupt of their own in place of the Stopped a handler raised
            raise Stopped.last or Stopped("SIGINT", handler.where) from None


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
            raise Stopped(name, AGAIN)
        self.reason = name
        if self.uncheckpointed:
            from rlkit.algorithms.loop import RunStopped  # imported by the run, which raises it too; heavy
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
def stop_on_signals(cfg: CheckpointConfig, ends_start_up: bool = True):
    """Within: SIGINT and SIGTERM request a stop (StopRequest; at once where checkpoint.enabled is
    false: there is no checkpoint to finish). After: the handler before is back; a StopAtOnce then
    says a signal came while the run stopped its workers, unless the start-up goes on (not
    ends_start_up: the warm start on workers of its own)."""
    request = StopRequest(cfg.interrupt_grace_s, None if cfg.enabled else NOTHING_SAVED)
    with _handling(request.handle) as previous:
        try:
            yield request
        finally:
            if request.grace_timer is not None:  # the run stopped in time: its grace period must not
                request.grace_timer.cancel()  # interrupt what this process does next
            if ends_start_up and isinstance(previous, StopAtOnce):
                previous.where = STOPPING


@contextlib.contextmanager
def _handling(handler):
    """Within: handler handles SIGINT and SIGTERM (where this is the main thread: only it gets
    signals); yields SIGINT's handler before, which is back after."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield previous[signal.SIGINT]
    finally:
        for s, before in previous.items():
            signal.signal(s, before)
