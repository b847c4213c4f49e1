"""A checkpoint the disk cannot take is one CheckpointWriteError naming the folder and its free
space, and leaves nothing unfinished behind; any other error passes as it is. The full disk is
real: a 1 MB tmpfs mounted in a user and mount namespace of this test's own (`unshare`, no root
needed), where a process runs the scenario (`python <this file> <folder>`) and reports back."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_checkpoint_manifest import Models, manager, save

from rlkit.checkpoint import CheckpointWriteError, verify

NAMESPACE = ["unshare", "--user", "--map-root-user", "--mount"]


class BigModels(Models):
    """Models whose background writers also write `nbytes` (as a worker's would) once asked."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.nbytes = nbytes

    def saved(self, wait: bool):
        with open(Path(self.shard).parent / "__1_0.distcp", "wb") as f:  # a real write: ENOSPC as the disk says it
            f.write(os.urandom(self.nbytes))
        return super().saved(wait)


def fill_the_disk(root: Path) -> dict:
    """On a 1 MB disk: step 1 fits; step 2's models' files do not (the OSError a write raises);
    then step 3's controller state does not (torch's writer raises a RuntimeError without the
    OSError). What each failure said, and what the folder holds after it."""
    checkpoints, said = manager(root), {}
    save(checkpoints, 1, BigModels(600_000))
    for step, models, state in [(2, BigModels(600_000), {"step": 2}), (3, Models(), {"rows": os.urandom(600_000)})]:
        try:
            checkpoints.save(step, models, state, OmegaConf.create({"run": {"seed": 0}}))
            checkpoints.finish(wait=True)
        except CheckpointWriteError as e:
            said[step] = {"error": str(e), "left": sorted(p.name for p in root.iterdir())}
    said["intact"] = verify(root / "step_000001") is None
    return said


def test_a_full_disk_is_one_line_naming_the_folder_and_nothing_unfinished_stays(tmp_path):
    if shutil.which("unshare") is None or subprocess.run([*NAMESPACE, "true"]).returncode != 0:
        pytest.skip("no user namespaces here (unshare): they give the test a disk of its own to fill")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run([*NAMESPACE, "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs "{disk}" && '
                                                   f'exec "{sys.executable}" "{__file__}" "{disk}"'],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    root = disk / "checkpoints"
    assert said["2"]["error"].startswith(f"checkpoint step_000002 could not be written into {root}: No space left "
                                         f"on device (0.0 MB free there; the last checkpoint took 0.6 MB); its "
                                         f"unfinished files (0.4 MB) are removed: make room there or set "
                                         f"checkpoint.dir to a disk with room, then rerun the same command to resume "
                                         f"from {root}/step_000001"), said
    assert said["3"]["error"].startswith(f"checkpoint step_000003 could not be written into {root}: the disk is full "
                                         f"(0.0 MB free there; the last checkpoint took 0.6 MB)"), said
    assert "\n" not in said["2"]["error"] + said["3"]["error"]
    assert said["2"]["left"] == said["3"]["left"] == ["step_000001"]
    assert said["intact"]


def test_an_error_that_is_not_the_disks_passes_as_it_is(tmp_path):
    class Failing(Models):
        def saved(self, wait):
            raise ValueError("a writer's bug")

    checkpoints = manager(tmp_path)
    checkpoints.save(1, Failing(), {"step": 1}, OmegaConf.create({}))
    with pytest.raises(ValueError, match="a writer's bug"):
        checkpoints.finish(wait=True)


if __name__ == "__main__":  # inside the namespace, on the disk mounted for it
    print(json.dumps(fill_the_disk(Path(sys.argv[1]) / "checkpoints")))
