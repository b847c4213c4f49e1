"""The README's measured figures, written from results files so they cannot drift from a run.

    .venv/bin/python scripts/readme_figures.py measure-main-job   # run the main job -> docs/results/main_job.json
    .venv/bin/python scripts/readme_figures.py record-suite LOG   # pytest's summary line -> docs/results/suite.json
    .venv/bin/python scripts/readme_figures.py write              # fill the README's marked figures from both

In README.md a figure sits between markers, `<!-- figure:NAME -->value<!-- /figure -->`; `write`
replaces each value in place with `figures(...)[NAME]`. tests/unit/test_readme.py fails when a
marked value differs from what these functions make of the results files.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"
MAIN_JOB = RESULTS / "main_job.json"
SUITE = RESULTS / "suite.json"
RECIPE = "grpo_tiny_cpu"
FIGURE = re.compile(r"<!-- figure:([a-z0-9_]+) -->(.*?)<!-- /figure -->", re.DOTALL)

# lines of the main job's console output quoted in the README, first match of each, in this order
EXCERPT = [("warm_start", re.compile(r"warm start: running \d+ SFT steps")),
           ("before", re.compile(r"before training: ")),
           ("first_step", re.compile(r"step +1/\d+ \[")),
           ("last_step", None),  # the step line of the last step, found by its number
           ("done", re.compile(r"done: "))]
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d ")  # the controller's log lines (workers' lines start with "(")


def git_commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def machine() -> dict:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"cpu_count": os.cpu_count(), "memory_gib": round(memory / 2**30), "system": platform.system(),
            "machine": platform.machine(), "platform": platform.platform(), "python": platform.python_version()}


def today() -> str:
    return datetime.date.today().isoformat()


# ---------------------------------------------------------------------------------------------------
# formatting: what the README shows for each results file


def duration(seconds: float) -> str:
    """1300.4 -> '21 min 40 s'; 48.2 -> '48 s'."""
    seconds = round(seconds)
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def machine_text(m: dict, load: float | None = None) -> str:
    """load: the 1-minute load average at the end of the run (other work on the same cores slows it)."""
    cores = f"{m['cpu_count']} CPU cores"
    if load is not None:
        cores += f" (load average {load:.1f} at the end of the run)"
    return f"{cores}, {m['memory_gib']} GiB, {m['system']} {m['machine']}"


def figures(main_job: dict, suite: dict) -> dict[str, str]:
    """Every marked figure of the README, by name, as the README shows it."""
    excerpt = "\n".join(["```text", *main_job["excerpt"], "```"])
    commit = suite["commit"]
    return {
        "main_job_val_acc_before": f"{main_job['val_accuracy_before']:.2f}",
        "main_job_val_acc_after": f"{main_job['val_accuracy_after']:.2f}",
        "main_job_train_reward_first": f"{main_job['train_reward_first']:.3f}",
        "main_job_train_reward_last": f"{main_job['train_reward_last']:.3f}",
        "main_job_steps": str(main_job["last_step"]),
        "main_job_wall": duration(main_job["wall_seconds"]),
        "main_job_first_step": duration(main_job["first_step_seconds"]),
        "main_job_measured_on": (f"commit {main_job['commit']}, {main_job['date']}, "
                                 f"{machine_text(main_job['machine'], main_job.get('load_average_after'))}"),
        "main_job_excerpt": "\n" + excerpt + "\n",
        "suite_result": (f"{suite['passed']} passed, {suite.get('skipped', 0)} skipped in "
                         f"{duration(suite['seconds'])}"),
        "suite_measured_on": f"commit {commit}" if commit != "unknown" else "commit not recorded",
    }


def load_results() -> tuple[dict, dict]:
    return json.loads(MAIN_JOB.read_text()), json.loads(SUITE.read_text())


def marked(text: str) -> list[tuple[str, str]]:
    """The README's marked figures in order: (name, the text between its markers); a figure may
    appear more than once."""
    return [(m.group(1), m.group(2)) for m in FIGURE.finditer(text)]


def fill(text: str, values: dict[str, str]) -> str:
    unknown = sorted({name for name, _ in marked(text)} - set(values))
    if unknown:
        raise ValueError(f"README.md marks figures no results file gives: {unknown} (known: {sorted(values)})")
    return FIGURE.sub(lambda m: f"<!-- figure:{m.group(1)} -->{values[m.group(1)]}<!-- /figure -->", text)


# ---------------------------------------------------------------------------------------------------
# commands


def measure_main_job(args) -> int:
    rlkit = ROOT / ".venv" / "bin" / "rlkit"
    if not rlkit.exists():
        sys.exit(f"readme_figures: {rlkit} is missing; run `bash scripts/setup.sh` first")
    work = Path(tempfile.mkdtemp(prefix="rlkit_main_job."))
    out, cache = work / "outputs", work / "cache"
    command = [str(rlkit), "train", "--config-name", RECIPE, f"run.output_dir={out}", f"run.cache_dir={cache}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # always its own local cluster
    lines, first_step_seconds, load_before = [], None, os.getloadavg()[0]
    print("readme_figures: running " + " ".join(command), file=sys.stderr)
    start = time.perf_counter()
    with subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as process:
        for line in process.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if first_step_seconds is None and LOG_LINE.match(line) and EXCERPT[2][1].search(line):
                first_step_seconds = time.perf_counter() - start
            if LOG_LINE.match(line) and args.verbose:
                print(line, file=sys.stderr)
    wall_seconds = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    (work / "output.log").write_text("\n".join(lines) + "\n")
    if process.returncode != 0:
        sys.exit(f"readme_figures: the main job failed (exit {process.returncode}); its output: {work / 'output.log'}")
    if first_step_seconds is None:
        sys.exit(f"readme_figures: no step 1 line in the main job's output ({work / 'output.log'})")

    history = [json.loads(line) for line in (out / RECIPE / "metrics.jsonl").read_text().splitlines()]
    before, last = history[0], history[-1]
    first_trained = next(m for m in history if m["step"] == 1)
    if before["step"] != 0 or "val/accuracy" not in last:
        sys.exit("readme_figures: metrics.jsonl lacks the validation before training or after the last step")
    log_lines = [line for line in lines if LOG_LINE.match(line)]
    patterns = dict(EXCERPT)
    patterns["last_step"] = re.compile(rf"step +{last['step']}/{last['step']} \[")
    excerpt = []
    for name, _ in EXCERPT:
        hit = next((line for line in log_lines if patterns[name].search(line)), None)
        if hit is None:
            sys.exit(f"readme_figures: no {name!r} line in the main job's output ({work / 'output.log'})")
        # the paths a user sees with the recipe's defaults, not this measurement's temporary ones
        excerpt.append(hit.replace(str(out), "outputs").replace(str(cache), ".rlkit_cache"))

    result = {
        "command": f".venv/bin/rlkit train --config-name {RECIPE}",
        "measured_with": "fresh run.output_dir and run.cache_dir (tiny model, tokenizer and warm start built "
                         "from scratch, as on a first run)",
        "commit": git_commit(),
        "date": today(),
        "machine": machine(),
        "load_average_before": round(load_before, 2),
        "load_average_after": round(load_after, 2),
        "wall_seconds": round(wall_seconds, 1),
        "first_step_seconds": round(first_step_seconds, 1),
        "last_step": last["step"],
        "val_accuracy_before": before["val/accuracy"],
        "val_reward_before": before["val/reward"],
        "val_accuracy_after": last["val/accuracy"],
        "val_reward_after": last["val/reward"],
        "train_reward_first": first_trained["train/reward"],
        "train_reward_last": last["train/reward"],
        "step_line": excerpt[3],
        "excerpt": excerpt,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    MAIN_JOB.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    print(f"readme_figures: wrote {MAIN_JOB.relative_to(ROOT)}: wall {duration(wall_seconds)}, first step after "
          f"{duration(first_step_seconds)}, val accuracy {result['val_accuracy_before']:.2f} -> "
          f"{result['val_accuracy_after']:.2f}", file=sys.stderr)
    return 0


SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+)(?:, \d+ \w+)*) in ([\d.]+)s\b")


def parse_summary(text: str) -> dict:
    """pytest's final summary line, e.g. '812 passed, 13 skipped in 1290.5s (0:21:30)', as counts."""
    hits = [m for m in map(SUMMARY.match, (line.strip() for line in text.splitlines())) if m]
    if not hits:
        raise ValueError("no pytest summary line ('N passed, ... in Xs') found")
    counts_text, seconds = hits[-1].groups()
    counts = {}
    for part in counts_text.split(", "):
        number, word = part.split(" ", 1)
        counts[{"error": "errors", "warning": "warnings"}.get(word, word)] = int(number)
    return {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
            "skipped": counts.get("skipped", 0), "errors": counts.get("errors", 0),
            "counts": counts, "seconds": float(seconds), "summary": f"{counts_text} in {seconds}s"}


def record_suite(args) -> int:
    result = {**parse_summary(Path(args.log).read_text(errors="replace")),
              "command": ".venv/bin/python -m pytest tests -n 2", "commit": args.commit or git_commit(), "date": today(),
              "machine": machine()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    SUITE.write_text(json.dumps(result, indent=2) + "\n")
    print(f"readme_figures: wrote {SUITE.relative_to(ROOT)}: {result['summary']}", file=sys.stderr)
    return 0


def write(args) -> int:
    text = README.read_text()
    values = figures(*load_results())
    missing = sorted(set(values) - {name for name, _ in marked(text)})
    new = fill(text, values)
    changed = sum(a != b for a, b in zip(marked(text), marked(new)))
    if new != text:
        README.write_text(new)
    print(f"readme_figures: README.md: {len(marked(new))} marked figures, {changed} changed"
          + (f"; not marked in the README: {missing}" if missing else ""), file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    measure = commands.add_parser("measure-main-job", help="run the main job once and record its figures")
    measure.add_argument("--verbose", action="store_true", help="echo the job's log lines while it runs")
    measure.set_defaults(run=measure_main_job)
    suite = commands.add_parser("record-suite", help="record a full pytest run's summary line")
    suite.add_argument("log", help="a file holding pytest's output (its last summary line is used)")
    suite.add_argument("--commit", help="the commit the run tested (default: the checkout's)")
    suite.set_defaults(run=record_suite)
    commands.add_parser("write", help="fill the README's marked figures").set_defaults(run=write)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
