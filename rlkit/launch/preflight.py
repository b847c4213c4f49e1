"""Checks that a run can do something at all, before any worker starts.

A run that cannot work is a ConfigError; one that looks pointless but may be meant is a warning
in its first lines. With the config (check_config, the last step of validation): each split comes
from where the run says and is the run's own, generated data must not land on a user's file,
async rollouts must ever see new weights, the learning rate should get out of its warmup. Before
Ray starts (check_generation_backend): vLLM is there to run the engines. On resume
(check_resumed_schedule): an async run keeps its schedule. Once the prompts are loaded
(check_prompts): every row holds what the environment reads, and a correct answer fits the token
budget.
"""

import importlib.util
import inspect
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from rlkit.algorithms.registry import load_algorithm
from rlkit.config.schema import ConfigError, RootConfig
from rlkit.data.files import foreign_file, is_local, missing_file
from rlkit.data.synthetic import generated_sets, refused
from rlkit.envs.base import Environment, import_target, load_environment
from rlkit.envs.tools import ToolDefinitionError, ToolEnvironment

if TYPE_CHECKING:  # torch and Ray: check_config runs as a config loads
    from rlkit.algorithms.loop import TrainingData

log = logging.getLogger("rlkit")


def check_config(cfg: RootConfig) -> None:
    """The checks of a whole config (the last step of its validation)."""
    rollouts = load_algorithm(cfg.algorithm.name).rollouts
    _check_data_paths(cfg)
    if rollouts and cfg.algorithm.max_staleness >= cfg.algorithm.num_steps:
        a = cfg.algorithm
        raise ConfigError(f"algorithm.max_staleness: must be below algorithm.num_steps, or every rollout comes from "
                          f"the starting weights and the engines never get new ones (got: {a.max_staleness} with "
                          f"num_steps={a.num_steps}); use at most {a.num_steps - 1}, or 0 for on-policy rollouts")
    _warn_long_warmup(cfg, rollouts)
    _warn_model_reward_timeouts(cfg)


def _warn_model_reward_timeouts(cfg: RootConfig) -> None:
    """A model reward's own request limit (env.timeout_s, or a combined part's) at or above the
    runner's step limit: a slow model then times out the whole step (env/timeouts, its worker
    replaced) before its own limit reports which model was slow, so say so in the run's first lines."""
    env = cfg.env or {}
    limits = {"env.timeout_s": env.get("timeout_s")}
    parts = env.get("parts") or {}
    limits.update({f"env.parts.{name}.timeout_s": part.get("timeout_s") for name, part in parts.items()
                   if isinstance(part, dict)})
    for key, seconds in limits.items():
        if isinstance(seconds, (int, float)) and seconds >= cfg.env_runner.timeout_s:
            log.warning("%s: %gs is not below env_runner.timeout_s (%gs): a slow model times out its whole step "
                        "(env/timeouts, its worker replaced) before its own limit names it; set %s well below "
                        "env_runner.timeout_s", key, seconds, cfg.env_runner.timeout_s, key)


def _check_data_paths(cfg: RootConfig) -> None:
    """At once (the files are read only once the tokenizer has loaded and Ray has started): each
    split comes from where this run says, and is this run's own."""
    d = cfg.data
    if d.val_path is None:
        log.info("data.val_path=null: validation is skipped (before training, every algorithm.val_every steps and at "
                 "the last step)")
    elif d.val_path == d.train_path and (d.synthetic is not None or _is_file(d.train_path)):
        overwrite = ", and the generated validation rows would overwrite the training rows" if d.synthetic else ""
        raise ConfigError(f"data.val_path: is data.train_path ({d.train_path}), so validation would score the "
                          f"training rows{overwrite}; give a separate validation file, or data.val_path=null to skip "
                          f"validation")
    if d.synthetic is not None:
        _check_generated_data(cfg)
        return
    cache = Path(cfg.run.cache_dir).resolve()
    for key, path in [("data.train_path", d.train_path), ("data.val_path", d.val_path)]:
        if path is None:
            continue
        if is_local(path) and Path(path).expanduser().resolve().is_relative_to(cache):
            # a recipe's default path of a generated set: another run's, with whatever it generated
            raise ConfigError(f"{key}: {path} lies in run.cache_dir ({cfg.run.cache_dir}), where runs with "
                              f"data.synthetic write their generated sets, and this run generates none "
                              f"(data.synthetic=null); give your own file"
                              + (", or data.val_path=null to skip validation" if key == "data.val_path" else ""))
        missing = missing_file(path)
        if missing:
            raise ConfigError(f"{key}: {missing}")
    if d.val_path is not None and is_local(d.train_path) and not is_local(d.val_path):
        raise ConfigError(f"data.val_path: {d.val_path} is a hub dataset, while data.train_path is the local "
                          f"{d.train_path}; set data.val_path to a local validation file, or null to skip validation")


def _is_file(source: str) -> bool:
    """A local file, read whole: not a hub dataset or a dataset folder, which have a split each."""
    return is_local(source) and not Path(source).expanduser().is_dir()


def _check_generated_data(cfg: RootConfig) -> None:
    """data.synthetic writes its set to the data paths: only inside run.cache_dir, and never over
    a file rlkit did not write. A path of the user's own with data.synthetic still set used to
    have the generated set written over it, and trained on."""
    cache = Path(cfg.run.cache_dir).resolve()
    for key, path, records in generated_sets(cfg.data):
        if not Path(path).resolve().is_relative_to(cache):
            raise ConfigError(f"{key} / data.synthetic: {key}={path} lies outside run.cache_dir ({cfg.run.cache_dir}), "
                              f"so it is not where data.synthetic writes its generated set; set data.synthetic=null "
                              f"to train on {path}, or leave {key} at its default to train on the generated set")
        problem = foreign_file(path, records)
        if problem:
            raise ConfigError(refused(key, problem))


def _warn_long_warmup(cfg: RootConfig, rollouts: bool) -> None:
    """A warmup longer than the run trains it at a fraction of the learning rate throughout."""
    o, a = cfg.policy.optimizer, cfg.algorithm
    # RL: an optimizer step per mini-batch of the rollout; SFT and DPO: one per step
    per_step = a.prompts_per_step * a.group_size // cfg.policy.train_global_batch_size if rollouts else 1
    total = a.num_steps * per_step
    if o.warmup_steps > total:
        count = f"algorithm.num_steps={a.num_steps}" + (f" x {per_step} mini-batches per step" if per_step > 1 else "")
        log.warning("policy.optimizer.warmup_steps=%d is longer than the run's %d optimizer steps (%s): the learning "
                    "rate never gets past %d/%d of policy.optimizer.lr=%g; lower warmup_steps well below %d, or "
                    "raise algorithm.num_steps", o.warmup_steps, total, count, total, o.warmup_steps, o.lr, total)


def check_generation_backend(cfg: RootConfig) -> None:
    """Before Ray starts: generation.backend=vllm needs vLLM where the run starts its engines (a
    run joining a cluster starts them on its machines). Without it, the run used to fail once its
    workers had started, in a 153-line traceback ending in No module named 'vllm'."""
    g = cfg.generation
    if g is None or g.backend != "vllm" or cfg.cluster.address_to_join() is not None:
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("generation.backend: vllm is not installed on this machine (no module 'vllm'); its engines "
                          "run on NVIDIA GPUs: on a CPU machine use generation=hf refit=cpu, on a GPU machine pip "
                          "install vllm")


def check_resumed_schedule(cfg: RootConfig, saved: DictConfig, checkpoint_dir: Path) -> None:
    """An async run (algorithm.max_staleness > 0) resumes only with the max_staleness and
    num_steps it was saved with: they fix which weights generate each step and which rollouts the
    checkpoint holds, so other values would quietly train on another schedule."""
    if not load_algorithm(cfg.algorithm.name).rollouts:
        return
    saved_staleness = saved.algorithm.get("max_staleness", 0)  # absent: saved before async rollouts existed
    staleness = cfg.algorithm.max_staleness
    if saved_staleness == staleness == 0:
        return
    for key, before, now in [("algorithm.max_staleness", saved_staleness, staleness),
                             ("algorithm.num_steps", saved.algorithm.num_steps, cfg.algorithm.num_steps)]:
        if before != now:
            raise ConfigError(f"{key}: {checkpoint_dir} was saved with {key}={before} and this run asks for {now}; "
                              f"with async rollouts that changes the schedule mid-run (which weights generate each "
                              f"step, and the rollouts the checkpoint holds); resume with {key}={before}, or start a "
                              f"fresh run (another run.name, or checkpoint.resume=none)")


def check_prompts(cfg: RootConfig, data: "TrainingData", tokenizer) -> None:
    """RL, once the prompts are loaded: every row holds the fields the environment reads, and the
    token budget of a response can hold the environment's correct answers."""
    env = import_target(cfg.env["_target_"])
    if not (inspect.isclass(env) and issubclass(env, Environment)):
        return  # a scoring function declares nothing
    for key, path, prompts in [("data.train_path", cfg.data.train_path, data.train),
                               ("data.val_path", cfg.data.val_path, data.val)]:
        for field in env.metadata_fields:
            missing = [p for p in prompts if p.metadata.get(field) is None]
            if missing:
                raise ConfigError(f"{key}: {len(missing)} of the {len(prompts)} rows of {path} have no field "
                                  f"'{field}', which env._target_={cfg.env['_target_']} reads from every row (e.g. "
                                  f"the row of prompt {missing[0].messages[-1]['content']!r:.80}); add '{field}' "
                                  f"to every row, or select the environment this data is for")
    _check_answer_budget(cfg, data.train, env, tokenizer)
    if issubclass(env, ToolEnvironment):
        _check_tool_budgets(cfg, tokenizer)


def _check_tool_budgets(cfg: RootConfig, tokenizer) -> None:
    """A tool call cut off at the token budget is answered with an error (tools/partial), and one
    the episode has no turn left to follow up is wasted: where no call fits, the model can earn
    only by answering without tools, so say so in the run's first lines. So too where a hung
    tool would time out its whole step before its own limit stops it."""
    g, r = cfg.generation, cfg.env_runner
    env = load_environment(cfg.env["_target_"], {k: v for k, v in cfg.env.items() if k != "_target_"})
    try:
        call = env.shortest_tool_call()  # builds the toolbox: the tools' schemas, not read with the config
    except ToolDefinitionError as e:
        raise ConfigError(f"env._target_: {cfg.env['_target_']}.{e.attribute}: {e}") from None
    if call is not None:
        tokens = len(tokenizer(call, add_special_tokens=False)["input_ids"])
        key, budget = min(("generation.max_new_tokens", g.max_new_tokens),
                          ("env_runner.max_total_tokens", r.max_total_tokens), key=lambda kv: kv[1])
        if budget < tokens:
            log.warning("%s: %d tokens cannot hold even the shortest tool call of env._target_=%s (%r: %d tokens): "
                        "every call is cut off and answered with an error (tools/partial), so only answers without "
                        "tools can earn a reward; raise %s to at least %d, with room for the answer after it", key,
                        budget, cfg.env["_target_"], call, tokens, key, tokens)
    if r.max_turns < 2:
        log.warning("env_runner.max_turns: %d turn leaves none to answer after a tool call of env._target_=%s, so "
                    "a call earns nothing; set env_runner.max_turns to at least 2", r.max_turns, cfg.env["_target_"])
    if env.tool_timeout_s >= r.timeout_s:
        log.warning("env_runner.timeout_s: %gs is not above the tool time limit of env._target_=%s (%gs): a hung "
                    "tool times out its whole step (env/timeouts, its worker replaced) before its own limit stops "
                    "it (tools/timeout); set env.tool_timeout_s well below env_runner.timeout_s", r.timeout_s,
                    cfg.env["_target_"], env.tool_timeout_s)


def _check_answer_budget(cfg: RootConfig, prompts: list, env: type[Environment], tokenizer) -> None:
    """A response is cut at its token budget: where not even the environment's shortest correct
    answer fits, every reward is 0 (an error when that holds for every row, a warning for some)."""
    answers = [answer for p in prompts if (answer := env.reference_response(p.metadata)) is not None]
    if not answers:
        return
    g, r = cfg.generation, cfg.env_runner
    key, budget = ("generation.max_new_tokens", g.max_new_tokens) if g.max_new_tokens <= r.max_total_tokens \
        else ("env_runner.max_total_tokens", r.max_total_tokens)
    lengths = [len(ids) for ids in tokenizer(answers, add_special_tokens=False)["input_ids"]]
    over = [(n, answer) for n, answer in zip(lengths, answers) if n > budget]
    if not over:
        return
    longest, example = max(over)
    problem = (f"{key}: {budget} tokens cannot hold the shortest correct answer to {len(over)} of the {len(answers)} "
               f"training prompts of {cfg.data.train_path} (in the form env._target_={cfg.env['_target_']} reads, "
               f"e.g. {example!r}: {longest} tokens)")
    fix = f"raise {key} to at least {longest}, with room for any reasoning before the answer"
    if len(over) == len(answers):
        raise ConfigError(f"{problem}, so every reward would be 0; {fix}")
    log.warning("%s: those can never be rewarded; %s", problem, fix)
