"""`rlkit convert` refuses, in one line and before any worker starts, every checkpoint it cannot
export whole (missing, a file, unfinished, a folder of checkpoints, not a checkpoint, damaged) and
every output it could overwrite or that lies inside the checkpoint; the checkpoints are real ones
(CheckpointManager's, with their manifests), written by stand-in models without workers."""

import os
import re

import pytest
from test_checkpoint_manifest import Models, manager, truncate

from rlkit.cli import main
from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config
from rlkit.launch.convert import checked_conversion, export_hf


@pytest.fixture
def run_dir(tmp_path):
    """A run's folder with two complete checkpoints (steps 2 and 4), each with the run's resolved
    config, and the unfinished write of a third."""
    cfg, resolved = load_config("grpo_tiny_cpu", [f"run.cache_dir={tmp_path / 'cache'}"])
    checkpoints = manager(tmp_path / "run" / "checkpoints")
    for step in (2, 4):
        checkpoints.save(step, Models(), {"step": step}, resolved)
        checkpoints.finish(wait=True)
    checkpoints.save(6, Models(), {"step": 6}, resolved)  # never finished
    return tmp_path / "run"


def refused(checkpoint, out, match, merged=False):
    with pytest.raises(ConfigError, match=match):
        checked_conversion(checkpoint, out, merged)


def test_a_missing_checkpoint_or_a_file_is_refused(tmp_path):
    refused(tmp_path / "nowhere", tmp_path / "out", r"^rlkit convert: .*nowhere does not exist; give a checkpoint")
    (tmp_path / "weights.bin").write_bytes(b"x")
    refused(tmp_path / "weights.bin", tmp_path / "out", r"weights.bin is a file, not a checkpoint folder")


def test_an_unfinished_checkpoint_is_refused_naming_the_newest_complete_one(run_dir, tmp_path):
    unfinished = next((run_dir / "checkpoints").glob("step_000006.tmp-*"))
    refused(unfinished, tmp_path / "out", rf"is an unfinished checkpoint .*; convert a complete one, e.g. the newest "
                                          rf"in .*checkpoints: {re.escape(str(run_dir))}/checkpoints/step_000004$")


@pytest.mark.parametrize("folder", ["checkpoints", "."], ids=["the checkpoints folder", "the run's folder"])
def test_a_folder_of_checkpoints_is_refused_naming_its_newest(run_dir, tmp_path, folder):
    refused(run_dir / folder, tmp_path / "out",
            rf"is not a checkpoint folder \(one holds manifest.json and config.yaml\); .*e.g. the newest in .*: "
            rf"{re.escape(str(run_dir))}/checkpoints/step_000004$")


def test_a_folder_that_is_no_checkpoint_is_refused(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    refused(tmp_path / "notes", tmp_path / "out", r"notes is not a checkpoint folder .*step_NNNNNN\)$")


def test_a_damaged_checkpoint_is_refused_as_a_resume_refuses_it(run_dir, tmp_path):
    """The manifest check `train` makes: a truncated shard is named, and the intact one before it offered."""
    newest = run_dir / "checkpoints" / "step_000004"
    truncate(newest / "policy" / "__0_0.distcp")
    refused(newest, tmp_path / "out", r"step_000004 is damaged: policy/__0_0.distcp has 2048 bytes, 4096 when "
                                      r"written; convert another one, e.g. the newest in .*: .*step_000002$")


def test_an_output_in_or_equal_to_the_checkpoint_is_refused(run_dir):
    checkpoint = run_dir / "checkpoints" / "step_000004"
    for out in (checkpoint, checkpoint / "hf", checkpoint / "policy" / ".." / "policy"):
        refused(checkpoint, out, r"is inside the checkpoint .*; write the export to a folder of its own outside it")


def test_an_output_holding_files_or_being_a_file_or_link_is_refused_and_left_as_it_was(run_dir, tmp_path):
    checkpoint = run_dir / "checkpoints" / "step_000004"
    users = tmp_path / "users"
    users.mkdir()
    mine = {"config.json": "{}", "model.safetensors": "weights", "adapter_config.json": "{}", "notes.txt": "x"}
    for name, text in mine.items():
        (users / name).write_text(text)
    refused(checkpoint, users, r"users already holds files \(adapter_config.json, config.json, model.safetensors and "
                               r"1 more\); give a new or empty folder \(rlkit convert never overwrites\)$")
    assert {p.name: p.read_text() for p in users.iterdir()} == mine
    refused(checkpoint, users / "notes.txt", r"notes.txt is a file \(or a link\)")
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    refused(checkpoint, tmp_path / "link", r"link is a file \(or a link\)")


def test_an_output_that_cannot_be_created_is_refused_before_any_worker(run_dir, tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match=r"cannot write beside the output .*a_file/out \(File exists: .*a_file\)"):
        export_hf(run_dir / "checkpoints" / "step_000004", tmp_path / "a_file" / "out")
    assert (tmp_path / "a_file").read_text() == "x"


def test_merged_needs_adapters(run_dir, tmp_path):
    refused(run_dir / "checkpoints" / "step_000004", tmp_path / "out", r"--merged: .* holds every weight", merged=True)


def test_what_is_exported_is_decided_by_the_checkpoint_and_an_empty_output_is_taken(run_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    conversion = checked_conversion(run_dir / "checkpoints" / "step_000004", tmp_path / "empty", merged=False)
    assert (conversion.kind, conversion.adapter_alone) == ("HF checkpoint", False)


def test_the_command_says_a_refusal_in_one_line(run_dir, tmp_path, capsys):
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / "config.json").write_text("{}")
    assert main(["convert", str(run_dir / "checkpoints"), str(tmp_path / "out")]) == 2
    assert main(["convert", str(run_dir / "checkpoints" / "step_000004"), str(tmp_path / "users")]) == 2
    said = capsys.readouterr()
    assert said.out == ""
    assert [line.split(": ")[:2] for line in said.err.splitlines()] == [["rlkit", "config error"]] * 2
