"""How fast the CLI answers what needs no worker: the help texts and config errors. Each command
runs N times, each time in a fresh process; reported: the median wall time (and min, max) of each,
beside two references measured in the same run: `python -c pass` (the interpreter's own start)
and `python -c "import torch"` (what a command pays if anything on its path imports torch).

    python benchmarks/cli_latency.py                          (N=5, prints a table)
    python benchmarks/cli_latency.py -n 11 --out cli.json     (also writes the numbers as JSON)

The runs are interleaved (one of each command per round), so a load that comes and goes on a
shared machine spreads over all of them alike. A command that answers with another exit code
than expected (e.g. a config error that became a traceback) fails the benchmark.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ["train", "--config-name", "grpo_tiny_cpu"]
# name -> (arguments of rlkit, the exit code it must answer with)
COMMANDS = {
    "rlkit --help": (["--help"], 0),
    "rlkit train --help": (["train", "--help"], 0),
    "unknown recipe": (["train", "--config-name", "grpo_tiny"], 2),
    "unknown key (Hydra)": ([*RECIPE, "algorithm.kl_coeff=0.1"], 2),
    "misspelled group": ([*RECIPE, "polcy.lr=1e-5"], 2),
    "policy.lr=abc": ([*RECIPE, "policy.lr=abc"], 2),
    "wrong type (schema)": ([*RECIPE, "policy.optimizer.lr=abc"], 2),
    "algorithm's own check": ([*RECIPE, "algorithm.group_size=1"], 2),
}
REFERENCES = {"python -c pass": [sys.executable, "-c", "pass"],
              "python -c 'import torch'": [sys.executable, "-c", "import torch"]}


def rlkit_command() -> list[str]:
    """The installed `rlkit` script beside this interpreter, as a user runs it; else `-m rlkit.cli`."""
    script = Path(sys.executable).with_name("rlkit")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "rlkit.cli"]


def timed(argv: list[str]) -> tuple[float, int, str]:
    """(wall seconds, exit code, first line of what it printed) of one fresh process."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = (done.stderr if done.returncode else done.stdout).strip().splitlines()
    return seconds, done.returncode, lines[0] if lines else ""


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs_s": times}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=5, help="runs of each command (fresh process each)")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()

    rlkit = rlkit_command()
    jobs = {**{name: (argv, None) for name, argv in REFERENCES.items()},
            **{name: ([*rlkit, *argv], code) for name, (argv, code) in COMMANDS.items()}}
    times = {name: [] for name in jobs}
    answers, wrong = {}, {}
    for _ in range(args.n):
        for name, (argv, expected) in jobs.items():
            seconds, code, first = timed(argv)
            times[name].append(seconds)
            answers[name] = first
            if expected is not None and code != expected:
                wrong[name] = f"exit {code}, expected {expected}: {first}"

    results = {name: {"argv": argv, "expected_exit": expected, "answer": answers[name], **summary(times[name])}
               for name, (argv, expected) in jobs.items()}
    width = max(map(len, jobs))
    print(f"{'command':<{width}}  median    min      max      first line of the answer")
    for name, r in results.items():
        print(f"{name:<{width}}  {r['median_s']:6.3f} s {r['min_s']:6.3f} s {r['max_s']:6.3f} s  {r['answer'][:70]}")
    print(f"{args.n} runs each, {os.cpu_count()} CPUs, python {platform.python_version()}, rlkit as "
          f"{' '.join(Path(a).name for a in rlkit)}")
    for name, problem in wrong.items():
        print(f"FAILED {name}: {problem}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "n": args.n, "cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.node(),
            "rlkit": rlkit, "results": results, "wrong_exit": wrong}, indent=1) + "\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
