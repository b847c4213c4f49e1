"""Checkpoints are trusted only once verified against their manifest: each kind of damage is found
and named, auto-resume falls back to the newest intact checkpoint, and pruning keeps it."""

import logging
import os
import re

import pytest
import torch
from omegaconf import OmegaConf

from rlkit.checkpoint import MANIFEST, CheckpointManager, verify
from rlkit.config.schema import CheckpointConfig, ConfigError


def manager(root, keep_last=0, resume="auto") -> CheckpointManager:
    cfg = CheckpointConfig(every=1, save_format="dist", keep_last=keep_last, resume=resume, dir=str(root),
                           interrupt_grace_s=60)
    return CheckpointManager(cfg, root)


def write_models(directory):
    """What the policy workers write: a distributed-checkpoint shard and metadata, one RNG file per rank."""
    os.makedirs(f"{directory}/policy")
    os.makedirs(f"{directory}/rng")
    with open(f"{directory}/policy/__0_0.distcp", "wb") as f:
        f.write(os.urandom(4096))
    with open(f"{directory}/policy/.metadata", "wb") as f:
        f.write(b"metadata" * 64)
    for rank in range(2):
        torch.save({"torch": torch.get_rng_state()}, f"{directory}/rng/policy_rank_{rank}.pt")


def save(checkpoints, step):
    return checkpoints.save(step, write_models, {"step": step}, OmegaConf.create({"run": {"seed": 0}}))


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def garble(path):
    """Same size, other bytes."""
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(b"\0" * size)


DAMAGE = {
    "a rank's RNG file lost": (lambda c: os.remove(c / "rng/policy_rank_1.pt"), r"rng/policy_rank_1.pt is missing"),
    "a truncated shard": (lambda c: truncate(c / "policy/__0_0.distcp"), r"policy/__0_0.distcp has 2048 bytes, 4096"),
    "a truncated controller.pt": (lambda c: truncate(c / "controller.pt"), r"controller.pt has \d+ bytes"),
    "garbage metadata": (lambda c: garble(c / "policy/.metadata"), r"policy/.metadata differs .*SHA-256"),
    "no manifest": (lambda c: os.remove(c / MANIFEST), r"has no manifest.json"),
    "a garbage manifest": (lambda c: (c / MANIFEST).write_text("{not json"), r"manifest.json is unreadable"),
}


def test_a_saved_checkpoint_verifies_and_lists_every_file(tmp_path):
    path = save(manager(tmp_path), 1)
    assert verify(path) is None
    listed = set(OmegaConf.load(path / MANIFEST)["files"])
    assert listed == {"controller.pt", "config.yaml", "policy/__0_0.distcp", "policy/.metadata",
                      "rng/policy_rank_0.pt", "rng/policy_rank_1.pt"}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_newest_checkpoint_is_named_and_the_intact_one_before_it_resumes(tmp_path, caplog, damage):
    checkpoints = manager(tmp_path)
    intact, newest = save(checkpoints, 2), save(checkpoints, 4)
    damage_it, named = damage
    damage_it(newest)
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        assert checkpoints.to_resume() == intact
    assert "step_000004 is damaged" in caplog.text
    assert len(caplog.records) == 1 and re.search(named, caplog.text)
    # asked for by name, the damaged one is refused, naming the file
    with pytest.raises(ConfigError, match=f"checkpoint.resume={newest}: the checkpoint is damaged: .*{named}"):
        manager(tmp_path, resume=str(newest)).to_resume()


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    checkpoints = manager(tmp_path)
    only = save(checkpoints, 3)
    os.remove(only / "rng/policy_rank_0.pt")
    with pytest.raises(ConfigError, match=r"checkpoint.resume=auto: every checkpoint in .* is damaged "
                                          r"\(step_000003; see above\); .*checkpoint.resume=none"):
        checkpoints.to_resume()


def test_a_missing_resume_path_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.resume=.*step_000009: not a complete checkpoint directory"):
        manager(tmp_path, resume=str(tmp_path / "step_000009")).to_resume()


def test_keep_last_keeps_the_newest_intact_checkpoints_past_a_damaged_newer_one(tmp_path):
    save(manager(tmp_path, keep_last=2), 4)
    damaged = save(manager(tmp_path, keep_last=2), 6)
    os.remove(damaged / "rng/policy_rank_1.pt")
    # a run resumed from step 4 saves step 5: the old rule (the newest keep_last=1 by name) kept only
    # the damaged step 6 and deleted step 5, just written
    save(manager(tmp_path, keep_last=1), 5)
    assert [p.name for p in manager(tmp_path).complete()] == ["step_000005", "step_000006"]
    assert manager(tmp_path).to_resume().name == "step_000005"
    # once an intact newer checkpoint exists, the older ones go as usual
    save(manager(tmp_path, keep_last=1), 6)
    assert [p.name for p in manager(tmp_path).complete()] == ["step_000006"]


def test_a_checkpoint_saved_at_another_expert_parallel_size_is_one_config_error(tmp_path):
    """Megatron keys an MoE optimizer's state by the expert parallel size (one optimizer at EP=1,
    a dense and an expert one above): resuming at another size is refused before workers start."""
    from rlkit.launch.config import load_config
    from rlkit.launch.run import check_expert_layout

    moe = ["policy.model_path=tiny://qwen3_moe", f"run.cache_dir={tmp_path}", f"run.output_dir={tmp_path}"]
    saved_cfg, saved = load_config("grpo_tiny_cpu", [*moe, "policy.expert_parallel_size=2"])
    check_expert_layout(saved_cfg, saved, tmp_path / "step_000002")  # the same size resumes
    now, _ = load_config("grpo_tiny_cpu", moe)
    with pytest.raises(ConfigError, match=r"^policy\.expert_parallel_size: .*step_000002 was saved at 2 and this run "
                                          r"asks for 1; .*resume with policy\.expert_parallel_size=2"):
        check_expert_layout(now, saved, tmp_path / "step_000002")
