"""Prompts in, training Batches out."""

import random

import torch

from rlkit.data.batch import Batch, right_pad
from rlkit.workers.generation.base import Generations


class PromptStream:
    """Endless shuffled epochs over a dataset; next() gives `size` rows."""

    def __init__(self, dataset, size: int, seed: int):
        self.rows, self.size, self.rng = list(dataset), size, random.Random(seed)
        self.order, self.position = [], 0

    def state(self) -> dict:
        return {"rng": self.rng.getstate(), "order": list(self.order), "position": self.position}

    def restore(self, state: dict):
        self.rng.setstate(state["rng"])
        self.order, self.position = list(state["order"]), state["position"]

    def __next__(self) -> list[dict]:
        batch = []
        while len(batch) < self.size:
            if self.position == len(self.order):
                self.order, self.position = self.rng.sample(range(len(self.rows)), len(self.rows)), 0
            batch.append(self.rows[self.order[self.position]])
            self.position += 1
        return batch


def rollout_batch(prompt_ids: list[list[int]], generations: Generations, pad_id: int) -> Batch:
    """Right-padded prompt+response rows with a response mask and the sampler's logprobs,
    all token-aligned (see Batch)."""
    sequences = [p + r for p, r in zip(prompt_ids, generations.token_ids)]
    input_ids = right_pad(sequences, pad_id)
    response_mask = torch.zeros(input_ids.shape, dtype=torch.float32)
    generation_logprobs = torch.zeros(input_ids.shape, dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompt_ids, generations.token_ids, generations.logprobs)):
        response_mask[i, len(p):len(p) + len(r)] = 1.0
        generation_logprobs[i, len(p):len(p) + len(r)] = torch.tensor(lp, dtype=torch.float32)
    return Batch({"input_ids": input_ids, "response_mask": response_mask,
                  "generation_logprobs": generation_logprobs})


def supervised_batch(prompt_ids: list[list[int]], target_ids: list[list[int]], pad_id: int) -> Batch:
    """prompt+target rows; loss_mask marks the target tokens."""
    input_ids = right_pad([p + t for p, t in zip(prompt_ids, target_ids)], pad_id)
    loss_mask = torch.zeros(input_ids.shape, dtype=torch.float32)
    for i, (p, t) in enumerate(zip(prompt_ids, target_ids)):
        loss_mask[i, len(p):len(p) + len(t)] = 1.0
    return Batch({"input_ids": input_ids, "loss_mask": loss_mask})
