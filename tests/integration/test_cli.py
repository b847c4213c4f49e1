"""`rlkit train` as a user runs it (the README's environment example, run once for the session:
conftest.readme_environment_command): the command starts its own local Ray cluster, warm-starts
(and caches the warm start), prints one line per step and no warnings, stops what it started, and
run again once finished says so without starting anything. Config and data errors, and the
refit check, each one line (the last two by the CLI's main in this process, on the session's
cluster)."""

import logging
import subprocess
import sys

import pytest
import ray

from rlkit.cli import main
from rlkit.launch.config import load_config
from rlkit.launch.run import train

pytestmark = pytest.mark.integration


def test_train_command_runs_and_reuses_its_warm_start(readme_environment_command, warm_pool, caplog):
    command = readme_environment_command
    log = command.stderr
    assert command.returncode == 0, log[-3000:]
    assert "started a local Ray cluster" in log
    assert "running 2 SFT steps" in log
    assert "step   1/2 [" in log and "step   2/2 [" in log and "| reward" in log and "val_acc" in log
    run_name = next(word.split("=", 1)[1] for word in command.argv if word.startswith("run.name="))
    assert (command.cwd / "out" / run_name / "metrics.jsonl").is_file()
    # expected warnings are said once, by the driver; no Python warning from any process
    assert "UserWarning" not in log and "c10d::broadcast_" not in log
    assert log.count("not installed: Megatron uses its PyTorch fallbacks") == 1

    again = command.again()  # finished: says so, starts nothing
    assert again.returncode == 0 and f"{run_name} already finished" in again.stderr, again.stderr[-3000:]
    assert "started a local Ray cluster" not in again.stderr

    # a new run of the same warm start (its key holds the model, data and warm-start settings, and the
    # environment only where it writes reference turns: neither of these does) loads it, in this
    # process on the pool's workers
    overrides = [word for word in command.argv[command.argv.index("grpo_tiny_cpu") + 1:]
                 if not word.startswith(("env.", "run.name="))]
    cfg, resolved = load_config("grpo_tiny_cpu", [*overrides, "run.name=second"])
    with caplog.at_level(logging.INFO, logger="rlkit"):
        train(cfg, resolved, pool=warm_pool)
    assert "using the cached SFT checkpoint" in caplog.text
    assert "running 2 SFT steps" not in caplog.text


def test_config_error_exits_before_any_worker(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rlkit.cli", "train", "--config-name", "grpo_tiny_cpu",
                             f"run.cache_dir={tmp_path / 'cache'}", f"run.output_dir={tmp_path / 'out'}",
                             "algorithm.group_size=1"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "rlkit: config error: algorithm.group_size: GRPO needs at least 2 samples per prompt to compare "
        "(got: 1); set it to 2 or more"]


def in_this_process(capsys, *argv: str) -> tuple[int, str, str]:
    """`rlkit <argv>` by the CLI's own main, in this process, joining the session's cluster
    (cluster.address) instead of starting one: a command's start-up as its own process is
    test_train_command_runs_and_reuses_its_warm_start's. Returns the exit status, stdout, stderr."""
    status = main([*argv, f"cluster.address={ray.get_runtime_context().gcs_address}"])
    out, err = capsys.readouterr()
    return status, out, err


def test_verify_refit_reports_float_noise_on_cpu(ray_cluster, cache_dir, capsys):
    status, out, err = in_this_process(capsys, "verify-refit", "--config-name", "grpo_tiny_cpu", "--num-prompts", "16",
                                       f"run.cache_dir={cache_dir}")
    assert status == 0, err[-3000:]
    report = dict(line.split(": ") for line in out.strip().splitlines())
    assert float(report["refit/token_mult_prob_error"]) < 1.0001
    assert float(report["refit/logprob_abs_error_max"]) < 1e-4
    assert int(report["refit/tokens_compared"]) > 0


@pytest.mark.parametrize("rows, message", [
    (None, "data.train_path: {path}: no such file"),
    ('{"prompt": "1+1=", "response": "2"}\n{"prompt": "2+2="}\n', "data.train_path: {path} row 1 lacks 'response'"),
], ids=["missing-file", "row-without-response"])
def test_bad_sft_data_is_one_error_naming_file_row_and_field(ray_cluster, tmp_path, capsys, rows, message):
    """Bad data fails before any worker starts, as one line naming the key, the file, the row and
    the field; no run folder is left behind."""
    path = tmp_path / "data.jsonl"
    if rows is not None:
        path.write_text(rows)
    status, _, err = in_this_process(capsys, "train", "--config-name", "sft_tiny_cpu",
                                     f"run.cache_dir={tmp_path / 'cache'}", f"run.output_dir={tmp_path / 'out'}",
                                     f"data.train_path={path}", "data.val_path=null", "data.synthetic=null")
    assert status == 2
    errors = [line for line in err.splitlines() if line.startswith("rlkit: config error:")]
    assert len(errors) == 1 and message.format(path=path) in errors[0], err[-2000:]
    assert not (tmp_path / "out").exists()
