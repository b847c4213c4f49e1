"""A CPU run's start-up with its workers forked from one process that imported torch, transformers
and megatron-core (cluster.fork_workers=true, the default) against each worker importing them
itself (false): `rlkit train` of the tiny GRPO recipe, 3 steps, each run a fresh command with a
local Ray cluster of its own, the two settings alternating (one of each per round, so a load that
comes and goes on a shared machine falls on both alike). Reported per setting: the median of the
start-up to the first step (the run's own `start-up ... s to the first step` line, phase by phase)
and of the whole command's wall time, and the ratio of forked to unforked.

    python benchmarks/startup_cpu.py                       (3 rounds, prints a table)
    python benchmarks/startup_cpu.py -n 5 --out s.json     (also writes every run as JSON)
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ["train", "--config-name", "grpo_tiny_cpu", "algorithm.num_steps=3", "algorithm.val_every=100",
       "algorithm.warm_start.sft_steps=0"]
SETTINGS = {"forked": "cluster.fork_workers=true", "each imports": "cluster.fork_workers=false"}
STARTUP = re.compile(r"start-up ([\d.]+) s to the first step: (.*)")


def phases(text: str) -> dict[str, float]:
    """`python_imports 2.5; ray 4.1; generation_workers 9.2 (process_start_imports 3.9, ...)` -> seconds."""
    return {name: float(value) for name, value in re.findall(r"([a-z_]+) ([\d.]+)", text)}


def one_run(setting: str, out_dir: Path, cache_dir: Path) -> dict:
    script = Path(sys.executable).with_name("rlkit")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "rlkit.cli"]
    start = time.perf_counter()
    done = subprocess.run([*command, *RUN, SETTINGS[setting], f"run.output_dir={out_dir}",
                           f"run.cache_dir={cache_dir}"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    found = STARTUP.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{setting}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return {"setting": setting, "wall_s": wall, "startup_s": float(found.group(1)), "phases": phases(found.group(2))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write every run and the summary as JSON")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="rlkit-startup-") as scratch:
        cache = Path(scratch) / "cache"
        one_run("forked", Path(scratch) / "warm", cache)  # builds the tiny model and data once, untimed
        for round_ in range(args.rounds):
            for setting in SETTINGS:
                runs.append(one_run(setting, Path(scratch) / f"{round_}-{setting}".replace(" ", "_"), cache))
    summary = {}
    for setting in SETTINGS:
        mine = [r for r in runs if r["setting"] == setting]
        summary[setting] = {"startup_median_s": statistics.median(r["startup_s"] for r in mine),
                            "wall_median_s": statistics.median(r["wall_s"] for r in mine)}
    ratio = {key: summary["forked"][key] / summary["each imports"][key] for key in summary["forked"]}
    print(f"{'setting':<14} {'to the first step':>18} {'whole command':>14}")
    for setting, values in summary.items():
        print(f"{setting:<14} {values['startup_median_s']:>16.1f} s {values['wall_median_s']:>12.1f} s")
    print(f"{'forked/each':<14} {ratio['startup_median_s']:>18.2f} {ratio['wall_median_s']:>14.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"runs": runs, "summary": summary, "ratio_forked_to_each": ratio,
                                        "rounds": args.rounds, "cpu_count": os.cpu_count(),
                                        "platform": platform.platform(), "python": platform.python_version(),
                                        "load_average_at_end": os.getloadavg()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
