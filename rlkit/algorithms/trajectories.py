"""Trajectories that proceed on their own (env_runner.flow=per_trajectory): each episode sends
its own generation request, then its own environment step, then its next turn, as soon as the
last one answered. Many episodes' requests are with the engines at once and their steps run
side by side on the environment workers, so a slow tool call or a long answer holds up its own
trajectory alone.

Every request has a seed of its own, from the rollout's seed, the episode's index and the turn,
and the engines sample each request independently of the requests beside it: a rollout is the
same whatever the timing, and a resumed run repeats it exactly.
"""

import asyncio
import hashlib
from dataclasses import replace
from typing import Protocol

from rlkit.cluster.generation_requests import GenerationRequests
from rlkit.cluster.groups import GenerationWorkers
from rlkit.config.schema import EnvRunnerConfig
from rlkit.data.generation import SamplingParams
from rlkit.data.prompts import PromptRenderer
from rlkit.envs.runner import EnvironmentPool, Stepped


class Episode(Protocol):
    """What a trajectory reads and adds to (rlkit/algorithms/episodes.py: Episode, which runs
    these trajectories)."""
    token_ids: list[int]
    messages: list[dict]
    metadata: dict
    turns: int
    generated: int
    done: bool

    def add_generation(self, ids: list[int], logprobs: list[float], budget: int, tokenizer) -> None: ...

    def add_step(self, stepped: Stepped, generated: list[int], renderer: PromptRenderer,
                 cfg: EnvRunnerConfig) -> None: ...


def request_seed(rollout_seed: int, episode: int, turn: int) -> int:
    """The sampling seed of one episode's turn: a hash of the three (distinct triples, unrelated
    seeds), below 2**63 as vLLM and torch take it."""
    digest = hashlib.blake2b(f"{rollout_seed}/{episode}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def run_trajectories(episodes: list[Episode], renderer: PromptRenderer, generation: GenerationWorkers,
                     envs: EnvironmentPool, params: SamplingParams, cfg: EnvRunnerConfig) -> float:
    """Every episode to its end, each on its own (params.seed: the rollout's). Returns how long
    the engines had requests in flight, in seconds, the mean over engines: the rest of the
    rollout they waited for environment steps (or for requests to arrive)."""
    return asyncio.run(_run_all(episodes, renderer, generation, envs, params, cfg))


async def _run_all(episodes: list[Episode], renderer: PromptRenderer, generation: GenerationWorkers,
                   envs: EnvironmentPool, params: SamplingParams, cfg: EnvRunnerConfig) -> float:
    environment = envs.concurrent_steps()
    async with GenerationRequests(generation) as engines:

        async def trajectory(index: int, episode: Episode) -> None:
            while not episode.done:
                budget = min(params.max_new_tokens, cfg.max_total_tokens - episode.generated)
                request = replace(params, max_new_tokens=budget, seed=request_seed(params.seed, index, episode.turns))
                ids, logprobs = await engines.generate(episode.token_ids, request)
                episode.add_generation(ids, logprobs, budget, renderer.tokenizer)
                stepped = await environment.step(episode.messages, episode.metadata)
                episode.add_step(stepped, ids, renderer, cfg)

        await asyncio.gather(*(trajectory(i, e) for i, e in enumerate(episodes)))
    return engines.busy_seconds / len(engines.workers)
