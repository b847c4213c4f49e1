"""Warm starts: a short supervised run before RL or DPO, cached so later runs skip it."""

import logging
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlkit.algorithms.lr_schedule import check_learning_rate
from rlkit.bridge.base import check_transformer_engine_packing
from rlkit.config.schema import ConfigError, RootConfig
from rlkit.data.stream import ShuffledStream
from rlkit.envs.base import Environment, import_target
from rlkit.models.cache_entry import publish
from rlkit.models.resolve import cache_key

if TYPE_CHECKING:  # Ray: loading a config imports this module (validate_warm_start)
    from rlkit.cluster.groups import ModelWorkers

log = logging.getLogger("rlkit")


def answer_example(tokenizer) -> Callable:
    """A prompt's example: its tokens, then the ground-truth answer + EOS, trained on."""
    def example(prompt) -> tuple[list[int], list[bool]]:
        target = tokenizer(str(prompt.metadata["answer"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return prompt.token_ids + target, [False] * len(prompt.token_ids) + [True] * len(target)
    return example


def episode_example(env, renderer, eos_id: int, direct_fraction: float = 0.0, seed: int = 0) -> Callable:
    """A prompt's example as a whole episode: the environment's reference turns for the row
    (env.reference_turns: what the model should write, e.g. a tool call, then the answer), each
    + EOS and trained on, with what the environment answers each one (tool results, observations)
    appended as a run appends them, not trained on. A direct_fraction of the examples, drawn
    from `seed`, answer at once instead (the row's answer as answer_example trains on it), so the
    model learns both to call tools and to answer without them."""
    tokenizer, rng = renderer.tokenizer, random.Random(seed)

    def example(prompt) -> tuple[list[int], list[bool]]:
        ids, trained, messages = list(prompt.token_ids), [False] * len(prompt.token_ids), list(prompt.messages)
        direct = rng.random() < direct_fraction
        turns = [str(prompt.metadata["answer"])] if direct else env.reference_turns(prompt.messages, prompt.metadata)
        for content in turns:
            generated = tokenizer(content, add_special_tokens=False)["input_ids"] + [eos_id]
            ids, trained = ids + generated, trained + [True] * len(generated)
            messages.append({"role": "assistant", "content": content})
            step = env.step(messages, prompt.metadata)
            if step.done:
                break
            turn = step.tool_messages or [{"role": "user", "content": step.observation}]
            appended = renderer.appended_ids(generated, turn)
            ids, trained, messages = ids + appended, trained + [False] * len(appended), messages + turn
        return ids, trained
    return example


def sft_steps(policy: "ModelWorkers", example: Callable, pad_id: int, dataset, steps: int, batch_size: int,
              lr: float, seed: int) -> list[float]:
    """`steps` optimizer steps of NLL on the trained tokens of each prompt's example (example(prompt)
    -> (token ids, trained flags): answer_example, episode_example; dataset: Prompts,
    rlkit/data/prompts.py). Returns the loss of each step."""
    from rlkit.algorithms.objectives import NextTokenNLL
    from rlkit.data.batch import batch_totals, masked_batch

    rows = ShuffledStream(dataset, batch_size, seed)
    policy.set_learning_rate(lr)
    losses = []
    for step in range(1, steps + 1):
        batch = masked_batch([example(p) for p in next(rows)], pad_id)
        losses.append(policy.train(batch, batch_totals(batch["loss_mask"]), NextTokenNLL())["loss"])
        if step % 10 == 0 or step == steps:
            log.info("warm start SFT step %d/%d: loss %.3f", step, steps, losses[-1])
    return losses


def cached_warm_start(policy: "ModelWorkers", out_dir: Path, train) -> None:
    """Run `train()`, save the policy as an HF checkpoint at out_dir, atomically (a half-written
    directory never looks complete), and drop the optimizer state, so a run that just did the
    warm start and one that loaded it from the cache train on alike."""
    train()
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        policy.save_hf(str(tmp))
        publish(tmp, out_dir)
    finally:  # interrupted while saving: no half-written folder stays behind
        shutil.rmtree(tmp, ignore_errors=True)
    policy.reset_optimizer()


def validate_warm_start(cfg: RootConfig, dp: int) -> None:
    w, p = cfg.algorithm.warm_start, cfg.policy
    if w.sft_steps < 0:
        raise ConfigError(f"algorithm.warm_start.sft_steps: must be >= 0 (got: {w.sft_steps}); 0 skips the warm start")
    if w.batch_size < 1:
        raise ConfigError(f"algorithm.warm_start.batch_size: must be >= 1 (got: {w.batch_size}); set a positive value")
    check_learning_rate("algorithm.warm_start.lr", w.lr, "1e-3 for tiny models")
    if w.sft_steps > 0 and w.batch_size % (dp * p.micro_batch_size):
        raise ConfigError(f"algorithm.warm_start.batch_size: must be divisible by DP ({dp}) x "
                          f"policy.micro_batch_size ({p.micro_batch_size}) (got: {w.batch_size}); "
                          f"set it to a multiple of {dp * p.micro_batch_size}")
    if w.sft_steps > 0:  # the warm start's SFT packs its examples
        check_transformer_engine_packing("algorithm.warm_start.sft_steps", "algorithm.warm_start.sft_steps=0")


def validate_episode_warm_start(cfg: RootConfig, dp: int) -> None:
    """RL's warm start (EpisodeWarmStartConfig): the shared checks and its share of direct answers."""
    validate_warm_start(cfg, dp)
    fraction = cfg.algorithm.warm_start.direct_fraction
    if not 0 <= fraction <= 1:
        raise ConfigError(f"algorithm.warm_start.direct_fraction: must be in [0, 1], a share of the warm start's "
                          f"episodes (got: {fraction}); e.g. 0.3 for three in ten answered without tools")


def reference_turns_source(cfg: RootConfig) -> str | None:
    """env._target_ where that environment writes reference turns (an RL warm start then trains
    on its episodes: tool calls, then the answer), else None: a warm start on the rows' answers
    alone is the same whichever environment scores the run."""
    if not cfg.env:
        return None
    target = import_target(cfg.env["_target_"])
    writes_turns = isinstance(target, type) and issubclass(target, Environment) \
        and target.reference_turns is not Environment.reference_turns
    return cfg.env["_target_"] if writes_turns else None


def warm_start_dir(cfg: RootConfig, model_dir: Path, resume_from: Path | None, uses_reference: bool,
                   *data_identity) -> tuple[Path, Path | None]:
    """(directory the policy starts from, warm-start directory still to be written or None).
    The cache key covers the model, the warm-start settings, the environment whose reference
    turns an RL warm start trains on (reference_turns_source), the data section and data_identity
    (e.g. the data files' sizes and times), so a change to any of them trains a new warm start. A
    warm start tunes every weight, with or without policy.peft (see rlkit/launch/run.py)."""
    w = cfg.algorithm.warm_start
    if w.sft_steps == 0:
        return model_dir, None
    key = cache_key(str(model_dir), w, reference_turns_source(cfg), cfg.data, cfg.run.seed, *data_identity)
    warm_dir = Path(cfg.run.cache_dir).resolve() / f"warm-start-{key}"
    if (warm_dir / "config.json").is_file():
        log.info("warm start: using the cached SFT checkpoint %s", warm_dir)
        return warm_dir, None
    # a resumed run loads its weights from the checkpoint, but a reference (DPO's, or RL's KL
    # anchor) retrained from scratch need not match the one the run started with
    if resume_from is not None and uses_reference:
        raise ConfigError(f"checkpoint.resume: resuming {resume_from} needs the warm-start checkpoint {warm_dir} "
                          f"(the run's reference policy), and it is gone or its inputs changed "
                          f"(run.cache_dir={cfg.run.cache_dir}); restore it or set checkpoint.resume=none")
    return model_dir, warm_dir
