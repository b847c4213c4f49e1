"""What a run has logged so far, read while it may still be writing."""

import json
from pathlib import Path


def logged_steps(run_dir: Path) -> list[dict]:
    """The rows of the run's metrics.jsonl. A line the run is still writing (no newline yet) is not one."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def last_logged_step(run_dir: Path) -> int:
    """The last step the run logged; -1 before any."""
    return max((row["step"] for row in logged_steps(run_dir)), default=-1)
