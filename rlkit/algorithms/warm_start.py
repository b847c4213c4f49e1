"""Warm starts: a short supervised run before RL or DPO, cached so later runs skip it."""

import logging
import os
import shutil
from pathlib import Path

from rlkit.algorithms.losses import batch_totals
from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.cluster.roles import PolicyGroup
from rlkit.config.load import ConfigError
from rlkit.config.schema import RootConfig
from rlkit.data.rollout import PromptStream, supervised_batch
from rlkit.models.resolve import cache_key

log = logging.getLogger("rlkit")


def sft_steps(policy: PolicyGroup, tokenizer, dataset, steps: int, batch_size: int, lr: float,
              seed: int) -> list[float]:
    """`steps` optimizer steps of NLL on answer + EOS tokens. Returns the loss of each step."""
    rows = PromptStream(dataset, batch_size, seed)
    policy.call("set_learning_rate", lr)
    losses = []
    for step in range(1, steps + 1):
        batch_rows = next(rows)
        prompts = [tokenizer(r["prompt"])["input_ids"] for r in batch_rows]
        targets = [tokenizer(r["answer"])["input_ids"] + [tokenizer.eos_token_id] for r in batch_rows]
        batch = supervised_batch(prompts, targets, tokenizer.pad_token_id)
        losses.append(policy.train(batch, batch_totals(batch["loss_mask"]), NextTokenNLL())["loss"])
        if step % 10 == 0 or step == steps:
            log.info("warm start SFT step %d/%d: loss %.3f", step, steps, losses[-1])
    return losses


def cached_warm_start(policy: PolicyGroup, out_dir: Path, train) -> None:
    """Run `train()` and save the policy as an HF checkpoint at out_dir, atomically: a
    half-written directory never looks complete."""
    train()
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.call("save_hf", str(tmp))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def warm_start_dir(cfg: RootConfig, model_dir: Path, resume_from: Path | None,
                   *data_identity) -> tuple[Path, Path | None]:
    """(directory the policy starts from, warm-start directory still to be written or None).
    The cache key covers the model, the warm-start settings, the data section and data_identity
    (e.g. the data files' sizes and times), so a change to any of them trains a new warm start."""
    w = cfg.algorithm.warm_start
    if w.sft_steps == 0:
        return model_dir, None
    key = cache_key(str(model_dir), w.sft_steps, w.batch_size, w.lr, cfg.data, cfg.run.seed, *data_identity)
    warm_dir = Path(cfg.run.cache_dir).resolve() / f"warm-start-{key}"
    if (warm_dir / "config.json").is_file():
        log.info("warm start: using the cached SFT checkpoint %s", warm_dir)
        return warm_dir, None
    # a resumed run loads its weights from the checkpoint, but a reference (DPO's, or RL's KL
    # anchor) retrained from scratch need not match the one the run started with
    if resume_from is not None and (cfg.algorithm.name == "dpo" or cfg.algorithm.kl_coef > 0):
        raise ConfigError(f"checkpoint.resume: resuming {resume_from} needs the warm-start checkpoint {warm_dir} "
                          f"(the run's reference policy), and it is gone or its inputs changed "
                          f"(run.cache_dir={cfg.run.cache_dir}); restore it or set checkpoint.resume=none")
    return model_dir, warm_dir
