"""Shared by the benchmarks that compare modes of one recipe (async_grpo.py, multi_turn.py): each
mode a `rlkit train` run of its own, in a subprocess, whose metrics history they summarize.
Standard library only."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def add_run_options(parser: argparse.ArgumentParser, work_dir: str, timeout_s: int) -> None:
    """Where the runs go, where the recipe finds its model, each run's time limit, the results
    file, and more overrides for every run."""
    parser.add_argument("--work-dir", default=work_dir)
    parser.add_argument("--cache-dir", default=str(ROOT / ".rlkit_cache"), help="where the recipe finds its model")
    parser.add_argument("--timeout", type=int, default=timeout_s, help="seconds per run")
    parser.add_argument("--out", required=True)
    parser.add_argument("extra", nargs="*", help="more rlkit key=value overrides, for every run")


def train(recipe: str, overrides: list[str], work_dir: Path, name: str, timeout_s: int) -> tuple[str, list[dict]]:
    """`rlkit train` of the recipe as run.name=name in work_dir (a finished run of that name
    removed first: it would only say so), from the repository root, its output in work_dir/name.log.
    Returns the command line (after the interpreter) and the run's metrics history."""
    shutil.rmtree(work_dir / name, ignore_errors=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "rlkit.cli", "train", "--config-name", recipe, *overrides,
               f"run.output_dir={work_dir}", f"run.name={name}"]
    with open(work_dir / f"{name}.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=True, cwd=ROOT)
    lines = (work_dir / name / "metrics.jsonl").read_text().splitlines()
    return " ".join(command[1:]), [json.loads(line) for line in lines]
