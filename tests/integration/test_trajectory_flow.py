"""env_runner.flow on a real local Ray cluster, an HF engine on the tiny model and environment
actors: with per_trajectory a slow tool call holds up its own episode alone (the others' later
turns start while it sleeps; per_turn makes them wait), the rollout is the same bit for bit
whatever the timing, and a tool-time budget ends an episode cleanly."""

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rlkit.algorithms.episodes import run_episodes
from rlkit.cluster.groups import GenerationWorkers
from rlkit.data.generation import SamplingParams
from rlkit.data.prompts import Prompt, PromptRenderer
from rlkit.envs.runner import EnvironmentPool
from rlkit.workers.generation.hf import HFGenerationWorker

pytestmark = pytest.mark.integration

# three turns whatever the model writes; a prompt's metadata may make its first step slow
TIMED = '''
import json, time
from rlkit.envs import EnvStep, Environment

class Timed(Environment):
    def __init__(self, log_path: str):
        self.log_path = log_path

    def step(self, messages, metadata):
        turn = sum(m["role"] == "assistant" for m in messages)
        start = time.time()
        if turn == 1:
            time.sleep(metadata["sleep_s"])
        with open(self.log_path, "a") as log:
            log.write(json.dumps({"prompt": metadata["prompt"], "turn": turn, "start": start, "end": time.time()}) + "\\n")
        return EnvStep(reward=float(turn), done=turn == 3, observation=f" turn {turn} seen.")
'''

SLOW_S = 2.0


@pytest.fixture(scope="module")
def engine(warm_pool, make_cfg, tiny_qwen2):
    """One HF engine from the session's pool (its random weights are the tiny model's config's; one
    engine, so every request meets the same weights), the renderer and the run's config."""
    # three environment workers: the slow prompt's two episodes hold two, the other episodes share the third
    cfg, _ = make_cfg("env_runner.max_turns=3", "env_runner.num_workers=3")
    workers = warm_pool.take("generation", HFGenerationWorker, "",
                             lambda rank: dict(model_dir=str(tiny_qwen2), precision="fp32", threads=1, rank=rank),
                             1, cfg.cluster.call_timeout_s)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    yield GenerationWorkers(workers), PromptRenderer.of(tokenizer, cfg.data, cfg.env_runner.observation_format), cfg
    warm_pool.give_back(workers)


@pytest.fixture
def timed_env(tmp_path, monkeypatch):
    (tmp_path / "timed_env.py").write_text(TIMED)
    monkeypatch.chdir(tmp_path)  # user modules import from the launch directory
    return {"_target_": "timed_env.Timed", "log_path": str(tmp_path / "steps.jsonl")}


def roll_out(engine, env_cfg: dict, slow_prompt: int | None, **runner):
    """Two episodes of each of 4 prompts (slow_prompt's first steps sleep SLOW_S); the episodes
    and the environment's log of its steps."""
    generation, renderer, cfg = engine
    prompts = [Prompt([{"role": "user", "content": text}], renderer.tokenizer.encode(text),
                      {"prompt": i, "sleep_s": SLOW_S if i == slow_prompt else 0.0})
               for i, text in enumerate(["2+3=", "7+1=", "4+4=", "9+2="])]
    envs = EnvironmentPool(env_cfg, replace(cfg.env_runner, **runner))
    log = Path(env_cfg["log_path"])
    log.write_text("")  # this rollout's steps alone
    try:
        start = time.perf_counter()
        episodes = run_episodes(prompts, renderer, generation, envs, SamplingParams(4, 1.0, 1.0, 0, seed=5),
                                replace(cfg.env_runner, **runner), samples_per_prompt=2)
        print(f"{runner}: {time.perf_counter() - start:.1f} s")
    finally:
        envs.shutdown()
    return episodes, [json.loads(line) for line in log.read_text().splitlines()]


def test_a_slow_tool_delays_only_its_own_trajectory(engine, timed_env):
    for flow in ("per_trajectory", "per_turn"):
        episodes, steps = roll_out(engine, timed_env, slow_prompt=0, flow=flow)
        slow_end = max(s["end"] for s in steps if s["prompt"] == 0 and s["turn"] == 1)
        later_starts = [s["start"] for s in steps if s["prompt"] != 0 and s["turn"] > 1]
        assert len(later_starts) == 6 * 2 and episodes.metrics["train/turns"] == 3
        if flow == "per_trajectory":  # the other episodes went on while the slow call slept
            assert max(later_starts) < slow_end, (flow, steps)
        else:  # every episode's second turn waited for the slow call
            assert min(later_starts) > slow_end, (flow, steps)


def test_per_trajectory_rollout_does_not_depend_on_timing(engine, timed_env):
    """Another prompt's slow call, or none, changes which requests the engine runs together and
    in what order: the episodes (token ids, sampler logprobs, rewards) are the same, in prompt order."""
    runs = [roll_out(engine, timed_env, slow_prompt=slow, flow="per_trajectory")[0] for slow in (0, 3)]
    first, second = runs
    assert torch.equal(first.batch["input_ids"], second.batch["input_ids"])
    assert torch.equal(first.batch["generation_logprobs"], second.batch["generation_logprobs"])
    assert torch.equal(first.batch["response_mask"], second.batch["response_mask"])
    assert torch.equal(first.rewards, second.rewards) and first.metrics == second.metrics
    assert first.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    prompts = [first.batch["input_ids"][row, :4].tolist() for row in range(8)]
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]  # rows in prompt order
    assert not torch.equal(first.batch["input_ids"][0], first.batch["input_ids"][1])  # each sample its own seed


def test_tool_time_budget_ends_a_trajectory_cleanly(engine, timed_env):
    episodes, _ = roll_out(engine, timed_env, slow_prompt=1, flow="per_trajectory", max_tool_seconds=SLOW_S / 2)
    turns = (episodes.batch["response_mask"].diff(dim=1) == 1).sum(1)  # each model turn starts a run of 1s
    assert turns.tolist() == [3, 3, 1, 1, 3, 3, 3, 3]
    assert episodes.rewards.tolist() == [6.0, 6.0, 1.0, 1.0, 6.0, 6.0, 6.0, 6.0]  # its one step's reward kept
    assert episodes.metrics["env/ended_max_tool_seconds"] == 2 and episodes.metrics["env/failures"] == 0
