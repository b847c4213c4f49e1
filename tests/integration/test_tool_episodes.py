"""Tool episodes on a real local Ray cluster: after a short warm start on calculator episodes the
tiny model writes tool calls; each call's result is appended as the chat template renders it,
masked out of the loss, after the sampler's own tokens; and the trainer's logprobs on these
multi-turn trajectories are the sampler's."""

import re

import pytest
from transformers import AutoTokenizer

from rlkit.algorithms.episodes import run_episodes
from rlkit.algorithms.policy_gradient import load_prompts, prompt_renderer, warm_start_on_answers
from rlkit.algorithms.warm_start import cached_warm_start, warm_start_dir
from rlkit.cluster.refit_driver import RefitDriver
from rlkit.cluster.setup import start_workers
from rlkit.data.generation import SamplingParams
from rlkit.envs.runner import EnvironmentPool
from rlkit.launch.config import load_config
from rlkit.observability.logprob_agreement import logprob_error
from test_checkpoint import TOOLS_WARM_START

pytestmark = pytest.mark.integration

# what follows a model turn that called a tool: the end of its turn it did not write, the result, the next turn
TOOL_TURN = re.compile(r"(<\|im_end\|>)?\n<\|im_start\|>user\n<tool_response>\n.*\n</tool_response><\|im_end\|>\n"
                       r"<\|im_start\|>assistant\n", re.DOTALL)


def test_tool_calls_are_answered_token_in_token_out(warm_pool, cache_dir, tiny_qwen2, tmp_path):
    """grpo_tiny_cpu_tools after the warm start its SIGKILL test trains (test_checkpoint.py; the
    run's own cache entry, trained here where that test has not run)."""
    cfg, _ = load_config("grpo_tiny_cpu_tools", [
        f"run.cache_dir={cache_dir}", f"run.output_dir={tmp_path}", *TOOLS_WARM_START,
        # calls cut off by the budget are answered too (partial): every episode that starts one has
        # a tool turn, and the second turn's budget is short
        "env_runner.max_total_tokens=48", "generation.max_new_tokens=40", "generation.num_workers=1"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    data, renderer = load_prompts(cfg, tokenizer), prompt_renderer(cfg, tokenizer)
    start_dir, untrained = warm_start_dir(cfg, tiny_qwen2, None, False, *data.identity)
    workers = start_workers(cfg, str(start_dir), pool=warm_pool)
    envs = EnvironmentPool(cfg.env, cfg.env_runner)
    try:
        if untrained is not None:
            cached_warm_start(workers.policy, untrained,
                              lambda: warm_start_on_answers(cfg, workers.policy, tokenizer, data, untrained))
        RefitDriver(cfg, workers.policy, workers.generation, workers.placement_group, sleepers=[]).sync()
        prompts = data.val[:8]
        # sampled cooler than the recipes (T=1) so that most episodes start a call after so short a warm start
        workers.policy.set_temperature(0.6)
        rollout = run_episodes(prompts, renderer, workers.generation, envs, SamplingParams(40, 0.6, 1.0, 0, seed=0),
                               cfg.env_runner)
        trainer_logprobs = workers.policy.logprobs(rollout.batch)
    finally:
        envs.shutdown()
        workers.shutdown()
    assert rollout.metrics["tools/calls"] > 0 and rollout.metrics["train/turns"] > 1
    batch, tool_turns = rollout.batch, 0
    for i, prompt in enumerate(prompts):
        ids, mask, length = batch["input_ids"][i], batch["response_mask"][i], int(rollout.lengths[i])
        assert ids[:len(prompt.token_ids)].tolist() == prompt.token_ids and mask[:len(prompt.token_ids)].sum() == 0
        flags = "".join(str(int(m)) for m in mask[len(prompt.token_ids):length].tolist())
        for run in re.finditer(r"0+", flags):  # each masked run after the prompt is one tool turn, as the template writes it
            start = len(prompt.token_ids) + run.start()
            assert TOOL_TURN.fullmatch(tokenizer.decode(ids[start:len(prompt.token_ids) + run.end()]))
            tool_turns += 1
    assert tool_turns > 0
    agreement = logprob_error(trainer_logprobs, batch["generation_logprobs"], batch["response_mask"])
    print(f"{rollout.metrics}; {agreement}")
    assert agreement["refit/logprob_abs_error_max"] < 1e-4  # fp32 on CPU: the same weights, the same tokens
