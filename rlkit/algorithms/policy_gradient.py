"""The RL family's controller: GRPO, RLOO, REINFORCE++ and PPO differ only in their estimator
and where their KL goes (their modules' AlgorithmSpec). One step:

    sync weights -> generate + reward -> hold the rollout on the policy workers
    -> logprobs (and the reference's) -> advantages -> train

The rollout's token tensors cross the controller once: after the episodes, split per
data-parallel rank into the object store. Logprobs, token-level advantages and training happen
where each shard is held; only per-sample rewards and metrics come back.
"""

import json
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from rlkit.checkpoint import WrittenFiles
from rlkit.algorithms.async_rollouts import PENDING_ROLLOUTS, Rollout, RolloutPipeline
from rlkit.algorithms.dapo_rollouts import (extra_prompts, overlong_filtered, overlong_penalty,
                                            sample_informative_groups)
from rlkit.algorithms.episodes import Episodes, run_episodes
from rlkit.algorithms.loop import RunContext, TrainingData
from rlkit.algorithms.losses import ClippedPolicyLossConfig
from rlkit.algorithms.lr_schedule import LearningRateSchedule, schedule_of
from rlkit.algorithms.objectives import PolicyGradient
from rlkit.algorithms.off_policy import OffPolicyCorrection, off_policy_metrics
from rlkit.algorithms.registry import load_policy_loss
# the family's config, checks and estimator adapter, re-exported for algorithms of one's own
from rlkit.algorithms.policy_gradient_spec import (PolicyGradientConfig, kl_estimator,  # noqa: F401
                                                   max_response_tokens, per_sample, validate)
from rlkit.algorithms.warm_start import answer_example, episode_example, sft_steps
from rlkit.cluster.groups import ModelWorkers
from rlkit.config.schema import ConfigError, RootConfig
from rlkit.data.batch import Batch, BatchTotals, batch_totals
from rlkit.data.generation import SamplingParams
from rlkit.data.prompts import Prompt, PromptRenderer, load_prompt_splits
from rlkit.envs.base import load_environment
from rlkit.envs.reward_models.metrics import score_means
from rlkit.envs.runner import EnvironmentPool
from rlkit.envs.tools import environment_tools
from rlkit.observability.logprob_agreement import agreement_metrics, reference_kl
from rlkit.observability.metrics import PhaseTimer
from rlkit.observability.throughput import (DecoderShape, PhaseWork, forward_flops, peak_bf16_flops, phase_metrics,
                                            training_flops)
from rlkit.cluster.refit_driver import RefitDriver


def prompt_renderer(cfg: RootConfig, tokenizer) -> PromptRenderer:
    """Prompts and environment turns rendered as data.* and env_runner.observation_format say,
    with the environment's tools (if it has any) shown by the chat template."""
    return PromptRenderer.of(tokenizer, cfg.data, cfg.env_runner.observation_format, environment_tools(cfg.env))


def load_prompts(cfg: RootConfig, tokenizer) -> TrainingData:
    """Prompts rendered to token ids (rlkit/data/prompts.py); environment turns are rendered the
    same way (env_runner.observation_format for raw text)."""
    renderer = prompt_renderer(cfg, tokenizer)
    if renderer.tools:
        problem = renderer.tools_problem()
        if problem:
            raise ConfigError(f"data.chat_template: {cfg.env['_target_']} offers tools, but {problem}")
    if cfg.env_runner.max_turns > 1:
        try:  # a template that cannot take appended turns fails here, before any worker starts
            renderer.appended_ids([], [{"role": "user", "content": "probe"}])
        except ValueError as e:
            raise ConfigError(f"data.chat_template: {e}") from None
    return TrainingData(*load_prompt_splits(cfg.data, renderer))


def warm_start_on_answers(cfg: RootConfig, policy, tokenizer, data: TrainingData, out_dir) -> None:
    """A random-init model never answers, so every reward would be 0: SFT on the ground-truth
    answers first (algorithm.warm_start); for an environment that gives reference turns (a tool
    environment: call the tool, then answer), on those whole episodes."""
    w = cfg.algorithm.warm_start
    env = load_environment(cfg.env["_target_"], {k: v for k, v in cfg.env.items() if k != "_target_"})
    first = data.train[0]
    example = episode_example(env, prompt_renderer(cfg, tokenizer), tokenizer.eos_token_id, w.direct_fraction,
                              cfg.run.seed) \
        if env.reference_turns(first.messages, first.metadata) is not None else answer_example(tokenizer)
    try:
        sft_steps(policy, example, tokenizer.pad_token_id, data.train, w.sft_steps, w.batch_size, w.lr, cfg.run.seed)
    finally:
        env.close()


def policy_objective(cfg: RootConfig, kl_in_loss: bool) -> PolicyGradient:
    """What the policy's train step minimises: the loss algorithm.policy_loss names, on the
    algorithm's loss keys (the KL a loss term only where kl_in_loss), with the off-policy weights
    when a correction is on."""
    a = cfg.algorithm
    loss = ClippedPolicyLossConfig(a.clip_low, a.clip_high, a.kl_coef if kl_in_loss else 0.0, a.loss_aggregation,
                                   a.dual_clip_c, kl_estimator(a, in_loss=True), a.importance_ratio,
                                   max_response_tokens(cfg), a.entropy_coef)
    return PolicyGradient(loss, off_policy_weighted=a.off_policy_correction != "none",
                          loss_function=load_policy_loss(a.policy_loss))


# extra dynamic-sampling rounds shift the sampling seed by this much per round: round 0 keeps the
# step's seed, and no two (step, round) pairs share a seed in runs of fewer steps
EXTRA_ROUND_SEED_STRIDE = 1_000_000


# the masked token sums of the policy loss (and the worker's entropy), reported as means per
# response token under these names; a loss of one's own reports its other sums as train/<name>
TOKEN_MEANS = {"clipped_tokens": "train/clip_fraction", "dual_clipped_tokens": "train/dual_clip_fraction",
               "entropy": "train/entropy", "ratio": "train/importance_ratio", "kl": "train/kl"}


class PolicyGradientTrainer:
    """The pieces a step needs, set up once (ctx: the started run, rlkit/algorithms/loop.py)."""

    def __init__(self, ctx: RunContext):
        cfg, workers = ctx.cfg, ctx.workers
        self.cfg, self.algorithm, self.train_rows, self.val_rows = cfg, ctx.algorithm, ctx.data.train, ctx.data.val
        self.renderer = prompt_renderer(cfg, ctx.tokenizer)
        self.policy, self.generation = workers.policy, workers.generation
        self.rows_per_step = cfg.algorithm.prompts_per_step
        a, g = cfg.algorithm, cfg.generation
        self.kl_in_loss = self.algorithm.kl_in_loss(a)
        self.objective = policy_objective(cfg, self.kl_in_loss)
        self.off_policy = OffPolicyCorrection(a.off_policy_correction, a.tis_cap, a.seq_mask_low, a.seq_mask_high) \
            if a.off_policy_correction != "none" else None
        self.sampling = SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k, seed=cfg.run.seed,
                                       ignore_eos=g.ignore_eos)
        self.policy.set_temperature(g.temperature or 1.0)
        self.minibatches = a.prompts_per_step * a.group_size // cfg.policy.train_global_batch_size
        self.lr = schedule_of(cfg.policy.optimizer, a.num_steps * self.minibatches)
        if a.kl_coef > 0:  # the KL anchor: the weights the run started from (after any warm start)
            self.policy.init_reference(str(ctx.start_dir))
        self.critic = self.start_critic(ctx)
        self.models = [m for m in (self.policy, self.critic) if m is not None]  # the trained ones
        sleepers = self.models if cfg.cluster.placement == "colocated" else []
        self.refit = RefitDriver(cfg, self.policy, self.generation, workers.placement_group, sleepers)
        self.version = 0  # the policy's weight version: training steps applied to it
        self.rollouts = RolloutPipeline(a.max_staleness, a.num_steps, self.rollout, self.refit.push_weights)
        # what the throughput metrics need: the architecture (from config.json, no weights), the
        # GPU's peak (None on CPU: no MFU) and how many GPUs each phase runs on (a bundle is one)
        self.shape = DecoderShape.of(json.loads((ctx.start_dir / "config.json").read_text()))
        self.peak_flops = peak_bf16_flops(self.policy.device_name())
        self.gpus = {"policy": len(workers.placement.policy_bundles),
                     "generation": len(workers.placement.generation_bundles)}
        self.on_gpu = workers.device == "GPU"
        self.envs = EnvironmentPool(cfg.env, cfg.env_runner)

    def start_critic(self, ctx: RunContext):
        """PPO adds its critic here."""
        return None

    def step(self, rows: Iterator[list[Prompt]], step: int) -> dict:
        """One step on its rollout, which the pipeline generated from weight version
        rollout.weight_version (step - 1 on-policy; older with algorithm.max_staleness)."""
        a, timer = self.cfg.algorithm, PhaseTimer()
        with timer("step"):
            with timer("rollout_wait"):  # async: how long training waited for generation
                rollout = self.rollouts.take(step, self.version, rows)
            episodes = rollout.episodes
            rewards, group_ids = episodes.rewards, episodes.group_ids
            summary = {**episodes.summary("train"), **rollout.metrics}
            lengths, generated = episodes.lengths.tolist(), episodes.batch["response_mask"].sum().item()
            if a.overlong_filtering:  # after the summary: response lengths count the filtered responses too
                episodes.batch = episodes.batch.with_fields(
                    response_mask=overlong_filtered(episodes.batch["response_mask"], episodes.truncated))
                summary["train/overlong_filtered_fraction"] = episodes.truncated.float().mean().item()
            with timer("logprobs"):
                totals = minibatch_totals(episodes.batch, self.policy.layout.dp_size, self.minibatches)
                self.hold(episodes.batch)
                del episodes, rollout.episodes  # the token tensors have left the controller
                agreement = agreement_metrics(self.policy.forward_held("old_logprobs"))
                if a.kl_coef > 0:
                    agreement.update(reference_kl(self.policy.forward_held("reference_logprobs", reference=True)))
                if self.off_policy is not None:  # weights from old_logprobs and the engine's, where both are held
                    agreement.update(off_policy_metrics(self.policy.estimate_held(self.off_policy, rewards),
                                                        a.off_policy_correction))
            with timer("advantages"):
                advantage_metrics = self.algorithm.estimator(self, rewards, group_ids)
            with timer("train"):
                train_metrics = self.train(totals, (step - 1) * self.minibatches)
            self.version = step
        seconds = {**rollout.seconds, **timer.seconds}
        versions = {"train/weight_version": rollout.weight_version, "train/staleness": step - 1 - rollout.weight_version}
        return {**summary, **advantage_metrics, **train_metrics, **seconds, **agreement, **versions,
                **self.performance(lengths, generated, seconds)}

    def rollout(self, rows: list[Prompt], step: int) -> Rollout:
        """Step `step`'s rollout from the weights the engines hold (the pipeline's thread): the
        colocated hand-over, episodes and rewards, the memory back to the trained models."""
        timer = PhaseTimer()
        with timer("refit"):
            hand_over = self.refit.hand_over()
        episodes, sampling_metrics = self.roll_out(rows, step, timer)
        with timer("reclaim"):
            wake_metrics = self.refit.reclaim()  # colocated: the memory goes back to the trained models
        return Rollout(episodes, {**sampling_metrics, **hand_over, **wake_metrics}, timer.seconds)

    def roll_out(self, rows: list[Prompt], step: int, timer: PhaseTimer) -> tuple[Episodes, dict]:
        """The step's episodes, group_size per prompt, rewards with the soft overlong penalty
        (algorithm.overlong_buffer > 0); with algorithm.dynamic_sampling, rounds on more prompts
        until every group's rewards differ (rlkit/algorithms/dapo_rollouts.py). Round r samples
        with seed run.seed + step + r * EXTRA_ROUND_SEED_STRIDE and draws its prompts from
        (run.seed, step, r): a resumed step repeats every round."""
        a = self.cfg.algorithm

        def episodes_of(prompts: list[Prompt], round_: int) -> Episodes:
            seed = self.sampling.seed + step + round_ * EXTRA_ROUND_SEED_STRIDE
            episodes = self.episodes(prompts, replace(self.sampling, seed=seed), timer,
                                     a.group_size)
            if a.overlong_buffer == 0:
                return episodes
            penalty = overlong_penalty(episodes.batch["response_mask"].sum(1), max_response_tokens(self.cfg),
                                       a.overlong_buffer, a.overlong_penalty_factor)
            return replace(episodes, rewards=episodes.rewards + penalty)

        if not a.dynamic_sampling:
            return episodes_of(rows, 0), {}
        return sample_informative_groups(
            rows, episodes_of, lambda round_: extra_prompts(self.train_rows, len(rows), self.cfg.run.seed, step, round_),
            a.dynamic_sampling_max_rounds, self.renderer.tokenizer.pad_token_id)

    def episodes(self, prompts: list[Prompt], params: SamplingParams, timer: PhaseTimer | None = None,
                 samples_per_prompt: int = 1) -> Episodes:
        """samples_per_prompt episodes of each prompt (one group each), with generation and
        environment turns until every episode is done; timer accumulates the generate and reward
        phases over the turns."""
        return run_episodes(prompts, self.renderer, self.generation, self.envs, params, self.cfg.env_runner, timer,
                            samples_per_prompt)

    def hold(self, rollout: Batch) -> None:
        self.policy.hold(rollout)

    def performance(self, lengths: list[int], generated: float, seconds: dict) -> dict:
        """Tokens/s and MFU of the model phases (rlkit/observability/throughput.py), counted on the
        rows' real lengths, and on GPU each trained model's peak memory since the last step.
        generate: the sampled tokens; its FLOPs one forward over each whole row (what decoding
        with a KV cache adds up to). logprobs: every row's tokens once per model that scores them
        (the policy; the reference when algorithm.kl_coef > 0). train: every row's tokens."""
        forward, tokens = forward_flops(self.shape, lengths), float(sum(lengths))
        scorers = 2 if self.cfg.algorithm.kl_coef > 0 else 1
        work = {"generate": PhaseWork(generated, forward, self.gpus["generation"]),
                "logprobs": PhaseWork(scorers * tokens, scorers * forward, self.gpus["policy"]),
                "train": PhaseWork(tokens, self.train_flops(lengths), self.gpus["policy"])}
        memory = {f"memory/{m.role}_peak_gb": m.peak_memory_gb() for m in self.models} if self.on_gpu else {}
        return {**phase_metrics(work, seconds, self.peak_flops), **memory}

    def train_flops(self, lengths: list[int]) -> float:
        """The policy's forward and backward over the rows (PPO adds its critic's)."""
        return training_flops(self.shape, lengths)

    def train(self, totals: list[BatchTotals], first_optimizer_step: int) -> dict:
        """One optimizer step per mini-batch of policy.train_global_batch_size samples: part i of
        every held shard (totals[i] counts that mini-batch over all shards)."""
        sums = train_minibatches(self.policy, totals, self.objective, self.lr, first_optimizer_step)
        tokens = max(sum(t.num_tokens for t in totals), 1.0)
        out = {"train/loss": sums.pop("loss") / len(totals), "train/grad_norm": sums.pop("grad_norm") / len(totals),
               "train/lr": sums.pop("lr")}
        return {**out, **{TOKEN_MEANS.get(k, f"train/{k}"): v / tokens for k, v in sums.items()}}

    def validate(self) -> dict:
        """Answers to held-out prompts from the current policy weights (once the launched
        rollouts are done), sampled as in training or greedy (algorithm.val_greedy); the seed is
        fixed so runs compare."""
        refit_metrics = self.rollouts.engines_at_policy(self.version)
        refit_metrics.pop("timing/refit", None)  # the step's timing/refit is its rollout's; this one is validation's
        hand_over = self.refit.hand_over()
        params = replace(self.sampling, temperature=0.0) if self.cfg.algorithm.val_greedy \
            else self.sampling
        episodes = self.episodes(self.val_rows, params)
        self.refit.reclaim()  # what follows (training, a checkpoint) needs the trained models' memory
        summary = episodes.summary("val")
        # beside the reward: the length, and each model reward's own score (combined/<part>, reward_model/raw),
        # so that a model reward rising while the rule's accuracy falls shows on held-out prompts too
        scores = {f"val/{k}": v for k, v in score_means(episodes.metrics).items()}
        return {**refit_metrics, **hand_over, **scores,
                **{k: summary[k] for k in ("val/reward", "val/accuracy", "val/response_length") if k in summary}}

    def save(self, checkpoint_dir: str) -> dict[str, float]:
        """The policy, and the rollouts launched ahead (max_staleness > 0): generated from
        weights the checkpoint no longer holds, they are saved rather than made again."""
        held = self.policy.save_checkpoint(checkpoint_dir, self.cfg.checkpoint.save_format)
        if self.cfg.algorithm.max_staleness > 0:
            torch.save(self.rollouts.pending(), Path(checkpoint_dir) / PENDING_ROLLOUTS)
        return held

    def saved(self, wait: bool) -> WrittenFiles | None:
        return self.policy.finish_checkpoint(wait)

    def load(self, checkpoint_dir: str, step: int):
        self.policy.load_checkpoint(checkpoint_dir, self.cfg.checkpoint.save_format)
        self.version = step
        path = Path(checkpoint_dir) / PENDING_ROLLOUTS  # absent: saved with max_staleness=0
        self.rollouts.restore(torch.load(path, weights_only=False) if path.exists() else {}, step)

    def close(self):
        self.rollouts.close()
        self.envs.shutdown()


def train_minibatches(model: ModelWorkers, totals: list[BatchTotals], objective, lr: LearningRateSchedule,
                      first_optimizer_step: int) -> dict:
    """One optimizer step of `model` per mini-batch (part i of every held shard, counted by
    totals[i]), each at its step's learning rate; the metric sums added over the mini-batches,
    and the last learning rate."""
    sums = {}
    for part, part_totals in enumerate(totals):
        sums["lr"] = lr(first_optimizer_step + part)
        model.set_learning_rate(sums["lr"])
        for k, v in model.train_held(part, len(totals), part_totals, objective).items():
            sums[k] = sums.get(k, 0.0) + v
    return sums


def minibatch_totals(batch: Batch, dp: int, parts: int, mask_key: str = "response_mask") -> list[BatchTotals]:
    """Per mini-batch (part i of every DP shard), its token and sequence counts over all shards."""
    totals = [BatchTotals(0.0, 0.0)] * parts
    for shard in batch.split(dp):
        totals = [t + batch_totals(piece[mask_key]) for t, piece in zip(totals, shard.split(parts))]
    return totals
