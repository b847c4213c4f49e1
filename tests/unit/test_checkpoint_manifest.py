"""Checkpoints are trusted only once verified against their manifest: each kind of damage is found
and named, auto-resume falls back to the newest intact checkpoint, and pruning keeps it."""

import hashlib
import logging
import os
import re

import pytest
import torch
from omegaconf import OmegaConf

from rlkit.checkpoint import MANIFEST, CheckpointManager, WrittenFiles, verify
from rlkit.config.schema import CheckpointConfig, ConfigError


def manager(root, keep_last=0, resume="auto") -> CheckpointManager:
    cfg = CheckpointConfig(every=1, save_format="dist", background=True, keep_last=keep_last, resume=resume,
                           dir=str(root), interrupt_grace_s=60)
    return CheckpointManager(cfg, root)


class Models:
    """What the policy workers write: a distributed-checkpoint shard and metadata, one RNG file per
    rank; the shard's last bytes only once `polls` calls of saved(wait=False) have asked, as a write
    in the background."""

    def __init__(self, polls=0):
        self.polls, self.shard, self.digest = polls, None, {}

    def save(self, directory) -> dict:
        os.makedirs(f"{directory}/policy")
        os.makedirs(f"{directory}/rng")
        self.shard = f"{directory}/policy/__0_0.distcp"
        with open(self.shard, "wb") as f:
            f.write(os.urandom(2048))
        with open(f"{directory}/policy/.metadata", "wb") as f:
            f.write(b"metadata" * 64)
        for rank in range(2):
            torch.save({"torch": torch.get_rng_state()}, f"{directory}/rng/policy_rank_{rank}.pt")
        return {"held": 0.25, "stage": 0.125}

    def saved(self, wait: bool) -> WrittenFiles | None:
        """The writers' digest of the shard, as they report it."""
        if not wait and self.polls > 0:
            self.polls -= 1
            return None
        if self.shard:
            with open(self.shard, "ab") as f:
                f.write(os.urandom(2048))
            self.digest = {self.shard: hashlib.sha256(open(self.shard, "rb").read()).hexdigest()}
            self.shard = None
        return WrittenFiles(self.digest, nbytes=4096, write_seconds=0.5, digest_seconds=0.25)


def save(checkpoints, step, models=None):
    """A checkpoint, whole."""
    checkpoints.save(step, models or Models(), {"step": step}, OmegaConf.create({"run": {"seed": 0}}))
    return checkpoints.finish(wait=True)


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


def test_a_checkpoint_is_whole_only_once_its_background_write_is(tmp_path):
    """While the models' workers write, the checkpoint is neither listed nor resumed; each poll
    asks them without waiting; the next save waits for it; the manifest holds the digest the
    writers took of what they wrote last, and the controller's of the rest."""
    checkpoints = manager(tmp_path)
    first = save(checkpoints, 1)
    held = checkpoints.save(2, Models(polls=2), {"step": 2}, OmegaConf.create({"run": {"seed": 0}}))
    assert held == {"held": 0.25, "stage": 0.125}
    assert checkpoints.finish(wait=False) is None and checkpoints.finish(wait=False) is None
    assert checkpoints.complete() == [first] and checkpoints.to_resume() == first
    assert any(".tmp-" in p.name for p in tmp_path.iterdir())
    newest = checkpoints.finish(wait=False)
    assert newest.name == "step_000002" and verify(newest) is None
    assert (newest / "policy/__0_0.distcp").stat().st_size == 4096
    assert checkpoints.complete() == [first, newest] and checkpoints.finish(wait=False) is None
    checkpoints.save(3, Models(polls=5), {"step": 3}, OmegaConf.create({"run": {"seed": 0}}))
    checkpoints.save(4, Models(polls=5), {"step": 4}, OmegaConf.create({"run": {"seed": 0}}))  # waits for step 3
    assert [p.name for p in checkpoints.complete()] == ["step_000001", "step_000002", "step_000003"]
    assert checkpoints.finish(wait=True).name == "step_000004"
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())


def test_a_write_stopped_at_once_is_discarded_and_the_whole_checkpoints_stay(tmp_path):
    """A run stopped in the middle of a checkpoint removes its own unfinished write; another
    process's leftover (a killed run's) is left for the next prune, and whole checkpoints stay."""
    checkpoints = manager(tmp_path)
    first = save(checkpoints, 1)
    killed_earlier = tmp_path / "step_000002.tmp-1"
    killed_earlier.mkdir()
    checkpoints.save(2, Models(polls=5), {"step": 2}, OmegaConf.create({"run": {"seed": 0}}))
    assert (tmp_path / f"step_000002.tmp-{os.getpid()}").is_dir()
    checkpoints.discard_unfinished()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002.tmp-1"]
    assert checkpoints.finish(wait=True) is None and checkpoints.to_resume() == first and verify(first) is None
    checkpoints.discard_unfinished()  # nothing of its own left: a no-op


def test_the_background_write_is_reported_with_its_rate(tmp_path, caplog):
    """Writers side by side (ranks, policy and critic): their bytes add up, the slowest one's
    seconds count; the completed checkpoint's figures are kept for the step's metrics."""
    ranks = WrittenFiles({"a": "1"}, 3 * 10**9, 2.0, 1.0) | WrittenFiles({"b": "2"}, 10**9, 4.0, 0.5)
    assert ranks.digests == {"a": "1", "b": "2"}
    assert ranks.metrics() == {"timing/checkpoint_write": 4.0, "timing/checkpoint_digest": 1.0,
                               "timing/checkpoint_written_gb": 4.0, "timing/checkpoint_write_gbytes_per_s": 1.0}
    assert WrittenFiles({}).metrics()["timing/checkpoint_write_gbytes_per_s"] == 0.0  # nothing written in the background
    checkpoints = manager(tmp_path)
    with caplog.at_level(logging.INFO, logger="rlkit"):
        save(checkpoints, 1)
    assert checkpoints.last_write.metrics()["timing/checkpoint_write_gbytes_per_s"] == 4096 / 0.5 / 1e9
    assert "written in the background in 0.50 s (0.00 GB at 0.00 GB/s), digests 0.25 s" in caplog.text
