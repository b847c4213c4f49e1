"""The LLM judge on vLLM (env.backend=vllm on a GPU): its server scores a batch of conversations
through the environment pool; a verdict it cannot read is a counted failure, and an identical
request is answered from its cache. The judge is a tiny Qwen2 built here, offline, whose greedy
answer is fixed by the last token it reads: a readable verdict, or none."""

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rlkit.config.schema import EnvRunnerConfig
from rlkit.envs.runner import EnvironmentPool
from rlkit.models.tiny import build_tokenizer

JUDGE = "rlkit.envs.reward_models.judge.JudgeEnv"
# the rubric ends with the response: the judge's answer follows from the response's last token
TEMPLATE = "Q: {prompt}\nA: {response}"


def chained_judge(path, tokenizer, answers: dict[str, str]) -> None:
    """A causal LM that, after a prompt ending in the last token of a key of `answers`, writes that
    answer and stops: one layer whose attention and MLP add nothing, embeddings one-hot, and an LM
    head mapping each token to the one after it (EOS after an answer's last token and anywhere else)."""
    vocab = -(-len(tokenizer) // 64) * 64
    config = Qwen2Config(vocab_size=vocab, hidden_size=vocab, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    following = torch.full((vocab,), tokenizer.eos_token_id)
    for cue, answer in answers.items():
        chain = [tokenizer(cue, add_special_tokens=False)["input_ids"][-1],
                 *tokenizer(answer, add_special_tokens=False)["input_ids"]]
        assert len(set(chain)) == len(chain), f"{answer!r} repeats a token: the chain would loop"
        following[chain[:-1]] = torch.tensor(chain[1:])
    with torch.no_grad():
        for name, weight in model.named_parameters():
            weight.copy_(torch.ones_like(weight) if "norm" in name else torch.zeros_like(weight))
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        model.lm_head.weight[following, torch.arange(vocab)] = 1.0
    model.save_pretrained(path)
    tokenizer.chat_template = None  # the rubric as written: its last token is the response's
    tokenizer.save_pretrained(path)


def runner_cfg() -> EnvRunnerConfig:
    return EnvRunnerConfig(num_workers=2, timeout_s=180.0, failure_reward=-1.0, fail_fast=False, max_turns=1,
                           max_total_tokens=64, max_tool_seconds=0, observation_format="{observation}",
                           flow="per_turn")


def item(prompt: str, response: str) -> tuple[list[dict], dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], {}


def test_vllm_judge_scores_counts_unreadable_verdicts_and_caches(ray_cluster, tmp_path):
    chained_judge(tmp_path, build_tokenizer(), {" yes": "Score: 7/10", " no": "xq"})
    env = {"_target_": JUDGE, "model_path": str(tmp_path), "template": TEMPLATE, "backend": "vllm", "num_gpus": 1,
           "dtype": "bfloat16", "max_new_tokens": 16, "failure_reward": -0.5, "timeout_s": 120.0,
           "load_timeout_s": 600.0}
    items = [item("What is 2+3?", "5, yes"), item("What is 12+7?", "19, yes"), item("What is 4-9?", "-5, no"),
             item("What is 2+3?", "5, yes")]
    pool = EnvironmentPool(env, runner_cfg())
    try:
        assert list(pool.services) == ["judge"]
        stepped = pool.step(items)
        assert [s.step.reward for s in stepped] == [0.7, 0.7, -0.5, 0.7]
        for s in [stepped[0], stepped[1], stepped[3]]:
            assert s.step.faults is None and s.step.counts["judge/score_sum"] == 0.7
        unreadable = stepped[2].step
        assert unreadable.faults[0].startswith("judge verdict missing")
        assert unreadable.counts["judge/failures"] == unreadable.counts["judge/missing"] == 1
        assert sum(s.step.counts["judge/cache_hits"] for s in stepped) == 1  # the repeated conversation
        again = pool.step(items[:1])[0].step
        assert again.reward == 0.7 and again.counts["judge/cache_hits"] == 1
    finally:
        pool.shutdown()  # its server with it
