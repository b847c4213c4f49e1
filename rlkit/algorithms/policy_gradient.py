"""The RL controller: GRPO, RLOO and REINFORCE++ (PPO subclasses it in ppo.py).
One step = refit -> generate -> reward -> logprobs -> advantages -> train."""

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlkit.algorithms.advantages import grpo_advantages, reinforce_pp_advantages, rloo_advantages
from rlkit.algorithms.loop import RunResult, run_steps
from rlkit.algorithms.losses import ClippedPolicyLossConfig, batch_totals
from rlkit.algorithms.objectives import PolicyGradient
from rlkit.algorithms.rollout import Rollout, run_episodes
from rlkit.algorithms.warm_start import cached_warm_start, sft_steps, warm_start_dir
from rlkit.checkpoint import CheckpointManager
from rlkit.cluster.setup import Workers, start_workers
from rlkit.config.schema import RootConfig
from rlkit.data.arithmetic import arithmetic_splits
from rlkit.data.batch import Batch
from rlkit.data.rollout import PromptStream, rollout_batch
from rlkit.envs.runner import EnvGroup
from rlkit.models.resolve import resolve_model_dir
from rlkit.observability.metrics import MetricsLogger, PhaseTimer
from rlkit.refit.plan import RefitPlan
from rlkit.refit.transports import TRANSPORTS
from rlkit.refit.verify import logprob_error
from rlkit.workers.generation.base import SamplingParams

log = logging.getLogger("rlkit")


def kl_in_loss(cfg: RootConfig) -> bool:
    """Where the KL to the reference goes: a k3 term in the loss (GRPO, RLOO, PPO with
    kl_mode=loss) or a per-token penalty in the rewards (REINFORCE++, PPO with kl_mode=reward)."""
    a = cfg.algorithm
    return a.name in ("grpo", "rloo") or (a.name == "ppo" and a.kl_mode == "loss")


class PolicyGradientTrainer:
    """The pieces a step needs, set up once."""

    def __init__(self, cfg: RootConfig, workers: Workers, tokenizer, envs: EnvGroup | None,
                 reference_dir: Path | None = None, val_rows: list[dict] | None = None):
        self.cfg, self.workers, self.tokenizer, self.envs = cfg, workers, tokenizer, envs
        self.policy, self.generation, self.val_rows = workers.policy, workers.generation, val_rows
        a = cfg.algorithm
        self.objective = PolicyGradient(ClippedPolicyLossConfig(
            a.clip_low, a.clip_high, a.kl_coef if kl_in_loss(cfg) else 0.0, a.loss_aggregation))
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
        self.weights_stale = True  # the generation workers do not hold the policy's starting weights yet
        # models that leave the GPU to a colocated vLLM while it generates (PPO adds its critic)
        self.sleepers = [self.policy] if cfg.cluster.placement == "colocated" else []

    def refit(self) -> dict:
        """Push the policy's weights into the generation workers if training changed them; then
        (colocated on GPU) the trained models sleep, leaving the memory to the generation engines."""
        self.generation.call("wake", "weights")
        metrics = {}
        if self.weights_stale:
            metrics = self.transport(self.plan, self.cfg.refit.verify_checksums)
            self.weights_stale = False
        for model in self.sleepers:
            freed = sum(model.call("sleep"))
            if freed:
                metrics[f"memory/{model.workers.role}_offloaded_gb"] = freed / 1e9
        self.generation.call("wake")  # the KV cache, now that the policy's memory is free
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
            with timer("logprobs"):
                rollout = episodes.batch.with_fields(old_logprobs=self.policy.logprobs(episodes.batch))
                if a.kl_coef > 0:
                    rollout = rollout.with_fields(reference_logprobs=self.policy.reference_logprobs(rollout))
            with timer("advantages"):
                rollout, advantage_metrics = self.advantages(rollout, episodes.rewards)
            with timer("train"):
                train_metrics = self.train(rollout)
                self.weights_stale = True
        mask = rollout["response_mask"]
        accuracy = {} if episodes.correct is None else {"train/accuracy": episodes.correct.float().mean().item()}
        return {
            "train/reward": episodes.rewards.mean().item(), **accuracy,
            "train/response_length": mask.sum(1).mean().item(), **episodes.metrics, **advantage_metrics,
            **train_metrics, **refit_metrics, **timer.seconds,
            **logprob_error(rollout["old_logprobs"], rollout["generation_logprobs"], mask),
        }

    def advantages(self, rollout: Batch, rewards: torch.Tensor) -> tuple[Batch, dict]:
        """The algorithm's estimator: rollout gains `advantages` ([B] or token-level [B, S])."""
        a = self.cfg.algorithm
        if a.name == "grpo":
            advantages = grpo_advantages(rewards, a.group_size, a.normalize_std)
        elif a.name == "rloo":
            advantages = rloo_advantages(rewards, a.group_size)
        else:  # reinforce_pp: the KL penalty is part of the per-token reward
            kl = rollout["old_logprobs"] - rollout["reference_logprobs"] if a.kl_coef > 0 else None
            advantages = reinforce_pp_advantages(rewards, rollout["response_mask"], kl, a.kl_coef,
                                                 a.group_size if a.baseline else None)
        return rollout.with_fields(advantages=advantages), {}

    def train(self, rollout) -> dict:
        """One optimizer step per mini-batch of policy.train_global_batch_size samples."""
        keys = ["input_ids", "response_mask", "old_logprobs", "advantages"]
        if "reference_logprobs" in rollout:
            keys.append("reference_logprobs")
        minibatches = rollout.select(*keys).split(len(rollout) // self.cfg.policy.train_global_batch_size)
        sums, tokens = {}, rollout["response_mask"].sum().item()
        for minibatch in minibatches:
            m = self.policy.train(minibatch, batch_totals(minibatch["response_mask"]), self.objective)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
        out = {"train/loss": sums["loss"] / len(minibatches), "train/grad_norm": sums["grad_norm"] / len(minibatches),
               "train/clip_fraction": sums["clipped_tokens"] / max(tokens, 1),
               "train/entropy": sums["entropy"] / max(tokens, 1)}
        if "kl" in sums:
            out["train/kl"] = sums["kl"] / max(tokens, 1)
        return out

    def validate(self) -> dict:
        """Answers to held-out prompts from the current policy weights (refit first), sampled as in
        training or greedy (algorithm.val_greedy); the seed is fixed so runs compare."""
        refit_metrics = self.refit()
        params = SamplingParams(**{**self.sampling.__dict__, "temperature": 0.0}) if self.cfg.algorithm.val_greedy \
            else self.sampling
        episodes = self.episodes(self.val_rows, params)
        self.generation.call("sleep")  # what follows (training, a checkpoint) needs the policy's memory
        accuracy = {} if episodes.correct is None else {"val/accuracy": episodes.correct.float().mean().item()}
        return {**refit_metrics, "val/reward": episodes.rewards.mean().item(), **accuracy}

    def save(self, checkpoint_dir: str):
        self.policy.call("save_checkpoint", checkpoint_dir, self.cfg.checkpoint.save_format)

    def load(self, checkpoint_dir: str):
        self.policy.call("load_checkpoint", checkpoint_dir, self.cfg.checkpoint.save_format)
        self.weights_stale = True


def run_policy_gradient(cfg: RootConfig, resolved: DictConfig) -> RunResult:
    """An RL run of algorithm.name (grpo, rloo, reinforce_pp, ppo) on the arithmetic prompts."""
    from rlkit.algorithms.ppo import PPO

    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    checkpoints = CheckpointManager(cfg.checkpoint, run_dir)
    resume_from = checkpoints.to_resume()
    train_set, val_set = arithmetic_splits(cfg.data)
    reference_dir, warm_dir = warm_start_dir(cfg, resolve_model_dir(cfg), resume_from)
    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    ppo = cfg.algorithm.name == "ppo"
    workers = start_workers(cfg, str(reference_dir), with_critic=ppo)
    state_step = CheckpointManager.controller_state(resume_from)["step"] if resume_from else None
    logger = MetricsLogger(cfg.logger, run_dir, cfg.run.name, resolved, resume_step=state_step)
    envs = None
    try:
        if resume_from is None and warm_dir is not None:
            w = cfg.algorithm.warm_start
            log.info("warm start: the random-init model cannot earn reward yet; running %d SFT steps with "
                     "rlkit's trainer, cached in %s", w.sft_steps, warm_dir)
            cached_warm_start(workers.policy, warm_dir, lambda: sft_steps(
                workers.policy, tokenizer, train_set, w.sft_steps, w.batch_size, w.lr, cfg.run.seed))
            workers.policy.call("reset_optimizer")
            reference_dir = warm_dir
        envs = EnvGroup(cfg.env, cfg.env_runner)
        trainer = (PPO if ppo else PolicyGradientTrainer)(cfg, workers, tokenizer, envs, reference_dir, val_set)
        prompts = PromptStream(train_set, cfg.algorithm.prompts_per_step, cfg.run.seed)
        return run_steps(cfg, resolved, trainer, prompts, checkpoints, logger, resume_from)
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
        trainer = PolicyGradientTrainer(cfg, workers, AutoTokenizer.from_pretrained(model_dir), envs=None,
                                        reference_dir=model_dir)
        metrics = trainer.refit()
        prompt_ids = trainer.encode(val_set[:num_prompts])
        generations = trainer.generation.generate(prompt_ids, trainer.sampling)
        rollout = rollout_batch(prompt_ids, generations, trainer.tokenizer.pad_token_id)
        rollout = rollout.slice(0, len(rollout) - len(rollout) % workers.policy.layout.dp_size)
        train_logprobs = trainer.policy.logprobs(rollout)
        metrics.update(logprob_error(train_logprobs, rollout["generation_logprobs"], rollout["response_mask"]))
        metrics["refit/tokens_compared"] = int(rollout["response_mask"].sum())
        return metrics
    finally:
        workers.shutdown()
