"""Compose a recipe with Hydra, check it against the schema, then check cross-key consistency:
what every run needs, what runs with rollouts need, then the algorithm's own checks (its spec),
then that the run's directories can be written, and last that the run can do something at all
(rlkit/launch/preflight.py). Every problem is one ConfigError line: `key: problem (got: value); fix`.

Nothing here imports torch, Ray or Megatron, nor may anything it imports (the algorithm modules
included): the CLI's help texts and config errors come from here, in well under a second
(benchmarks/cli_latency.py; tests/unit/test_cli_startup.py holds it to that)."""

import difflib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import NamedTuple

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rlkit.algorithms.lr_schedule import check_schedule
from rlkit.algorithms.registry import load_algorithm
from rlkit.bridge.base import ATTENTION_BACKENDS, BRIDGES, check_bridge_supports, check_transformer_engine_layout
from rlkit.bridge.adapters import check_init_from, check_peft
from rlkit.checkpoint.rules import check_checkpoint
from rlkit.cluster.placement import PLACEMENTS
from rlkit.config.choices import OFFLOAD_MODES
from rlkit.config.schema import (DATASETS, ConfigError, PolicyConfig, RootConfig, check_choice, check_finite,
                                 check_positive)
from rlkit.data.rules import check_data
from rlkit.envs.rules import check_env_runner, check_environment
from rlkit.launch.preflight import check_config
from rlkit.models.tiny import ARCHITECTURES, TINY_EXPERTS, TINY_HEADS, parse_tiny
from rlkit.refit.transport import check_refit
from rlkit.workers.generation.rules import check_generation

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
    """Merge into the schema: unknown keys, wrong types and missing values fail here. The
    algorithm section is typed by its module's spec (algorithm.name), data by data.name."""
    schema = OmegaConf.structured(RootConfig)
    name = OmegaConf.select(cfg, "algorithm.name")
    if not isinstance(name, str):
        raise ConfigError(f"algorithm.name: no algorithm selected (got: {name!r}); select the config group with "
                          f"algorithm=<name>")
    schema["algorithm"] = OmegaConf.structured(load_algorithm(name).config)
    name = OmegaConf.select(cfg, "data.name")
    if name not in DATASETS:
        raise ConfigError(f"data.name: must be one of {list(DATASETS)} (got: {name!r}); select the config group "
                          f"with data=<name>")
    schema["data"] = OmegaConf.structured(DATASETS[name])
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


class ModelShape(NamedTuple):
    """What the parallel layout must divide: attention heads, key/value heads, routed experts (0: dense),
    transformer layers (0: config.json does not say); and the hidden size LoRA's rank stays below (0: unknown)."""
    heads: int
    kv_heads: int
    experts: int
    layers: int
    hidden: int = 0


def _model_shape(model_path: str, tiny_layers: int, tiny_hidden: int = 0) -> ModelShape:
    """The model's shape from an HF checkpoint's config.json, or from the tiny:// architecture."""
    arch = parse_tiny(model_path)
    if arch:
        return ModelShape(*TINY_HEADS, TINY_EXPERTS.get(arch, 0), tiny_layers, tiny_hidden)
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        made_here = "; `rlkit pretrained smollm2-135m-instruct` makes it" if "SmolLM2" in model_path else ""
        raise ConfigError(f"policy.model_path: {config_file} does not exist; give an HF checkpoint directory "
                          f"or tiny://<{'|'.join(ARCHITECTURES)}>{made_here}")
    try:
        hf = json.loads(config_file.read_text())
        # Qwen-MoE and DeepSeek write num_experts / n_routed_experts; Mixtral and transformers 5 num_local_experts
        experts = next((hf[key] for key in ("num_experts", "num_local_experts", "n_routed_experts") if key in hf), 0)
        return ModelShape(hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"]), experts,
                          hf.get("num_hidden_layers", 0), hf.get("hidden_size", 0))
    except (json.JSONDecodeError, KeyError) as e:
        raise ConfigError(f"policy.model_path: {config_file} is not a usable HF config ({type(e).__name__}: {e}); "
                          f"point policy.model_path at a complete HF checkpoint directory") from None


def validate(cfg: RootConfig) -> None:
    """Cross-key checks: what every run needs, what rollouts need, then the algorithm's own."""
    p, a = cfg.policy, cfg.algorithm
    algorithm = load_algorithm(a.name)
    check_choice("cluster.placement", cfg.cluster.placement, PLACEMENTS)
    check_choice("policy.precision", p.precision, ("fp32", "bf16"))
    check_choice("policy.attention_backend", p.attention_backend, ATTENTION_BACKENDS)
    check_choice("policy.bridge", p.bridge, BRIDGES)
    if algorithm.rollouts:
        _check_rollout_sections(cfg)
        check_env_runner(cfg.env_runner)  # before the algorithm's checks, which compute the response budget from it
    check_data(cfg.data, a.name, algorithm.data)
    arch = parse_tiny(p.model_path)
    if p.model_path.startswith("tiny://") and arch not in ARCHITECTURES:
        raise ConfigError(f"policy.model_path: tiny model '{p.model_path}' is unknown; use one of "
                          f"{['tiny://' + x for x in ARCHITECTURES]}")
    check_positive(("policy.num_workers", p.num_workers), ("policy.tensor_parallel_size", p.tensor_parallel_size),
              ("policy.pipeline_parallel_size", p.pipeline_parallel_size),
              ("policy.virtual_pipeline_parallel_size", p.virtual_pipeline_parallel_size),
              ("policy.context_parallel_size", p.context_parallel_size),
              ("policy.expert_parallel_size", p.expert_parallel_size),
              ("policy.micro_batch_size", p.micro_batch_size),
              ("policy.train_global_batch_size", p.train_global_batch_size),
              ("cluster.num_cpus", cfg.cluster.num_cpus), ("algorithm.val_every", a.val_every),
              ("algorithm.num_steps", a.num_steps))
    model_parallel = p.tensor_parallel_size * p.pipeline_parallel_size * p.context_parallel_size
    if p.num_workers % model_parallel:
        raise ConfigError(f"policy.num_workers: must be a multiple of policy.tensor_parallel_size x "
                          f"policy.context_parallel_size x policy.pipeline_parallel_size = {model_parallel} "
                          f"(got: {p.num_workers}); set it to a multiple of {model_parallel}")
    check_choice("policy.offload", p.offload, OFFLOAD_MODES)
    if p.max_tokens_per_microbatch < 0:
        raise ConfigError(f"policy.max_tokens_per_microbatch: must be >= 0 (got: {p.max_tokens_per_microbatch}); "
                          f"0 turns the token budget off")
    check_schedule(p.optimizer)
    dp = p.num_workers // model_parallel
    if p.train_global_batch_size % (dp * p.micro_batch_size):
        raise ConfigError(f"policy.train_global_batch_size: must be divisible by DP ({dp}) x "
                          f"policy.micro_batch_size ({p.micro_batch_size}) = {dp * p.micro_batch_size} "
                          f"(got: {p.train_global_batch_size}); set it to a multiple of {dp * p.micro_batch_size}")
    for section in ("algorithm", "policy", "generation", "refit"):
        check_finite(section, getattr(cfg, section))
    algorithm.validate(cfg, dp)
    shape = _model_shape(p.model_path, p.tiny_model.num_layers, p.tiny_model.hidden_size)
    for name, count in [("attention heads", shape.heads), ("key/value heads", shape.kv_heads)]:
        if count % p.tensor_parallel_size:
            raise ConfigError(f"policy.tensor_parallel_size: must divide the model's {count} {name} "
                              f"(got: {p.tensor_parallel_size}); pick a divisor of {count}")
    _validate_expert_parallel(p, dp, shape.experts)
    _validate_virtual_pipeline(p, shape.layers, dp)
    _validate_context_parallel(p, shape.experts)
    _validate_bridge(p)
    check_transformer_engine_layout(p.context_parallel_size, *_packing(cfg))
    check_peft(p.peft, p.bridge, shape.hidden)
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


def _validate_expert_parallel(p: PolicyConfig, dp: int, experts: int) -> None:
    """Megatron lays the experts over TP x EP x PP ranks (expert TP = TP), so an expert-parallel group
    spans data-parallel ranks only, and each of its ranks holds an equal share of the experts."""
    ep = p.expert_parallel_size
    if ep == 1:
        return
    if not experts:
        raise ConfigError(f"policy.expert_parallel_size: {p.model_path} is a dense model, without experts to "
                          f"spread (got: {ep}); set it to 1")
    if experts % ep:
        raise ConfigError(f"policy.expert_parallel_size: must divide the model's {experts} experts (got: {ep}); "
                          f"pick a divisor of {experts}")
    if dp % ep:
        raise ConfigError(f"policy.expert_parallel_size: must divide the data-parallel size policy.num_workers / "
                          f"(TP x PP) = {dp} (got: {ep}); set policy.num_workers to a multiple of "
                          f"TP x PP x EP = {p.tensor_parallel_size * p.pipeline_parallel_size * ep}")


def _validate_virtual_pipeline(p: PolicyConfig, layers: int, dp: int) -> None:
    """Virtual pipeline stages: each pipeline rank holds policy.virtual_pipeline_parallel_size chunks
    of equal depth, run by Megatron's interleaved schedule, which needs a micro-batch per pipeline
    rank. Built and converted by mbridge."""
    vpp = p.virtual_pipeline_parallel_size
    if vpp == 1:
        return
    key = "policy.virtual_pipeline_parallel_size"
    if p.pipeline_parallel_size == 1:
        raise ConfigError(f"{key}: virtual stages interleave pipeline ranks, and policy.pipeline_parallel_size is 1 "
                          f"(got: {vpp}); set policy.pipeline_parallel_size > 1, or this to 1")
    stages = p.pipeline_parallel_size * vpp
    if not layers:
        raise ConfigError(f"{key}: {p.model_path}/config.json gives no num_hidden_layers to split into {stages} chunks; "
                          f"point policy.model_path at a complete HF checkpoint, or set {key}=1")
    if layers % stages:
        fitting = [v for v in range(1, layers + 1) if layers % (p.pipeline_parallel_size * v) == 0]
        raise ConfigError(f"{key}: the model's {layers} layers must split evenly into policy.pipeline_parallel_size x "
                          f"{key} = {stages} chunks (got: {vpp}); at policy.pipeline_parallel_size="
                          f"{p.pipeline_parallel_size} pick one of {fitting}")
    if p.bridge != "mbridge":
        # Megatron-Bridge (and with it policy.peft) has not been run with virtual stages here
        raise ConfigError(f"{key}: virtual stages are built and converted through mbridge (got: policy.bridge="
                          f"{p.bridge}); set policy.bridge=mbridge, or {key}=1")
    if p.train_global_batch_size // dp < p.pipeline_parallel_size:
        raise ConfigError(f"policy.train_global_batch_size: with {key}={vpp} each of the {dp} data-parallel ranks "
                          f"needs at least policy.pipeline_parallel_size={p.pipeline_parallel_size} rows per step, one "
                          f"per micro-batch (got: {p.train_global_batch_size}); set it to at least "
                          f"{dp * p.pipeline_parallel_size}")


def _validate_bridge(p: PolicyConfig) -> None:
    """policy.bridge=megatron_bridge: the architectures rlkit checks it on, experts held on one rank
    (its conversion numbers a rank's local experts as global ones only in TE's grouped layout) and
    no context parallelism (never run with it)."""
    if p.bridge != "megatron_bridge":
        return
    hf_config = {} if parse_tiny(p.model_path) else json.loads((Path(p.model_path) / "config.json").read_text())
    model_type = parse_tiny(p.model_path) or hf_config.get("model_type")
    check_bridge_supports(p.bridge, model_type)
    for key, value in [("policy.expert_parallel_size", p.expert_parallel_size),
                       ("policy.context_parallel_size", p.context_parallel_size)]:
        if value > 1:
            raise ConfigError(f"{key}: policy.bridge=megatron_bridge runs with {key}=1 only (got: {value}); set "
                              f"{key}=1 or policy.bridge=mbridge")


def _packing(cfg: RootConfig) -> tuple[str | None, str]:
    """The key that makes the run pack rows (None: nothing does), and its setting that does not."""
    warm_start = getattr(cfg.algorithm, "warm_start", None)
    if warm_start is not None and warm_start.sft_steps > 0:  # the warm start's SFT packs its examples
        return "algorithm.warm_start.sft_steps", "algorithm.warm_start.sft_steps=0"
    if cfg.algorithm.name == "sft" and cfg.data.pack:
        return "data.pack", "data.pack=false"
    return None, ""


def _validate_context_parallel(p: PolicyConfig, experts: int) -> None:
    """rlkit's context-parallel attention is SDPAttention's (rlkit/bridge/context_parallel.py);
    with MoE layers it is untested, so refused rather than trusted."""
    cp = p.context_parallel_size
    if cp == 1:
        return
    if p.attention_backend != "sdpa":
        raise ConfigError(f"policy.context_parallel_size: context parallelism needs policy.attention_backend=sdpa "
                          f"(got: {p.attention_backend!r} with context_parallel_size={cp}); set "
                          f"policy.attention_backend=sdpa or policy.context_parallel_size=1")
    if experts:
        raise ConfigError(f"policy.context_parallel_size: {p.model_path} is an MoE model, which rlkit does not "
                          f"train with context parallelism yet (got: {cp}); set policy.context_parallel_size=1")


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
