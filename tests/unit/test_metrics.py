"""Metrics: JSONL, TensorBoard and offline wandb written; resume drops the interrupted run's
later lines; plots saved; the progress bar's ETA."""

import json

from omegaconf import OmegaConf

from rlkit.config.schema import LoggerConfig, WandbConfig
from rlkit.observability.metrics import MetricsLogger, console_line, progress


def make_logger(tmp_path, resume_step=None, wandb=False):
    cfg = LoggerConfig(wandb=WandbConfig(enabled=wandb, project="rlkit-test", mode="offline"),
                       tensorboard=True, plots=True)
    return MetricsLogger(cfg, tmp_path, "test", OmegaConf.create({"a": 1}), resume_step=resume_step)


def test_every_sink_gets_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = make_logger(tmp_path, wandb=True)
    for step in range(4):
        logger.log(step, {"train/reward": step / 4, "val/reward": 0.5, "timing/step": 0.1})
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert (tmp_path / "plots" / "reward.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "train_reward.png").is_file()


def test_resume_drops_lines_after_the_checkpoint(tmp_path):
    logger = make_logger(tmp_path)
    for step in range(6):
        logger.log(step, {"train/reward": float(step)})
    logger.close()
    resumed = make_logger(tmp_path, resume_step=3)
    assert [m["step"] for m in resumed.history] == [0, 1, 2, 3]
    resumed.log(4, {"train/reward": 40.0})
    resumed.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]


def test_progress_bar_and_eta():
    assert progress(5, 10, 2.0, width=10) == "[#####.....]  50% eta 0m10s"
    assert progress(10, 10, 2.0, width=10).endswith("100% eta 0m00s")
    line = console_line(3, 150, {"train/reward": 0.5, "train/accuracy": 0.25, "timing/step": 0.4,
                                 "timing/train_tokens_per_s": 1234.4}, 0.4)
    assert line.startswith("step   3/150 [") and "eta 0m58s" in line and "reward 0.500" in line
    assert "train_tok/s 1234 | time 0.40s" in line
