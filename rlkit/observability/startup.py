"""Where the seconds from the command to the first training step go, phase by phase.

The driver times its phases (Ray, each worker group until it answers, the warm start, the
trainer's setup, validation before training); each worker times its own (what it imports, builds
and loads) and the driver adds them as the breakdown of its group's phase. The run logs one line
once the first step starts, and the first row of metrics.jsonl holds every figure as
timing/startup/<phase> (timing/startup/<group>/<part> for the workers' parts)."""

import sys
import time
from contextlib import contextmanager

import rlkit
from rlkit.observability.metrics import PhaseTimer


@contextmanager
def without_wandb():
    """Within: `import wandb` raises ImportError (unless it was imported before), as megatron-core's
    modules import it, for logging no worker of rlkit's uses: 0.4 s of CPU, and two temporary
    folders that a worker process, ending without Python's exit handlers, leaves behind. Imported
    later, it is there."""
    kept_out = sys.modules.setdefault("wandb", None) is None
    try:
        yield
    finally:
        if kept_out:
            del sys.modules["wandb"]


class PhaseTimes:
    """A worker's own start-up: wall-clock time at construction, then named phases in order."""

    def __init__(self):
        self.entered = time.time()  # the driver's creation time subtracted from it: process start + module imports
        self.phase = PhaseTimer(prefix="")  # with startup.phase("load"): ...
        self.phases: dict[str, float] = self.phase.seconds

    def report(self) -> dict:
        return {"entered": self.entered, "phases": dict(self.phases)}


class StartupClock(PhaseTimes):
    """The driver's phases to the first step: from rlkit's start in this process (a command's,
    whose imports are a phase; the interpreter's own start before it takes some tens of ms), or from now."""

    def __init__(self, from_rlkit_start: bool = False):
        super().__init__()
        self.started = rlkit.STARTED if from_rlkit_start else time.perf_counter()
        if from_rlkit_start:
            self.phases["python_imports"] = time.perf_counter() - self.started
        self.parts: dict[str, dict[str, float]] = {}  # phase -> its workers' breakdown

    def add_workers(self, name: str, created: float, reports: list[dict]) -> None:
        """A worker group's breakdown: created is time.time() when its actors were asked for;
        each part is the slowest rank's (the group is ready when its slowest rank is)."""
        parts = {"process_start_imports": max(r["entered"] - created for r in reports)}
        for report in reports:
            for part, seconds in report["phases"].items():
                parts[part] = max(parts.get(part, 0.0), seconds)
        self.parts[name] = parts

    def metrics(self) -> dict[str, float]:
        figures = {f"timing/startup/{name}": seconds for name, seconds in self.phases.items()}
        for name, parts in self.parts.items():
            figures.update({f"timing/startup/{name}/{part}": seconds for part, seconds in parts.items()})
        figures["timing/startup/total"] = time.perf_counter() - self.started
        return figures

    def line(self) -> str:
        total = time.perf_counter() - self.started

        def phase(name: str, seconds: float) -> str:
            parts = self.parts.get(name)
            inner = f" ({', '.join(f'{p} {s:.1f}' for p, s in parts.items())})" if parts else ""
            return f"{name} {seconds:.1f}{inner}"
        return f"start-up {total:.1f} s to the first step: " + "; ".join(phase(n, s) for n, s in self.phases.items())
