"""`rlkit eval`: score a model on held-out prompts with an environment's reward. Greedy accuracy,
and with --n samples per prompt pass@k (rlkit/observability/evaluation.py); mean reward and
response length of each. Generation and scoring are a run's own: its generation workers (vLLM
on GPU, HF on CPU), its episodes and its environment workers, as in validation.

What is scored: an HF model directory (config.json), with a recipe for everything but the
model; or an rlkit checkpoint (outputs/<run>/checkpoints/step_NNNNNN, either save format, or a
policy.peft run's adapters), whose policy is rebuilt as its run had it (its config.yaml) and
loads the checkpoint. Either way the policy's weights reach the generation workers by a refit,
as in a run: nothing is written to disk. The rows are the data section's validation split, or
the rows of --data FILE.

Everything the user gave is checked here before any worker starts (plan_eval); Ray and torch
are imported only by evaluate(), so the CLI's errors come at once."""

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import OmegaConf

from rlkit.algorithms.registry import load_algorithm
from rlkit.checkpoint import verify
from rlkit.config.schema import ConfigError, RootConfig
from rlkit.data.files import missing_file
from rlkit.launch.config import RECIPES_DIR, compose_recipe, load_config, to_typed, validate
from rlkit.observability.evaluation import mean_pass_at_k, parse_ks
from rlkit.workers.policy.adapter_base import restored_base

log = logging.getLogger("rlkit")


@dataclass(frozen=True)
class EvalPlan:
    """An evaluation, checked: what to load, on which rows, and where the report goes."""
    cfg: RootConfig  # the recipe's data, env, generation and cluster; the checkpoint's policy and refit
    model: Path  # what the user named
    model_dir: Path  # the HF directory the workers load (a checkpoint's base)
    checkpoint: Path | None  # restored over model_dir and refit into the generation workers
    n: int | None  # samples per prompt for pass@k; None: greedy only
    ks: list[int]
    out: Path


def plan_eval(model: str, recipe: str | None, overrides: list[str], n: int | None, ks: str | None,
              data_file: str | None, out: str | None, recipes_dir: Path = RECIPES_DIR) -> EvalPlan:
    """The evaluation the CLI's arguments ask for, or a ConfigError naming the argument at fault."""
    path = Path(model).expanduser().absolute()
    if not path.exists():
        raise ConfigError(f"model: {model} does not exist; give an HF model directory or a checkpoint "
                          f"(outputs/<run>/checkpoints/step_NNNNNN)")
    if n is not None and n < 1:
        raise ConfigError(f"--n: samples per prompt must be >= 1 (got: {n})")
    if ks is not None and n is None:
        raise ConfigError(f"--k: pass@k needs samples: add --n (e.g. --n 8 --k {ks})")
    try:
        k_list = parse_ks(ks or f"1,{n}", n) if n is not None else []
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if (path / "config.yaml").is_file() and (path / "policy").is_dir():
        cfg, model_dir = _checkpoint_config(path, recipe, overrides, recipes_dir)
        checkpoint = path
    elif (path / "config.json").is_file():
        if recipe is None:
            raise ConfigError(f"--config-name: {model} is an HF model, so a recipe must say how to prompt and score "
                              f"it (data, env, generation); add e.g. --config-name grpo_tiny_cpu")
        cfg, _ = load_config(recipe, [*overrides, f"policy.model_path={path}"], recipes_dir)
        model_dir, checkpoint = path, None
    elif (path / "checkpoints").is_dir():
        raise ConfigError(f"model: {model} is a run's folder; name one of its checkpoints, e.g. "
                          f"{model}/checkpoints/step_NNNNNN")
    else:
        raise ConfigError(f"model: {model} is neither an HF model directory (config.json) nor an rlkit checkpoint "
                          f"(config.yaml and policy/, as in outputs/<run>/checkpoints/step_NNNNNN)")
    if not load_algorithm(cfg.algorithm.name).rollouts:
        raise ConfigError(f"algorithm.name: {cfg.algorithm.name} generates nothing, so its config has no generation "
                          f"or env settings to evaluate with; add --config-name <an RL recipe>, e.g. grpo_tiny_cpu")
    cfg = _with_rows(cfg, data_file)
    return EvalPlan(cfg, path, model_dir, checkpoint, n, k_list, _report_path(path, out))


def _checkpoint_config(checkpoint: Path, recipe: str | None, overrides: list[str],
                       recipes_dir: Path) -> tuple[RootConfig, Path]:
    """The config to evaluate a checkpoint with: its run's, or with --config-name the recipe's
    with the checkpoint's policy and refit sections (the model and how it reaches the engines);
    and the HF directory its policy is restored over."""
    problem = verify(checkpoint)  # every file's checksum: a damaged weight would only lower the scores
    if problem is not None:
        raise ConfigError(f"model: the checkpoint {checkpoint} is damaged: {problem}; evaluate another one")
    saved = OmegaConf.load(checkpoint / "config.yaml")
    if load_algorithm(saved.algorithm.name).head != "lm":
        raise ConfigError(f"model: {checkpoint} holds a reward model (algorithm {saved.algorithm.name}), which scores "
                          f"answers and writes none; export it with rlkit convert and score with it (env=reward_model)")
    if recipe is None:
        groups = [o for o in overrides if "." not in o.partition("=")[0]]
        if groups:
            raise ConfigError(f"{groups[0]}: choosing a config group needs a recipe to compose; add --config-name "
                              f"<recipe> (the checkpoint's model is kept)")
        raw = OmegaConf.merge(saved, OmegaConf.from_dotlist(overrides))
    else:
        raw = compose_recipe(recipe, overrides, recipes_dir)
        raw.policy = saved.policy
        if saved.get("refit") is not None:  # an SFT or DPO run has none: the recipe's then
            raw.refit = saved.refit
    raw.checkpoint.resume = "none"  # a resumed run's config names a checkpoint this evaluation does not read
    cfg = to_typed(raw)
    validate(cfg)
    return cfg, restored_base(checkpoint, to_typed(saved), "model")


def _with_rows(cfg: RootConfig, data_file: str | None) -> RootConfig:
    """cfg whose validation split is the rows to score: the data section's, or --data's file
    (read as the data section reads files: data.prompt_field, data.answer_field, its template)."""
    if data_file is None:
        if cfg.data.val_path is None:
            raise ConfigError("data.val_path: null, so there are no held-out rows to score; set data.val_path, "
                              "pick a data preset with data=<name>, or give a file with --data")
        return cfg
    missing = missing_file(data_file)
    if missing:
        raise ConfigError(f"--data: {missing}")
    # no training rows to load; data.val_size still limits the rows scored
    return replace(cfg, data=replace(cfg.data, train_path=None, val_path=data_file, synthetic=None))


def _report_path(model: Path, out: str | None) -> Path:
    """--out, which must not exist yet; else beside the model, <name>.eval.json or the first free
    <name>.eval-<i>.json. The folder is probed for writing now, before any worker starts."""
    if out is not None:
        path = Path(out).expanduser().absolute()
        if path.exists():
            raise ConfigError(f"--out: {out} exists, and rlkit never overwrites a file; give a new path")
        if not path.parent.is_dir():
            raise ConfigError(f"--out: the folder {path.parent} does not exist; create it or give another path")
    else:
        names = (f"{model.name}.eval{'' if i == 1 else f'-{i}'}.json" for i in range(1, 10_000))
        path = next(model.parent / name for name in names if not (model.parent / name).exists())
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--out: cannot write to {path.parent} ({e.strerror}); give a path in a folder you can "
                          f"write to") from None
    return path


def write_report(report: dict, path: Path) -> None:
    """The report as JSON at path, whole or not at all; never over a file (one made since the
    plan was checked is an error)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        os.link(tmp, path)  # unlike a rename, fails if path exists
    except FileExistsError:
        raise ConfigError(f"--out: {path} was created while the evaluation ran, and rlkit never overwrites a file; "
                          f"the report is not written: rerun with another --out") from None
    finally:
        os.remove(tmp)


def evaluate(plan: EvalPlan, pool=None) -> dict:
    """Score plan's model: greedy answers to every row, and with plan.n that many samples of each
    (the recipe's generation.temperature, top_p, top_k) for pass@k. pool: worker processes to take
    instead of new ones (CPU; rlkit/cluster/warm_pool.py). Returns the report."""
    from rlkit.algorithms.episodes import run_episodes
    from rlkit.algorithms.policy_gradient import load_prompts, prompt_renderer
    from rlkit.cluster.refit_driver import RefitDriver
    from rlkit.cluster.setup import start_workers
    from rlkit.data.generation import SamplingParams
    from rlkit.envs.runner import EnvironmentPool
    from rlkit.launch.preflight import check_prompts
    from rlkit.launch.run import failing
    from rlkit.models.tokenizer import load_tokenizer

    started, cfg, g = time.perf_counter(), plan.cfg, plan.cfg.generation
    tokenizer = load_tokenizer(plan.model_dir)
    data = load_prompts(cfg, tokenizer)  # bad rows stop here, before any worker starts
    check_prompts(cfg, data, tokenizer)
    renderer = prompt_renderer(cfg, tokenizer)
    sampling = SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k, cfg.run.seed, g.ignore_eos)
    workers = start_workers(cfg, str(plan.model_dir), pool=pool)
    envs = None
    try:
        sleepers = [workers.policy] if cfg.cluster.placement == "colocated" else []
        refit = RefitDriver(cfg, workers.policy, workers.generation, workers.placement_group, sleepers)
        if plan.checkpoint is not None:
            workers.policy.load_checkpoint(str(plan.checkpoint), cfg.checkpoint.save_format)
        refit.sync()  # the engines get their weights from the policy, whatever it loaded
        envs = EnvironmentPool(cfg.env, cfg.env_runner)

        def scored(params: SamplingParams, samples: int):
            return run_episodes(data.val, renderer, workers.generation, envs, params, cfg.env_runner,
                                samples_per_prompt=samples)

        log.info("eval: greedy answers to %d prompts", len(data.val))
        greedy = scored(replace(sampling, temperature=0.0), 1)
        report = {"model": str(plan.model), "step": _step(plan.checkpoint), "prompts": len(data.val),
                  "data": cfg.data.val_path, "env": cfg.env["_target_"], "generation": g.backend,
                  "greedy": _figures(greedy.summary("greedy"), "greedy")}
        if plan.n is not None:
            log.info("eval: sampling each prompt --n %d times at temperature %g", plan.n, g.temperature)
            sampled = scored(sampling, plan.n)
            verdicts = (sampled.correct == 1).view(len(data.val), plan.n).tolist()  # no verdict: not correct
            report["sampled"] = {"n": plan.n, "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
                                 **{f"pass@{k}": mean_pass_at_k(verdicts, k) for k in plan.ks},
                                 **_figures(sampled.summary("sampled"), "sampled")}
    finally:
        if envs is not None:
            envs.shutdown()
        workers.shutdown(failed=failing())
    report["seconds"] = time.perf_counter() - started
    return report


def _figures(summary: dict, split: str) -> dict:
    """An Episodes summary's figures under short names; accuracy None where no episode got a verdict."""
    return {"accuracy": summary.get(f"{split}/accuracy"), "scored": summary.get(f"{split}/accuracy_scored", 0),
            "reward": summary[f"{split}/reward"], "response_length": summary[f"{split}/response_length"],
            "env_failures": summary["env/failures"]}


def _step(checkpoint: Path | None) -> int | None:
    return int(checkpoint.name.removeprefix("step_")) if checkpoint is not None and \
        checkpoint.name.startswith("step_") else None
