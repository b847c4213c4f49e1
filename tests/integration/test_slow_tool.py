"""A slow tool under env_runner.flow=per_trajectory, on the session's Ray cluster with an HF engine
from its pool: the tool benchmark's environment (benchmarks/tool_turns.py ToolTurns: two turns,
a review tool called between them, in the tool process) with one problem's review sleeping. The
other episodes end, their final answers scored, before that review returns; its own episodes end
after it. Order of completions, read from the environment workers' own timestamps."""

import json
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlkit.algorithms.episodes import run_episodes
from rlkit.cluster.groups import GenerationWorkers
from rlkit.data.generation import SamplingParams
from rlkit.data.prompts import Prompt, PromptRenderer
from rlkit.envs.runner import EnvironmentPool
from rlkit.workers.generation.hf import HFGenerationWorker

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SLOW_S = 2.0
# ToolTurns logging when each of its steps ended (in its worker), and which turn and problem it was
LOGGED = '''
import json, time
from benchmarks.tool_turns import ToolTurns

class Logged(ToolTurns):
    def __init__(self, log_path: str, **kwargs):
        super().__init__(**kwargs)
        self.log_path = log_path

    def step(self, messages, metadata):
        step = super().step(messages, metadata)
        with open(self.log_path, "a") as log:
            log.write(json.dumps({"answer": metadata["answer"], "turn": sum(m["role"] == "assistant" for m in messages),
                                  "done": step.done, "tools": [m["name"] for m in step.tool_messages or []],
                                  "end": time.time()}) + "\\n")
        return step
'''


def problems(slow_one_in: int) -> list[str]:
    """Four worked solutions: the first one of the slow problems (is_slow), three of the others."""
    from benchmarks.tool_turns import is_slow

    answers = [f"{n} * 2 = <<{n}*2={2 * n}>>{2 * n}\n#### {2 * n}" for n in range(10, 200)]
    slow = [a for a in answers if is_slow({"answer": a}, slow_one_in)]
    fast = [a for a in answers if not is_slow({"answer": a}, slow_one_in)]
    return slow[:1] + fast[:3]


def test_a_slow_tool_does_not_stall_the_other_trajectories(warm_pool, make_cfg, tiny_qwen2, tmp_path, monkeypatch):
    cfg, _ = make_cfg("env_runner.max_turns=2", "env_runner.num_workers=3", "env_runner.flow=per_trajectory",
                      "env_runner.timeout_s=30")
    (tmp_path / "logged_env.py").write_text(LOGGED)
    monkeypatch.syspath_prepend(str(ROOT))  # benchmarks.tool_turns, for this process and the workers
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "steps.jsonl"
    env_cfg = {"_target_": "logged_env.Logged", "log_path": str(log), "turns": 2, "sleep_s": SLOW_S,
               "slow_one_in": 4, "tool_timeout_s": SLOW_S + 5}
    workers = warm_pool.take("generation", HFGenerationWorker, "",
                             lambda rank: dict(model_dir=str(tiny_qwen2), precision="fp32", threads=1, rank=rank),
                             1, cfg.cluster.call_timeout_s)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    renderer = PromptRenderer.of(tokenizer, cfg.data, cfg.env_runner.observation_format)
    answers = problems(slow_one_in=4)
    prompts = [Prompt([{"role": "user", "content": f"{i}+1="}], tokenizer.encode(f"{i}+1="), {"answer": a})
               for i, a in enumerate(answers)]
    envs = EnvironmentPool(env_cfg, cfg.env_runner)
    try:
        start = time.perf_counter()
        episodes = run_episodes(prompts, renderer, GenerationWorkers(workers), envs,
                                SamplingParams(4, 1.0, 1.0, 0, seed=3), cfg.env_runner, samples_per_prompt=2)
        print(f"rollout {time.perf_counter() - start:.1f} s")
    finally:
        envs.shutdown()
        warm_pool.give_back(workers)
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    reviews = [s for s in steps if s["turn"] == 1]
    finals = [s for s in steps if s["turn"] == 2]
    assert len(reviews) == len(finals) == 8 and all(s["tools"] == ["review"] for s in reviews)
    assert all(s["done"] for s in finals) and episodes.metrics["train/turns"] == 2
    slow_review_returned = min(s["end"] for s in reviews if s["answer"] == answers[0])
    others_done = [s["end"] for s in finals if s["answer"] != answers[0]]
    assert len(others_done) == 6 and max(others_done) < slow_review_returned, steps
    assert min(s["end"] for s in finals if s["answer"] == answers[0]) > slow_review_returned
