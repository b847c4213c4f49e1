"""Batch: the one container that moves between controller and workers.

A dict of tensors sharing the leading (sample) dimension. Fields used by rlkit, with shapes
(B samples, S tokens; token-aligned means position t describes input_ids[:, t]):

  input_ids            [B, S] long   prompt + response, right-padded with pad_id
  response_mask        [B, S] float  1 where the token is model-generated and trained on
  generation_logprobs  [B, S] float  sampler logprob of each response token (token-aligned)
  old_logprobs         [B, S] float  policy logprob before this step's update (token-aligned)
  reference_logprobs   [B, S] float  frozen reference policy logprob (token-aligned)
  advantages           [B] or [B, S] float  per sample (broadcast over its tokens) or per token
  returns, old_values  [B, S] float  PPO: the critic's regression targets and its values at rollout time
  off_policy_weights   [B, S] float  per-token weights of the off-policy correction (rlkit/algorithms/off_policy.py)
  entropy              [B, S] float  per micro-batch, when the objective has an entropy bonus (with its gradient)
  loss_mask            [B, S] float  SFT and DPO: 1 on target tokens
  position_ids, segment_ids  [B, S] long  packed rows only (rlkit/data/packing.py): positions restart at 0
                       for each sequence, segment ids tell the sequences apart

Without packing, right padding keeps position ids 0..S-1 valid for every sample, so no attention mask
is needed; a packed row's attention stays inside each segment.
"""

from dataclasses import dataclass

import torch


MODEL_INPUTS = ("input_ids", "position_ids", "segment_ids")  # what a forward pass reads (packing adds the last two)


@dataclass(frozen=True)
class BatchTotals:
    """Counts over the whole optimizer batch (all micro-batches, all DP ranks): the normalizers
    that make each micro-batch's loss its exact share of the batch loss."""

    num_tokens: float  # masked tokens
    num_sequences: float

    def __add__(self, other: "BatchTotals") -> "BatchTotals":
        return BatchTotals(self.num_tokens + other.num_tokens, self.num_sequences + other.num_sequences)


def batch_totals(mask: torch.Tensor) -> BatchTotals:
    return BatchTotals(num_tokens=float(mask.sum()), num_sequences=float(mask.shape[0]))


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor]

    def __post_init__(self):
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the number of samples: {sizes}")

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0] if self.tensors else 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def with_fields(self, **fields: torch.Tensor) -> "Batch":
        return Batch({**self.tensors, **fields})

    def select(self, *keys: str) -> "Batch":
        missing = [k for k in keys if k not in self.tensors]
        if missing:
            raise KeyError(f"Batch lacks fields {missing}; it has {sorted(self.tensors)}")
        return Batch({k: self.tensors[k] for k in keys})

    def slice(self, start: int, stop: int) -> "Batch":
        return Batch({k: v[start:stop] for k, v in self.tensors.items()})

    def split(self, num_chunks: int) -> list["Batch"]:
        """Equal contiguous chunks (e.g. one per DP rank, or micro-batches)."""
        if len(self) % num_chunks:
            raise ValueError(f"cannot split a batch of {len(self)} samples into {num_chunks} equal chunks")
        size = len(self) // num_chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(num_chunks)]

    @staticmethod
    def concat(batches: list["Batch"]) -> "Batch":
        keys = batches[0].tensors.keys()
        if any(b.tensors.keys() != keys for b in batches):
            raise ValueError(f"cannot concat batches with different fields: {[sorted(b.tensors) for b in batches]}")
        return Batch({k: torch.cat([b.tensors[k] for b in batches]) for k in keys})


def right_pad(sequences: list[list[int]], pad_id: int, length: int | None = None) -> torch.Tensor:
    """[len(sequences), length] long tensor, each sequence left-aligned."""
    length = length or max(len(s) for s in sequences)
    out = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def rollout_batch(prompt_ids: list[list[int]], generations, pad_id: int) -> Batch:
    """Right-padded prompt+response rows with a response mask and the sampler's logprobs,
    all token-aligned (generations: rlkit.data.generation.Generations)."""
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
    return masked_batch([(p + t, [False] * len(p) + [True] * len(t)) for p, t in zip(prompt_ids, target_ids)], pad_id)


def masked_batch(rows: list[tuple[list[int], list[bool]]], pad_id: int) -> Batch:
    """Rows of (token ids, whether each is trained on); loss_mask marks the trained tokens."""
    input_ids = right_pad([ids for ids, _ in rows], pad_id)
    loss_mask = torch.zeros(input_ids.shape, dtype=torch.float32)
    for i, (_, trained) in enumerate(rows):
        loss_mask[i, :len(trained)] = torch.tensor(trained, dtype=torch.float32)
    return Batch({"input_ids": input_ids, "loss_mask": loss_mask})
