"""The tool warm start for word problems (MathCalculatorEnv.reference_turns, episode_example): the
calls of each worked solution in order, each result appended as the environment answers it, the
solution last; a share of the episodes answered directly; and the tool results masked out of the
loss: no gradient reaches the logits that predict their tokens, in the warm start's NLL and in
GRPO's policy loss, computed as a policy worker computes them (TokenIO's logprobs, the objective)."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rlkit.algorithms.episodes import Episode, _collate
from rlkit.algorithms.losses import ClippedPolicyLossConfig
from rlkit.algorithms.objectives import NextTokenNLL, PolicyGradient
from rlkit.algorithms.policy_gradient import load_prompts, prompt_renderer
from rlkit.algorithms.warm_start import answer_example, episode_example
from rlkit.data.batch import batch_totals, masked_batch
from rlkit.envs.calculator import MathCalculatorEnv
from rlkit.envs.runner import Stepped
from rlkit.envs.tools import load_parser
from rlkit.launch.config import load_config
from rlkit.models.tiny import build_tokenizer
from rlkit.workers.policy.token_io import TokenIO

SOLUTION = "15 * 94 = <<15*94=1410>>1410\n1410 / 30 = <<1410/30=47>>47\nMax has 47 stickers now.\n#### 47"
# one Megatron rank: no tensor or context parallelism
ONE_RANK = SimpleNamespace(get_context_parallel_world_size=lambda: 1, get_context_parallel_rank=lambda: 0,
                           get_context_parallel_group=lambda: SimpleNamespace(size=lambda: 1),
                           get_tensor_model_parallel_group=lambda: None)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The tiny CPU analogue of grpo_smollm2_gpu_tools_hard: its prompts, renderer and environment."""
    cfg, _ = load_config("grpo_tiny_cpu", [
        "env=math_calculator", "data=word_problems_hard", "data.chat_template=true", "env_runner.max_turns=5",
        "data.synthetic.train_size=200", "data.synthetic.val_size=8", f"run.cache_dir={tmp_path_factory.mktemp('c')}"])
    tokenizer = build_tokenizer()
    return SimpleNamespace(prompts=load_prompts(cfg, tokenizer).train, renderer=prompt_renderer(cfg, tokenizer),
                           tokenizer=tokenizer, env=MathCalculatorEnv())


def test_reference_turns_call_each_step_in_order_then_answer(task):
    parse = load_parser("hermes").parse
    for prompt in task.prompts[:50]:
        solution = prompt.metadata["answer"]
        *calls, answer = task.env.reference_turns(prompt.messages, prompt.metadata)
        steps = [line.split(" = ")[0].split() for line in solution.splitlines()[:-2]]  # "1410 / 30"
        # a chain: each step needs the last one's result, so one call per turn
        assert [[(c.name, c.arguments) for c in parse(turn).calls] for turn in calls] == [
            [({"+": "add", "-": "subtract", "*": "multiply", "/": "divide"}[op], {"a": int(a), "b": int(b)})]
            for a, op, b in steps]
        assert answer == solution and parse(answer).calls == []


def test_calls_that_need_no_earlier_result_share_a_turn():
    """GSM8K's own rows: steps with more than one operation, or a fraction, are left to the model."""
    solution = ("She sold 48/2 = <<48/2=24>>24 in May and 5*3=<<5*3=15>>15 pens, 48+24 = <<48+24=72>>72 in all, "
                "then <<72*1.5=108>>108 and <<(72+3)*2=150>>150, 7/2 = <<7/2=3.5>>3.5\n#### 72")
    turns = MathCalculatorEnv().reference_turns([], {"answer": solution})
    assert [[(c.name, c.arguments) for c in load_parser("hermes").parse(t).calls] for t in turns] == [
        [("divide", {"a": 48, "b": 2}), ("multiply", {"a": 5, "b": 3})], [("add", {"a": 48, "b": 24})], []]
    assert turns[-1] == solution
    assert MathCalculatorEnv().reference_turns([], {"answer": "It is 4.\n#### 4"}) == ["It is 4.\n#### 4"]


def test_an_episode_example_is_the_whole_tool_episode(task):
    messages = [{"role": "user", "content": "Max buys 15 boxes of stickers ..."}]
    prompt = SimpleNamespace(messages=messages, token_ids=task.renderer.prompt_ids(messages),
                             metadata={"answer": SOLUTION})
    ids, trained = episode_example(task.env, task.renderer, task.tokenizer.eos_token_id)(prompt)
    decode = task.tokenizer.decode
    eos = decode([task.tokenizer.eos_token_id])
    call = '<tool_call>{{"name": "{}", "arguments": {{"a": {}, "b": {}}}}}</tool_call>'
    assert decode([i for i, t in zip(ids, trained) if t]) == (
        call.format("multiply", 15, 94) + eos + call.format("divide", 1410, 30) + eos + SOLUTION + eos)
    untrained = decode([i for i, t in zip(ids[len(prompt.token_ids):], trained[len(prompt.token_ids):]) if not t])
    assert "<tool_response>\n1410\n</tool_response>" in untrained and "<tool_response>\n47\n</tool_response>" in untrained


def test_a_share_of_the_episodes_answers_directly(task):
    """algorithm.warm_start.direct_fraction: those examples are answer_example's, token for
    token (the no-tools recipe's warm start); the rest are tool episodes; drawn from the seed."""
    def directs(fraction, seed=0, prompts=task.prompts):
        example = episode_example(task.env, task.renderer, task.tokenizer.eos_token_id, fraction, seed)
        answers = answer_example(task.tokenizer)
        flags = []
        for prompt in prompts:
            ids, trained = example(prompt)
            direct = "<tool_call>" not in task.tokenizer.decode(ids[len(prompt.token_ids):])
            assert not direct or (ids, trained) == answers(prompt)
            flags.append(direct)
        return flags

    quarter = directs(0.25)
    assert 30 <= sum(quarter) <= 70 and quarter == directs(0.25)  # about 50 of 200, the same each time
    assert quarter != directs(0.25, seed=1)
    few = task.prompts[:40]
    assert not any(directs(0.0, prompts=few)) and all(directs(1.0, prompts=few))


def logits_gradient(input_ids: torch.Tensor, objective, batch) -> torch.Tensor:
    """The gradient of the objective's loss on random logits [B, S, V], through TokenIO's
    token-aligned logprobs as a policy worker computes them."""
    logits = torch.randn(*input_ids.shape, 300, generator=torch.Generator().manual_seed(0), requires_grad=True)
    logprobs = TokenIO(ONE_RANK, "lm").logprobs(logits, input_ids)
    loss, _ = objective(logprobs, batch, batch_totals(batch[objective.mask_key]))
    loss.backward()
    return logits.grad


def assert_only_model_tokens_are_trained(grad: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor, tokenizer,
                                         prompt_length: int):
    """Position t - 1 predicts token t: zero gradient wherever token t is the environment's (a
    tool result, the template around it) and non-zero wherever it is the model's (the calls)."""
    predicting = grad[:-1].abs().sum(-1)  # [S - 1]: position t - 1's gradient, about token t
    appended = [t for t in range(prompt_length, len(tokens)) if mask[t] == 0]
    results = tokenizer.decode(tokens[appended].tolist())
    assert "1410" in results and "47" in results  # the tool results are among them
    assert all(predicting[t - 1] == 0 for t in appended)
    assert all(predicting[t - 1] > 0 for t in range(len(tokens)) if mask[t] == 1)
    assert all(predicting[t - 1] == 0 for t in range(1, prompt_length))


def test_tool_results_get_no_gradient_in_the_warm_start(task):
    prompt = replace(task.prompts[0], metadata={"answer": SOLUTION})
    ids, trained = episode_example(task.env, task.renderer, task.tokenizer.eos_token_id)(prompt)
    assert ids[:len(prompt.token_ids)] == prompt.token_ids
    batch = masked_batch([(ids, trained)], task.tokenizer.pad_token_id)
    grad = logits_gradient(batch["input_ids"], NextTokenNLL(), batch)
    assert_only_model_tokens_are_trained(grad[0], batch["loss_mask"][0], batch["input_ids"][0], task.tokenizer,
                                         len(prompt.token_ids))


def test_tool_results_get_no_gradient_in_grpo(task):
    """An episode assembled as a rollout assembles it (Episode: the sampler's turns, the
    environment's real steps appended), collated, then GRPO's clipped policy loss."""
    prompt, tokenizer = replace(task.prompts[0], metadata={"answer": SOLUTION}), task.tokenizer
    episode = Episode(list(prompt.token_ids), [False] * len(prompt.token_ids), [0.0] * len(prompt.token_ids),
                      list(prompt.messages), prompt.metadata, group=0)
    runner = SimpleNamespace(max_turns=5, max_total_tokens=4096, max_tool_seconds=0)
    for turn in task.env.reference_turns(prompt.messages, prompt.metadata):
        ids = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        episode.add_generation(ids, [-1.0] * len(ids), budget=4096, tokenizer=tokenizer)
        step = task.env.step(episode.messages, episode.metadata)
        episode.add_step(Stepped(step, {}, 0.0), ids, task.renderer, runner)
    assert episode.done and episode.correct and episode.turns == 3
    rollout = _collate([episode], tokenizer.pad_token_id)
    mask = rollout.batch["response_mask"]
    batch = rollout.batch.with_fields(old_logprobs=torch.zeros_like(mask), advantages=torch.ones_like(mask))
    objective = PolicyGradient(ClippedPolicyLossConfig(0.2, 0.28, 0.0, "token-mean"))
    grad = logits_gradient(batch["input_ids"], objective, batch)
    assert_only_model_tokens_are_trained(grad[0], mask[0], batch["input_ids"][0], tokenizer, len(prompt.token_ids))
