"""The one launch path every run takes, whatever its algorithm: run directory, checkpoints and
resume, model and tokenizer, data, workers, an optional cached warm start, the trainer, the loop,
and cleanup. Also the two other commands that start workers: verify-refit and convert."""

import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlkit.algorithms.loop import RunContext, RunResult, RunStopped, run_steps
from rlkit.algorithms.registry import load_algorithm
from rlkit.algorithms.warm_start import cached_warm_start, warm_start_dir
from rlkit.checkpoint import CheckpointManager
from rlkit.cluster.fork_server import ForkServer
from rlkit.cluster.ray_runtime import join_or_start_ray, stop_local_ray
from rlkit.cluster.setup import start_workers
from rlkit.cluster.warm_pool import WarmPool
from rlkit.config.schema import ConfigError, RootConfig
from rlkit.data.batch import rollout_batch
from rlkit.data.generation import SamplingParams
from rlkit.data.stream import ShuffledStream
from rlkit.launch.interrupts import stop_on_signals
from rlkit.launch.preflight import check_generation_backend, check_prompts, check_resumed_schedule
from rlkit.launch.resume_drift import check_resume_drift
from rlkit.models.resolve import resolve_model_dir
from rlkit.models.tokenizer import load_tokenizer
from rlkit.observability.logprob_agreement import logprob_error
from rlkit.observability.metrics import MetricsLogger, read_history
from rlkit.observability.startup import StartupClock
from rlkit.cluster.refit_driver import RefitDriver
from rlkit.workers.policy.adapter_base import check_base

log = logging.getLogger("rlkit")


def train(cfg: RootConfig, resolved: DictConfig, clock: StartupClock | None = None,
          pool: WarmPool | None = None, fork_server: ForkServer | None = None) -> RunResult:
    """Train cfg.algorithm.name; returns the run's metrics history and folder. clock: where the
    start-up's phases are timed (default: from this call). pool: worker processes kept between the
    runs of this process (CPU), instead of new ones. fork_server: the command's, started as it
    began (fork_server.start_ahead), for the local cluster this run starts."""
    clock = clock or StartupClock()
    algorithm = load_algorithm(cfg.algorithm.name)
    check_generation_backend(cfg)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    checkpoints = CheckpointManager(cfg.checkpoint, run_dir)
    resume_from = checkpoints.to_resume()
    state_step = CheckpointManager.controller_state(resume_from)["step"] if resume_from else None
    changed = ""
    if resume_from is not None:
        saved = OmegaConf.load(resume_from / "config.yaml")
        check_expert_layout(cfg, saved, resume_from)
        check_resumed_schedule(cfg, saved, resume_from)
        changed = check_resume_drift(cfg, resolved, saved, resume_from, state_step)
    if state_step is not None and state_step >= cfg.algorithm.num_steps:
        # an async run's schedule is fixed by its num_steps (check_resumed_schedule): it cannot train on
        train_on = "" if algorithm.rollouts and cfg.algorithm.max_staleness else \
            "raise algorithm.num_steps to train on, or "
        log.info("%s already finished: its checkpoint %s is at step %d of algorithm.num_steps=%d, so there is "
                 "nothing to do (%sset run.name for a new run)%s",
                 cfg.run.name, resume_from, state_step, cfg.algorithm.num_steps, train_on,
                 f"; these settings changed since are not used: {changed}" if changed else "")
        return RunResult(read_history(run_dir, state_step), run_dir)
    if changed:
        log.info("settings changed since %s: %s", resume_from, changed)
    started_cluster = False
    try:
        # the tokenizer and data load while Ray starts (on a GPU machine each takes 5-9 s); Ray's own
        # processes die with the thread that started them, so Ray starts on this one
        with ThreadPoolExecutor(1, thread_name_prefix="rlkit-data") as executor:
            loading = executor.submit(_model_tokenizer_data, cfg, algorithm, clock)
            with clock.phase("ray"):
                started_cluster = join_or_start_ray(cfg.cluster, cfg.policy.bridge, fork_server)
        model_dir, tokenizer, data = loading.result()  # bad data stops the run before any worker starts
        start_dir, warm_dir = model_dir, None
        if algorithm.warm_start is not None:
            start_dir, warm_dir = warm_start_dir(cfg, model_dir, resume_from, algorithm.uses_reference(cfg.algorithm),
                                                 *data.identity)
        if resume_from is None and warm_dir is not None and (cfg.policy.peft is not None or algorithm.head != "lm"):
            # adapters on a model that never answers learn too little to start from: the warm start
            # tunes every weight, on workers of its own, and the adapters train on top of its result;
            # a reward model's head has no tokens to train on: its trunk starts from the result
            full_tuning = replace(cfg, policy=replace(cfg.policy, peft=None))
            with clock.phase("warm_start"):
                # the warm start's workers stop the cluster they are given (so does their failed start)
                given, started_cluster = started_cluster, None
                warm_workers = start_workers(full_tuning, str(start_dir), with_generation=False, with_critic=False,
                                             pool=pool, started_cluster=given)
                try:
                    with stop_on_signals(cfg.checkpoint, ends_start_up=False) as stop_requested:
                        _warm_start(full_tuning, algorithm, warm_workers.policy, tokenizer, data, warm_dir,
                                    stop_requested)
                finally:
                    warm_workers.shutdown(failed=failing())
            start_dir, warm_dir = warm_dir, None
        if resume_from is not None:
            check_base(resume_from / "policy", str(start_dir), cfg.policy.peft is not None, "checkpoint.resume")
        elif cfg.policy.peft is not None and cfg.policy.peft.init_from is not None:
            check_base(Path(cfg.policy.peft.init_from) / "policy", str(start_dir), True, "policy.peft.init_from")
    except BaseException:
        if started_cluster:  # started for this run and given to no workers yet
            stop_local_ray(keep_logs=False)
        raise
    workers = start_workers(cfg, str(start_dir), with_generation=algorithm.rollouts, with_critic=algorithm.critic,
                            clock=clock, pool=pool, started_cluster=started_cluster, policy_head=algorithm.head)
    logger = MetricsLogger(cfg.logger, run_dir, cfg.run.name, resolved, resume_step=state_step)
    trainer = None
    try:
        with stop_on_signals(cfg.checkpoint) as stop_requested:
            if resume_from is None and warm_dir is not None:
                with clock.phase("warm_start"):
                    _warm_start(cfg, algorithm, workers.policy, tokenizer, data, warm_dir, stop_requested)
                start_dir = warm_dir
            with clock.phase("trainer_setup"):
                trainer = algorithm.trainer(RunContext(cfg, algorithm, workers, tokenizer, data, start_dir))
            rows = ShuffledStream(data.train, trainer.rows_per_step, cfg.run.seed)
            return run_steps(cfg, resolved, trainer, rows, checkpoints, logger, resume_from, stop_requested, clock)
    finally:
        if trainer is not None:
            trainer.close()
        logger.close()
        workers.shutdown(failed=failing())
        checkpoints.discard_unfinished()  # a stop at once or an error may leave one; its writers are gone now


def _model_tokenizer_data(cfg: RootConfig, algorithm, clock: StartupClock):
    """The model's directory, its tokenizer and the algorithm's data, its prompts checked."""
    with clock.phase("model_tokenizer_data"):
        model_dir = resolve_model_dir(cfg)
        tokenizer = load_tokenizer(model_dir)
        data = algorithm.load_data(cfg, tokenizer)
        if algorithm.rollouts:
            check_prompts(cfg, data, tokenizer)
    return model_dir, tokenizer, data


def _warm_start(cfg: RootConfig, algorithm, policy, tokenizer, data, warm_dir: Path, stop_requested) -> None:
    """The algorithm's warm start on `policy`, cached as an HF checkpoint in warm_dir."""
    log.info("warm start: running %d SFT steps with rlkit's trainer before %s, cached in %s",
             cfg.algorithm.warm_start.sft_steps, algorithm.name, warm_dir)
    with stop_requested.stopping_at_once("during the warm start, which is not checkpointed (the next run redoes it); "
                                         "rerun the same command to continue"):
        cached_warm_start(policy, warm_dir, lambda: algorithm.warm_start(cfg, policy, tokenizer, data, warm_dir))


def verify_refit(cfg: RootConfig, num_prompts: int) -> dict:
    """`rlkit verify-refit`: load the model into policy and generation, refit, sample answers to
    held-out prompts and compare the sampler's logprobs with the policy's on the same tokens."""
    model_dir = resolve_model_dir(cfg)
    tokenizer = load_tokenizer(model_dir)
    data = load_algorithm(cfg.algorithm.name).load_data(cfg, tokenizer)
    val_set = data.val or data.train  # the training prompts where data.val_path=null
    workers = start_workers(cfg, str(model_dir))
    try:
        workers.policy.set_temperature(cfg.generation.temperature or 1.0)
        metrics = RefitDriver(cfg, workers.policy, workers.generation, workers.placement_group, []).sync()
        g = cfg.generation
        prompt_ids = [p.token_ids for p in val_set[:num_prompts]]
        generations = workers.generation.generate(prompt_ids, SamplingParams(g.max_new_tokens, g.temperature,
                                                                             g.top_p, g.top_k, cfg.run.seed))
        rollout = rollout_batch(prompt_ids, generations, tokenizer.pad_token_id)
        rollout = rollout.slice(0, len(rollout) - len(rollout) % workers.policy.layout.dp_size)
        metrics.update(logprob_error(workers.policy.logprobs(rollout), rollout["generation_logprobs"],
                                     rollout["response_mask"]))
        metrics["refit/tokens_compared"] = int(rollout["response_mask"].sum())
        return metrics
    finally:
        workers.shutdown(failed=failing())


def check_expert_layout(cfg: RootConfig, saved: DictConfig, checkpoint_dir: Path) -> None:
    """Before any worker starts: a checkpoint loads only at the expert parallel size it was saved
    at. Megatron keys the optimizer state by it (one optimizer at EP=1, a dense and an expert one
    above), so another EP fails deep inside the load."""
    saved_ep = saved.policy.get("expert_parallel_size", 1)
    if saved_ep != cfg.policy.expert_parallel_size:
        raise ConfigError(f"policy.expert_parallel_size: {checkpoint_dir} was saved at {saved_ep} and this run asks "
                          f"for {cfg.policy.expert_parallel_size}; its optimizer state loads only at the size it was "
                          f"saved at: resume with policy.expert_parallel_size={saved_ep}, or export the weights "
                          f"(rlkit convert) and start a new run from them")


def failing() -> bool:
    """Inside a finally: whether an error (not a requested stop) is on its way out."""
    error = sys.exc_info()[1]
    return error is not None and not isinstance(error, (RunStopped, KeyboardInterrupt))
