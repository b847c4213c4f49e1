"""What a resumed run may change: this command's config against the one its checkpoint was saved
with (the checkpoint's config.yaml), compared before Ray or any worker starts.

A command whose run.name names an existing run continues it (checkpoint.resume=auto). A setting
given to such a command used to be ignored without a word: a finished run printed "nothing to do",
and a README example pasted after the quick start seemed to have trained with it. Keys come in
three kinds (RULES; the first pattern a key matches decides):
- free: where the run lives and how it is driven and watched (run folders, the Ray connection,
  resources and timeouts, logging, checkpoint cadence, algorithm.num_steps, validation, how the
  weights travel to the generation workers): they may change on any resume;
- never: what the checkpoint is (the model, the algorithm, the adapters' shape, the save format;
  at save_format=hf also the parallel layout, its optimizer state being per rank): only a new run
  may change them (policy.expert_parallel_size: run.check_expert_layout);
- every other key (hyperparameters, data, environment, sampling, parallel layout): the run stops
  unless checkpoint.resume_with_changes=true asks to continue it with the new values.
The configs are compared as written, interpolations unresolved: a path under ${run.cache_dir}
stays equal when only run.cache_dir moves.
"""

import dataclasses
import functools
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from rlkit.config.schema import ConfigError, RootConfig

FREE, CHOICE, NEVER = "free", "choice", "never"

# (pattern, kind) by dotted key: the first pattern a key matches decides; one matching none needs the choice
RULES = [
    ("run.name", FREE), ("run.output_dir", FREE), ("run.cache_dir", FREE),
    ("cluster.placement", CHOICE), ("cluster.*", FREE),
    ("logger.*", FREE),
    ("checkpoint.save_format", NEVER), ("checkpoint.*", FREE),
    ("algorithm.num_steps", FREE),  # an async run's is fixed: preflight.check_resumed_schedule
    ("algorithm.val_*", FREE),
    ("algorithm.name", NEVER),
    ("policy.model_path", NEVER), ("policy.tiny_model.*", NEVER),
    ("policy.peft.init_from", FREE),  # read only as a run starts
    ("policy.peft.alpha", CHOICE), ("policy.peft.dropout", CHOICE), ("policy.peft*", NEVER),
    ("policy.offload", FREE),
    ("refit.keep_fp32", CHOICE), ("refit.*", FREE),
    ("generation.vllm.gpu_memory_utilization", FREE), ("generation.vllm.enforce_eager", FREE),
    ("generation.vllm.torch_compile", FREE), ("generation.vllm.engine_process", FREE),
    ("env_runner.num_workers", FREE),
]
# an hf checkpoint's optimizer state is one file per rank: it loads only into the layout it was saved at
HF_LAYOUT = ["policy.num_workers", "policy.*_parallel_size", "policy.use_distributed_optimizer"]
_UNSET = object()


@dataclass(frozen=True)
class Change:
    key: str
    before: Any
    now: Any
    kind: str

    def __str__(self) -> str:
        return f"{self.key}: {_shown(self.before)} -> {_shown(self.now)}"


def changes(saved: DictConfig, now: DictConfig, schema: RootConfig | None = None) -> list[Change]:
    """Every key whose value differs, in now's order (then keys only saved has), with its kind. A
    key of rlkit's own config (schema: the typed config) that saved lacks is none: rlkit added it
    since, with a default that keeps what rlkit did before it."""
    hf = OmegaConf.select(saved, "checkpoint.save_format") == "hf"
    added_since = functools.partial(_is_schema_key, schema) if schema is not None else lambda key: False
    return [Change(key, before, value, kind_of(key, hf)) for key, before, value in
            _differences(OmegaConf.to_container(saved), OmegaConf.to_container(now), "", added_since)]


def _is_schema_key(schema, key: str) -> bool:
    """Whether the dotted key is a field of rlkit's typed config (not a free key such as an
    environment's keyword arguments)."""
    node = schema
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


def kind_of(key: str, hf_checkpoint: bool = False) -> str:
    """FREE, CHOICE or NEVER for a dotted key of a checkpoint saved in format hf (hf_checkpoint) or dist."""
    if hf_checkpoint and any(fnmatchcase(key, pattern) for pattern in HF_LAYOUT):
        return NEVER
    return next((kind for pattern, kind in RULES if fnmatchcase(key, pattern)), CHOICE)


def check_resume_drift(cfg: RootConfig, resolved: DictConfig, saved: DictConfig, checkpoint_dir: Path,
                       step: int) -> str:
    """Before a run (typed cfg, config as written `resolved`) continues from checkpoint_dir, saved
    at `step` with config `saved`: a ConfigError naming every changed key unless each may change
    (free, or checkpoint.resume_with_changes=true and none is never). Returns the changes it
    accepts, as "key: old -> new, ..." ("" for none), for the run to say what it goes on with."""
    found = changes(saved, resolved, cfg)
    never = [c for c in found if c.kind == NEVER]
    refused = [c for c in found if c.kind == NEVER or (c.kind == CHOICE and not cfg.checkpoint.resume_with_changes)]
    if refused:
        raise ConfigError(_refusal(cfg, checkpoint_dir, step, refused, never))
    return ", ".join(map(str, found))


def _refusal(cfg: RootConfig, checkpoint_dir: Path, step: int, refused: list[Change], never: list[Change]) -> str:
    finished = step >= cfg.algorithm.num_steps
    auto = cfg.checkpoint.resume == "auto"
    where = f"run.name={cfg.run.name}: its checkpoint {checkpoint_dir}" if auto \
        else f"checkpoint.resume={checkpoint_dir}: that checkpoint"
    state = f"step {step}, the run has finished" if finished else f"step {step}"
    problem = f"{where} ({state}) was saved with other settings: {', '.join(map(str, refused))}"
    new_run = "set another run.name for a new run with them" if auto else \
        "drop checkpoint.resume and set another run.name for a new run with them"
    if never:
        return (f"{problem}; {', '.join(c.key for c in never)} cannot change within a run (the checkpoint holds "
                f"state of the old value); {new_run}")
    more = " and a higher algorithm.num_steps" if finished else ""
    return f"{problem}; {new_run}, or add checkpoint.resume_with_changes=true{more} to continue this run with them"


def _differences(before: Any, now: Any, prefix: str, added_since: Callable[[str], bool]):
    """(dotted key, before, now) of each difference; a section present on one side only, or
    null on one, is one difference; so is a key on one side only, unless added_since(key) says
    rlkit added it since the checkpoint was saved."""
    if isinstance(before, dict) and isinstance(now, dict):
        for key in [*now, *(k for k in before if k not in now)]:
            yield from _differences(before.get(key, _UNSET), now.get(key, _UNSET), f"{prefix}{key}.", added_since)
    elif before != now and not (before is _UNSET and added_since(prefix[:-1])):
        yield prefix[:-1], before, now


def _shown(value: Any) -> str:
    if value is _UNSET:
        return "(unset)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
