"""Runs that cannot work, or would quietly do nothing, stop (or warn) in their first lines, before any
worker starts (rlkit/launch/preflight.py and the checks around it); and generated data never overwrites
a user's file. Each case is what a user met on a fresh clone: the run it used to start, and what it says now."""

import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlkit.algorithms.registry import load_algorithm
from rlkit.checkpoint import CheckpointManager, WrittenFiles
from rlkit.cli import main
from rlkit.config.schema import ConfigError
from rlkit.data.files import GENERATED_MARKER
from rlkit.envs import sandbox
from rlkit.launch.config import RECIPES_DIR, load_config
from rlkit.launch.preflight import check_prompts, check_resumed_schedule
from rlkit.launch.run import train
from rlkit.models.tiny import build_tokenizer

RECIPE = "grpo_tiny_cpu"  # 64 prompts x 8 samples per step, global batch 256: 2 optimizer steps per step


@pytest.fixture
def dirs(tmp_path) -> list[str]:
    """A private cache and output folder, so nothing lands in the checkout's .rlkit_cache."""
    return [f"run.cache_dir={tmp_path / 'cache'}", f"run.output_dir={tmp_path / 'out'}"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def load_error(recipe: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    assert "\n" not in str(info.value), f"config errors are one line: {info.value!r}"
    return str(info.value)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- A. generated data never overwrites a user's file --------------------------------------------------

USER_ROWS = {"grpo_tiny_cpu": {"prompt": "my prompt", "answer": "7"},
             "sft_tiny_cpu": {"prompt": "my prompt", "response": "my answer"},
             "dpo_tiny_cpu": {"prompt": "my prompt", "chosen": "yes", "rejected": "no"}}


@pytest.mark.parametrize("key", ["data.train_path", "data.val_path"])
@pytest.mark.parametrize("recipe", list(USER_ROWS))
def test_own_file_with_a_synthetic_set_is_an_error_naming_both_keys(tmp_path, dirs, recipe, key):
    """It used to overwrite the user's file with the generated arithmetic set and train on it, exit 0."""
    mine = write_jsonl(tmp_path / "mine.jsonl", [USER_ROWS[recipe]])
    before = mine.read_text()
    message = load_error(recipe, [*dirs, f"{key}={mine}"])
    assert message.startswith(f"{key} / data.synthetic: {key}={mine} lies outside run.cache_dir")
    assert "set data.synthetic=null to train on" in message
    load_config(recipe, [*dirs, f"{key}={mine}", "data.synthetic=null"])  # the fix the message gives
    assert mine.read_text() == before


@pytest.mark.parametrize("recipe, default_file", [("grpo_tiny_cpu", "arithmetic_train.jsonl"),
                                                  ("sft_tiny_cpu", "arithmetic_sft_train.jsonl"),
                                                  ("dpo_tiny_cpu", "arithmetic_preferences_train.jsonl")])
def test_a_file_rlkit_did_not_write_at_the_generated_path_is_left_alone(tmp_path, dirs, recipe, default_file):
    mine = tmp_path / "cache" / "data" / default_file
    mine.parent.mkdir(parents=True)
    write_jsonl(mine, [USER_ROWS[recipe]])
    message = load_error(recipe, dirs)
    assert message.startswith(f"data.train_path / data.synthetic: {mine} exists and rlkit did not generate it "
                              f"(no {default_file}{GENERATED_MARKER} beside it)")
    assert message.endswith("set data.synthetic=null to train on that file, or move it away to have the set "
                            "generated there")


def test_the_generated_set_is_rlkits_own_once_loaded(tmp_path, dirs, tokenizer):
    """The recipe's default paths: written (and marked) by the data loader, accepted on the next load."""
    cfg, _ = load_config(RECIPE, dirs)
    load_algorithm("grpo").load_data(cfg, tokenizer)
    marker = json.loads(Path(f"{cfg.data.train_path}{GENERATED_MARKER}").read_text())
    assert marker["generated_by"] == "rlkit" and marker["data.synthetic"]["kind"] == "arithmetic"
    load_config(RECIPE, dirs)
    load_config(RECIPE, [*dirs, "data.synthetic.seed=1"])  # another set: its own file, rewritten at load


def test_cli_refuses_in_one_line_and_leaves_the_file(tmp_path, dirs, capsys):
    mine = write_jsonl(tmp_path / "mine.jsonl", [USER_ROWS[RECIPE]])
    before = mine.read_text()
    assert main(["train", "--config-name", RECIPE, *dirs, f"data.train_path={mine}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("rlkit: config error: data.train_path / data.synthetic: ")
    assert mine.read_text() == before


# ---- B. runs that would do nothing --------------------------------------------------------------------

def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_warmup_longer_than_the_run_is_warned_about(dirs, caplog):
    """4 steps x 2 mini-batches = 8 optimizer steps: the rate climbs to 8/1000 of 1e-4 and stops there."""
    load_config(RECIPE, [*dirs, "algorithm.num_steps=4", "policy.optimizer.warmup_steps=1000"])
    assert warnings_of(caplog) == [
        "policy.optimizer.warmup_steps=1000 is longer than the run's 8 optimizer steps (algorithm.num_steps=4 x 2 "
        "mini-batches per step): the learning rate never gets past 8/1000 of policy.optimizer.lr=0.0001; lower "
        "warmup_steps well below 8, or raise algorithm.num_steps"]


@pytest.mark.parametrize("recipe, overrides, warned", [
    (RECIPE, ["policy.optimizer.warmup_steps=8"], False),  # reaches the full rate at the last optimizer step
    ("sft_tiny_cpu", ["policy.optimizer.warmup_steps=4"], False),  # SFT: one optimizer step per step
    ("sft_tiny_cpu", ["policy.optimizer.warmup_steps=5"], True),
])
def test_warmup_is_counted_in_optimizer_steps(dirs, caplog, recipe, overrides, warned):
    load_config(recipe, [*dirs, "algorithm.num_steps=4", *overrides])
    assert bool(warnings_of(caplog)) == warned


def test_staleness_of_the_whole_run_is_an_error(dirs):
    """Every rollout would come from the starting weights: the engines never get new ones."""
    async_run = [*dirs, "cluster.placement=disaggregated", "algorithm.num_steps=4"]
    message = load_error(RECIPE, [*async_run, "algorithm.max_staleness=4"])
    assert message.startswith("algorithm.max_staleness: must be below algorithm.num_steps")
    assert "(got: 4 with num_steps=4); use at most 3" in message
    load_config(RECIPE, [*async_run, "algorithm.max_staleness=3"])


def saved_run(tmp_path, dirs, *overrides) -> None:
    """A checkpoint at step 2 of a 4-step async run, as the loop saves it (no model files: train()
    must stop before it would load any)."""
    cfg, resolved = load_config(RECIPE, [*dirs, "cluster.placement=disaggregated", "algorithm.num_steps=4",
                                         "algorithm.max_staleness=1", *overrides])
    checkpoints = CheckpointManager(cfg.checkpoint, tmp_path / "out" / cfg.run.name)
    checkpoints.save(2, NoModels(), {"step": 2, "rows": None}, resolved)
    checkpoints.finish(wait=True)


class NoModels:
    def save(self, directory) -> dict:
        return {"held": 0.0}

    def saved(self, wait: bool) -> WrittenFiles:
        return WrittenFiles({})


@pytest.mark.parametrize("key, saved, asked", [("algorithm.max_staleness", 1, 2), ("algorithm.num_steps", 4, 6)])
def test_resuming_an_async_run_with_another_schedule_stops_before_any_worker(tmp_path, dirs, key, saved, asked):
    """It used to resume on another rollout schedule without a word."""
    saved_run(tmp_path, dirs)
    cfg, resolved = load_config(RECIPE, [*dirs, "cluster.placement=disaggregated", "algorithm.num_steps=4",
                                         "algorithm.max_staleness=1", f"{key}={asked}"])
    with pytest.raises(ConfigError) as info:
        train(cfg, resolved)
    checkpoint = tmp_path / "out" / RECIPE / "checkpoints" / "step_000002"
    assert str(info.value) == (f"{key}: {checkpoint} was saved with {key}={saved} and this run asks for {asked}; with "
                               f"async rollouts that changes the schedule mid-run (which weights generate each step, "
                               f"and the rollouts the checkpoint holds); resume with {key}={saved}, or start a fresh "
                               f"run (another run.name, or checkpoint.resume=none)")
    assert not (tmp_path / "cache").exists()  # stopped before even the model was built


def test_a_synchronous_run_may_resume_with_more_steps(tmp_path, dirs):
    cfg, resolved = load_config(RECIPE, [*dirs, "algorithm.num_steps=6"])
    saved = OmegaConf.create(OmegaConf.to_container(resolved))
    saved.algorithm.num_steps = 4
    check_resumed_schedule(cfg, saved, tmp_path / "step_000002")


def code_run(tmp_path, dirs, rows: list[dict]) -> list[str]:
    path = write_jsonl(tmp_path / "code.jsonl", rows)
    return [*dirs, "env=code", "env.allow_weak_sandbox=true", f"data.train_path={path}", "data.val_path=null",
            "data.synthetic=null"]


def test_code_rows_without_tests_are_an_error_naming_file_and_field(tmp_path, dirs, tokenizer):
    """Every sample used to fail in the environment (512/512 at every step, grad norm 0)."""
    rows = [{"prompt": "Write f() returning 1.", "answer": "1"}, {"prompt": "Write g() returning 2.", "answer": "2"}]
    cfg, _ = load_config(RECIPE, code_run(tmp_path, dirs, rows))
    data = load_algorithm("grpo").load_data(cfg, tokenizer)
    with pytest.raises(ConfigError) as info:
        check_prompts(cfg, data, tokenizer)
    assert str(info.value).startswith(f"data.train_path: 2 of the 2 rows of {tmp_path / 'code.jsonl'} have no field "
                                      f"'tests', which env._target_=rlkit.envs.code_execution.CodeExecutionEnv reads")
    rows = [{**row, "tests": "assert True"} for row in rows]
    cfg, _ = load_config(RECIPE, code_run(tmp_path, dirs, rows))
    check_prompts(cfg, load_algorithm("grpo").load_data(cfg, tokenizer), tokenizer)


def test_cli_code_rows_without_tests_exit_2_before_any_worker(tmp_path, dirs, capsys):
    rows = [{"prompt": "Write f() returning 1.", "answer": "1"}]
    assert main(["train", "--config-name", RECIPE, *code_run(tmp_path, dirs, rows)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("rlkit: config error: data.train_path: 1 of the 1 rows of ")
    assert "Traceback" not in err and "Ray" not in err


GSM8K_ROWS = [{"question": "Ana has 3 apples and gets 4 more. How many now?", "answer": "3 + 4 = 7\n#### 7"},
              {"question": "Tom has 90 books and gives 18 away. How many now?", "answer": "90 - 18 = 72\n#### 72"}]


def gsm8k_run(tmp_path, dirs, rows, *overrides) -> list[str]:
    path = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    return [*dirs, "data=gsm8k", "env=math", f"data.train_path={path}", "data.val_path=null", "data.subset=null",
            *overrides]


def test_answers_beyond_the_token_budget(tmp_path, dirs, tokenizer, caplog):
    """The tiny recipe's 6 tokens: "#### 7" is 4 + 2 tokens of the tiny tokenizer ('#' x 4, ' ', '7') and
    fits; "#### 72" (7 tokens) cannot, so that prompt can never be rewarded: a warning. With only such
    prompts no reward is possible (reward 0 and grad norm 0 at every step): an error."""
    cfg, _ = load_config(RECIPE, gsm8k_run(tmp_path, dirs, GSM8K_ROWS))
    check_prompts(cfg, load_algorithm("grpo").load_data(cfg, tokenizer), tokenizer)
    assert warnings_of(caplog) == [
        f"generation.max_new_tokens: 6 tokens cannot hold the shortest correct answer to 1 of the 2 training prompts "
        f"of {tmp_path / 'gsm8k.jsonl'} (in the form env._target_=rlkit.envs.math_answers.MathEnv reads, e.g. "
        f"'#### 72': 7 tokens): those can never be rewarded; raise generation.max_new_tokens to at least 7, with "
        f"room for any reasoning before the answer"]

    cfg, _ = load_config(RECIPE, gsm8k_run(tmp_path, dirs, GSM8K_ROWS[1:]))
    with pytest.raises(ConfigError, match=r"^generation.max_new_tokens: 6 tokens cannot hold the shortest correct "
                                          r"answer to 1 of the 1 training prompts .*, so every reward would be 0; "
                                          r"raise generation.max_new_tokens to at least 7"):
        check_prompts(cfg, load_algorithm("grpo").load_data(cfg, tokenizer), tokenizer)

    caplog.clear()
    cfg, _ = load_config(RECIPE, gsm8k_run(tmp_path, dirs, GSM8K_ROWS, "generation.max_new_tokens=7"))
    check_prompts(cfg, load_algorithm("grpo").load_data(cfg, tokenizer), tokenizer)
    assert warnings_of(caplog) == []


def test_the_recipes_own_answers_fit(dirs, tokenizer, caplog):
    cfg, _ = load_config(RECIPE, dirs)
    check_prompts(cfg, load_algorithm("grpo").load_data(cfg, tokenizer), tokenizer)
    assert warnings_of(caplog) == []


# ---- C. late or weak errors, now one line before any worker ---------------------------------------------

def test_a_sandbox_that_cannot_start_is_a_config_error(tmp_path, dirs, monkeypatch):
    """It used to be a 100-line traceback 52 s in, after every worker had started. A bwrap that fails as
    one without user namespaces does stands in for this machine's."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "BWRAP", str(fake))
    message = load_error(RECIPE, [*dirs, "env=code"])
    assert message.startswith(f"env._target_: rlkit.envs.code_execution.CodeExecutionEnv cannot run on this machine: "
                              f"code sandbox: {fake} cannot start a sandbox here (bwrap: setting up uid map: "
                              f"Permission denied)")
    assert "env.allow_weak_sandbox=true" in message
    load_config(RECIPE, [*dirs, "env=code", "env.allow_weak_sandbox=true"])


@pytest.mark.parametrize("key", ["generation.max_new_tokens", "env_runner.max_total_tokens", "env_runner.max_turns"])
def test_a_negative_token_budget_names_its_own_key(dirs, key):
    """generation.max_new_tokens=-3 used to be reported as an algorithm.overlong_buffer error."""
    assert load_error(RECIPE, [*dirs, f"{key}=-3"]) == f"{key}: must be >= 1 (got: -3); set a positive value"


def test_a_malformed_line_of_a_prompt_file_is_named(tmp_path, dirs, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"\n')
    cfg, _ = load_config(RECIPE, [*dirs, f"data.train_path={path}", "data.val_path=null", "data.synthetic=null"])
    with pytest.raises(ConfigError, match=rf"^data.train_path: {path} line 2: not valid JSON \(Expecting ',' "
                                          rf"delimiter, column 33\); fix that line"):
        load_algorithm("grpo").load_data(cfg, tokenizer)


@pytest.fixture
def broken_recipes(tmp_path) -> Path:
    """A copy of the main recipe with an unclosed list (line 36 opens it), and one using a config group
    file of its own whose mapping is broken on line 3."""
    recipes = tmp_path / "recipes"
    (recipes / "data").mkdir(parents=True)
    text = (RECIPES_DIR / f"{RECIPE}.yaml").read_text()
    assert "  num_steps: 150\n" in text
    (recipes / "unclosed.yaml").write_text(text.replace("  num_steps: 150\n", "  num_steps: [150\n"))
    (recipes / "own_group.yaml").write_text(text.replace("  - /data: arithmetic\n", "  - /data: mine\n"))
    (recipes / "data" / "mine.yaml").write_text("# mine\ndefaults:\n  - arithmetic\n   bad: indent\n")
    return recipes


@pytest.mark.parametrize("recipe, where", [("unclosed", "unclosed.yaml:38: invalid YAML: expected ',' or ']', but got "
                                                       "'?' (while parsing a flow sequence at line 36)"),
                                           ("own_group", "data/mine.yaml:4: invalid YAML: ")])
def test_a_yaml_syntax_error_names_file_and_line(broken_recipes, recipe, where):
    with pytest.raises(ConfigError) as info:
        load_config(recipe, [], broken_recipes)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"recipe '{recipe}': {broken_recipes}/{where}")
    assert message.endswith("; fix the syntax there")


def test_cli_yaml_syntax_error_is_one_line(broken_recipes, capsys):
    assert main(["train", "--config-name", "unclosed", "--config-dir", str(broken_recipes)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"rlkit: config error: recipe 'unclosed': {broken_recipes}/unclosed.yaml:38: invalid YAML: expected "
                   f"',' or ']', but got '?' (while parsing a flow sequence at line 36); fix the syntax there"]
