"""Advantage estimators: pure functions of rewards (and, token-level, of logprobs and values).

Token-level estimators run where a rollout shard is held (rlkit/workers/policy/megatron.py);
statistics over the whole batch, such as whitening, take `reduce(tensor, op)`, which combines a
tensor over every shard with op in {"sum", "min", "max"}. The default, `whole_batch`, is the
identity: the tensors are the whole batch.

Group estimators (GRPO, RLOO, group centring) take the group structure as a group_size (uniform
groups, each prompt's samples adjacent) or as [B] group ids (groups of any size, one-sample groups
included; see group_index)."""

import torch


def whole_batch(tensor: torch.Tensor, op: str) -> torch.Tensor:
    return tensor


def group_index(groups: int | torch.Tensor, count: int) -> torch.Tensor:
    """[count] index in 0..G-1 of each sample's group, from either form of the group structure:
    an int group_size (the samples of one prompt adjacent, every group that size) or [count]
    integer group ids (samples with one id form a group, anywhere in the batch, of any size;
    indices follow the sorted ids)."""
    if isinstance(groups, int):
        if groups < 1 or count % groups:
            raise ValueError(f"{count} rewards do not form groups of {groups} (need group_size >= 1 dividing them)")
        return torch.arange(count) // groups
    if groups.shape != (count,) or groups.is_floating_point():
        raise ValueError(f"group ids must be an integer tensor of shape [{count}], one per reward (got: "
                         f"{groups.dtype} of shape {list(groups.shape)})")
    return torch.unique(groups, return_inverse=True)[1]


def _within_groups(rewards: torch.Tensor, groups: int | torch.Tensor, within) -> torch.Tensor:
    """[B] float32: within([n, size] rewards of n groups of one size) -> [n, size], applied to the
    groups of each size stacked; a one-sample group gets 0 (nothing to compare it with). Uniform
    adjacent groups are one stack, rewards.view(-1, group_size), so they get exactly what a
    per-row reduction over that view gives."""
    values = rewards.float()
    index = group_index(groups, values.numel())
    order = torch.argsort(index, stable=True)  # each group's samples together, in their order
    sizes = torch.bincount(index)
    starts = sizes.cumsum(0) - sizes
    out = torch.zeros_like(values)
    for size in sizes.unique().tolist():
        if size > 1:
            rows = order[starts[sizes == size].unsqueeze(1) + torch.arange(size)]  # [n, size] positions
            out[rows] = within(values[rows])
    return out


def _centered(grouped: torch.Tensor) -> torch.Tensor:
    """[n, size] rewards minus their row's mean; rows of equal rewards give exactly 0 (no float
    rounding of the mean)."""
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    return torch.where(_all_equal(grouped), torch.zeros_like(centered), centered)


def _all_equal(grouped: torch.Tensor) -> torch.Tensor:
    return (grouped == grouped[:, :1]).all(dim=1, keepdim=True)


def grpo_advantages(rewards: torch.Tensor, groups: int | torch.Tensor, normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, arXiv:2402.03300).

    rewards: [B]; groups: group_size or [B] group ids (see group_index; groups may differ in size).
    A_i = (r_i - mean(group)) / (std(group) + eps). With normalize_std=False this is
    Dr.GRPO (Liu et al. 2025, arXiv:2503.20783), which drops the std division because it
    over-weights prompts whose rewards barely vary. std is the unbiased sample std.
    Groups with equal rewards get exactly 0, and so does a one-sample group. Returns [B] float32.
    """
    def normalized(grouped: torch.Tensor) -> torch.Tensor:
        centered = _centered(grouped)
        return centered / (grouped.std(dim=1, keepdim=True) + eps) if normalize_std else centered

    return _within_groups(rewards, groups, normalized)


def group_centered(rewards: torch.Tensor, groups: int | torch.Tensor) -> torch.Tensor:
    """[B] rewards minus their group's mean (groups: see group_index); equal groups and one-sample
    groups give exactly 0."""
    return _within_groups(rewards, groups, _centered)


def rloo_advantages(rewards: torch.Tensor, groups: int | torch.Tensor) -> torch.Tensor:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740).

    rewards: [B]; groups: group_size or [B] group ids (see group_index; groups may differ in size).
    A_i = r_i - mean_{j != i} r_j over the group, computed as G/(G-1) * (r_i - mean(group)) with G
    the group's size, which is the same quantity. Groups with equal rewards get exactly 0. A
    one-sample group has no other sample to form its baseline (undefined): it gets 0, no signal.
    Returns [B] float32.
    """
    def leave_one_out(grouped: torch.Tensor) -> torch.Tensor:
        size = grouped.shape[1]
        return _centered(grouped) * (size / (size - 1))

    return _within_groups(rewards, groups, leave_one_out)


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, reduce=whole_batch) -> torch.Tensor:
    """(x - mean) / (std + eps) over the entries where mask is 1, 0 elsewhere (PPO advantages).

    values, mask: same shape, mask 0/1. std is the unbiased sample std over the masked entries.
    Masked entries that are all equal (including a single one) give exactly 0, so float rounding
    of the mean is not blown up to unit scale; no masked entries give all zeros.
    Unmasked entries may hold inf/nan. reduce: over several shards (see the module's docstring).
    Returns float32, same shape as values.
    """
    keep = mask.bool()
    x = torch.where(keep, values.float(), torch.zeros((), dtype=torch.float32, device=values.device))
    count = reduce(keep.sum(), "sum")
    mean = reduce(x.sum(), "sum") / count.clamp(min=1)
    centered = torch.where(keep, x - mean, torch.zeros_like(x))
    std = (reduce(centered.square().sum(), "sum") / (count - 1).clamp(min=1)).sqrt()
    lowest = reduce(torch.where(keep, x, torch.full_like(x, float("inf"))).amin(), "min")
    highest = reduce(torch.where(keep, x, torch.full_like(x, float("-inf"))).amax(), "max")
    all_equal = (lowest == highest) | (count == 0)
    return torch.where(all_equal, torch.zeros_like(x), centered / (std + eps))


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float,
                            groups: int | torch.Tensor | None = None, eps: float = 1e-8, reduce=whole_batch,
                            gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): token-level returns, whitened over the batch.

    rewards: [B] scalar reward per sample; mask: [B, S] response tokens (token-aligned, may have
    holes for multi-turn observation tokens); kl: [B, S] per-token KL estimate to the reference
    policy (unmasked entries may hold inf/nan), or None for no KL penalty.
    Token reward = -kl_coef * kl_t on masked tokens, plus the sample's reward at its last masked
    token. A_t = sum over masked t' >= t of gamma^k(t, t') * reward_t', k the number of masked
    tokens after t up to t' (the discounted return-to-go: only masked tokens are steps, as in
    gae_advantages; gamma = 1 is the paper's undiscounted return), then whitened over all masked
    tokens of the batch (see whiten; fewer than 2 masked tokens give 0).
    groups (REINFORCE++-baseline; group_size or [B] group ids, see group_index) first subtracts
    each group's mean reward (a one-sample group: its reward becomes 0); a zero-length sample
    still counts in its group's mean (over shards: centre on the controller, pass None).
    Rows with no masked token get 0. Returns [B, S] float32.
    """
    keep = mask.bool()
    scalar = rewards.float() if groups is None else group_centered(rewards, groups)
    kl_rewards = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
    if kl is not None:
        kl_rewards = torch.where(keep, -kl_coef * kl.float(), kl_rewards)
    # float64, as torch's cumsum accumulates: long responses do not drift
    running, kl_returns = torch.zeros(keep.shape[0], dtype=torch.float64, device=keep.device), []
    for t in reversed(range(keep.shape[1])):  # unmasked positions neither add nor discount
        running = torch.where(keep[:, t], kl_rewards[:, t].double() + gamma * running, running)
        kl_returns.append(running)
    kl_returns = torch.stack(kl_returns[::-1], dim=1).float()
    # the reward sits on the last masked token: discounted once per masked token after t
    steps_after = keep.float().flip(1).cumsum(dim=1).flip(1) - keep.float()
    return whiten(kl_returns + scalar.unsqueeze(1) * gamma ** steps_after, mask, eps, reduce)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                   lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438) for PPO.

    token_rewards, values, mask: [B, S], token-aligned. Only masked positions are steps, in order;
    unmasked ones (padding, multi-turn observation tokens) are skipped, their rewards and values
    ignored (may hold inf/nan). For masked t with next masked t' (none: terminal, V = 0):
    delta_t = r_t + gamma * V_t' - V_t,  A_t = delta_t + gamma * lam * A_t'.
    Returns (advantages, returns = A + V), both [B, S] float32 and 0 at unmasked positions.
    """
    keep = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=keep.device)
    rewards = torch.where(keep, token_rewards.float(), zero)
    values = torch.where(keep, values.float(), zero)
    next_value = torch.zeros(keep.shape[0], dtype=torch.float32, device=keep.device)
    next_advantage = torch.zeros_like(next_value)
    columns = []  # advantages from the last position back
    for t in reversed(range(keep.shape[1])):
        step = keep[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        columns.append(torch.where(step, advantage, zero))
        next_value = torch.where(step, values[:, t], next_value)
        next_advantage = torch.where(step, advantage, next_advantage)
    advantages = torch.stack(columns[::-1], dim=1)
    return advantages, torch.where(keep, advantages + values, zero)


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor, kl_penalty: torch.Tensor | None) -> torch.Tensor:
    """[B, S] per-token rewards: each sample's reward on its last response token, minus the KL
    penalty (already scaled) on every response token. Rows without response tokens get 0."""
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=torch.float32)
    has_response = last >= 0
    out[has_response, last[has_response]] = rewards[has_response].float()
    if kl_penalty is not None:
        out = out - torch.where(mask.bool(), kl_penalty, torch.zeros_like(kl_penalty))
    return out


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, reduce=whole_batch) -> float:
    """1 - Var(returns - values) / Var(returns) over response tokens (unbiased variances): 1 is a
    perfect critic, 0 no better than a constant."""
    m = mask.bool()
    r, d = returns[m].double(), (returns[m] - values[m]).double()
    n = reduce(torch.tensor(float(m.sum()), dtype=torch.float64), "sum")
    sums = [reduce(x, "sum") for x in (r.sum(), r.square().sum(), d.sum(), d.square().sum())]

    def variance(total, squares):
        return (squares - total * total / n) / (n - 1) if n > 1 else torch.zeros((), dtype=torch.float64)

    var_returns = variance(sums[0], sums[1])
    return float(1.0 - variance(sums[2], sums[3]) / var_returns) if var_returns > 0 else 0.0
