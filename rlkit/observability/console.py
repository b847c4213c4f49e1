"""What a command prints: rlkit's own lines. Other libraries' log records, Python warnings and the
lines worker processes print go to the run's log file (<run_dir>/run.log) instead, so the console
reads as rlkit's account of the run and the file keeps the rest; errors, anyone's, reach both.

The command's process (`setup`) and Ray's output in it (`route_ray_output`); worker processes'
warnings that are known and harmless are filtered where they start (rlkit/workers/)."""

import logging
import os
import re
import warnings
from pathlib import Path

RLKIT_DIR = str(Path(__file__).resolve().parents[1])
LOG_FILE = "run.log"
WAITING_MAX = 10_000  # records kept for a run log whose folder does not exist yet (the newest)
# progress bars carry nothing a log needs; read by huggingface_hub (model downloads and saves,
# transformers' "Writing model shards") and datasets, here and in the workers, which inherit them
QUIET_PROGRESS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
# a Python warning as the warnings module prints it: "path:line: SomeWarning: message"
WARNING_LINE = re.compile(r"^(?P<path>.+?):\d+: \w*Warning: ")
# what rlkit's worker code prints: "[policy] refit export: ...", "rlkit fork server: ..."
RLKIT_WORKER_LINE = re.compile(r"\[\w[\w-]*\] |rlkit\b")
# an error a library logs to standard output (vLLM's logger writes there), shown whoever wrote it
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL|FATAL)\b|^Traceback \(most recent call last\)")
# the loggers whose records are rlkit's: its own, and the warnings that rlkit's code raises
RLKIT_LOGGER = "rlkit"
THIRD_PARTY_WARNINGS = "py.warnings"
WORKER_LINES = "workers"

_run_log: "RunLog | None" = None  # this command's, once setup() configured logging


def is_rlkits(record: logging.LogRecord) -> bool:
    """Whether a record is for the console: rlkit's own, or an error of anyone's."""
    return record.name.split(".")[0] == RLKIT_LOGGER or record.levelno >= logging.ERROR


class RunLog(logging.Handler):
    """Every record into <run_dir>/run.log, appended. The run creates its folder as its workers
    start (a config or data error leaves none): the records before then wait here."""

    def __init__(self, run_dir: Path | None):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.run_dir, self.waiting, self.file = run_dir, [], None

    def emit(self, record: logging.LogRecord) -> None:
        self.waiting.append(self.format(record))
        del self.waiting[:-WAITING_MAX]
        self.flush()

    def flush(self) -> None:
        if self.file is None and self.run_dir is not None and self.run_dir.is_dir():
            self.file = open(self.run_dir / LOG_FILE, "a")
        if self.file is not None:
            self.file.writelines(line + "\n" for line in self.waiting)
            self.file.flush()
            self.waiting = []

    def close(self) -> None:
        self.flush()  # the folder may have appeared since the last record
        if self.file is not None:
            self.file.close()
        super().close()


def setup() -> None:
    """Console and run log for a command (log_run_in names the run). Leaves logging alone where
    something configured it already (a program or test that calls rlkit's main)."""
    global _run_log
    root = logging.getLogger()
    if root.handlers and _run_log not in root.handlers:
        return
    for variable, value in QUIET_PROGRESS.items():
        os.environ.setdefault(variable, value)
    if _run_log is not None:
        root.removeHandler(_run_log)
        _run_log.close()
    root.handlers = [handler for handler in root.handlers if not getattr(handler, "rlkit_console", False)]
    console = logging.StreamHandler()
    console.rlkit_console = True
    console.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    console.addFilter(is_rlkits)
    _run_log = RunLog(None)
    root.addHandler(console)
    root.addHandler(_run_log)
    root.setLevel(logging.INFO)
    warnings.showwarning = _log_warning


def log_run_in(run_dir: Path) -> None:
    """The run whose folder gets the run log; a command that names none keeps no log file (the
    records that are not for the console are dropped at its end)."""
    if _run_log is not None:
        _run_log.run_dir = run_dir


def _log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A Python warning as a record: rlkit's logger's where rlkit's code raised it, else py.warnings."""
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    name = RLKIT_LOGGER if str(Path(filename).resolve()).startswith(RLKIT_DIR) else THIRD_PARTY_WARNINGS
    logging.getLogger(name).warning("%s", text)


def route_ray_output() -> None:
    """Ray's output in a command that setup() configured, to call before ray.init: Ray's own log
    records join the others (Ray gives its logger a console handler of its own), and of the lines
    Ray forwards from worker processes the console gets rlkit's (see console_lines), the run log
    every one."""
    if _run_log is None:
        return
    import ray._private.worker as ray_worker

    ray_logger = logging.getLogger("ray")
    ray_logger.handlers.clear()
    ray_logger.propagate = True
    print_lines = ray_worker.print_to_stdstream
    if getattr(print_lines, "rlkit_routed", False):
        return

    def print_rlkits(data: dict, ignore_prefix: bool) -> None:
        lines, pid = data.get("lines", []), data.get("pid")
        # Ray's own notices (a worker killed for memory, say) are the cluster's health, shown whole
        system = pid in ("raylet", "autoscaler")
        name = data.get("actor_name") or data.get("task_name")
        prefix = f"({pid})" if system else f"({name} pid={pid})" if name else f"(pid={pid})"  # as Ray's
        for line in lines:
            logging.getLogger(WORKER_LINES).info("%s %s", prefix, line)
        shown = lines if system else console_lines(lines, data.get("is_err", False))
        if shown:
            print_lines({**data, "lines": shown}, ignore_prefix)

    print_rlkits.rlkit_routed = True
    ray_worker.print_to_stdstream = print_rlkits


def console_lines(lines: list[str], is_err: bool) -> list[str]:
    """Which of a batch of lines a worker printed reach the console: on stdout, rlkit's own
    (RLKIT_WORKER_LINE) and errors (ERROR_LINE); on stderr, all but Python warnings that rlkit's
    code did not raise (the warning line and its indented source line) and progress bars."""
    shown, in_warning = [], False
    for line in lines:
        warning = WARNING_LINE.match(line)
        if warning:
            in_warning = not warning["path"].startswith(RLKIT_DIR)
        elif not line.startswith(" "):
            in_warning = False
        if is_err:
            keep = not in_warning and "\r" not in line
        else:
            keep = RLKIT_WORKER_LINE.match(line) is not None or ERROR_LINE.search(line) is not None
        if keep:
            shown.append(line)
    return shown
