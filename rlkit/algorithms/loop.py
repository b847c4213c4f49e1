"""The loop every algorithm shares: steps, validation, metrics, checkpoints and resume. An
algorithm supplies a Trainer; the loop never looks inside a step."""

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

from omegaconf import DictConfig

from rlkit.checkpoint import CheckpointManager, WrittenFiles
from rlkit.cluster.setup import RunWorkers
from rlkit.cluster.worker_group import WorkerError
from rlkit.config.schema import RootConfig
from rlkit.data.stream import ShuffledStream
from rlkit.observability.metrics import MetricsLogger, console_line
from rlkit.observability.startup import StartupClock

log = logging.getLogger("rlkit")


@dataclass
class RunResult:
    history: list[dict]  # metrics of every step (step 0: validation before training)
    run_dir: Path


class RunStopped(Exception):
    """The run stopped at a step boundary because it was asked to; reason: e.g. "SIGTERM"."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class TrainingData:
    train: list  # rows (RL prompts) or tokenized examples (SFT, DPO)
    val: list
    identity: tuple = ()  # e.g. the data files' sizes and times: a warm start cached for other data is not reused


@dataclass
class RunContext:
    """What a trainer is built from: the run's config, its started workers, the data and the
    checkpoint the policy started from (after any warm start: the KL / DPO reference)."""

    cfg: RootConfig
    algorithm: object  # its AlgorithmSpec
    workers: RunWorkers
    tokenizer: object
    data: TrainingData
    start_dir: Path


class Trainer(Protocol):
    rows_per_step: int  # rows of the training data each next(rows) gives

    def step(self, rows: Iterator[list], step: int) -> dict:
        """One step; it takes its rows with next(rows), and may take later steps' rows ahead
        (rollouts generated ahead of training): the stream's state is checkpointed after the step."""

    def validate(self) -> dict: ...

    def save(self, checkpoint_dir: str) -> dict[str, float]:
        """Start writing every model's weights, optimizer state and RNG into checkpoint_dir (the
        models' workers write in the background). Returns the seconds it held training ("held"),
        and in which parts."""

    def saved(self, wait: bool) -> WrittenFiles | None:
        """None while what the last save started is being written; once it is on disk whole (wait:
        block until then), what the workers' background writers made."""

    def load(self, checkpoint_dir: str, step: int) -> None:
        """What save wrote after `step`."""

    def close(self) -> None:
        """Stop what the trainer started (e.g. environment workers)."""


def run_steps(cfg: RootConfig, resolved: DictConfig, trainer: Trainer, rows: ShuffledStream,
              checkpoints: CheckpointManager, logger: MetricsLogger, resume_from: Path | None,
              stop_requested: Callable[[], str | None], clock: StartupClock) -> RunResult:
    """Steps 1..algorithm.num_steps (after the checkpoint's step when resuming), validating before
    the first (algorithm.val_before_training) and every algorithm.val_every (never with
    data.val_path=null), checkpointing every checkpoint.every and at the end. The start-up's phases (clock) are logged once, before the
    first step, and go into the first row of metrics.
    stop_requested() names why to stop (e.g. "SIGTERM"), checked between steps: the run then
    checkpoints the step it finished and raises RunStopped."""
    a = cfg.algorithm
    validates = cfg.data.val_path is not None  # null: no validation at all (said in the run's first lines)
    state = CheckpointManager.controller_state(resume_from) if resume_from else None
    if state is not None:
        log.info("resuming from %s: continuing after step %d", resume_from, state["step"])
        trainer.load(str(resume_from), state["step"])
        rows.restore(state["rows"])
    elif a.val_before_training and validates:
        start = time.perf_counter()
        with clock.phase("validation"):
            baseline = trainer.validate()
        log.info("before training: %s", ", ".join(f"{k} {v:.3f}" for k, v in baseline.items() if k.startswith("val/")))
    log.info(clock.line())
    startup = clock.metrics()  # in the first row logged
    if state is None and a.val_before_training and validates:
        logger.log(0, {**baseline, "timing/step": time.perf_counter() - start, **startup})
        startup = {}
    first = state["step"] + 1 if state else 1
    started = time.perf_counter()
    for step in range(first, a.num_steps + 1):
        try:
            metrics = {**trainer.step(rows, step), **startup}
            startup = {}
            if validates and (step % a.val_every == 0 or step == a.num_steps):
                metrics.update(trainer.validate())
            why = stop_requested()
            if checkpoints.finish(wait=False):  # the checkpoint written since an earlier step, if it is on disk
                metrics.update(checkpoints.last_write.metrics())
            due = cfg.checkpoint.enabled and (
                (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == a.num_steps or why)
            if due:  # started, never completed before the step is logged: a whole checkpoint's step always is
                held = checkpoints.save(step, trainer, {"step": step, "rows": rows.state()}, resolved)
                metrics.update({f"timing/checkpoint_{part}": seconds for part, seconds in held.items()})
            logger.log(step, metrics)
            log.info(console_line(step, a.num_steps, metrics, (time.perf_counter() - started) / (step - first + 1)))
            if due and (why or step == a.num_steps or not cfg.checkpoint.background):
                checkpoints.finish(wait=True)
            if why and step < a.num_steps:
                raise RunStopped(why, f"stopped by {why} after step {step}, checkpointed in {checkpoints.complete()[-1]}; "
                                 f"rerun the same command to continue")
        except WorkerError as e:
            last = checkpoints.complete()
            raise WorkerError(f"step {step}: {e}\nThe last complete checkpoint is "
                              f"{last[-1] if last else 'none'}; rerun the same command to resume "
                              f"(checkpoint.resume=auto).") from None
    return RunResult(logger.history, logger.run_dir)
