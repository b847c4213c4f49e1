"""benchmarks/e2e.py's summary of a run's steps (pure)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import e2e  # noqa: E402


def step(generate, logprobs, train, weight_sync, total):
    return {"generate": generate, "logprobs": logprobs, "train": train, "weight_sync": weight_sync, "step": total}


def test_other_and_the_outside_share_are_taken_per_step_before_the_median():
    # the first step is warm-up; medians over steps 2..4
    result = e2e.summary([step(50, 5, 5, 5, 100), step(10, 2, 4, 1, 20), step(14, 2, 2, 1, 20), step(12, 2, 4, 1, 30)])
    median = result["median"]
    assert median["other"] == pytest.approx(3)  # others 3, 1, 11
    # outside shares 0.2, 0.1, 0.4667: the median of the steps, not 1 - (12 + 2 + 4) / 20
    assert result["outside_compute_fraction"] == pytest.approx(0.2)
    assert [s["other"] for s in result["steps"]] == pytest.approx([35, 3, 1, 11])


def test_trl_optimizer_steps_group_into_generation_rounds_with_their_own_phases():
    import e2e_trl

    begins, ends = [0, 10, 20, 30], [9, 19, 29, 39]
    timings = [(0, "GRPOTrainer.vLLM.generate", 6.0), (0, "GRPOTrainer.sync_weights", 0.5),
               (1, "GRPOTrainer.compute_loss", 2.0), (2, "GRPOTrainer.vLLM.generate", 5.0),
               (2, "GRPOTrainer.sync_weights", 0.25)]
    assert e2e_trl.rounds(begins, ends, timings, per_round=2) == [
        {"step": 19, "generate": 6.0, "weight_sync": 0.5}, {"step": 19, "generate": 5.0, "weight_sync": 0.25}]
    assert len(e2e_trl.rounds(begins, ends[:3], timings, per_round=2)) == 1  # an unfinished round is left out


def test_ratios_cover_start_up_first_step_and_the_phases_both_report():
    rlkit = {"to_first_step_s": 30.0, "first_step_s": 12.0, "median": {"step": 8.0, "generate": 4.0, "train": 2.0}}
    peer = {"to_first_step_s": 60.0, "first_step_s": 16.0, "median": {"step": 10.0, "generate": 5.0, "other": 3.0}}
    assert e2e.ratios(rlkit, peer) == pytest.approx({"step": 0.8, "generate": 0.8, "to_first_step_s": 0.5,
                                                     "first_step_s": 0.75})


# --- the layout, the workload's overrides and prompts (benchmarks/e2e_workload.py) ---------------------

def args_of(overrides: list[str]) -> dict:
    return dict(o.split("=", 1) for o in overrides)


def test_colocated_on_four_gpus_puts_an_engine_beside_each_policy_rank():
    from e2e_workload import Layout, layout_overrides

    args = args_of(layout_overrides(Layout("colocated", gpus=4), on_gpu=True))
    assert args["cluster.placement"] == "colocated" and args["refit"] == "cuda_ipc"
    assert (args["policy.num_workers"], args["generation.num_workers"]) == ("4", "4")
    assert args["algorithm.max_staleness"] == "0" and args["refit.verify_checksums"] == "false"
    assert args["policy.use_distributed_optimizer"] == "true"
    tp2 = args_of(layout_overrides(Layout("colocated", gpus=4, tp=2, engine_tp=2), on_gpu=True))
    assert (tp2["policy.tensor_parallel_size"], tp2["generation.num_workers"]) == ("2", "2")
    assert tp2["generation.vllm.tensor_parallel_size"] == "2"


def test_disaggregated_and_async_split_the_gpus_and_refit_over_nccl():
    from e2e_workload import Layout, layout_overrides

    split = args_of(layout_overrides(Layout("disaggregated", gpus=4), on_gpu=True))
    assert (split["cluster.placement"], split["refit"]) == ("disaggregated", "nccl")
    assert (split["policy.num_workers"], split["generation.num_workers"]) == ("2", "2")
    ahead = args_of(layout_overrides(Layout("async", gpus=4, policy_gpus=3, staleness=1), on_gpu=True))
    assert (ahead["policy.num_workers"], ahead["generation.num_workers"]) == ("3", "1")
    assert (ahead["algorithm.max_staleness"], ahead["algorithm.off_policy_correction"]) == ("1", "token_tis")
    cpu = args_of(layout_overrides(Layout("async", gpus=2), on_gpu=False))
    assert cpu["refit"] == "cpu" and "generation.vllm.tensor_parallel_size" not in cpu


@pytest.mark.parametrize("layout, problem", [
    (dict(mode="sideways"), "--layout"), (dict(mode="disaggregated", gpus=4, policy_gpus=4), "--policy-gpus"),
    (dict(gpus=4, engine_tp=3), "--engine-tp"), (dict(gpus=4, tp=2, ep=4), "--tp / --ep"),
    (dict(gpus=2, engine_tp=2, on_gpu=False), "HF workers")])
def test_a_layout_that_does_not_divide_up_is_named(layout, problem):
    from e2e_workload import Layout, layout_overrides

    on_gpu = layout.pop("on_gpu", True)
    with pytest.raises(ValueError, match=problem):
        layout_overrides(Layout(**layout), on_gpu)


def test_rlkit_reads_the_workload_prompts_and_samples_fixed_lengths(tmp_path):
    from e2e_workload import Workload

    w = Workload(response_tokens=1024, max_prompt_tokens=256, steps=4)
    args = args_of(e2e.rlkit_overrides(w, tmp_path / "m", tmp_path / "p.jsonl", tmp_path / "run", tmp_path / "c",
                                       vllm=True))
    assert args["data.train_path"] == str(tmp_path / "p.jsonl") and args["data.synthetic"] == "null"
    assert (args["data.max_prompt_tokens"], args["generation.max_new_tokens"]) == ("256", "1024")
    assert args["generation.ignore_eos"] == "true" and args["generation.vllm.max_model_len"] == "1280"
    assert args["checkpoint.enabled"] == "false" and args["algorithm.num_steps"] == "4"
    assert w.tokens_per_step == 64 * 8 * 1280


def test_every_prompt_renders_to_exactly_the_prompt_tokens(tmp_path):
    import dataclasses

    from e2e_workload import Workload, write_prompts

    from rlkit.config.schema import PromptDataConfig
    from rlkit.data.prompts import PromptRenderer, load_prompt_splits
    from rlkit.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    data = PromptDataConfig(name="prompts", train_path="unused", val_path=None, subset=None, train_split="train",
                            val_split="test", val_size=None, prompt_field="question", answer_field="answer",
                            max_prompt_tokens=200, max_row_bytes=1 << 20, chat_template=True, system_prompt=None,
                            prompt_format="{prompt}\nAnswer after ####.", tool_prompt="chat_template", synthetic=None)
    path = write_prompts(tmp_path / "prompts.jsonl", Workload(max_prompt_tokens=200), data, tokenizer, rows=64)
    loaded = dataclasses.replace(data, train_path=str(path))
    train, _ = load_prompt_splits(loaded, PromptRenderer.of(tokenizer, loaded, observation_format="{observation}"))
    assert len(train) == 64 and {len(p.token_ids) for p in train} == {200}
    assert all(p.metadata["answer"].split("#### ")[1].isdigit() for p in train)
    with pytest.raises(ValueError, match="over max_prompt_tokens=40"):
        write_prompts(tmp_path / "short.jsonl", Workload(max_prompt_tokens=40), data, tokenizer, rows=4)


# --- the models and what training them holds (benchmarks/common.py) ---------------------------------

@pytest.mark.parametrize("name, billions", [("qwen2.5-7b", 7.62), ("llama3.1-8b", 8.03), ("qwen3-30b-a3b", 30.53),
                                            ("qwen3-moe-16b-a3b", 16.03)])
def test_parameter_counts_match_the_released_models(name, billions):
    from common import model_config, parameter_counts

    assert sum(parameter_counts(model_config(name))) / 1e9 == pytest.approx(billions, abs=0.01)


def test_qwen3_30b_a3b_does_not_fit_four_h200s_and_its_half_the_experts_variant_does():
    from common import model_config, training_memory_gb

    h200 = 143771 * 2 ** 20 / 1e9  # 150.8 GB
    full = training_memory_gb(model_config("qwen3-30b-a3b"), gpus=4, ep=4, microbatch_tokens=1280)
    assert full["params"] == pytest.approx(17.6, abs=0.1) and full["adam"] == pytest.approx(91.6, abs=0.1)
    assert full["state"] < h200 < full["total"]  # one 1280-token row of activations is over
    half = training_memory_gb(model_config("qwen3-moe-16b-a3b"), gpus=4, ep=4, microbatch_tokens=4 * 1280)
    assert half["total"] < 0.75 * h200
    dense = training_memory_gb(model_config("qwen2.5-7b"), gpus=4, tp=2)
    assert dense["adam"] == pytest.approx(12 * 7.62 / 4, abs=0.1) and dense["params"] == pytest.approx(7.62, abs=0.1)


def test_a_layout_that_would_not_fit_a_gpu_stops_before_anything_starts():
    from e2e_workload import Layout, Workload

    w = Workload(response_tokens=1024, micro_batch_per_gpu=4)
    with pytest.raises(SystemExit, match=r"qwen3-30b-a3b on 4 policy GPUs \(TP=1, EP=4\) would hold about 174 GB per "
                                         r"GPU \(144 of weights.*over one GPU's 151 GB"):
        e2e.memory_estimate("qwen3-30b-a3b", w, Layout("colocated", gpus=4, ep=4), device_gb=150.8)
    fits = e2e.memory_estimate("qwen3-moe-16b-a3b", w, Layout("colocated", gpus=4, ep=4), device_gb=150.8)
    assert fits["total"] < fits["device"] == 150.8
    assert e2e.memory_estimate("qwen3-30b-a3b", w, Layout("colocated", gpus=4, ep=4), device_gb=None)["state"] > 144
    assert e2e.memory_estimate("smollm2", w, Layout(), device_gb=150.8) is None


def test_a_random_checkpoint_is_written_once_and_whole(tmp_path):
    import json

    from common import model_checkpoint

    out = model_checkpoint("tiny-qwen3-moe", tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts_per_tok"] == 2
    assert (out / "tokenizer.json").is_file() and float((out / "build_seconds.txt").read_text()) > 0
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen3-moe"]  # nothing half-written beside it
    stamp = (out / "config.json").stat().st_mtime_ns
    assert model_checkpoint("tiny-qwen3-moe", tmp_path) == out and (out / "config.json").stat().st_mtime_ns == stamp


def test_an_earlier_rlkit_result_is_compared_without_a_new_run(tmp_path, monkeypatch):
    import json

    rlkit = {"rlkit": {"to_first_step_s": 100.0, "first_step_s": 60.0, "median": {"step": 40.0, "train": 20.0}}}
    verl = {"framework": "verl", "to_first_step_s": 300.0, "first_step_s": 120.0, "median": {"step": 80.0, "gen": 9.0}}
    (tmp_path / "rlkit.json").write_text(json.dumps(rlkit))
    (tmp_path / "verl.json").write_text(json.dumps(verl))
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--rlkit-result", str(tmp_path / "rlkit.json"), "--compare",
                                      str(tmp_path / "verl.json"), "--out", str(tmp_path / "both.json")])
    e2e.main()
    both = json.loads((tmp_path / "both.json").read_text())
    assert both["ratio_rlkit_over_peer"]["verl"] == pytest.approx({"step": 0.5, "to_first_step_s": 1 / 3,
                                                                   "first_step_s": 0.5})
    assert both["peers"]["verl"]["median"]["gen"] == 9.0
