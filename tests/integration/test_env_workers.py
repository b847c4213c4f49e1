"""Environments on a real local Ray cluster: user bugs become recorded failures, hung calls are
cut off and their worker replaced, multi-turn rollouts mask the environment's tokens, and the
README's custom environment runs as documented."""

import asyncio
import dataclasses
import json
import re
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rlkit.algorithms.episodes import run_episodes
from rlkit.algorithms.policy_gradient import load_prompts
from rlkit.cluster.setup import start_workers
from rlkit.config.schema import EnvRunnerConfig
from rlkit.envs.runner import EnvironmentPool, EnvironmentFailure
from rlkit.data.generation import SamplingParams
from rlkit.data.prompts import PromptRenderer
from rlkit.observability.metrics import console_line

pytestmark = pytest.mark.integration

FAULTY = '''
import time
from rlkit.envs import EnvStep, Environment

class Faulty(Environment):
    def step(self, messages, metadata):
        mode = metadata["mode"]
        if mode == "raise":
            raise ZeroDivisionError("user bug")
        if mode == "hang":
            time.sleep(60)
        if mode == "garbage":
            return {"reward": 1}
        return EnvStep(reward=1.0, done=True)
'''


def runner_cfg(**overrides) -> EnvRunnerConfig:
    values = dict(num_workers=2, timeout_s=1.0, failure_reward=-1.0, fail_fast=False, max_turns=1,
                  max_total_tokens=64, max_tool_seconds=0, observation_format="{observation}", flow="per_turn")
    return EnvRunnerConfig(**{**values, **overrides})


@pytest.fixture
def faulty_env(tmp_path, monkeypatch):
    (tmp_path / "faulty_env.py").write_text(FAULTY)
    monkeypatch.chdir(tmp_path)  # user modules import from the launch directory
    return {"_target_": "faulty_env.Faulty"}


def test_user_failures_are_recorded_not_fatal(ray_cluster, faulty_env):
    envs = EnvironmentPool(faulty_env, runner_cfg())
    try:
        modes = ["ok", "raise", "hang", "garbage", "ok", "ok"]
        steps = envs.step([([{"role": "assistant", "content": "x"}], {"mode": m}) for m in modes])
        assert [s.step.reward for s in steps] == [1.0, -1.0, -1.0, -1.0, 1.0, 1.0]
        assert [s.counts for s in steps] == [{}, {"env/failures": 1, "env/exceptions": 1},
                                             {"env/failures": 1, "env/timeouts": 1},
                                             {"env/failures": 1, "env/malformed": 1}, {}, {}]
        assert steps[2].seconds == 1.0  # a timed-out call took the whole env_runner.timeout_s
        # the worker whose call hung was replaced: the next batch runs normally
        steps = envs.step([([{"role": "assistant", "content": "x"}], {"mode": "ok"})] * 4)
        assert [s.step.reward for s in steps] == [1.0] * 4 and not any(s.counts for s in steps)
    finally:
        envs.shutdown()


def test_concurrent_steps_fail_and_replace_workers_as_batched_ones(ray_cluster, faulty_env):
    """Single calls side by side (env_runner.flow=per_trajectory): each takes a free worker, a hung
    call holds up only its own caller and is cut off, and its worker is replaced."""
    envs = EnvironmentPool(faulty_env, runner_cfg())

    async def calls(modes):
        steps = envs.concurrent_steps()
        return await asyncio.gather(*(steps.step([{"role": "assistant", "content": "x"}], {"mode": m}) for m in modes))

    try:
        start = time.perf_counter()
        steps = asyncio.run(calls(["hang", "ok", "raise", "ok", "garbage"]))
        assert time.perf_counter() - start < 10  # the calls beside the hung one ran on the other worker
        assert [s.step.reward for s in steps] == [-1.0, 1.0, -1.0, 1.0, -1.0]
        assert [s.counts for s in steps] == [{"env/failures": 1, "env/timeouts": 1}, {},
                                             {"env/failures": 1, "env/exceptions": 1}, {},
                                             {"env/failures": 1, "env/malformed": 1}]
        steps = asyncio.run(calls(["ok"] * 4))  # the replaced worker answers
        assert [s.step.reward for s in steps] == [1.0] * 4
    finally:
        envs.shutdown()


def test_fail_fast_raises_with_the_traceback(ray_cluster, faulty_env):
    envs = EnvironmentPool(faulty_env, runner_cfg(fail_fast=True))
    try:
        with pytest.raises(EnvironmentFailure, match="faulty_env.Faulty failed \\(exception\\)") as error:
            envs.step([([{"role": "assistant", "content": "x"}], {"mode": "raise"})])
        assert "ZeroDivisionError: user bug" in str(error.value)
    finally:
        envs.shutdown()


TOOLS = '''
import os
import threading
from pathlib import Path
from rlkit.envs.tools import ToolEnvironment

def sleeps_forever(pid_file: str) -> str:
    """Write down its process id, then never return.

    Args:
        pid_file: where to write it
    """
    Path(pid_file).write_text(str(os.getpid()))
    threading.Event().wait()

def divide(a: int, b: int) -> float:
    """Divide.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b

class Flaky(ToolEnvironment):
    tool_timeout_s = 1.0

    def tools(self):
        return [sleeps_forever, divide]

    def score(self, answer, metadata):
        return 1.0
'''


def tool_call(name: str, **arguments) -> list[dict]:
    call = json.dumps({"name": name, "arguments": arguments})
    return [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"}]


def test_a_hung_tool_is_stopped_and_counted_and_fail_fast_stops_on_a_tool_that_raises(ray_cluster, tmp_path,
                                                                                      monkeypatch):
    """In an environment worker (a Ray actor): a tool that never returns is stopped at
    tool_timeout_s, its process gone, and the step goes on, the call counted and shown on the
    step's console line; with env_runner.fail_fast a tool that raises stops the run in one line."""
    (tmp_path / "tool_env.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    env = {"_target_": "tool_env.Flaky"}
    envs = EnvironmentPool(env, runner_cfg(num_workers=1, timeout_s=30.0))
    try:
        pid_file = tmp_path / "pid"
        hung, answered = envs.step([(tool_call("sleeps_forever", pid_file=str(pid_file)), {}),
                                    ([{"role": "assistant", "content": "42"}], {})])
        # no worker replaced, no env failure: the tool's process was killed, not the step
        assert hung.counts == {} and hung.step.counts["tools/timeout"] == 1 and answered.step.reward == 1.0
        pid = int(pid_file.read_text())
        assert not Path(f"/proc/{pid}").exists()  # killed, and reaped by the worker
        line = console_line(1, 2, {"env/failures": 0, **hung.step.counts}, 2.0)
        assert line.endswith("env_fail 0 | tool_fail 1/1 (timeout 1)"), line
        # the same worker (a second pool would cost an actor start): the controller raises on its answer
        envs.cfg = dataclasses.replace(envs.cfg, fail_fast=True)
        with pytest.raises(EnvironmentFailure) as error:
            envs.step([(tool_call("divide", a=1, b=0), {})])
        assert re.fullmatch(r"environment tool_env.Flaky: tool divide raised ZeroDivisionError: division by zero "
                            r"\(tool_env.py:\d+\); env_runner.fail_fast is on: fix it, or set "
                            r"env_runner.fail_fast=false to answer such calls with an error and count them "
                            r"\(tools/\*\)", str(error.value)), str(error.value)
    finally:
        envs.shutdown()


BROKEN = '''
from rlkit.envs import Environment

class Broken(Environment):
    def __init__(self):
        raise RuntimeError("cannot start here")

    def step(self, messages, metadata):
        raise AssertionError("never called")
'''


def test_environment_that_cannot_start_stops_the_pool(ray_cluster, tmp_path, monkeypatch):
    """A constructor's error (e.g. the code sandbox without bubblewrap) stops the pool at creation,
    before any training, instead of failing every sample."""
    (tmp_path / "broken_env.py").write_text(BROKEN)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EnvironmentFailure, match="broken_env.Broken could not start") as error:
        EnvironmentPool({"_target_": "broken_env.Broken"}, runner_cfg())
    assert "cannot start here" in str(error.value)


# what an environment turn looks like between the model's turns, raw and chat-templated
RAW_TURN = re.compile(r" (higher|lower|a number please)\n\d+\+\d+=")
CHAT_TURN = re.compile(r"(<\|im_end\|>)?\n<\|im_start\|>user\n (higher|lower|a number please)\n\d+\+\d+="
                       r"<\|im_end\|>\n<\|im_start\|>assistant\n")


MULTI_TURN = ["env=guess_sum", "env_runner.max_turns=3", "generation.num_workers=1"]


@pytest.fixture(scope="module")
def multi_turn_workers(warm_pool, make_cfg, tiny_qwen2):
    """The workers of both chat_template cases: the template is the prompt renderer's, not theirs."""
    cfg, _ = make_cfg(*MULTI_TURN)
    workers = start_workers(cfg, str(tiny_qwen2), pool=warm_pool)
    yield workers
    workers.shutdown()


@pytest.mark.parametrize("chat_template", [False, True])
def test_multi_turn_rollout_masks_environment_tokens(multi_turn_workers, make_cfg, tiny_qwen2, chat_template):
    """Each environment turn is appended after the model's tokens as they were generated, masked
    out of the loss, and rendered raw or with the chat template (end of the model's turn, the
    user turn, the next generation prompt)."""
    cfg, _ = make_cfg(*MULTI_TURN, f"data.chat_template={chat_template}")
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    prompts = load_prompts(cfg, tokenizer).train[:8]
    envs = EnvironmentPool(cfg.env, cfg.env_runner)
    try:
        rollout = run_episodes(prompts, PromptRenderer.of(tokenizer, cfg.data, cfg.env_runner.observation_format),
                               multi_turn_workers.generation, envs, SamplingParams(4, 1.0, 1.0, 0, seed=0),
                               cfg.env_runner)
    finally:
        envs.shutdown()
    batch = rollout.batch
    assert rollout.metrics["train/turns"] > 1  # the random model is wrong, so episodes go on
    turns = 0
    for i, prompt in enumerate(prompts):
        ids, mask = batch["input_ids"][i], batch["response_mask"][i]
        length = len(ids)
        while length and ids[length - 1] == tokenizer.pad_token_id and mask[length - 1] == 0:
            length -= 1  # right padding (a pad the model itself sampled is trained on: mask 1)
        prompt_len = len(prompt.token_ids)
        assert ids[:prompt_len].tolist() == prompt.token_ids and mask[:prompt_len].sum() == 0
        # every maximal run of mask-0 tokens after the prompt is one environment turn
        flags = "".join(str(int(m)) for m in mask[prompt_len:length].tolist())
        for run in re.finditer(r"0+", flags):
            text = tokenizer.decode(ids[prompt_len + run.start():prompt_len + run.end()])
            assert (CHAT_TURN if chat_template else RAW_TURN).fullmatch(text), text
            turns += 1
        # sampler logprobs exist exactly where the model generated
        assert torch.all((batch["generation_logprobs"][i] != 0) <= (mask == 1))
    assert turns > 0


def test_readme_custom_environment_runs(readme_environment_command):
    """The README's example (conftest.readme_environment_command runs it as written, for 2 steps)."""
    command = readme_environment_command
    assert len((command.cwd / "my_env.py").read_text().strip().splitlines()) < 30
    assert command.returncode == 0, textwrap.shorten(command.stderr[-3000:], 3000)
    assert "step   2/2 [" in command.stderr and "| reward" in command.stderr


def test_multi_turn_grpo_improves(warm_pool, cache_dir, tmp_path):
    """recipes/grpo_tiny_cpu_multiturn.yaml, its first 30 of 60 steps: reward rises (measured at 30
    steps: training reward 0.282 -> 0.305 -> 0.324 over 10-step means, validation reward 0.263 ->
    0.330 -> 0.305 at steps 0, 15, 30; here validated at 0 and 30 alone). The training reward
    averages 5120 episodes per 10 steps, so it carries the threshold; the validation's 100 sampled
    answers have a standard error of about 0.045, so the validation is held to its direction alone."""
    from rlkit.launch.run import train
    from rlkit.launch.config import load_config

    cfg, resolved = load_config("grpo_tiny_cpu_multiturn", [f"run.cache_dir={cache_dir}",
                                                            f"run.output_dir={tmp_path}", "algorithm.num_steps=30",
                                                            "algorithm.val_every=30", "checkpoint.enabled=false",
                                                            "logger.plots=false"])
    history = train(cfg, resolved, pool=warm_pool).history
    rewards = [m["train/reward"] for m in history[1:]]
    assert sum(rewards[-10:]) / 10 >= sum(rewards[:10]) / 10 + 0.03
    assert history[-1]["val/reward"] > history[0]["val/reward"]
    assert max(m["train/turns"] for m in history[1:]) > 1.5  # episodes really are multi-turn
