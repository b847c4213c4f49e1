"""What every training backend's rank does alike: name its accelerator, report its peak memory,
and set or drop its optimizer (self.optimizer, built at its first use: None until then)."""

import torch

ON_GPU = torch.cuda.is_available()


class RankBasics:
    optimizer = None
    lr: float

    def device_name(self) -> str | None:
        return torch.cuda.get_device_name() if ON_GPU else None

    def peak_memory_gb(self) -> float:
        if not ON_GPU:
            return 0.0
        peak = torch.cuda.max_memory_allocated() / 1e9
        torch.cuda.reset_peak_memory_stats()
        return peak

    def reset_optimizer(self):
        """Drop optimizer state (rebuilt fresh at the next train step), e.g. between a warm start
        and RL, so a run that just did the warm start and one that loaded it from cache agree."""
        self.optimizer = None

    def set_learning_rate(self, lr: float):
        self.lr = lr
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
