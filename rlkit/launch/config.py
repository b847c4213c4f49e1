"""Compose a recipe with Hydra, check it against the schema, then check cross-key consistency:
what every run needs, what runs with rollouts need, then the algorithm's own checks (its spec),
then that the run's directories can be written, and last that the run can do something at all
(rlkit/launch/preflight.py). Every problem is one ConfigError line: `key: problem (got: value); fix`.

Nothing here imports torch, Ray or Megatron, nor may anything it imports (the algorithm modules
included): the CLI's help texts and config errors come from here, in well under a second
(benchmarks/cli_latency.py; tests/unit/test_cli_startup.py holds it to that)."""

import difflib
import importlib.util
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

from rlkit.algorithms.lr_schedule import SCHEDULES, check_learning_rate
from rlkit.algorithms.registry import load_algorithm
from rlkit.bridge.base import ATTENTION_BACKENDS, BRIDGES, check_bridge_supports, check_transformer_engine_layout
from rlkit.bridge.adapters import check_init_from, check_peft
from rlkit.checkpoint import named_checkpoint
from rlkit.cluster.placement import PLACEMENTS
from rlkit.config.choices import BROADCAST_GROUPS, FLOWS, OFFLOAD_MODES, PEFT_MODES, TOOL_PROMPTS
from rlkit.config.schema import (DATASETS, ConfigError, FileDataConfig, PolicyConfig, PromptDataConfig, RootConfig,
                                 check_finite)
from rlkit.envs.base import check_environment_config
from rlkit.launch.preflight import check_config
from rlkit.models.tiny import ARCHITECTURES, TINY_EXPERTS, TINY_HEADS, parse_tiny
from rlkit.refit.transport import check_refit

REPO_ROOT = Path(__file__).resolve().parents[2]
# data.name -> config groups of that kind, for error messages
DATA_GROUPS = {"prompts": "data=arithmetic, gsm8k, math, word_problems or prompt_files",
               "sft_files": "data=arithmetic_sft", "preference_files": "data=arithmetic_preferences"}
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


def _choice(key: str, value, choices):
    if value not in choices:
        raise ConfigError(f"{key}: must be one of {list(choices)} (got: {value!r}); pick one of those")


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


def _positive(*pairs):
    for key, value in pairs:
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1 (got: {value}); set a positive value")


def validate(cfg: RootConfig) -> None:
    """Cross-key checks: what every run needs, what rollouts need, then the algorithm's own."""
    p, a = cfg.policy, cfg.algorithm
    algorithm = load_algorithm(a.name)
    _choice("cluster.placement", cfg.cluster.placement, PLACEMENTS)
    _choice("policy.precision", p.precision, ("fp32", "bf16"))
    _choice("policy.attention_backend", p.attention_backend, ATTENTION_BACKENDS)
    _choice("policy.bridge", p.bridge, BRIDGES)
    if algorithm.rollouts:
        _validate_rollout_choices(cfg)
    if cfg.data.name != algorithm.data:
        raise ConfigError(f"data.name: algorithm {a.name} trains on data of kind {algorithm.data!r} (got: "
                          f"{cfg.data.name!r}); select a group of that kind: {DATA_GROUPS[algorithm.data]}")
    if cfg.data.name == "prompts":
        _validate_prompts(cfg.data)
    if cfg.data.synthetic is not None:
        _validate_synthetic(cfg.data)
    arch = parse_tiny(p.model_path)
    if p.model_path.startswith("tiny://") and arch not in ARCHITECTURES:
        raise ConfigError(f"policy.model_path: tiny model '{p.model_path}' is unknown; use one of "
                          f"{['tiny://' + x for x in ARCHITECTURES]}")
    _positive(("policy.num_workers", p.num_workers), ("policy.tensor_parallel_size", p.tensor_parallel_size),
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
    _choice("policy.offload", p.offload, OFFLOAD_MODES)
    if p.max_tokens_per_microbatch < 0:
        raise ConfigError(f"policy.max_tokens_per_microbatch: must be >= 0 (got: {p.max_tokens_per_microbatch}); "
                          f"0 turns the token budget off")
    o = p.optimizer
    _choice("policy.optimizer.lr_schedule", o.lr_schedule, SCHEDULES)
    check_learning_rate("policy.optimizer.lr", o.lr, "1e-6")
    if o.warmup_steps < 0:
        raise ConfigError(f"policy.optimizer.warmup_steps: must be >= 0 (got: {o.warmup_steps}); 0 for no warmup")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"policy.optimizer.min_lr_ratio: must lie in [0, 1] (got: {o.min_lr_ratio}); e.g. 0.1")
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
        _validate_vllm(cfg)
        check_refit(cfg)
        _validate_adapter_refit(cfg)
    _choice("checkpoint.save_format", cfg.checkpoint.save_format, ("dist", "hf"))
    if cfg.checkpoint.save_format == "hf" and p.use_distributed_optimizer:
        raise ConfigError("checkpoint.save_format: hf keeps per-rank optimizer state, which the distributed optimizer "
                          "does not expose that way, so a resume would restore stale weights; use "
                          "checkpoint.save_format=dist (or policy.use_distributed_optimizer=false)")
    if cfg.checkpoint.save_format == "hf" and p.peft is not None:
        raise ConfigError("checkpoint.save_format: hf saves the policy with its adapters merged into the weights, "
                          "which a resume would load as the base under the adapters again; use "
                          "checkpoint.save_format=dist with policy.peft")
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep_last < 0:
        raise ConfigError(f"checkpoint.every / checkpoint.keep_last: must be >= 0 (got: {cfg.checkpoint.every}, "
                          f"{cfg.checkpoint.keep_last}); 0 means only at the end / keep all")
    cfg.cluster.check_timeouts()
    cfg.checkpoint.check_timeouts()
    if cfg.checkpoint.resume not in ("auto", "none"):
        named_checkpoint(cfg.checkpoint.resume)
    if algorithm.rollouts:
        _validate_environment(cfg)
    # last: the only checks that touch the disk, so a config with other mistakes creates no directories
    for key, path in [("run.output_dir", cfg.run.output_dir), ("run.cache_dir", cfg.run.cache_dir),
                      ("checkpoint.dir", cfg.checkpoint.dir)]:
        if path is not None:
            _writable_dir(key, path)
    check_config(cfg)  # that the run can do something at all (rlkit/launch/preflight.py)


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


def _validate_prompts(d: PromptDataConfig) -> None:
    try:
        d.prompt_format.format(prompt="")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"data.prompt_format: must be a template with {{prompt}} and no other fields (got: "
                          f"{d.prompt_format!r}: {type(e).__name__} {e}); write literal braces as {{{{ }}}}") from None
    if "{prompt}" not in d.prompt_format:
        raise ConfigError(f"data.prompt_format: must contain {{prompt}} (got: {d.prompt_format!r})")
    if d.system_prompt is not None and not d.chat_template:
        raise ConfigError("data.system_prompt: needs data.chat_template=true (raw prompts have no system turn); "
                          "set data.system_prompt=null or data.chat_template=true")
    _positive(("data.max_prompt_tokens", d.max_prompt_tokens), *([("data.val_size", d.val_size)] if d.val_size else []))
    _choice("data.tool_prompt", d.tool_prompt, TOOL_PROMPTS)
    if d.val_size == 0:
        raise ConfigError("data.val_size: must be >= 1 or null (all rows) (got: 0); to skip validation set "
                          "data.val_path=null")


def _validate_synthetic(d: PromptDataConfig | FileDataConfig) -> None:
    """data.synthetic: the sizes. The generator's own checks (kind, operations, enough distinct
    problems for the sizes) run when preflight generates the set to check where it goes."""
    s = d.synthetic
    _positive(("data.synthetic.train_size", s.train_size), ("data.synthetic.max_operand", s.max_operand))
    if s.val_size < 0:
        raise ConfigError(f"data.synthetic.val_size: must be >= 0 (got: {s.val_size}); set a count of problems")
    if s.val_size == 0 and d.val_path is not None:
        raise ConfigError("data.synthetic.val_size: must be >= 1 while data.val_path is set (got: 0); to skip "
                          "validation set data.val_path=null")


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


def _validate_rollout_choices(cfg: RootConfig) -> None:
    for section in ("generation", "refit", "env", "env_runner"):
        if getattr(cfg, section) is None:
            raise ConfigError(f"{section}: algorithm {cfg.algorithm.name} generates rollouts and needs this "
                              f"section; add /{section} to the recipe's defaults (see recipes/grpo_tiny_cpu.yaml)")
    _choice("generation.precision", cfg.generation.precision, ("fp32", "bf16"))
    _choice("generation.backend", cfg.generation.backend, ("hf", "vllm"))
    _choice("refit.channel_host", cfg.refit.channel_host, ("loopback", "node_ip"))
    _choice("refit.peft", cfg.refit.peft, PEFT_MODES)
    _choice("refit.broadcast_groups", cfg.refit.broadcast_groups, BROADCAST_GROUPS)
    r = cfg.env_runner  # before the algorithm's checks, which compute the response budget from these
    _positive(("env_runner.num_workers", r.num_workers), ("env_runner.max_turns", r.max_turns),
              ("env_runner.max_total_tokens", r.max_total_tokens))
    _choice("env_runner.flow", r.flow, FLOWS)
    if r.max_tool_seconds < 0:
        raise ConfigError(f"env_runner.max_tool_seconds: must be >= 0 (got: {r.max_tool_seconds}); give seconds, "
                          f"or 0 for no limit")


def _validate_engine_parallel(cfg: RootConfig) -> None:
    """A vLLM engine of several GPUs splits the model's heads as the policy's TP does."""
    tp = cfg.generation.vllm.tensor_parallel_size
    _positive(("generation.vllm.tensor_parallel_size", tp))
    heads = _model_shape(cfg.policy.model_path, cfg.policy.tiny_model.num_layers).heads
    if heads % tp:
        raise ConfigError(f"generation.vllm.tensor_parallel_size: must divide the model's {heads} attention heads "
                          f"(got: {tp}); pick a divisor of {heads}")


def _validate_vllm(cfg: RootConfig) -> None:
    if cfg.generation.backend != "vllm":
        return
    if cfg.generation.vllm is None:
        raise ConfigError("generation.vllm: the vllm backend needs engine settings; use generation=vllm")
    _validate_engine_parallel(cfg)


def _validate_adapter_refit(cfg: RootConfig) -> None:
    """refit.peft=adapter moves policy.peft's adapters, which the HF workers apply with HF peft."""
    if cfg.refit.peft != "adapter":
        return
    if cfg.policy.peft is None:
        raise ConfigError("refit.peft: adapter sends the policy's LoRA adapters alone, and policy.peft is null (the "
                          "policy trains every weight); set refit.peft=merged, or set policy.peft (README \"LoRA\")")
    if cfg.generation.backend == "hf" and importlib.util.find_spec("peft") is None:
        raise ConfigError("refit.peft: adapter on generation.backend=hf applies the adapters with HF peft, which is "
                          "not installed; pip install 'peft>=0.18,<0.19', or set refit.peft=merged")


def _validate_environment(cfg: RootConfig) -> None:
    if "_target_" not in cfg.env:
        raise ConfigError("env._target_: no environment set; give an importable Environment class or scoring "
                          "function, e.g. env._target_=rlkit.envs.arithmetic.ArithmeticEnv")
    problem = check_environment_config(cfg.env["_target_"], {k: v for k, v in cfg.env.items() if k != "_target_"})
    if problem:
        raise ConfigError(problem)
    r = cfg.env_runner
    if r.timeout_s <= 0:
        raise ConfigError(f"env_runner.timeout_s: must be > 0 (got: {r.timeout_s}); set a positive number of seconds")
    if "{observation}" not in r.observation_format:
        raise ConfigError(f"env_runner.observation_format: must contain {{observation}} (got: {r.observation_format!r})")


def load_config(name: str, overrides: list[str], recipes_dir: Path = RECIPES_DIR) -> tuple[RootConfig, DictConfig]:
    """Returns the typed, validated config and the resolved DictConfig (for printing/logging)."""
    raw = compose_recipe(name, overrides, recipes_dir)
    typed = to_typed(raw)
    validate(typed)
    return typed, raw
