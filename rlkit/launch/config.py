"""Compose a recipe with Hydra, check it against the schema, then run each part's config rules,
which the part they govern keeps (validate lists them in order): what every run needs, what runs
with rollouts need, the algorithm's own (its spec), the model's layout against its shape, then
that the run's directories can be written, and last that the run can do something at all
(rlkit/launch/preflight.py). Every problem is one ConfigError line: `key: problem (got: value); fix`.

Nothing here imports torch, Ray or Megatron, nor may anything it imports (the algorithm modules
included): the CLI's help texts and config errors come from here, in well under a second
(benchmarks/cli_latency.py; tests/unit/test_cli_startup.py holds it to that)."""

import difflib
import os
import re
import tempfile
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rlkit.algorithms.lr_schedule import check_schedule
from rlkit.algorithms.registry import load_algorithm
from rlkit.bridge.adapters import check_init_from
from rlkit.checkpoint.rules import check_checkpoint
from rlkit.cluster.placement import PLACEMENTS
from rlkit.config.schema import ConfigError, RootConfig, check_choice, check_finite, check_positive
from rlkit.data.rules import check_data
from rlkit.envs.rules import check_env_runner, check_environment
from rlkit.launch.preflight import check_config
from rlkit.launch.section_schemas import typed_schema
from rlkit.refit.transport import check_refit
from rlkit.workers.generation.rules import check_generation
from rlkit.workers.policy.rules import check_model, check_policy, data_parallel_size

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_GROUPS_DIR = REPO_ROOT / "configs"
RECIPES_DIR = REPO_ROOT / "recipes"


def recipe_names(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in Path(recipes_dir).glob("*.yaml"))


def _unknown_key(full_key: str, known: DictConfig, at: str = "") -> ConfigError:
    """The unknown-key error, naming the keys of `known` (the whole config, or its section at the
    dotted path `at`) that full_key may have meant (_near_keys)."""
    relative = full_key.removeprefix(f"{at}.") if at else full_key
    near = [f"{at}.{key}" if at else key for key in _near_keys(relative, known)]
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    return ConfigError(f"{full_key}: unknown key; remove it or fix its spelling{hint}")


def _near_keys(key: str, known: DictConfig) -> list[str]:
    """The keys of `known` that `key` may have meant: each part of its path that is not there
    replaced by the closest name at that level (algorithm.kl_coeff -> algorithm.kl_coef,
    polcy.num_workers -> policy.num_workers); a last part that is not at its level but deeper in
    that section found there (policy.lr, polcy.lr -> policy.optimizer.lr); else the path as far as
    a misspelling could be corrected (polcy.no_such_key -> policy). Empty when nothing is close."""
    parts, path, node = key.split("."), [], known
    for i, part in enumerate(parts):
        names = [str(name) for name in node.keys()] if isinstance(node, DictConfig) else []
        names = [name for name in names if path or name != "hydra"]  # Hydra's own settings, not the run's
        name = part if part in names else next(iter(difflib.get_close_matches(part, names, n=1)), None)
        if name is None:
            deeper = _paths_ending_in(node, part) if i == len(parts) - 1 and isinstance(node, DictConfig) else []
            if deeper:
                return [".".join([*path, found]) for found in deeper]
            return [".".join(path)] if path != parts[:len(path)] else []
        path.append(name)
        node = OmegaConf.select(node, name, throw_on_missing=False, throw_on_resolution_failure=False)
    return [".".join(path)] if path != parts else []


def _paths_ending_in(node: DictConfig, name: str) -> list[str]:
    """The dotted paths under `node` whose last part is `name` (at most three, the shallowest first)."""
    found, level = [], [((), node)]
    while level and len(found) < 3:
        deeper = []
        for path, config in level:
            for key in config.keys():
                child = OmegaConf.select(config, str(key), throw_on_missing=False, throw_on_resolution_failure=False)
                if str(key) == name:
                    found.append(".".join([*path, str(key)]))
                if isinstance(child, DictConfig):
                    deeper.append(((*path, str(key)), child))
        level = deeper
    return found[:3]


def compose_recipe(name: str, overrides: list[str], recipes_dir: Path = RECIPES_DIR) -> DictConfig:
    if not (Path(recipes_dir) / f"{name}.yaml").is_file():
        raise ConfigError(f"recipe '{name}': no {name}.yaml in {recipes_dir}; recipes there: "
                          f"{', '.join(recipe_names(recipes_dir))}")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(recipes_dir).resolve()), version_base=None):
            return compose(config_name=name, overrides=[*overrides, f"hydra.searchpath=[file://{CONFIG_GROUPS_DIR}]"])
    except Exception as e:  # Hydra's errors are multi-line; keep the first, it names the key
        syntax = _yaml_syntax_error(e)
        if syntax is not None:
            raise ConfigError(f"recipe '{name}': {syntax}") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        unknown = re.match(r"Could not override '([^']+)'", first)
        if unknown:
            # OmegaConf's error holds the section that lacks the key (the whole config for a
            # misspelled group); only without it is the recipe composed again to find near keys
            key, section = unknown.group(1), getattr(e.__cause__, "parent_node", None)
            at = str(getattr(e.__cause__, "full_key", "")).rpartition(".")[0]
            if isinstance(section, DictConfig) and (not at or key.startswith(f"{at}.")):
                raise _unknown_key(key, section, at) from None
            raise _unknown_key(key, compose_recipe(name, [], recipes_dir)) from None
        options = re.search(r"Available options in '[^']+':\n((?:\t.*\n)+)", str(e))
        if options:  # a config group's option that does not exist: Hydra lists the others below its first line
            first += f"; pick one of: {', '.join(options.group(1).split())}"
        raise ConfigError(f"recipe '{name}': {first}") from None
    finally:
        GlobalHydra.instance().clear()


def _yaml_syntax_error(error: BaseException | None) -> str | None:
    """`file:line: problem` of a YAML syntax error in a recipe or config group file, or None.
    PyYAML reports it over several lines, which the one-line error would cut to "while parsing
    a flow sequence", naming no file."""
    while error is not None and not isinstance(error, yaml.MarkedYAMLError):
        error = error.__cause__ or error.__context__
    if error is None or error.problem_mark is None:
        return None
    mark, opened = error.problem_mark, error.context_mark
    context = f" ({error.context} at line {opened.line + 1})" if error.context and opened else ""
    return f"{mark.name}:{mark.line + 1}: invalid YAML: {error.problem}{context}; fix the syntax there"


def to_typed(cfg: DictConfig) -> RootConfig:
    """Merge into the schema (section_schemas.py: the sections each part types by a choice in the
    config): unknown keys, wrong types and missing values fail here."""
    schema = typed_schema(cfg)
    try:
        merged = OmegaConf.merge(schema, cfg)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"{missing[0]}: no value set; give it one in the recipe or as {missing[0]}=...")
        return OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        raise _unknown_key(e.full_key, schema) from None
    except ValidationError as e:
        raise ConfigError(f"{e.full_key}: {e.msg.splitlines()[0]}; give a value of the right type") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{getattr(e, 'full_key', '?')}: {str(e).splitlines()[0]}") from None


def validate(cfg: RootConfig) -> None:
    """Each part's rules, kept by the part they govern: what every run needs, what rollouts need,
    the algorithm's own (its spec's validate), then the model's layout against its shape."""
    p, algorithm = cfg.policy, load_algorithm(cfg.algorithm.name)
    check_choice("cluster.placement", cfg.cluster.placement, PLACEMENTS)
    if algorithm.rollouts:
        _check_rollout_sections(cfg)
        check_env_runner(cfg.env_runner)  # before the algorithm's checks, which compute the response budget from it
    check_data(cfg.data, cfg.algorithm.name, algorithm.data)
    check_policy(p)
    check_positive(("cluster.num_cpus", cfg.cluster.num_cpus), ("algorithm.val_every", cfg.algorithm.val_every),
                   ("algorithm.num_steps", cfg.algorithm.num_steps))
    check_schedule(p.optimizer)
    for section in ("algorithm", "policy", "generation", "refit"):
        check_finite(section, getattr(cfg, section))
    algorithm.validate(cfg, data_parallel_size(p))
    shape = check_model(cfg, {algorithm.head, *(["value"] if algorithm.critic else [])})
    check_init_from(p.peft)
    if algorithm.rollouts:
        check_generation(cfg.generation, shape.heads)
        check_refit(cfg)
    cfg.cluster.check_timeouts()
    check_checkpoint(cfg)
    if algorithm.rollouts:
        check_environment(cfg.env)
    # last: the only checks that touch the disk, so a config with other mistakes creates no directories
    for key, path in [("run.output_dir", cfg.run.output_dir), ("run.cache_dir", cfg.run.cache_dir),
                      ("checkpoint.dir", cfg.checkpoint.dir)]:
        if path is not None:
            _writable_dir(key, path)
    check_config(cfg)  # that the run can do something at all (rlkit/launch/preflight.py)


def _check_rollout_sections(cfg: RootConfig) -> None:
    for section in ("generation", "refit", "env", "env_runner"):
        if getattr(cfg, section) is None:
            raise ConfigError(f"{section}: algorithm {cfg.algorithm.name} generates rollouts and needs this "
                              f"section; add /{section} to the recipe's defaults (see recipes/grpo_tiny_cpu.yaml)")


def _writable_dir(key: str, path: str) -> None:
    """The directory exists or can be made, and can be written: a path under a file, a file where
    the directory should be, or a read-only place fails here, not when the run first writes there
    minutes in. Probed in its nearest existing ancestor, so a config error leaves no folder behind."""
    where = Path(path).absolute()
    existing = next(p for p in [where, *where.parents] if p.exists())
    if not existing.is_dir():
        what = "is a file" if existing == where else f"lies under the file {existing}"
        raise ConfigError(f"{key}: {path} {what}, not a directory; give a directory path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlkit-write-probe-", dir=existing))
    except OSError as e:
        raise ConfigError(f"{key}: cannot create or write to the directory {path} ({e.strerror}: {existing}); "
                          f"give a directory rlkit can create and write to") from None


def load_config(name: str, overrides: list[str], recipes_dir: Path = RECIPES_DIR) -> tuple[RootConfig, DictConfig]:
    """Returns the typed, validated config and the resolved DictConfig (for printing/logging)."""
    raw = compose_recipe(name, overrides, recipes_dir)
    typed = to_typed(raw)
    validate(typed)
    return typed, raw
