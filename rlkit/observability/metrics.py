"""Metrics: phase timers, one console line per step, a JSONL file, optional wandb."""

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlkit.config.schema import LoggerConfig

log = logging.getLogger("rlkit")


class PhaseTimer:
    """with timer("generate"): ...  ->  {"timing/generate": seconds}"""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{phase}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start


class MetricsLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, run_name: str, resolved: DictConfig):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        self._file = open(run_dir / "metrics.jsonl", "a")
        self._wandb = None
        if cfg.wandb.enabled:
            import wandb
            self._wandb = wandb.init(project=cfg.wandb.project, name=run_name, mode=cfg.wandb.mode,
                                     dir=str(run_dir), config=OmegaConf.to_container(resolved, resolve=True))

    def log(self, step: int, metrics: dict):
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self):
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def console_line(step: int, num_steps: int, m: dict) -> str:
    parts = [f"step {step:>3}/{num_steps}"]
    for key, label, fmt in [("train/reward", "reward", ".3f"), ("train/accuracy", "acc", ".3f"),
                            ("val/accuracy", "val_acc", ".3f"), ("val/reward", "val_reward", ".3f"),
                            ("train/turns", "turns", ".2f"), ("env/failures", "env_fail", "d"),
                            ("train/response_length", "len", ".1f"),
                            ("train/kl", "kl", ".4f"), ("train/entropy", "ent", ".3f"),
                            ("train/grad_norm", "gnorm", ".3f"),
                            ("refit/logprob_abs_error_mean", "lp_err", ".1e"), ("timing/step", "time", ".2f")]:
        if key in m:
            parts.append(f"{label} {m[key]:{fmt}}" + ("s" if key == "timing/step" else ""))
    return " | ".join(parts)
