"""GRPO: the controller loop. One step = refit -> generate -> reward -> advantages -> logprobs -> train."""

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlkit.algorithms.advantages import grpo_advantages
from rlkit.algorithms.losses import ClippedPolicyLossConfig, batch_totals
from rlkit.algorithms.rollout import Rollout, run_episodes
from rlkit.algorithms.sft import cached_warm_start, sft_steps
from rlkit.checkpoint import CheckpointManager
from rlkit.cluster.setup import Workers, start_workers
from rlkit.cluster.worker_group import WorkerError
from rlkit.config.schema import RootConfig
from rlkit.data.arithmetic import arithmetic_splits
from rlkit.data.rollout import PromptStream, rollout_batch
from rlkit.envs.runner import EnvGroup
from rlkit.models.resolve import cache_key, resolve_model_dir
from rlkit.observability.metrics import MetricsLogger, PhaseTimer, console_line
from rlkit.refit.plan import RefitPlan
from rlkit.refit.transports import TRANSPORTS
from rlkit.refit.verify import logprob_error
from rlkit.workers.generation.base import SamplingParams

log = logging.getLogger("rlkit")


@dataclass
class GRPOResult:
    history: list[dict]  # metrics of every step (step 0: validation before training)
    run_dir: Path


class GRPO:
    """The pieces a GRPO step needs, set up once."""

    def __init__(self, cfg: RootConfig, workers: Workers, tokenizer, envs: EnvGroup | None,
                 reference_dir: Path | None = None):
        self.cfg, self.workers, self.tokenizer, self.envs = cfg, workers, tokenizer, envs
        self.policy, self.generation = workers.policy, workers.generation
        a = cfg.algorithm
        self.loss_cfg = ClippedPolicyLossConfig(a.clip_low, a.clip_high, a.kl_coef, a.loss_aggregation)
        g = cfg.generation
        self.sampling = SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k, seed=cfg.run.seed)
        self.policy.call("set_temperature", g.temperature or 1.0)
        self.policy.call("set_learning_rate", cfg.policy.optimizer.lr)
        if a.kl_coef > 0:  # the KL anchor: the weights the run started from (after any warm start)
            self.policy.call("init_reference", str(reference_dir))
        manifest = self.policy.rank0("refit_manifest")
        self.plan = RefitPlan.build(manifest, int(cfg.refit.bucket_mb * 2**20),
                                    transfer_dtype="bfloat16" if g.precision == "bf16" else None,
                                    keep_fp32=tuple(cfg.refit.keep_fp32))
        self.transport = TRANSPORTS[cfg.refit.transport](self.policy, self.generation, workers.placement_group)
        self.weights_stale = True  # generation workers start with random weights

    def refit(self) -> dict:
        """Push the policy's weights into the generation workers if training changed them."""
        self.generation.call("wake")
        if not self.weights_stale:
            return {}
        metrics = self.transport(self.plan, self.cfg.refit.verify_checksums)
        self.weights_stale = False
        return metrics

    def encode(self, rows: list[dict]) -> list[list[int]]:
        return [self.tokenizer(r["prompt"])["input_ids"] for r in rows]

    def episodes(self, rows: list[dict], params: SamplingParams, timer: PhaseTimer | None = None) -> Rollout:
        """Generation and environment turns until every episode is done; timer accumulates the
        generate and reward phases over the turns."""
        return run_episodes(rows, self.tokenizer, self.generation, self.envs, params, self.cfg.env_runner, timer)

    def step(self, rows: list[dict], step: int) -> dict:
        a, timer = self.cfg.algorithm, PhaseTimer()
        with timer("step"):
            with timer("refit"):
                refit_metrics = self.refit()
            sampling = SamplingParams(**{**self.sampling.__dict__, "seed": self.sampling.seed + step})
            episodes = self.episodes([r for r in rows for _ in range(a.group_size)], sampling, timer)
            with timer("generate"):
                self.generation.call("sleep")  # colocated: give the memory back to the policy
            rewards = episodes.rewards
            rollout = episodes.batch.with_fields(advantages=grpo_advantages(rewards, a.group_size, a.normalize_std))
            with timer("logprobs"):
                rollout = rollout.with_fields(old_logprobs=self.policy.logprobs(rollout))
                if a.kl_coef > 0:
                    rollout = rollout.with_fields(reference_logprobs=self.policy.reference_logprobs(rollout))
            with timer("train"):
                train_metrics = self.train(rollout)
                self.weights_stale = True
        mask = rollout["response_mask"]
        accuracy = {} if episodes.correct is None else {"train/accuracy": episodes.correct.float().mean().item()}
        return {
            "train/reward": rewards.mean().item(), **accuracy,
            "train/response_length": mask.sum(1).mean().item(), **episodes.metrics,
            **train_metrics, **refit_metrics, **timer.seconds,
            **logprob_error(rollout["old_logprobs"], rollout["generation_logprobs"], mask),
        }

    def train(self, rollout) -> dict:
        """One optimizer step per mini-batch of policy.train_global_batch_size samples."""
        keys = ["input_ids", "response_mask", "old_logprobs", "advantages"]
        if "reference_logprobs" in rollout:
            keys.append("reference_logprobs")
        minibatches = rollout.select(*keys).split(len(rollout) // self.cfg.policy.train_global_batch_size)
        sums, tokens = {}, rollout["response_mask"].sum().item()
        for minibatch in minibatches:
            m = self.policy.train(minibatch, batch_totals(minibatch["response_mask"]), "policy", self.loss_cfg)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
        out = {"train/loss": sums["loss"] / len(minibatches), "train/grad_norm": sums["grad_norm"] / len(minibatches),
               "train/clip_fraction": sums["clipped_tokens"] / max(tokens, 1),
               "train/entropy": sums["entropy"] / max(tokens, 1)}
        if "kl" in sums:
            out["train/kl"] = sums["kl"] / max(tokens, 1)
        return out

    def validate(self, rows: list[dict]) -> dict:
        """Answers to held-out prompts from the current (refit) generation weights, sampled as in
        training or greedy (algorithm.val_greedy); the seed is fixed so runs compare."""
        params = SamplingParams(**{**self.sampling.__dict__, "temperature": 0.0}) if self.cfg.algorithm.val_greedy \
            else self.sampling
        episodes = self.episodes(rows, params)
        accuracy = {} if episodes.correct is None else {"val/accuracy": episodes.correct.float().mean().item()}
        return {"val/reward": episodes.rewards.mean().item(), **accuracy}


def _starting_checkpoint(cfg: RootConfig, model_dir: Path) -> tuple[Path, Path | None]:
    """(directory the policy loads, warm-start directory still to be written or None)."""
    w = cfg.algorithm.warm_start
    if w.sft_steps == 0:
        return model_dir, None
    key = cache_key(str(model_dir), w.sft_steps, w.batch_size, w.lr, cfg.data, cfg.run.seed)
    warm_dir = Path(cfg.run.cache_dir).resolve() / f"warm-start-{key}"
    if (warm_dir / "config.json").is_file():
        log.info("warm start: using the cached SFT checkpoint %s", warm_dir)
        return warm_dir, None
    return model_dir, warm_dir


def run_grpo(cfg: RootConfig, resolved: DictConfig) -> GRPOResult:
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    checkpoints = CheckpointManager(cfg.checkpoint, run_dir)
    resume_from = checkpoints.to_resume()
    state = CheckpointManager.controller_state(resume_from) if resume_from else None
    train_set, val_set = arithmetic_splits(cfg.data)
    reference_dir, warm_dir = _starting_checkpoint(cfg, resolve_model_dir(cfg))
    if resume_from is not None and warm_dir is not None and cfg.algorithm.kl_coef > 0:
        raise FileNotFoundError(f"resuming {resume_from} needs the warm-start checkpoint {warm_dir} as the KL "
                                f"reference, and it is gone (run.cache_dir={cfg.run.cache_dir}); restore it or "
                                f"set checkpoint.resume=none")
    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    workers = start_workers(cfg, str(reference_dir))
    logger = MetricsLogger(cfg.logger, run_dir, cfg.run.name, resolved, resume_step=state and state["step"])
    prompts = PromptStream(train_set, cfg.algorithm.prompts_per_step, cfg.run.seed)
    envs = None
    try:
        if resume_from is not None:
            log.info("resuming from %s: continuing after step %d", resume_from, state["step"])
            workers.policy.call("load_checkpoint", str(resume_from), cfg.checkpoint.save_format)
            prompts.restore(state["prompts"])
        elif warm_dir is not None:
            w = cfg.algorithm.warm_start
            log.info("warm start: the random-init model cannot earn reward yet; running %d SFT steps with "
                     "rlkit's trainer, cached in %s", w.sft_steps, warm_dir)
            cached_warm_start(workers.policy, warm_dir, lambda: sft_steps(
                workers.policy, tokenizer, train_set, w.sft_steps, w.batch_size, w.lr, cfg.run.seed,
                minibatch_size=w.batch_size))
            workers.policy.call("reset_optimizer")
            reference_dir = warm_dir
        envs = EnvGroup(cfg.env, cfg.env_runner)
        grpo = GRPO(cfg, workers, tokenizer, envs, reference_dir)
        if resume_from is None:
            _validation_step(grpo, val_set, logger)
        a, first = cfg.algorithm, (state["step"] + 1 if state else 1)
        started = time.perf_counter()
        for step in range(first, a.num_steps + 1):
            try:
                metrics = grpo.step(next(prompts), step)
                if step % a.val_every == 0 or step == a.num_steps:
                    grpo.refit()
                    metrics.update(grpo.validate(val_set))
                logger.log(step, metrics)
                log.info(console_line(step, a.num_steps, metrics, (time.perf_counter() - started) / (step - first + 1)))
                every = cfg.checkpoint.every
                if (every and step % every == 0) or step == a.num_steps:
                    checkpoints.save(step, lambda path: workers.policy.call(
                        "save_checkpoint", path, cfg.checkpoint.save_format),
                        {"step": step, "prompts": prompts.state()}, resolved)
            except WorkerError as e:
                last = checkpoints.complete()
                raise WorkerError(f"step {step}: {e}\nThe last complete checkpoint is "
                                  f"{last[-1] if last else 'none'}; rerun the same command to resume "
                                  f"(checkpoint.resume=auto).") from None
        return GRPOResult(logger.history, run_dir)
    finally:
        logger.close()
        if envs is not None:
            envs.shutdown()
        workers.shutdown()


def run_verify_refit(cfg: RootConfig, num_prompts: int) -> dict:
    """Load the model into policy and generation, refit, sample answers to held-out prompts and
    compare the sampler's logprobs with the policy's on the same tokens."""
    _, val_set = arithmetic_splits(cfg.data)
    model_dir = resolve_model_dir(cfg)
    workers = start_workers(cfg, str(model_dir))
    try:
        grpo = GRPO(cfg, workers, AutoTokenizer.from_pretrained(model_dir), envs=None)
        metrics = grpo.refit()
        prompt_ids = grpo.encode(val_set[:num_prompts])
        generations = grpo.generation.generate(prompt_ids, grpo.sampling)
        rollout = rollout_batch(prompt_ids, generations, grpo.tokenizer.pad_token_id)
        rollout = rollout.slice(0, len(rollout) - len(rollout) % workers.policy.layout.dp_size)
        train_logprobs = grpo.policy.logprobs(rollout)
        metrics.update(logprob_error(train_logprobs, rollout["generation_logprobs"], rollout["response_mask"]))
        metrics["refit/tokens_compared"] = int(rollout["response_mask"].sum())
        return metrics
    finally:
        workers.shutdown()


def _validation_step(grpo: GRPO, val_set, logger: MetricsLogger):
    start = time.perf_counter()
    metrics = {**grpo.refit(), **grpo.validate(val_set)}
    metrics["timing/step"] = time.perf_counter() - start
    logger.log(0, metrics)
    log.info("before training: val_reward %.3f", metrics["val/reward"])
