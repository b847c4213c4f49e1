"""`rlkit eval` on a real local Ray cluster: the tiny recipe's warm start (the one test_checkpoint's
runs start from, trained here where they have not run) scored as an HF model with the recipe, and
as a dist checkpoint of the same weights with its run's saved config on the same rows given as a
file; its greedy accuracy must be what HF generate's greedy answers to the same prompts earn."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlkit.algorithms.policy_gradient import load_prompts, warm_start_on_answers
from rlkit.algorithms.warm_start import answer_example, cached_warm_start, sft_steps, warm_start_dir
from rlkit.checkpoint import CheckpointManager
from rlkit.cluster.setup import start_workers
from rlkit.envs.arithmetic import ArithmeticEnv
from rlkit.launch.evaluate import evaluate, plan_eval, write_report
from rlkit.models.tokenizer import load_tokenizer
from rlkit.observability.evaluation import report_table

pytestmark = pytest.mark.integration
WARM_START = "algorithm.warm_start.sft_steps=60"  # test_checkpoint's: one cache entry for both


class SavedPolicy:
    """The policy's part of a checkpoint, as a trainer saves it."""

    def __init__(self, policy, save_format: str):
        self.policy, self.save_format = policy, save_format

    def save(self, checkpoint_dir: str) -> dict[str, float]:
        return self.policy.save_checkpoint(checkpoint_dir, self.save_format)

    def saved(self, wait: bool):
        return self.policy.finish_checkpoint(wait)


@pytest.fixture(scope="module")
def warm_started(warm_pool, make_cfg, tiny_qwen2, tmp_path_factory):
    """(the warm start's HF folder, a dist checkpoint of the same weights, the config)."""
    cfg, resolved = make_cfg(WARM_START)
    tokenizer = load_tokenizer(tiny_qwen2)
    start_dir, untrained = warm_start_dir(cfg, tiny_qwen2, None, False, *load_prompts(cfg, tokenizer).identity)
    workers = start_workers(cfg, str(start_dir), with_generation=False, pool=warm_pool)
    try:
        if untrained is not None:
            cached_warm_start(workers.policy, untrained, lambda: warm_start_on_answers(
                cfg, workers.policy, tokenizer, load_prompts(cfg, tokenizer), untrained))
            start_dir = untrained
        # a run's checkpoint holds its optimizer's state: one step at learning rate 0 makes it, weights unchanged
        sft_steps(workers.policy, answer_example(tokenizer), tokenizer.pad_token_id, load_prompts(cfg, tokenizer).train,
                  1, cfg.algorithm.warm_start.batch_size, 0.0, cfg.run.seed)
        checkpoints = CheckpointManager(cfg.checkpoint, tmp_path_factory.mktemp("run"))
        checkpoints.save(60, SavedPolicy(workers.policy, "dist"), {"step": 60}, resolved)
        checkpoint = checkpoints.finish(wait=True)
    finally:
        workers.shutdown()
    return start_dir, checkpoint, cfg


def hf_greedy(model_dir, cfg, prompts) -> tuple[float, float]:
    """(accuracy, mean response length in tokens) of HF generate's greedy answers to the prompts
    (one prompt at a time, no rlkit worker), scored by the arithmetic environment; a response
    ends with its EOS, which counts, or at generation.max_new_tokens."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer, env = load_tokenizer(model_dir), ArithmeticEnv()
    correct = tokens = 0
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt.token_ids]), max_new_tokens=cfg.generation.max_new_tokens,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)[0, len(prompt.token_ids):].tolist()
        ids = ids[:ids.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in ids else ids
        answer = tokenizer.decode(ids, skip_special_tokens=True)
        correct += env.step([*prompt.messages, {"role": "assistant", "content": answer}], prompt.metadata).correct
        tokens += len(ids)
    return correct / len(prompts), tokens / len(prompts)


def test_eval_scores_what_hf_generate_scores(warm_started, warm_pool, make_cfg, cache_dir, tmp_path):
    """Greedy accuracy and response length equal HF generate's (within one prompt's flip: the
    workers batch prompts with padding, which can tip a near-tie); random weights answer nothing
    and never stop, so a refit that missed would show in both. pass@k is consistent with the
    samples it counts."""
    warm_dir, checkpoint, cfg = warm_started
    overrides = [f"run.cache_dir={cache_dir}", f"run.output_dir={tmp_path}", "generation.num_workers=1"]
    prompts = load_prompts(cfg, load_tokenizer(warm_dir)).val
    accuracy, length = hf_greedy(warm_dir, cfg, prompts)
    assert accuracy > 0 and length < cfg.generation.max_new_tokens - 1, (accuracy, length)

    hf_plan = plan_eval(str(warm_dir), "grpo_tiny_cpu", overrides, 4, "1,2,4", None, None)
    hf = evaluate(hf_plan, pool=warm_pool)
    write_report(hf, hf_plan.out)
    print(report_table(hf))
    assert hf_plan.out == warm_dir.parent / f"{warm_dir.name}.eval.json"
    assert json.loads(hf_plan.out.read_text()) == hf
    greedy, flip = hf["greedy"], 1.01 / len(prompts)
    assert hf["prompts"] == len(prompts) and hf["step"] is None and greedy["scored"] == len(prompts)
    assert greedy["accuracy"] == pytest.approx(accuracy, abs=flip), (greedy, accuracy)
    assert greedy["response_length"] == pytest.approx(length, abs=cfg.generation.max_new_tokens * flip)
    sampled = hf["sampled"]
    assert sampled["scored"] == 4 * len(prompts) and sampled["pass@1"] == pytest.approx(sampled["accuracy"])
    assert sampled["pass@1"] <= sampled["pass@2"] <= sampled["pass@4"] and sampled["pass@4"] > 0

    # the same weights as a dist checkpoint, with its run's own config, on the same rows from a file of
    # the user's: the policy restores the checkpoint over the untrained model and refits the engine
    rows = tmp_path / "rows.jsonl"
    rows.write_text(Path(cfg.data.val_path).read_text())
    out = tmp_path / "checkpoint_report.json"
    restored = evaluate(plan_eval(str(checkpoint), None, ["generation.num_workers=1"], None, None, str(rows), str(out)),
                        pool=warm_pool)
    assert restored["step"] == 60 and restored["data"] == str(rows) and "sampled" not in restored
    assert restored["prompts"] == len(prompts) and restored["greedy"]["accuracy"] == pytest.approx(accuracy, abs=flip)
    assert restored["greedy"]["response_length"] == pytest.approx(length, abs=cfg.generation.max_new_tokens * flip)
