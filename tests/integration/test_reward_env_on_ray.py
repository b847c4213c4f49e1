"""Model rewards on the session's Ray cluster: a reward model's server, shared by the environment
workers, scores exactly as the HF model called directly does; a server that does not answer in
time or dies fails its calls, not the run; an LLM judge's nonsense verdicts are counted failures
beside a rule's reward in a weighted combination; a GRPO step trains on a rule and a reward model
combined."""

import time

import pytest
import ray
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config

from rlkit.config.schema import EnvRunnerConfig
from rlkit.envs.runner import EnvironmentPool
from rlkit.launch.run import train
from rlkit.models.tiny import build_tokenizer

pytestmark = pytest.mark.integration

RM = "rlkit.envs.reward_models.reward_model.RewardModelEnv"
JUDGE = "rlkit.envs.reward_models.judge.JudgeEnv"
COMBINED = "rlkit.envs.reward_models.combined.CombinedEnv"


def runner_cfg(**overrides) -> EnvRunnerConfig:
    values = dict(num_workers=2, timeout_s=60.0, failure_reward=-1.0, fail_fast=False, max_turns=1,
                  max_total_tokens=64, max_tool_seconds=0, observation_format="{observation}", flow="per_turn")
    return EnvRunnerConfig(**{**values, **overrides})


def item(prompt: str, response: str, answer: str = "0") -> tuple[list[dict], dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], {"answer": answer}


# conversations of different lengths (rows of a batch padded to the longest), one of them twice
ITEMS = [item("2+3=", "5", "5"), item("12+7=", "The answer is 19", "19"), item("4-9=", "-5", "-5"),
         item("What is 6+6? Think first.", "6+6 is 12, so the answer is 12", "12"), item("2+3=", "5", "5"),
         item("1+1=", "3", "2")]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny Qwen2 reward model (sequence classification, one label) with the tiny models' tokenizer."""
    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("reward_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def kill_and_wait(actor) -> None:
    """ray.kill only asks for the kill: calls sent right after it can still be served."""
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(600):
            ray.get(actor.ready.remote(), timeout=30)
            time.sleep(0.05)


def scores_called_directly(model_dir: str, items) -> list[float]:
    """Each conversation alone through the HF model, rendered by its tokenizer's chat template."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    scores = []
    with torch.no_grad():
        for messages, _ in items:
            ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False,
                            return_tensors="pt")["input_ids"]
            scores.append(model(input_ids=ids).logits[0, 0].item())
    return scores


def test_reward_model_server_scores_as_the_model_called_directly(ray_cluster, reward_model_dir):
    """Two workers send their conversations to one server, which scores them in batches; the
    rewards are the model's scores of each conversation alone. A server that dies fails the
    calls after it (env/exceptions), and the pool goes on."""
    pool = EnvironmentPool({"_target_": RM, "model_path": reward_model_dir}, runner_cfg())
    try:
        assert list(pool.services) == ["reward_model"]
        stepped = pool.step(ITEMS)
        rewards = [s.step.reward for s in stepped]
        torch.testing.assert_close(torch.tensor(rewards), torch.tensor(scores_called_directly(reward_model_dir, ITEMS)))
        assert len(set(rewards)) == 5  # the repeated conversation scores alike, the others apart
        tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
        for s, (messages, _) in zip(stepped, ITEMS):
            response_tokens = len(tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"])
            assert s.counts == {} and s.step.counts == {
                "reward_model/raw_sum": s.step.reward, "reward_model/scored": 1, "reward_model/truncated": 0,
                "reward_model/response_tokens_sum": response_tokens}
        kill_and_wait(pool.services["reward_model"])
        after = pool.step(ITEMS[:2])
        assert [s.step.reward for s in after] == [-1.0, -1.0]
        assert all(s.counts == {"env/failures": 1, "env/exceptions": 1} for s in after)
    finally:
        pool.shutdown()


def test_a_request_the_server_does_not_answer_in_time_is_a_timeout(ray_cluster, reward_model_dir):
    """One request for two workers: the server waits up to 30 s for the other worker's to fill
    the batch, and the request gives up after 0.5 s (env.timeout_s) as a timeout, well inside
    env_runner.timeout_s, so its worker is kept."""
    env = {"_target_": RM, "model_path": reward_model_dir, "max_wait_s": 30.0, "timeout_s": 0.5}
    pool = EnvironmentPool(env, runner_cfg())
    try:
        worker = pool.workers[0]
        (stepped,) = pool.step(ITEMS[:1])
        assert stepped.step.reward == -1.0 and stepped.counts == {"env/failures": 1, "env/timeouts": 1}
        assert pool.workers[0] is worker
    finally:
        pool.shutdown()


def test_judge_nonsense_verdicts_are_counted_failures_beside_a_rule(ray_cluster, tiny_qwen2):
    """A random tiny causal LM as the judge writes no readable verdict: each is a fault counted
    in judge/failures (judge/missing or judge/malformed), scored failure_reward, never a crashed
    call; the rule's reward and verdict come through beside it, the total their weighted sum. The
    repeated conversation is answered from the judge's cache."""
    parts = {"rule": {"_target_": "rlkit.envs.arithmetic.ArithmeticEnv", "weight": 1.0},
             "judge": {"_target_": JUDGE, "weight": 0.5, "model_path": str(tiny_qwen2), "max_new_tokens": 8,
                       "failure_reward": -1.0}}
    pool = EnvironmentPool({"_target_": COMBINED, "parts": parts}, runner_cfg())
    try:
        assert list(pool.services) == ["judge/judge"]
        stepped = pool.step(ITEMS)
        correct = [messages[-1]["content"] == metadata["answer"] for messages, metadata in ITEMS]
        assert [s.step.correct for s in stepped] == correct
        assert [s.step.reward for s in stepped] == [float(c) - 0.5 for c in correct]
        counts = [s.step.counts for s in stepped]
        assert all(s.counts == {} and len(s.step.faults) == 1 and s.step.faults[0].startswith("judge: judge verdict")
                   for s in stepped)
        assert all(c["judge/failures"] == 1 and c["combined/judge_sum"] == -1.0 for c in counts)
        assert sum(c.get("judge/missing", 0) + c.get("judge/malformed", 0) for c in counts) == len(ITEMS)
        assert sum(c["judge/cache_hits"] for c in counts) == 1
    finally:
        pool.shutdown()


def test_a_grpo_step_trains_on_a_rule_and_a_reward_model_combined(warm_pool, make_cfg, reward_model_dir, tmp_path):
    """The trainer's environment pool starts the reward model's server (configs/env/math_reward_model.yaml,
    its rule the arithmetic one here); the step's reward is the weighted sum of the parts' rewards,
    each reported beside it."""
    cfg, resolved = make_cfg("env=math_reward_model", "env.parts.correct._target_=rlkit.envs.arithmetic.ArithmeticEnv",
                             f"env.parts.preference.model_path={reward_model_dir}", "algorithm.num_steps=1",
                             "algorithm.prompts_per_step=8", "policy.train_global_batch_size=64",
                             "checkpoint.enabled=false", f"run.output_dir={tmp_path}")
    step = train(cfg, resolved, pool=warm_pool).history[-1]
    assert step["env/failures"] == 0 and step["combined/scored"] == step["reward_model/scored"] == 64
    weighted = (step["combined/correct_sum"] + 0.5 * step["combined/preference_sum"]) / 64
    assert step["train/reward"] == pytest.approx(weighted)
