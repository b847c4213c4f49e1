"""Masks the token-level unit tests share: the shapes a response mask takes in practice."""

import torch

# token-aligned response masks, one row per sample; samples of one prompt adjacent
MASK = torch.tensor([
    [0, 0, 1, 1, 1, 1, 1, 1],  # prompt, then response to the end
    [0, 0, 1, 1, 1, 0, 0, 0],  # prompt, response, trailing padding
    [0, 1, 1, 0, 0, 1, 1, 0],  # multi-turn: observation tokens (a hole) inside the response
    [0, 0, 0, 0, 0, 0, 0, 0],  # zero-length response
    [1, 1, 1, 1, 1, 1, 1, 1],
    [0, 0, 0, 1, 0, 0, 0, 0],  # single token
], dtype=torch.float32)


def with_garbage(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values with nan / inf / -inf at the unmasked positions; results must not change."""
    garbage = torch.tensor([float("nan"), float("inf"), float("-inf")]).repeat(values.numel() // 3 + 1)
    return torch.where(mask.bool(), values, garbage[:values.numel()].view_as(values))
