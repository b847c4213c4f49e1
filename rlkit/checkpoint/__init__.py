"""Checkpoints: everything a resume needs, written atomically.

Layout of <run_dir>/checkpoints/step_000042/:
  policy/                 weights + optimizer state (format: checkpoint.save_format), written by
                          the policy workers themselves
  critic/                 the same for PPO's critic
  rng/<model>_rank_<r>.pt each rank's RNG states and learning rate
  controller.pt           step, data-stream position
  config.yaml             the resolved config of the run
  manifest.json           every other file's size and SHA-256, written last
A checkpoint is written into step_N.tmp-<pid> and renamed when complete, so a directory named
step_N is always whole. The models' workers write their part in the background while training
goes on (save() returns once they hold a copy of their state); finish() completes the checkpoint
once they are done: the manifest (with the SHA-256 of the files the workers wrote, which they
took as they wrote them), written last, then the rename. So a directory named step_N is always
whole; leftovers of a killed write are never read and are removed. A whole
checkpoint is trusted only once its files match its manifest: a file lost or damaged since (a
rank's RNG file, a truncated shard) is found before any worker starts, and the run resumes from
the newest intact checkpoint instead. A write the disk cannot take (full, over quota, read-only)
ends the run with one line naming the folder and its free space, the unfinished checkpoint removed.
"""

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from omegaconf import DictConfig, OmegaConf

from rlkit.config.schema import CheckpointConfig, ConfigError

log = logging.getLogger("rlkit")

_COMPLETE = re.compile(r"^step_(\d{6})$")
MANIFEST = "manifest.json"
# what a disk answers a write it cannot take: full, over quota, past a file size limit, read-only
_DISK_ERRORS = [os.strerror(code) for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)]


class DiskWriteError(RuntimeError):
    """Files the disk could not take: one line naming the folder, its free space and the fix."""


class CheckpointWriteError(DiskWriteError):
    """A checkpoint the disk could not take."""


@dataclass(frozen=True)
class DiskFailure:
    """What the disk did to a write (e.g. "No space left on device"), its free space and the size of
    what was written into the unfinished folder, as shown (e.g. "0.4 MB")."""
    what: str
    free: str
    unfinished: str


def disk_failure(error: Exception, unfinished: Path, needed: int = 0) -> DiskFailure | None:
    """Where error, raised as files were written into the folder `unfinished`, came from its disk: the
    disk error it names (by this process's write or a worker's), or a failure while the disk has less
    room than was written or is `needed` (torch's writer drops the OSError). None for another error."""
    named = next((text for text in _DISK_ERRORS if text in str(error)), None)
    free, written = _free_bytes(unfinished), _bytes_in(unfinished)
    if named is None and free >= max(written, needed):
        return None
    return DiskFailure(named or "the disk is full", _shown(free), _shown(written))


@dataclass(frozen=True)
class WrittenFiles:
    """What background writers made: {path: SHA-256} of each file, their bytes, the seconds the
    slowest writer took until its last file was written, and then until its last digest was taken
    (each file is hashed as soon as it is written, while the others are still being written).
    Writers run side by side (one per rank, per model), so `|` adds bytes and keeps the longest
    times."""
    digests: dict[str, str]
    nbytes: int = 0
    write_seconds: float = 0.0
    digest_seconds: float = 0.0

    def __or__(self, other: "WrittenFiles") -> "WrittenFiles":
        return WrittenFiles({**self.digests, **other.digests}, self.nbytes + other.nbytes,
                            max(self.write_seconds, other.write_seconds), max(self.digest_seconds, other.digest_seconds))

    def metrics(self) -> dict[str, float]:
        rate = self.nbytes / self.write_seconds / 1e9 if self.write_seconds else 0.0
        # all under timing/: which step sees a write complete depends on the clock, so resumed
        # runs compare equal on the rest
        return {"timing/checkpoint_write": self.write_seconds, "timing/checkpoint_digest": self.digest_seconds,
                "timing/checkpoint_written_gb": self.nbytes / 1e9, "timing/checkpoint_write_gbytes_per_s": rate}


class SavedModels(Protocol):
    def save(self, checkpoint_dir: str) -> dict[str, float]:
        """Start writing the models' part (weights, optimizer, RNG) into checkpoint_dir; the
        seconds it held training ("held"), and in which parts."""

    def saved(self, wait: bool) -> WrittenFiles | None:
        """None while that part is being written; once it is on disk whole (wait: block until
        then), what was written in the background."""


@dataclass
class _Writing:
    """A checkpoint whose files are still being written."""
    tmp: Path
    final: Path
    models: SavedModels
    started: float


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path):
        self.cfg = cfg
        self.root = Path(cfg.dir) if cfg.dir else run_dir / "checkpoints"
        self.writing: _Writing | None = None
        self.last_write: WrittenFiles | None = None  # of the checkpoint completed last

    def complete(self) -> list[Path]:
        """Whole checkpoints, oldest first."""
        return complete_checkpoints(self.root)

    def to_resume(self) -> Path | None:
        """The checkpoint checkpoint.resume asks for, verified: auto = the newest intact one (None if
        there are no checkpoints; a damaged one is reported and skipped), none = never, otherwise a path."""
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume == "auto":
            damaged = []
            for path in reversed(self.complete()):
                problem = verify(path)
                if problem is None:
                    return path
                log.warning("checkpoint %s is damaged: %s; trying the one before it", path, problem)
                damaged.append(path.name)
            if damaged:
                raise ConfigError(f"checkpoint.resume=auto: every checkpoint in {self.root} is damaged "
                                  f"({', '.join(damaged)}; see above); move them away, or set checkpoint.resume=none "
                                  f"to start over")
            return None
        path = named_checkpoint(self.cfg.resume)
        problem = verify(path)
        if problem is not None:
            raise ConfigError(f"checkpoint.resume={path}: the checkpoint is damaged: {problem}; resume from "
                              f"another one, or use auto to take the newest intact one")
        return path

    def save(self, step: int, models: SavedModels, controller_state: dict, resolved: DictConfig) -> dict[str, float]:
        """Start checkpoint `step` (after finishing the one before it): the models write their part
        in the background, finish() makes it whole. Returns the seconds the models held training
        ("held"), and in which parts."""
        import torch  # here, not at the top: config checks use named_checkpoint

        self.finish(wait=True)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"{final.name}.tmp-{os.getpid()}"
        with self._disk_checked(final.name, tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            started = time.perf_counter()
            # this process's files first: should they fail, no worker has begun writing
            torch.save(controller_state, tmp / "controller.pt")
            (tmp / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
            held = models.save(str(tmp))
        self.writing = _Writing(tmp, final, models, started)
        parts = ", ".join(f"{part} {s:.2f}" for part, s in held.items() if part != "held")
        if parts:  # the models' background writers hold the rest
            log.info("checkpoint %s: training held %.2f s (%s), the rest is written in the background", final.name,
                     held["held"], parts)
        else:  # written before save() returned (checkpoint.save_format=hf)
            log.info("checkpoint %s: written, training held %.2f s", final.name, held["held"])
        return held

    def finish(self, wait: bool) -> Path | None:
        """The checkpoint being written, completed once its models' files are (with wait: once
        they are); None while they are not, or when none is being written."""
        writing = self.writing
        if writing is None:
            return None
        with self._disk_checked(writing.final.name, writing.tmp):
            written = writing.models.saved(wait)
            if written is None:
                return None
            _write_manifest(writing.tmp, {Path(path).resolve(): digest for path, digest in written.digests.items()})
            if writing.final.exists():  # a resumed run re-reaching a step it had already saved
                shutil.rmtree(writing.final)
            os.replace(writing.tmp, writing.final)
        self.writing, self.last_write = None, written
        self._prune()
        log.info("checkpoint %s complete, %.1f s after it started; written in the background in %.2f s (%.2f GB at "
                 "%.2f GB/s), digests %.2f s", writing.final, time.perf_counter() - writing.started,
                 written.write_seconds, written.nbytes / 1e9, written.metrics()["timing/checkpoint_write_gbytes_per_s"],
                 written.digest_seconds)
        return writing.final

    @contextlib.contextmanager
    def _disk_checked(self, name: str, tmp: Path):
        """Around the writes of checkpoint `name` into tmp: an error the disk caused (named in it, by
        this process's write or a worker's, or failing a write while the disk has less room than a
        checkpoint takes: torch's writer drops the OSError) becomes one CheckpointWriteError, and
        the unfinished checkpoint is removed. Any other error passes as it is."""
        try:
            yield
        except Exception as error:
            last = self.complete()
            last_bytes = _bytes_in(last[-1]) if last else 0
            failure = disk_failure(error, tmp, last_bytes)
            if failure is None:
                raise
            log.debug("checkpoint %s: the write failed with %r", name, error)
            self.discard_unfinished()
            took = f"; the last checkpoint took {_shown(last_bytes)}" if last else ""
            raise CheckpointWriteError(
                f"checkpoint {name} could not be written into {self.root}: {failure.what} "
                f"({failure.free} free there{took}); its unfinished files ({failure.unfinished}) are removed: make "
                f"room there or set checkpoint.dir to a disk with room, then rerun the same command to resume from "
                f"{last[-1] if last else 'the start'}") from None

    def discard_unfinished(self) -> None:
        """Remove what this process began writing and never completed (a run stopped at once, or by
        an error), once its writers are stopped. Renamed first, so a writer still dying cannot
        recreate files under the old name; the new name keeps ".tmp-" for _prune should rmtree fail."""
        self.writing = None
        if not self.root.is_dir():
            return
        for tmp in self.root.glob(f"step_*.tmp-{os.getpid()}"):
            discarded = tmp.with_name(f"{tmp.name}.discarded")
            try:
                os.replace(tmp, discarded)
            except OSError:  # a full disk's directory may have no room for the new name
                discarded = tmp
            shutil.rmtree(discarded, ignore_errors=True)

    def _prune(self):
        """Remove leftovers of killed writes, and all but the newest checkpoint.keep_last checkpoints
        and the newest keep_last intact ones (checked by sizes, which is cheap): a damaged newer
        checkpoint never costs the intact ones a resume needs."""
        for stale in [p for p in self.root.iterdir() if ".tmp-" in p.name]:
            shutil.rmtree(stale, ignore_errors=True)
        if self.cfg.keep_last <= 0:
            return
        found = self.complete()
        intact = [path for path in found if verify(path, checksums=False) is None]
        keep = set(found[-self.cfg.keep_last:]) | set(intact[-self.cfg.keep_last:])
        for path in found:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def controller_state(path: Path) -> dict:
        import torch

        return torch.load(path / "controller.pt", weights_only=False)


def complete_checkpoints(root: Path) -> list[Path]:
    """The whole checkpoints (step_NNNNNN) in root, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _COMPLETE.match(p.name))]
    return [p for _, p in sorted(found)]


def named_checkpoint(resume: str) -> Path:
    """The directory a checkpoint.resume other than auto / none names, if it exists with a
    complete checkpoint's name; its files are verified by to_resume. Cheap: config validation calls
    it too, so a wrong path fails at load rather than when the run starts."""
    path = Path(resume)
    if not _COMPLETE.match(path.name) or not path.is_dir():
        raise ConfigError(f"checkpoint.resume={resume}: not a complete checkpoint directory (step_NNNNNN); use auto, "
                          f"none, or such a directory")
    return path


def verify(path: Path, checksums: bool = True) -> str | None:
    """None if every file in the checkpoint's manifest is there with its size (and checksum);
    otherwise what is wrong, naming the file."""
    try:
        entries = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (written last: the write never finished, or rlkit older than manifests wrote it)"
    except (ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for name, entry in entries.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, {entry['bytes']} when written"
    if checksums:
        names = list(entries)
        for name, digest in zip(names, file_digests([path / name for name in names])):
            if digest != entries[name]["sha256"]:
                return f"{name} differs from what was written (SHA-256 mismatch)"
    return None


def _bytes_in(folder: Path) -> int:
    """The bytes of the files under folder (0 if there is none), skipping files removed meanwhile."""
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            total += path.stat().st_size if path.is_file() else 0
    return total


def _free_bytes(folder: Path) -> int:
    """Free bytes on the filesystem of folder (or of its nearest existing parent)."""
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def _shown(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _write_manifest(directory: Path, known: dict[Path, str]):
    """known: digests already taken of some of the files (by the writers that wrote them), by
    resolved path."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    missing = [p for p in files if p.resolve() not in known]
    digests = {**{p: known[p.resolve()] for p in files if p.resolve() in known}, **dict(zip(missing, file_digests(missing)))}
    entries = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": digests[p]} for p in files}
    (directory / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def file_digest(path: Path) -> str:
    """SHA-256 of the file."""
    sha = hashlib.sha256()
    update_with_file(sha, path)
    return sha.hexdigest()


def update_with_file(sha: "hashlib._Hash", path: Path) -> None:
    """Feeds the file's bytes to sha, in chunks (a checkpoint's files may not fit in memory)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)


def file_digests(files: list[Path]) -> list[str]:
    """SHA-256 of each file, several at once (hashlib releases the GIL on large reads)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(file_digest, files))
