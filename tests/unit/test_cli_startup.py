"""What the CLI answers without a worker (help texts, config errors) it answers without importing
torch, Ray or Megatron, which cost seconds at every start (benchmarks/cli_latency.py times it).
Checked by what a fresh interpreter has imported once the command returns, not by timing."""

import json
import subprocess
import sys

import pytest

from rlkit.launch.config import RECIPES_DIR, compose_recipe
from recipe_stand_ins import reward_model_overrides

# each costs from half a second (Ray) to seconds (torch) at import; sympy: math_verify's, ~1 s
HEAVY = ("torch", "ray", "megatron", "transformers", "vllm", "sympy")
RECIPE = ["train", "--config-name", "grpo_tiny_cpu"]
# the command runs in a fresh interpreter; what it imported is printed last, as JSON
PROBE = """
import json, sys
import rlkit.cli
try:
    code = rlkit.cli.main(sys.argv[1:])
except SystemExit as e:  # argparse's --help
    code = e.code
print(json.dumps({"code": code, "heavy": sorted(m for m in sys.modules if m.split(".")[0] in %r)}))
""" % (HEAVY,)


def run(argv: list[str]) -> tuple[int, list[str], str]:
    """(exit code, heavy modules imported, stderr) of `rlkit <argv>` in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report["code"], report["heavy"], done.stderr


@pytest.mark.parametrize("argv, code, answer", [
    (["--help"], 0, ""),
    (["train", "--help"], 0, ""),
    (["train", "--config-name", "no_such_recipe"], 2, "rlkit: config error: recipe 'no_such_recipe': no "),
    ([*RECIPE, "polcy.lr=1e-5"], 2, "rlkit: config error: polcy.lr: unknown key"),
    ([*RECIPE, "policy.lr=abc"], 2, "rlkit: config error: policy.lr: unknown key"),
    ([*RECIPE, "policy.optimizer.lr=abc"], 2, "rlkit: config error: policy.optimizer.lr: Value 'abc'"),
    ([*RECIPE, "algorithm.group_size=1"], 2, "rlkit: config error: algorithm.group_size: GRPO needs"),
    ([*RECIPE, "policy.tensor_parallel_size=3", "policy.num_workers=3"], 2,
     "rlkit: config error: policy.tensor_parallel_size: must divide the model's 4 attention heads"),
], ids=["help", "train-help", "unknown-recipe", "misspelled-group", "unknown-key", "wrong-type", "algorithm-check",
        "model-shape-check"])
def test_help_and_config_errors_import_no_torch(argv, code, answer):
    exit_code, heavy, stderr = run(argv)
    assert exit_code == code and stderr.startswith(answer), stderr[-2000:]
    assert heavy == [], f"rlkit {' '.join(argv)} imported {heavy}"


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_every_recipes_checks_run_without_torch(recipe, tmp_path):
    """The last check of a config (its directories) fails, so every check before it ran: the
    algorithm's module and its checks, and the environment's, included."""
    overrides = [f"run.output_dir={tmp_path / 'file'}"]
    (tmp_path / "file").write_text("")
    if not str(compose_recipe(recipe, []).policy.model_path).startswith("tiny://"):  # an HF checkpoint's config
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text(json.dumps(
            {"model_type": "qwen2", "num_attention_heads": 12, "num_key_value_heads": 2}))
        overrides.append(f"policy.model_path={tmp_path / 'model'}")
    overrides += reward_model_overrides(recipe, tmp_path)
    exit_code, heavy, stderr = run(["train", "--config-name", recipe, *overrides])
    assert exit_code == 2 and stderr.startswith("rlkit: config error: run.output_dir: "), stderr[-2000:]
    assert heavy == [], f"{recipe}'s config checks imported {heavy}"
