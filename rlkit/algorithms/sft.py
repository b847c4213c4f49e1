"""Supervised fine-tuning: next-token NLL on the response tokens of file rows, no rollouts. One
step = one optimizer step on policy.train_global_batch_size examples (packed if data.pack)."""

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from rlkit.checkpoint import WrittenFiles
from rlkit.algorithms.lr_schedule import LearningRateSchedule, schedule_of
from rlkit.algorithms.registry import AlgorithmConfig, AlgorithmSpec
from rlkit.bridge.base import check_transformer_engine_packing
from rlkit.config.schema import ConfigError, RootConfig
from rlkit.data.sft import load_tokenized_splits, tokenize_sft_row

# torch and Ray are imported in the methods that train, not here: loading a config imports this module
if TYPE_CHECKING:
    from rlkit.algorithms.loop import RunContext, TrainingData
    from rlkit.data.batch import Batch


@dataclass
class SFTConfig(AlgorithmConfig):
    pass


def load_examples(cfg: RootConfig, tokenizer) -> "TrainingData":
    from rlkit.algorithms.loop import TrainingData

    train, val = load_tokenized_splits(cfg.data, functools.partial(tokenize_sft_row, tokenizer))
    return TrainingData(train, val)


def validate_file_data(cfg: RootConfig, dp: int) -> None:
    if cfg.data.max_length < 1:
        raise ConfigError(f"data.max_length: must be >= 1 (got: {cfg.data.max_length}); set a positive value")


def validate(cfg: RootConfig, dp: int) -> None:
    validate_file_data(cfg, dp)
    if cfg.data.pack:
        check_transformer_engine_packing("data.pack", "data.pack=false")


class SFT:
    """Examples are (input_ids, loss_mask) pairs, tokenized by load_examples."""

    def __init__(self, cfg: RootConfig, policy, pad_id: int, val_examples: list, pack: bool, rows_per_step: int,
                 lr: LearningRateSchedule):
        from rlkit.algorithms.objectives import NextTokenNLL

        self.cfg, self.policy, self.pad_id, self.pack = cfg, policy, pad_id, pack
        self.val_examples, self.rows_per_step, self.lr = val_examples, rows_per_step, lr
        self.objective = NextTokenNLL()

    @classmethod
    def from_context(cls, ctx: "RunContext") -> "SFT":
        return cls(ctx.cfg, ctx.workers.policy, ctx.tokenizer.pad_token_id, ctx.data.val, ctx.cfg.data.pack,
                   ctx.cfg.policy.train_global_batch_size, schedule_of(ctx.cfg.policy.optimizer, ctx.cfg.algorithm.num_steps))

    def set_learning_rate(self, step: int) -> dict:
        """One optimizer step per training step: step 1 trains at the schedule's step 0."""
        lr = self.lr(step - 1)
        self.policy.set_learning_rate(lr)
        return {"train/lr": lr}

    def batch(self, examples: list) -> "Batch":
        """Rows (packed if self.pack), padded with empty rows to a multiple of DP x micro-batch."""
        from rlkit.data.packing import pack_sequences, pad_rows

        rows = pack_sequences(examples, self.cfg.data.max_length, self.pad_id, self.pack)
        return pad_rows(rows, self.policy.layout.dp_size * self.cfg.policy.micro_batch_size, self.pad_id)

    def step(self, rows: Iterator[list], step: int) -> dict:
        from rlkit.data.batch import batch_totals

        batch = self.batch(next(rows))
        lr = self.set_learning_rate(step)
        metrics = self.policy.train(batch, batch_totals(batch["loss_mask"]), self.objective)
        tokens = max(batch["loss_mask"].sum().item(), 1.0)
        return {**lr, "train/loss": metrics["loss"], "train/grad_norm": metrics["grad_norm"],
                "train/entropy": metrics["entropy"] / tokens, "train/rows": len(batch),
                "train/tokens_per_row": batch["segment_ids"].gt(0).sum().item() / len(batch)}

    def validate(self) -> dict:
        from rlkit.data.batch import batch_totals

        if not self.val_examples:
            return {}
        batch = self.batch(self.val_examples)
        self.policy.hold(batch)
        return {"val/loss": self.policy.evaluate_held(batch_totals(batch["loss_mask"]), self.objective)["loss"]}

    def save(self, checkpoint_dir: str) -> dict[str, float]:
        return self.policy.save_checkpoint(checkpoint_dir, self.cfg.checkpoint.save_format)

    def saved(self, wait: bool) -> WrittenFiles | None:
        return self.policy.finish_checkpoint(wait)

    def load(self, checkpoint_dir: str, step: int):
        self.policy.load_checkpoint(checkpoint_dir, self.cfg.checkpoint.save_format)

    def close(self):
        pass


ALGORITHM = AlgorithmSpec(name="sft", config=SFTConfig, data="sft_files", load_data=load_examples,
                          trainer=SFT.from_context, validate=validate)
