"""Checkpoints: everything a resume needs, written atomically.

Layout of <run_dir>/checkpoints/step_000042/:
  policy/                 weights + optimizer state (format: checkpoint.save_format), written by
                          the policy workers themselves
  critic/                 the same for PPO's critic
  rng/<model>_rank_<r>.pt each rank's RNG states and learning rate
  controller.pt           step, data-stream position
  config.yaml        the resolved config of the run
A checkpoint is written into step_N.tmp-<pid> and renamed when complete, so a directory named
step_N is always whole; leftovers of a killed write are never read and are removed.
"""

import os
import re
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rlkit.config.schema import CheckpointConfig

_COMPLETE = re.compile(r"^step_(\d{6})$")


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path):
        self.cfg = cfg
        self.root = Path(cfg.dir) if cfg.dir else run_dir / "checkpoints"

    def complete(self) -> list[Path]:
        """Whole checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _COMPLETE.match(p.name))]
        return [p for _, p in sorted(found)]

    def to_resume(self) -> Path | None:
        """The checkpoint checkpoint.resume asks for: auto = newest complete one (None if none),
        none = never, otherwise a path."""
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume == "auto":
            found = self.complete()
            return found[-1] if found else None
        path = Path(self.cfg.resume)
        if not _COMPLETE.match(path.name) or not path.is_dir():
            raise FileNotFoundError(f"checkpoint.resume={self.cfg.resume}: not a complete checkpoint directory "
                                    f"(step_NNNNNN); use auto, none, or such a directory")
        return path

    def save(self, step: int, write_models, controller_state: dict, resolved: DictConfig) -> Path:
        """write_models(dir) writes the models' part (weights, optimizer, RNG) into dir."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_models(str(tmp))
        torch.save(controller_state, tmp / "controller.pt")
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        if final.exists():  # a resumed run re-reaching a step it had already saved
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return final

    def _prune(self):
        for stale in [p for p in self.root.iterdir() if ".tmp-" in p.name]:
            shutil.rmtree(stale, ignore_errors=True)
        for old in self.complete()[:-self.cfg.keep_last] if self.cfg.keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def controller_state(path: Path) -> dict:
        return torch.load(path / "controller.pt", weights_only=False)

