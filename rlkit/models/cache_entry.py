"""Entries of run.cache_dir (tiny models, converted checkpoints, warm starts): HF checkpoint
directories written elsewhere, then renamed into place, so an entry that is there is complete.
Several runs may share one cache and build the same entry at once."""

import os
import shutil
from pathlib import Path


def publish(written: Path, entry: Path) -> None:
    """Rename the directory `written` to `entry`. Where another process published `entry` first,
    its copy stays (the same inputs made it) and `written` is left for the caller to remove: a run
    may be reading that copy already."""
    try:
        os.replace(written, entry)
    except OSError:  # entry is a directory with files in it
        if (entry / "config.json").is_file():
            return
        shutil.rmtree(entry)  # not a published entry (an older layout, or made by hand)
        os.replace(written, entry)
