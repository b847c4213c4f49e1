"""`rlkit convert`: a checkpoint's policy as an HF checkpoint, or (a policy.peft run's) an HF PEFT
adapter; a reward model's as an HF sequence classifier. Every check runs before any worker starts:
the checkpoint is a complete one and matches its manifest (as a resume checks it), and the output
is a new or empty folder outside it. The export is written into a folder beside the output and
renamed into place once complete, so the output is whole or absent, and a user's files are never
overwritten."""

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from rlkit.algorithms.registry import load_algorithm
from rlkit.checkpoint import MANIFEST, DiskWriteError, complete_checkpoints, disk_failure, verify
from rlkit.config.schema import ConfigError, RootConfig
from rlkit.launch.config import to_typed
from rlkit.models.shape import model_shape
from rlkit.workers.policy.adapter_base import recorded_base, restored_base
from rlkit.workers.policy.rules import check_model_layout

if TYPE_CHECKING:  # Ray: the checks run before it is imported
    from rlkit.cluster.warm_pool import WarmPool

_UNFINISHED = re.compile(r"^step_\d+\.tmp-")
PEFT_ADAPTER = "HF PEFT adapter"
REWARD_MODEL = "HF sequence classifier (a reward model)"


@dataclass(frozen=True)
class Conversion:
    """A checked `rlkit convert`: the policy to rebuild (the run's saved config, over model_dir, with
    the head its algorithm trains) and what it writes, `kind`: an HF checkpoint, the adapters alone
    as an HF PEFT adapter, or a reward model's HF sequence classifier."""
    cfg: RootConfig
    model_dir: Path
    kind: str
    head: str  # the trained model's (AlgorithmSpec.head)

    @property
    def adapter_alone(self) -> bool:
        return self.kind == PEFT_ADAPTER


@dataclass(frozen=True)
class Exported:
    """What `rlkit convert` wrote: `kind` is what it exported, not what files the folder holds."""
    path: Path
    kind: str
    files: int
    nbytes: int

    def line(self) -> str:
        return f"{self.kind} written to {self.path} ({self.files} files, {self.nbytes / 1e6:.1f} MB)"


def checked_conversion(checkpoint_dir: Path, out_dir: Path, merged: bool) -> Conversion:
    """Every check `rlkit convert` makes, without starting a worker: a ConfigError naming the path
    at fault and the fix, else what to export."""
    check_checkpoint(checkpoint_dir)
    check_out_dir(out_dir, checkpoint_dir)
    cfg = to_typed(OmegaConf.load(checkpoint_dir / "config.yaml"))
    base = recorded_base(checkpoint_dir / "policy")
    if merged and base is None:
        raise ConfigError(f"rlkit convert --merged: {checkpoint_dir} holds every weight of the policy (it was trained "
                          f"without policy.peft), so there are no adapters to merge; convert it without --merged")
    model_dir = restored_base(checkpoint_dir, cfg, "rlkit convert")
    p = cfg.policy  # rebuilt as the run had it, over model_dir: checked as a run's config is, before any worker
    shape = model_shape(str(model_dir), p.tiny_model.num_layers, p.tiny_model.hidden_size)
    check_model_layout(p, shape)
    head = load_algorithm(cfg.algorithm.name).head
    if head == "reward":
        check_sequence_classifier(shape.model_type, model_dir)
        kind = REWARD_MODEL
    elif base is None:
        kind = "HF checkpoint"
    else:
        kind = "HF checkpoint (the base with the adapters merged in)" if merged else PEFT_ADAPTER
    return Conversion(cfg, model_dir, kind, head)


def check_sequence_classifier(model_type: str | None, model_dir: Path) -> None:
    """A ConfigError unless transformers has a sequence classifier of the model's architecture
    (a reward model's export is one)."""
    from rlkit.workers.policy.reward_export import sequence_classifier  # transformers' table: torch

    if sequence_classifier(model_type) is None:
        raise ConfigError(f"rlkit convert: the reward model is a {model_type} model ({model_dir}), for which "
                          f"transformers has no sequence classifier to export it as; train reward models on an "
                          f"architecture that has one (e.g. qwen2, qwen3, llama)")


def export_hf(checkpoint_dir: Path, out_dir: Path, merged: bool = False, pool: "WarmPool | None" = None) -> Exported:
    """HF weights (with config and tokenizer) from a checkpoint of either format; from an adapter
    checkpoint (policy.peft) an HF PEFT adapter folder over the base it was trained on, or with
    `merged` that base with the adapters merged in. The policy is rebuilt as the run had it (its
    saved config), loads the checkpoint and writes through the bridge; no offline converter.
    pool: worker processes to rebuild it on (as launch.run.train takes them), instead of new ones."""
    conversion = checked_conversion(checkpoint_dir, out_dir, merged)
    target = out_dir.resolve()  # "." or "x/..": a name to put a folder beside
    partial = _partial_dir(target)
    try:
        _write(conversion, checkpoint_dir, partial, pool)
        sizes = [p.stat().st_size for p in partial.rglob("*") if p.is_file()]
        os.replace(partial, target)  # onto an empty folder too; checked above that it is one
    except BaseException as error:
        failure = disk_failure(error, partial) if isinstance(error, Exception) else None
        shutil.rmtree(partial, ignore_errors=True)
        if failure is not None:
            raise DiskWriteError(f"the export could not be written beside {target}: {failure.what} "
                                 f"({failure.free} free there; its unfinished files, {failure.unfinished}, are "
                                 f"removed): make room there or give an output folder on a disk with room, then "
                                 f"rerun the command") from None
        raise
    return Exported(out_dir, conversion.kind, len(sizes), sum(sizes))


def _write(conversion: Conversion, checkpoint_dir: Path, out_dir: Path, pool: "WarmPool | None") -> None:
    """The policy rebuilt on workers of its own, loaded from the checkpoint, written to out_dir."""
    from rlkit.cluster.setup import start_workers  # here: Ray and torch, which the checks do without
    from rlkit.launch.run import failing

    workers = start_workers(conversion.cfg, str(conversion.model_dir), with_generation=False, pool=pool,
                            policy_head=conversion.head)
    try:
        workers.policy.load_checkpoint(str(checkpoint_dir), conversion.cfg.checkpoint.save_format)
        if conversion.adapter_alone:
            workers.policy.save_peft_adapter(str(out_dir))
        else:
            workers.policy.save_hf(str(out_dir))
    finally:
        workers.shutdown(failed=failing())


def check_checkpoint(path: Path) -> None:
    """A ConfigError unless `path` is a complete checkpoint folder whose files match its manifest;
    a folder of checkpoints (or a run's) names the newest one in it."""
    if not path.exists():
        raise ConfigError(f"rlkit convert: {path} does not exist; give a checkpoint folder "
                          f"(<run>/checkpoints/step_NNNNNN)")
    if not path.is_dir():
        raise ConfigError(f"rlkit convert: {path} is a file, not a checkpoint folder; give a checkpoint folder "
                          f"(<run>/checkpoints/step_NNNNNN)")
    if _UNFINISHED.match(path.name):
        raise ConfigError(f"rlkit convert: {path} is an unfinished checkpoint (a write that never completed: it "
                          f"may miss files); convert a complete one{_newest_hint(path.parent)}")
    if not (path / MANIFEST).is_file() or not (path / "config.yaml").is_file():
        raise ConfigError(f"rlkit convert: {path} is not a checkpoint folder (one holds {MANIFEST} and config.yaml); "
                          f"give one (<run>/checkpoints/step_NNNNNN){_newest_hint(path)}")
    problem = verify(path)
    if problem is not None:
        raise ConfigError(f"rlkit convert: the checkpoint {path} is damaged: {problem}; convert another "
                          f"one{_newest_hint(path.parent, other_than=path)}")


def _newest_hint(folder: Path, other_than: Path | None = None) -> str:
    """', e.g. <the newest intact checkpoint in folder, or in its checkpoints/>', or ''. Intact by
    its files' sizes (cheap); the one converted is then verified in full."""
    for root in (folder, folder / "checkpoints"):
        intact = [p for p in complete_checkpoints(root) if p != other_than and verify(p, checksums=False) is None]
        if intact:
            return f", e.g. the newest in {root}: {intact[-1]}"
    return ""


def check_out_dir(out_dir: Path, checkpoint_dir: Path) -> None:
    """A ConfigError unless out_dir is new or an empty folder, outside the checkpoint."""
    out, checkpoint = out_dir.resolve(), checkpoint_dir.resolve()
    if out == checkpoint or checkpoint in out.parents:
        raise ConfigError(f"rlkit convert: the output {out_dir} is inside the checkpoint {checkpoint_dir}; "
                          f"write the export to a folder of its own outside it")
    if out_dir.is_symlink() or out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"rlkit convert: the output {out_dir} is a file (or a link); give a new folder (rlkit "
                          f"convert never overwrites)")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        held = sorted(p.name for p in out_dir.iterdir())
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ConfigError(f"rlkit convert: the output {out_dir} already holds files ({shown}); give a new or empty "
                          f"folder (rlkit convert never overwrites)")


def _partial_dir(out_dir: Path) -> Path:
    """A new folder beside out_dir (same filesystem, so it renames into place), for the export."""
    partial = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a killed convert's, this pid's
        partial.mkdir()
    except OSError as e:
        raise ConfigError(f"rlkit convert: cannot write beside the output {out_dir} ({e.strerror}: "
                          f"{e.filename}); give a folder you can write to") from None
    return partial
