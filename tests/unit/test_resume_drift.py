"""A command whose run.name names an existing run never ignores its settings (rlkit/launch/resume_drift.py):
settings that change the training stop it with one line naming each key (old -> new) before Ray or any
worker starts, unless checkpoint.resume_with_changes=true; what the checkpoint is (the model, the
algorithm, the save format) never changes; free settings (folders, logging, cadence, num_steps) just
resume. The configs compared are those a checkpoint saves (its config.yaml) and a command loads."""

import logging
from pathlib import Path

import pytest
import ray
from omegaconf import OmegaConf
from test_preflight import NoModels

from rlkit.checkpoint import CheckpointManager
from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config
from rlkit.launch.resume_drift import CHOICE, FREE, NEVER, changes, check_resume_drift, kind_of
from rlkit.launch.run import train

RECIPE = "grpo_tiny_cpu"
SAVED_AT = 2


@pytest.fixture
def dirs(tmp_path) -> list[str]:
    return [f"run.cache_dir={tmp_path / 'cache'}", f"run.output_dir={tmp_path / 'out'}", "algorithm.num_steps=4"]


def saved_config(dirs, *overrides):
    """The config a checkpoint holds: what CheckpointManager.save writes, read back."""
    _, resolved = load_config(RECIPE, [*dirs, *overrides])
    return OmegaConf.create(OmegaConf.to_yaml(resolved))


def check(dirs, saved, *overrides, step=SAVED_AT) -> str:
    cfg, resolved = load_config(RECIPE, [*dirs, *overrides])
    return check_resume_drift(cfg, resolved, saved, run_dir(cfg) / "checkpoints" / f"step_{SAVED_AT:06d}", step)


def run_dir(cfg) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def refusal(dirs, saved, *overrides, step=SAVED_AT) -> str:
    with pytest.raises(ConfigError) as info:
        check(dirs, saved, *overrides, step=step)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_the_same_command_resumes_without_a_word(dirs):
    assert check(dirs, saved_config(dirs)) == ""


def test_changed_training_settings_stop_the_run_naming_each_key_and_both_ways_on(dirs, tmp_path):
    """The README's second example pasted after the quick start used to end at once, in silence."""
    message = refusal(dirs, saved_config(dirs), "policy.tensor_parallel_size=2", "algorithm.kl_coef=0.01")
    checkpoint = tmp_path / "out" / RECIPE / "checkpoints" / "step_000002"
    assert message == (f"run.name={RECIPE}: its checkpoint {checkpoint} (step 2) was saved with other settings: "
                       f"policy.tensor_parallel_size: 1 -> 2, algorithm.kl_coef: 0.0 -> 0.01; set another run.name "
                       f"for a new run with them, or add checkpoint.resume_with_changes=true to continue this run "
                       f"with them")


def test_a_finished_run_with_changed_settings_says_it_finished(dirs):
    message = refusal(dirs, saved_config(dirs), "algorithm.group_size=4", step=4)
    assert "(step 4, the run has finished) was saved with other settings: algorithm.group_size: 8 -> 4;" in message
    assert message.endswith("add checkpoint.resume_with_changes=true and a higher algorithm.num_steps to continue "
                            "this run with them")


def test_resume_with_changes_continues_with_the_new_values_and_says_which(dirs):
    changed = check(dirs, saved_config(dirs), "algorithm.kl_coef=0.01", "+env.correct_reward=2.0",
                    "checkpoint.resume_with_changes=true")
    assert changed == ("algorithm.kl_coef: 0.0 -> 0.01, env.correct_reward: (unset) -> 2.0, "
                       "checkpoint.resume_with_changes: false -> true")


def test_free_settings_resume_and_are_listed(dirs, tmp_path):
    """Folders, the Ray connection and timeouts, logging, checkpoint cadence, more steps, validation.
    The data paths live under ${run.cache_dir}: moving the cache leaves them equal."""
    changed = check(dirs, saved_config(dirs), "algorithm.num_steps=6", "algorithm.val_every=2", "logger.plots=false",
                    "checkpoint.every=1", "cluster.call_timeout_s=60", f"run.cache_dir={tmp_path / 'moved'}")
    assert changed == (f"cluster.call_timeout_s: 600 -> 60, algorithm.num_steps: 4 -> 6, algorithm.val_every: 25 -> 2, "
                       f"logger.plots: true -> false, checkpoint.every: 25 -> 1, run.cache_dir: {tmp_path / 'cache'} "
                       f"-> {tmp_path / 'moved'}")


def test_what_the_checkpoint_is_never_changes_even_when_asked(dirs):
    message = refusal(dirs, saved_config(dirs), "policy.model_path=tiny://llama", "checkpoint.save_format=hf",
                      "algorithm.kl_coef=0.01", "checkpoint.resume_with_changes=true")
    # named: what only a new run may change (kl_coef may change with the choice given)
    assert ("with other settings: policy.model_path: tiny://qwen2 -> tiny://llama, checkpoint.save_format: dist -> hf; "
            "policy.model_path, checkpoint.save_format cannot change within a run") in message
    assert message.endswith("set another run.name for a new run with them")


def test_an_hf_checkpoint_keeps_its_parallel_layout(dirs):
    """Its optimizer state is a file per rank; a dist checkpoint loads into any TP/PP."""
    hf = saved_config(dirs, "checkpoint.save_format=hf")
    assert "cannot change within a run" in refusal(dirs, hf, "checkpoint.save_format=hf",
                                                   "policy.tensor_parallel_size=2", "checkpoint.resume_with_changes=true")
    assert check(dirs, saved_config(dirs), "policy.tensor_parallel_size=2", "checkpoint.resume_with_changes=true")


def test_a_named_checkpoint_is_named_as_the_key_at_fault(dirs, tmp_path):
    checkpoint = tmp_path / "step_000002"
    checkpoint.mkdir()
    message = refusal(dirs, saved_config(dirs), f"checkpoint.resume={checkpoint}", "algorithm.kl_coef=0.01")
    assert message.startswith(f"checkpoint.resume=") and "drop checkpoint.resume and set another run.name" in message


@pytest.mark.parametrize("key, kind", [
    ("policy.optimizer.lr", CHOICE), ("data.train_path", CHOICE), ("env.tolerance", CHOICE), ("run.seed", CHOICE),
    ("cluster.placement", CHOICE), ("policy.peft.alpha", CHOICE), ("refit.keep_fp32", CHOICE),
    ("cluster.address", FREE), ("logger.wandb.enabled", FREE), ("checkpoint.keep_last", FREE), ("refit.bucket_mb", FREE),
    ("policy.peft.init_from", FREE), ("algorithm.val_greedy", FREE),
    ("policy.peft", NEVER), ("policy.peft.rank", NEVER), ("policy.tiny_model.num_layers", NEVER),
    ("algorithm.name", NEVER),
])
def test_each_key_has_its_kind_and_unknown_keys_need_the_choice(key, kind):
    assert kind_of(key) == kind


def test_a_section_on_one_side_only_is_one_change(dirs):
    lora = "policy.peft={type: lora, rank: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj]}"
    _, resolved = load_config(RECIPE, [*dirs, "policy.bridge=megatron_bridge", lora])
    found = changes(saved_config(dirs), resolved)
    assert [(c.key, c.kind) for c in found] == [("policy.bridge", CHOICE), ("policy.peft", NEVER)]
    assert str(found[1]).startswith("policy.peft: null -> {'type': 'lora', 'rank': 8")


def test_a_key_added_to_rlkit_since_the_checkpoint_is_no_change(dirs):
    saved = saved_config(dirs)
    del saved.algorithm["policy_loss"], saved.checkpoint["resume_with_changes"]  # as an older rlkit wrote it
    assert check(dirs, saved) == ""
    cfg, resolved = load_config(RECIPE, [*dirs, "algorithm.kl_coef=0.5", "+env.correct_reward=2.0"])
    assert [c.key for c in changes(saved, resolved, cfg)] == ["algorithm.kl_coef", "env.correct_reward"]


def saved_run(dirs, *overrides):
    """A checkpoint at step 2, as the loop saves it (no model files: train() must stop before it
    would load any)."""
    cfg, resolved = load_config(RECIPE, [*dirs, *overrides])
    checkpoints = CheckpointManager(cfg.checkpoint, run_dir(cfg))
    checkpoints.save(SAVED_AT, NoModels(), {"step": SAVED_AT, "rows": None}, resolved)
    checkpoints.finish(wait=True)


def test_train_refuses_before_ray_starts_and_a_finished_run_names_what_it_does_not_use(dirs, tmp_path, caplog):
    saved_run(dirs, "algorithm.num_steps=2")
    with pytest.raises(ConfigError, match=r"the run has finished\) was saved with other settings: policy\.tensor_parallel_size: 1 -> 2;"):
        train(*load_config(RECIPE, [*dirs, "algorithm.num_steps=2", "policy.tensor_parallel_size=2"]))
    assert not ray.is_initialized() and not (tmp_path / "cache").exists()  # nor was the model built
    with caplog.at_level(logging.INFO, logger="rlkit"):
        train(*load_config(RECIPE, [*dirs, "algorithm.num_steps=2", "logger.plots=false"]))
    assert "so there is nothing to do (raise algorithm.num_steps to train on, or set run.name for a new run); these " \
           "settings changed since are not used: logger.plots: true -> false" in caplog.text
