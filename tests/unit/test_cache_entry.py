"""Cache entries appear whole, and runs that share a cache and build the same entry at once
both finish: the first copy published stays, as a run may already read it."""

import multiprocessing
import os

from rlkit.models.cache_entry import publish
from rlkit.models.tiny import build_tiny_model


def written(path, text):
    path.mkdir()
    (path / "config.json").write_text(text)
    return path


def test_a_new_entry_is_the_written_directory(tmp_path):
    entry = tmp_path / "entry"
    publish(written(tmp_path / "entry.tmp1", "ours"), entry)
    assert (entry / "config.json").read_text() == "ours" and not (tmp_path / "entry.tmp1").exists()


def test_an_entry_published_first_stays_untouched(tmp_path):
    entry = written(tmp_path / "entry", "theirs")
    inode = os.stat(entry / "config.json").st_ino
    ours = written(tmp_path / "entry.tmp2", "ours")
    publish(ours, entry)
    assert (entry / "config.json").read_text() == "theirs" and os.stat(entry / "config.json").st_ino == inode
    assert ours.is_dir()  # the caller removes what it wrote


def test_a_directory_that_is_no_entry_is_replaced(tmp_path):
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "stray.txt").write_text("made by hand")
    publish(written(tmp_path / "entry.tmp3", "ours"), entry)
    assert sorted(p.name for p in entry.iterdir()) == ["config.json"]


def test_two_processes_building_one_tiny_model_at_once_both_finish(tmp_path):
    out = tmp_path / "tiny-qwen2"
    context = multiprocessing.get_context("spawn")
    builders = [context.Process(target=build_tiny_model, args=("qwen2", out, 64, 2, 0)) for _ in range(2)]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join(120)
    assert [builder.exitcode for builder in builders] == [0, 0]
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen2"]  # no temporary directory left
