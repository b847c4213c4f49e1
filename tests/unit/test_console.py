"""A command's console carries rlkit's lines and anyone's errors; other libraries' records and
warnings go to the run's log file, which waits for the run's folder (rlkit/observability/console.py).
The logging setup runs in a fresh interpreter, as a command's does (pytest configures logging here)."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

from rlkit.observability.console import LOG_FILE, RLKIT_DIR, console_lines

COMMAND = textwrap.dedent("""
    import logging, sys, warnings
    from pathlib import Path
    from rlkit.observability import console

    console.setup()
    run_dir = Path(sys.argv[1])
    console.log_run_in(run_dir)
    logging.getLogger("rlkit").info("rlkit's line")
    logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
    warnings.warn_explicit("old API", FutureWarning, "/site-packages/lib/mod.py", 7)
    warnings.warn_explicit("rlkit's own warning", UserWarning, console.RLKIT_DIR + "/cli.py", 3)
    logging.getLogger("ray").error("a worker died")
    run_dir.mkdir()  # the run's folder appears as its workers start
    logging.getLogger("transformers").warning("after the folder")
    from huggingface_hub.utils import tqdm  # transformers' and datasets' bars, as they save and load
    list(tqdm(range(3), desc="Writing model shards"))
""")


def test_console_has_rlkits_lines_and_errors_the_run_log_everything(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", COMMAND, str(run_dir)], capture_output=True, text=True,
                            timeout=60, cwd=Path(RLKIT_DIR).parent)
    assert result.returncode == 0, result.stderr
    # each record's first line, its time left out (a warning's second is the source line it names)
    console = [re.sub(r"^\d\d:\d\d:\d\d ", "", line) for line in result.stderr.splitlines() if not line.startswith(" ")]
    assert console == ["rlkit's line", f"{RLKIT_DIR}/cli.py:3: UserWarning: rlkit's own warning", "a worker died"]
    assert result.stdout == ""
    log = (run_dir / LOG_FILE).read_text()
    for said in ["rlkit's line", "generated new fontManager", "FutureWarning: old API", "rlkit's own warning",
                 "a worker died", "after the folder"]:
        assert said in log, said


def test_worker_lines_on_the_console_are_rlkits_and_errors():
    stdout = [" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 533632",
              "[policy] refit export: direct row copies from the parameters", "rlkit fork server: note",
              "ERROR 11-28 17:40:00 [core.py:7] EngineCore failed to start."]
    assert console_lines(stdout, is_err=False) == stdout[1:]
    stderr = ["/venv/site-packages/megatron/core/x.py:799: FutureWarning: `load_state_dict` is deprecated",
              "  checkpoint.load_state_dict(",
              f"{RLKIT_DIR}/workers/x.py:5: UserWarning: rlkit's own",
              "  warnings.warn(...)",
              "Traceback (most recent call last):",
              "  File \"x.py\", line 1, in <module>",
              "RuntimeError: boom",
              "Loading: 100%|##########| 1/1\r"]
    assert console_lines(stderr, is_err=True) == stderr[2:7]
