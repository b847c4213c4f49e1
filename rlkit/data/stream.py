"""Endless shuffled epochs over a dataset: what each step trains on, with a resumable position."""

import random


class ShuffledStream:
    """next() gives `size` rows; each epoch is a new permutation drawn from `seed`."""

    def __init__(self, dataset, size: int, seed: int):
        self.rows, self.size, self.rng = list(dataset), size, random.Random(seed)
        self.order, self.position = [], 0

    def state(self) -> dict:
        return {"rng": self.rng.getstate(), "order": list(self.order), "position": self.position}

    def restore(self, state: dict):
        self.rng.setstate(state["rng"])
        self.order, self.position = list(state["order"]), state["position"]

    def __next__(self) -> list:
        batch = []
        while len(batch) < self.size:
            if self.position == len(self.order):
                self.order, self.position = self.rng.sample(range(len(self.rows)), len(self.rows)), 0
            batch.append(self.rows[self.order[self.position]])
            self.position += 1
        return batch
