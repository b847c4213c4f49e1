"""The loop every algorithm shares: steps, validation, metrics, checkpoints and resume. An
algorithm supplies a Trainer; the loop never looks inside a step."""

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

from omegaconf import DictConfig

from rlkit.checkpoint import CheckpointManager
from rlkit.cluster.setup import RunWorkers
from rlkit.cluster.worker_group import WorkerError
from rlkit.config.schema import RootConfig
from rlkit.data.stream import ShuffledStream
from rlkit.observability.metrics import MetricsLogger, console_line

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

    def save(self, checkpoint_dir: str) -> None:
        """Every model's weights, optimizer state and RNG into checkpoint_dir. Collective."""

    def load(self, checkpoint_dir: str, step: int) -> None:
        """What save wrote after `step`."""

    def close(self) -> None:
        """Stop what the trainer started (e.g. environment workers)."""


def run_steps(cfg: RootConfig, resolved: DictConfig, trainer: Trainer, rows: ShuffledStream,
              checkpoints: CheckpointManager, logger: MetricsLogger, resume_from: Path | None,
              stop_requested: Callable[[], str | None]) -> RunResult:
    """Steps 1..algorithm.num_steps (after the checkpoint's step when resuming), validating before
    the first and every algorithm.val_every, checkpointing every checkpoint.every and at the end.
    stop_requested() names why to stop (e.g. "SIGTERM"), checked between steps: the run then
    checkpoints the step it finished and raises RunStopped."""
    a = cfg.algorithm
    state = CheckpointManager.controller_state(resume_from) if resume_from else None
    if state is not None:
        log.info("resuming from %s: continuing after step %d", resume_from, state["step"])
        trainer.load(str(resume_from), state["step"])
        rows.restore(state["rows"])
    else:
        start = time.perf_counter()
        metrics = trainer.validate()
        logger.log(0, {**metrics, "timing/step": time.perf_counter() - start})
        log.info("before training: %s", ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("val/")))
    first = state["step"] + 1 if state else 1
    started = time.perf_counter()
    for step in range(first, a.num_steps + 1):
        try:
            metrics = trainer.step(rows, step)
            if step % a.val_every == 0 or step == a.num_steps:
                metrics.update(trainer.validate())
            logger.log(step, metrics)
            log.info(console_line(step, a.num_steps, metrics, (time.perf_counter() - started) / (step - first + 1)))
            every = cfg.checkpoint.every
            why = stop_requested()
            if (every and step % every == 0) or step == a.num_steps or why:
                checkpoints.save(step, trainer.save, {"step": step, "rows": rows.state()}, resolved)
            if why and step < a.num_steps:
                raise RunStopped(why, f"stopped by {why} after step {step}, checkpointed in {checkpoints.complete()[-1]}; "
                                 f"rerun the same command to continue")
        except WorkerError as e:
            last = checkpoints.complete()
            raise WorkerError(f"step {step}: {e}\nThe last complete checkpoint is "
                              f"{last[-1] if last else 'none'}; rerun the same command to resume "
                              f"(checkpoint.resume=auto).") from None
    return RunResult(logger.history, logger.run_dir)
