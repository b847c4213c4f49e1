"""Placement: where each worker runs, as data. One pure function decides it."""

from dataclasses import dataclass

PLACEMENTS = ("colocated", "disaggregated")


@dataclass(frozen=True)
class Placement:
    bundles: list[dict[str, float]]  # one resource bundle per device slot
    policy_bundles: list[int]  # bundle index of policy rank i
    engine_bundles: list[list[int]]  # bundle indices of generation worker i, one per GPU of its engine
    share: float  # fraction of a bundle's resources each actor requests

    @property
    def gpu_share(self) -> float:
        """GPUs each actor asks for: its share of its bundle's GPU (0 on CPU)."""
        return self.share * self.bundles[0].get("GPU", 0.0) if self.bundles else 0.0

    @property
    def generation_bundles(self) -> list[int]:
        """Where generation worker i's actor sits: the first bundle of its engine."""
        return [bundles[0] for bundles in self.engine_bundles]


def plan_placement(mode: str, num_policy: int, num_generation: int, device: str, with_critic: bool = False,
                   engine_gpus: int = 1, server_gpus: float = 0.0) -> Placement:
    """colocated: policy rank i and generation worker i share bundle i (they take turns: the
    generation side sleeps while the policy trains); an engine of engine_gpus GPUs (vLLM tensor
    parallelism) spans that many consecutive bundles, each shared with one policy rank.
    disaggregated: separate bundles, policy first. A critic (PPO) shares the policy's bundles in
    both modes. device is "GPU" or "CPU": a bundle is one GPU (with a CPU) or one CPU; each actor
    asks for 1 / (most actors on a bundle). server_gpus: the share of each GPU its bundle leaves
    free for the environment's model servers (envs/reward_models/server.py shared_gpus)."""
    if mode not in PLACEMENTS:
        raise ValueError(f"cluster.placement='{mode}' is unknown; choose one of {PLACEMENTS}")
    if not 0.0 <= server_gpus < 1.0:
        raise ValueError(f"the environment's model servers ask for {server_gpus} of each GPU (env.num_gpus below 1, "
                         f"summed over env.parts); keep the sum below 1, or give a server whole GPUs of its own")
    bundle = {"CPU": 1.0, "GPU": 1.0 - server_gpus} if device == "GPU" else {"CPU": 1.0}
    models_per_bundle = 2 if with_critic else 1
    engine_slots = num_generation * engine_gpus
    if mode == "colocated":
        if engine_slots > num_policy:
            raise ValueError(f"colocated placement needs generation.num_workers x GPUs per engine ({engine_slots}) "
                             f"<= policy.num_workers ({num_policy}); lower it or use cluster.placement=disaggregated")
        share = 1.0 / (models_per_bundle + (1 if num_generation else 0))
        return Placement([dict(bundle) for _ in range(num_policy)], list(range(num_policy)),
                         _engines(0, num_generation, engine_gpus), share=share)
    return Placement([dict(bundle) for _ in range(num_policy + engine_slots)], list(range(num_policy)),
                     _engines(num_policy, num_generation, engine_gpus), share=1.0 / models_per_bundle)


def _engines(first: int, count: int, gpus: int) -> list[list[int]]:
    """`count` engines of `gpus` consecutive bundles each, from bundle `first` on."""
    return [list(range(first + i * gpus, first + (i + 1) * gpus)) for i in range(count)]
