"""Placement: where each worker runs, as data. One pure function decides it."""

from dataclasses import dataclass

PLACEMENTS = ("colocated", "disaggregated")


@dataclass(frozen=True)
class Placement:
    bundles: list[dict[str, float]]  # one resource bundle per device slot
    policy_bundles: list[int]  # bundle index of policy rank i
    generation_bundles: list[int]  # bundle index of generation worker i
    share: float  # fraction of a bundle's resources each actor requests


def plan_placement(mode: str, num_policy: int, num_generation: int, device: str, with_critic: bool = False) -> Placement:
    """colocated: policy rank i and generation worker i share bundle i (they take turns: the
    generation side sleeps while the policy trains). disaggregated: separate bundles, policy
    first. A critic (PPO) shares the policy's bundles in both modes. device is "GPU" or "CPU": a
    bundle is one GPU (with a CPU) or one CPU; each actor asks for 1 / (most actors on a bundle)."""
    if mode not in PLACEMENTS:
        raise ValueError(f"cluster.placement='{mode}' is unknown; choose one of {PLACEMENTS}")
    bundle = {"CPU": 1.0, "GPU": 1.0} if device == "GPU" else {"CPU": 1.0}
    models_per_bundle = 2 if with_critic else 1
    if mode == "colocated":
        if num_generation > num_policy:
            raise ValueError(f"colocated placement needs generation.num_workers ({num_generation}) <= "
                             f"policy.num_workers ({num_policy}); lower it or use cluster.placement=disaggregated")
        share = 1.0 / (models_per_bundle + (1 if num_generation else 0))
        return Placement([dict(bundle) for _ in range(num_policy)], list(range(num_policy)),
                         list(range(num_generation)), share=share)
    total = num_policy + num_generation
    return Placement([dict(bundle) for _ in range(total)], list(range(num_policy)),
                     list(range(num_policy, total)), share=1.0 / models_per_bundle)
