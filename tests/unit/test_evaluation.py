"""`rlkit eval` without workers: pass@k against a count of every draw, the report's table, and
each bad input as one config error before any worker starts (and without importing torch)."""

import hashlib
import itertools
import json
import math

import pytest
from omegaconf import OmegaConf
from test_cli_startup import run

from rlkit.config.schema import ConfigError
from rlkit.launch.config import compose_recipe
from rlkit.launch.evaluate import plan_eval, write_report
from rlkit.observability.evaluation import mean_pass_at_k, parse_ks, pass_at_k, report_table


def drawn_pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k by enumeration: the share of the k-subsets of n samples (c of them correct) that hold
    a correct one."""
    samples = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(samples, k))
    return sum(any(draw) for draw in draws) / len(draws)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_is_the_share_of_draws_with_a_correct_sample(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(drawn_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edges_and_large_n():
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 10, 1) == 1.0 and pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(200, 1, 1) == pytest.approx(0.005)  # exact binomials: no overflow at large n
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)
    assert pass_at_k(1000, 10, 500) == pytest.approx(1 - math.comb(990, 500) / math.comb(1000, 500))
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_mean_pass_at_k_averages_prompts():
    correct = [[True, False, False, False], [False] * 4, [True] * 4]
    assert mean_pass_at_k(correct, 1) == pytest.approx((0.25 + 0 + 1) / 3)
    assert mean_pass_at_k(correct, 4) == pytest.approx(2 / 3)


def test_parse_ks():
    assert parse_ks("8, 1,4,4", 8) == [1, 4, 8]
    for text, problem in [("1,x", "comma-separated list of integers"), (",", "at least one k"),
                          ("1,9", "each k must be in 1..--n=8"), ("0", "each k must be in 1..--n=8")]:
        with pytest.raises(ValueError, match=problem):
            parse_ks(text, 8)


REPORT = {"model": "outputs/run/checkpoints/step_000150", "step": 150, "prompts": 100, "data": "val.jsonl",
          "env": "rlkit.envs.arithmetic.ArithmeticEnv", "generation": "hf", "seconds": 12.34,
          "greedy": {"accuracy": 0.51, "scored": 100, "reward": 0.51, "response_length": 3.2, "env_failures": 0},
          "sampled": {"n": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "pass@1": 0.43, "pass@8": 0.9,
                      "accuracy": 0.43, "scored": 800, "reward": 0.43, "response_length": 3.5, "env_failures": 0}}


def test_report_table_fits_a_screen_and_shows_every_figure():
    table = report_table(REPORT)
    lines = table.splitlines()
    assert len(lines) < 20 and max(map(len, lines)) <= 100, table
    assert lines[0] == "rlkit eval: outputs/run/checkpoints/step_000150 (step 150)"
    for shown in ["100 prompts of val.jsonl", "greedy accuracy", "0.510 (100 scored)", "pass@1 (n=8, temperature 1)",
                  "0.430", "pass@8", "0.900", "sampled response length", "3.5 tokens", "12.3 s"]:
        assert shown in table, (shown, table)
    greedy_only = report_table({**{k: v for k, v in REPORT.items() if k != "sampled"}, "step": None,
                                "greedy": {**REPORT["greedy"], "accuracy": None, "scored": 0}})
    assert "pass@" not in greedy_only and "(step" not in greedy_only
    assert "n/a (the environment gave no verdicts)" in greedy_only


@pytest.fixture
def hf_model(tmp_path):
    """A folder that reads as an HF model to the config checks (its config.json; no weights)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "num_hidden_layers": 2}))
    return model


def plan(model, *overrides, recipe="grpo_tiny_cpu", n=None, k=None, data=None, out=None):
    cache = model.parent / "cache"
    return plan_eval(str(model), recipe, [f"run.cache_dir={cache}", f"run.output_dir={model.parent / 'out'}",
                                          *overrides], n, k, data, out)


def test_an_hf_model_is_planned_with_the_recipe(hf_model):
    p = plan(hf_model, n=4)
    assert p.model_dir == hf_model and p.checkpoint is None and p.cfg.policy.model_path == str(hf_model)
    assert p.n == 4 and p.ks == [1, 4] and p.out == hf_model.parent / "model.eval.json"
    assert p.cfg.data.val_path.endswith("arithmetic_val.jsonl")


def test_the_report_goes_beside_the_model_under_a_new_name(hf_model):
    (hf_model.parent / "model.eval.json").write_text("the user's")
    (hf_model.parent / "model.eval-2.json").write_text("the user's")
    assert plan(hf_model).out == hf_model.parent / "model.eval-3.json"
    assert not [p for p in hf_model.parent.iterdir() if p.name.startswith(".")]  # the write probe is gone


def test_a_report_is_never_written_over_a_file(hf_model):
    out = hf_model.parent / "report.json"
    out.write_text("the user's")
    with pytest.raises(ConfigError, match="--out: .*report.json exists, and rlkit never overwrites a file"):
        plan(hf_model, out=str(out))
    with pytest.raises(ConfigError, match="created while the evaluation ran"):  # one made after the plan
        write_report(REPORT, out)
    assert out.read_text() == "the user's" and sorted(p.name for p in out.parent.iterdir()) == ["model", "report.json"]
    fresh = out.with_name("fresh.json")
    write_report(REPORT, fresh)
    assert json.loads(fresh.read_text()) == REPORT


@pytest.mark.parametrize("model, kwargs, problem", [
    ("missing", {}, "model: .*missing does not exist; give an HF model directory or a checkpoint"),
    ("empty", {}, "model: .*empty is neither an HF model directory"),
    ("run", {}, "model: .*run is a run's folder; name one of its checkpoints"),
    ("model", {"n": 4, "k": "1,8"}, "--k: each k must be in 1..--n=4"),
    ("model", {"k": "1,4"}, "--k: pass@k needs samples: add --n"),
    ("model", {"n": 0}, "--n: samples per prompt must be >= 1"),
    ("model", {"recipe": None}, "--config-name: .*model is an HF model, so a recipe must say"),
    ("model", {"recipe": "sft_tiny_cpu"}, "algorithm.name: sft generates nothing"),
    ("model", {"data": "no_such_rows.jsonl"}, "--data: no_such_rows.jsonl: no such file"),
    ("model", {"overrides": ["data=no_such_preset"]},
     "recipe 'grpo_tiny_cpu': .*Could not find 'data/no_such_preset'; pick one of: arithmetic, .*gsm8k"),
    ("model", {"out": "no_such_folder/report.json"}, "--out: the folder .*no_such_folder does not exist"),
], ids=["missing", "not-a-model", "run-folder", "k-above-n", "k-without-n", "n-zero", "hf-without-recipe",
        "sft-recipe", "missing-data-file", "unknown-preset", "out-folder-missing"])
def test_bad_input_is_one_config_error(hf_model, model, kwargs, problem):
    (hf_model.parent / "empty").mkdir()
    (hf_model.parent / "run" / "checkpoints").mkdir(parents=True)
    overrides = kwargs.pop("overrides", [])
    with pytest.raises(ConfigError, match=problem):
        plan(hf_model.parent / model, *overrides, **kwargs)


@pytest.fixture
def checkpoint(hf_model):
    """A complete checkpoint folder as a run of grpo_tiny_cpu on hf_model leaves it (its weights a
    stand-in: nothing loads them here), from a run that had resumed from another checkpoint."""
    path = hf_model.parent / "run" / "checkpoints" / "step_000010"
    (path / "policy").mkdir(parents=True)
    (path / "policy" / "weights.distcp").write_bytes(b"weights")
    saved = compose_recipe("grpo_tiny_cpu", [f"policy.model_path={hf_model}", "generation.max_new_tokens=9",
                                             "refit.bucket_mb=7", f"run.cache_dir={hf_model.parent / 'cache'}",
                                             f"checkpoint.resume={hf_model.parent / 'gone' / 'step_000005'}"])
    (path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    write_manifest(path)
    return path


def write_manifest(checkpoint):
    """The manifest a checkpoint's writer leaves last: each file's size and SHA-256."""
    files = {name: (checkpoint / name).read_bytes() for name in ("policy/weights.distcp", "config.yaml")}
    (checkpoint / "manifest.json").write_text(json.dumps({"files": {
        name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()}}))


def test_a_checkpoint_is_planned_with_its_runs_config(checkpoint, hf_model):
    p = plan_eval(str(checkpoint), None, ["generation.num_workers=1"], None, None, None, None)
    assert p.checkpoint == checkpoint and p.model_dir == hf_model and p.out == checkpoint.parent / "step_000010.eval.json"
    assert p.cfg.generation.max_new_tokens == 9 and p.cfg.generation.num_workers == 1
    assert p.cfg.checkpoint.resume == "none"  # the run's resume source is not this evaluation's business
    with pytest.raises(ConfigError, match="data=gsm8k: choosing a config group needs a recipe"):
        plan_eval(str(checkpoint), None, ["data=gsm8k"], None, None, None, None)


def test_a_recipe_keeps_the_checkpoints_model_and_refit(checkpoint, hf_model):
    p = plan_eval(str(checkpoint), "grpo_tiny_cpu", [f"run.cache_dir={hf_model.parent / 'cache'}"], None, None, None,
                  None)
    assert p.cfg.generation.max_new_tokens == 6  # the recipe's
    assert p.cfg.policy.model_path == str(hf_model) and p.cfg.refit.bucket_mb == 7  # the checkpoint's


def test_an_sft_checkpoint_is_scored_with_an_rl_recipe(checkpoint, hf_model):
    saved = compose_recipe("sft_tiny_cpu", [f"policy.model_path={hf_model}", f"run.cache_dir={hf_model.parent}"])
    (checkpoint / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    write_manifest(checkpoint)
    with pytest.raises(ConfigError, match="algorithm.name: sft generates nothing.*add --config-name <an RL recipe>"):
        plan_eval(str(checkpoint), None, [], None, None, None, None)
    p = plan_eval(str(checkpoint), "grpo_tiny_cpu", [f"run.cache_dir={hf_model.parent / 'cache'}"], None, None, None,
                  None)
    assert p.cfg.refit.transport == "cpu" and p.cfg.policy.model_path == str(hf_model)


def test_a_damaged_checkpoint_is_refused(checkpoint):
    (checkpoint / "policy" / "weights.distcp").write_bytes(b"weightz")
    with pytest.raises(ConfigError, match="model: the checkpoint .*step_000010 is damaged: policy/weights.distcp "
                                          "differs from what was written"):
        plan_eval(str(checkpoint), None, [], None, None, None, None)


def test_eval_errors_come_without_torch(hf_model):
    code, heavy, stderr = run(["eval", str(hf_model), "--config-name", "grpo_tiny_cpu", "--n", "2", "--k", "4"])
    assert code == 2 and stderr.startswith("rlkit: config error: --k: each k must be in 1..--n=2"), stderr
    assert len(stderr.strip().splitlines()) == 1 and heavy == []
    # overrides after an option reach the recipe too
    code, heavy, stderr = run(["eval", str(hf_model), "--config-name", "grpo_tiny_cpu", "--n", "2", "data=nope"])
    assert code == 2 and stderr.startswith("rlkit: config error: recipe 'grpo_tiny_cpu': ") and "data/nope" in stderr
    assert heavy == []
