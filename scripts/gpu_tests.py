"""Run tests/gpu across every GPU of one machine, several tests at a time.

Each group of tests runs in its own pytest process (its own Ray cluster) on as many GPUs as its
`@pytest.mark.gpus(n)` asks, and as many groups run at once as the free GPUs allow. Tests of one
file with the same parameters form one group: module-scoped fixtures (the refit tests' workers)
are built once per parameter set, so splitting them would build them again.

    python scripts/gpu_tests.py --log-dir /tmp/gpu_tests [--until EPOCH] [--estimates durations.json] [tests/gpu ...]

A group starts only if its estimated time (from --estimates, a durations.json an earlier run
wrote; 90 s a test otherwise) ends before --until; what is left when nothing more can start is
reported as not run. Run the same command again with the same --log-dir to go on: groups whose
JUnit report exists are not run again. The summary counts every group the log dir holds.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

DEFAULT_ESTIMATE_S = 90.0
SUMMARY_MARGIN_S = 15.0  # kept free before --until for the summary and the log archive


@dataclass
class Group:
    key: str  # file[parameters], also the name of its files in the log dir
    gpus: int
    tests: list = field(default_factory=list)

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.key.removeprefix("tests/gpu/"))


class _Collector:
    """A pytest plugin that keeps each collected test's node id and the GPUs it is marked for."""

    def __init__(self):
        self.tests: list[tuple[str, int]] = []

    def pytest_collection_finish(self, session):
        for item in session.items:
            self.tests.append((item.nodeid, max([1, *(m.args[0] for m in item.iter_markers("gpus"))])))


def collect(paths: list[str]) -> list[Group]:
    collector = _Collector()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *paths], plugins=[collector])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        sys.exit(f"collecting {paths} failed (pytest exit code {code})")
    groups: dict[str, Group] = {}
    for nodeid, gpus in collector.tests:
        file, _, rest = nodeid.partition("::")
        params = re.search(r"\[(.*)\]$", rest)
        key = f"{file}[{params.group(1)}]" if params else nodeid
        group = groups.setdefault(key, Group(key, gpus))
        group.gpus = max(group.gpus, gpus)
        group.tests.append(nodeid)
    return list(groups.values())


def _results(junit: Path) -> dict[str, tuple[str, float]]:
    """nodeid -> (outcome, seconds) from a pytest JUnit report."""
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        nodeid = f"{path}::{case.get('name')}"
        outcome = next((tag for tag in ("failure", "error", "skipped") if case.find(tag) is not None), "passed")
        results[nodeid] = (outcome, float(case.get("time", 0)))
    return results


def _kill_tree(pid: int) -> None:
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def run(groups: list[Group], gpus: int, log_dir: Path, until: float, estimates: dict, pytest_args: list[str]) -> None:
    def estimate(group):
        return sum(estimates.get(t, DEFAULT_ESTIMATE_S) for t in group.tests)

    # longest first; each round starts every group that fits the GPUs free then, so a group that
    # needs every GPU runs once the narrower ones are done. One that needs more GPUs than there are
    # is left out (summarize reports it skipped, as its own run would be)
    queue = sorted((g for g in groups if g.gpus <= gpus and not (log_dir / f"{g.slug}.xml").exists()),
                   key=lambda g: (-estimate(g), -g.gpus))
    (log_dir / "tmp").mkdir(parents=True, exist_ok=True)  # pytest makes each group's --basetemp, not its parents
    free, running = list(range(gpus)), {}  # Popen -> (group, gpus held, started)
    while queue or running:
        for process, (group, held, started) in list(running.items()):
            if process.poll() is not None or time.time() > until:
                if process.poll() is None:
                    print(f"[gpu_tests] {group.key}: stopped at --until", flush=True)
                _kill_tree(process.pid)
                process.wait()
                print(f"[gpu_tests] {group.key} ended ({time.time() - started:.0f} s, exit {process.returncode})",
                      flush=True)
                free = sorted(free + held)
                del running[process]
        for group in list(queue):
            if group.gpus <= len(free) and time.time() + estimate(group) < until - SUMMARY_MARGIN_S:
                held, free = free[:group.gpus], free[group.gpus:]
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, held)),
                       # vLLM's compile cache is not safe against two engines writing one entry at once;
                       # a GPU runs one group at a time, so a cache per first GPU is never shared
                       "VLLM_CACHE_ROOT": str(Path.home() / ".cache" / f"vllm-gpu{held[0]}")}
                command = [sys.executable, "-m", "pytest", *group.tests, "-v", "-rA", "-p", "no:cacheprovider",
                           f"--junitxml={log_dir / (group.slug + '.xml')}", f"--basetemp={log_dir / 'tmp' / group.slug}",
                           *pytest_args]
                with open(log_dir / f"{group.slug}.log", "w") as log:
                    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True)
                running[process] = (group, held, time.time())
                queue.remove(group)
                print(f"[gpu_tests] {group.key} started on GPU {env['CUDA_VISIBLE_DEVICES']} "
                      f"(estimate {estimate(group):.0f} s)", flush=True)
        if queue and not running:
            break  # what is left cannot end before --until
        time.sleep(1)
    for group in queue:
        print(f"[gpu_tests] {group.key}: not started (estimate {estimate(group):.0f} s past --until)", flush=True)


def summarize(groups: list[Group], gpus: int, log_dir: Path) -> str:
    counts, lines, durations = {}, [], {}
    for group in groups:
        junit = log_dir / f"{group.slug}.xml"
        results = _results(junit) if junit.exists() else {}
        for test in group.tests:
            outcome, seconds = results.get(test, ("not run", 0.0))
            if outcome == "not run" and group.gpus > gpus:
                outcome = "skipped"  # by the plan: a run on this many GPUs would skip it alike
            counts[outcome] = counts.get(outcome, 0) + 1
            lines.append(f"{outcome:>8}  {seconds:7.1f} s  {test}")
            if outcome == "passed":
                durations[test] = round(seconds, 1)
    (log_dir / "durations.json").write_text(json.dumps(durations, indent=1, sort_keys=True) + "\n")
    total = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    return "\n".join([*lines, f"tests/gpu on {gpus} GPU(s): {total}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", default=["tests/gpu"])
    parser.add_argument("--log-dir", type=Path, required=True, help="logs, JUnit reports, durations.json")
    parser.add_argument("--gpus", type=int, help="GPUs to use (default: every visible one)")
    parser.add_argument("--until", type=float, default=float("inf"), help="start no group that would end after "
                        "this Unix time; stop what still runs then")
    parser.add_argument("--estimates", type=Path, help="durations.json of an earlier run (seconds per test)")
    parser.add_argument("--pytest-args", default="--timeout=300", help="more pytest arguments for every group")
    args = parser.parse_args()
    import torch  # after argparse: --help answers without it

    gpus = args.gpus if args.gpus is not None else torch.cuda.device_count()
    estimates = json.loads(args.estimates.read_text()) if args.estimates else {}
    groups = collect(args.paths)
    started = time.time()
    run(groups, gpus, args.log_dir, args.until, estimates, args.pytest_args.split())
    print(summarize(groups, gpus, args.log_dir))
    print(f"[gpu_tests] this call: {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
