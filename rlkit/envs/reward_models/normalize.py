"""What a reward model's raw scores become as rewards: unchanged (none), centred and scaled by
the mean and standard deviation of every score so far (running), or scale * score + shift (affine)."""

import math
from dataclasses import dataclass

NORMALIZATIONS = ("none", "running", "affine")


@dataclass
class RunningMoments:
    """Count, mean and sum of squared deviations of every score seen (Chan et al.'s parallel
    update: a batch at a time, no drift from summing squares)."""
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, scores: list[float]) -> None:
        if not scores:
            return
        n = len(scores)
        mean = sum(scores) / n
        m2 = sum((s - mean) ** 2 for s in scores)
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta ** 2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0


class Normalizer:
    """how: one of NORMALIZATIONS. A running normalizer counts each batch in before it scales
    it, so a first batch is centred on itself; its standard deviation is floored at `eps`."""

    def __init__(self, how: str, scale: float = 1.0, shift: float = 0.0, eps: float = 1e-6):
        if how not in NORMALIZATIONS:
            raise ValueError(f"normalization {how!r} is not one of {NORMALIZATIONS}")
        self.how, self.scale, self.shift, self.eps = how, scale, shift, eps
        self.moments = RunningMoments()

    def __call__(self, scores: list[float]) -> list[float]:
        if self.how == "affine":
            return [self.scale * s + self.shift for s in scores]
        if self.how == "running":
            self.moments.add(scores)
            mean, std = self.moments.mean, max(self.moments.std, self.eps)
            return [(s - mean) / std for s in scores]
        return list(scores)
