"""SFT and DPO: training on files of examples, no rollouts. One step = one optimizer step on
policy.train_global_batch_size examples (SFT) or half as many chosen/rejected pairs (DPO)."""

import logging
import os
from pathlib import Path

from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlkit.algorithms.loop import RunResult, run_steps
from rlkit.algorithms.losses import BatchTotals, DPOLossConfig, batch_totals
from rlkit.algorithms.objectives import DirectPreference, NextTokenNLL
from rlkit.algorithms.warm_start import cached_warm_start, warm_start_dir
from rlkit.checkpoint import CheckpointManager
from rlkit.cluster.roles import PolicyGroup
from rlkit.cluster.setup import start_workers
from rlkit.config.load import ConfigError
from rlkit.config.schema import FileDataConfig, RootConfig
from rlkit.data.arithmetic import arithmetic_splits
from rlkit.data.batch import Batch
from rlkit.data.packing import pack_sequences, pad_rows
from rlkit.data.rollout import PromptStream
from rlkit.data.sft import load_rows, tokenize_preference_row, tokenize_sft_row
from rlkit.data.synthetic import write_arithmetic_preferences, write_arithmetic_sft
from rlkit.models.resolve import resolve_model_dir
from rlkit.observability.metrics import MetricsLogger

log = logging.getLogger("rlkit")


def load_examples(d: FileDataConfig, tokenize, synthetic_writer) -> tuple[list, list]:
    """Tokenized (train, val) examples of data.train_path / data.val_path, after writing the
    synthetic set there first if data.synthetic asks for it and the files are missing."""
    if d.synthetic is not None:
        for path, rows in zip([d.train_path, d.val_path], arithmetic_splits(d.synthetic)):
            if path is not None and not Path(path).exists():
                log.info("data: writing the synthetic arithmetic set to %s", path)
                synthetic_writer(path, rows)
    splits = []
    for key, path in [("data.train_path", d.train_path), ("data.val_path", d.val_path)]:
        if path is None:
            splits.append([])
            continue
        try:
            splits.append([tokenize(row, f"{path} row {i}") for i, row in enumerate(load_rows(path))])
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"{key}: {e}") from None
    return splits[0], splits[1]


def _file_identity(*paths: str | None) -> list:
    """(path, size, mtime) of local files: a warm start cached for other contents is not reused."""
    return [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths if p and os.path.isfile(p)]


class SFT:
    """Examples are (input_ids, loss_mask) pairs, tokenized by the caller."""

    def __init__(self, cfg: RootConfig, policy: PolicyGroup, pad_id: int, train_examples: list, val_examples: list,
                 pack: bool):
        self.cfg, self.policy, self.pad_id, self.pack = cfg, policy, pad_id, pack
        self.train_examples, self.val_examples = train_examples, val_examples
        self.objective = NextTokenNLL()

    def batch(self, examples: list) -> Batch:
        """Rows (packed if self.pack), padded with empty rows to a multiple of DP x micro-batch."""
        rows = pack_sequences(examples, self.cfg.data.max_length, self.pad_id, self.pack)
        return pad_rows(rows, self.policy.layout.dp_size * self.cfg.policy.micro_batch_size, self.pad_id)

    def step(self, examples: list, step: int) -> dict:
        batch = self.batch(examples)
        metrics = self.policy.train(batch, batch_totals(batch["loss_mask"]), self.objective)
        tokens = max(batch["loss_mask"].sum().item(), 1.0)
        return {"train/loss": metrics["loss"], "train/grad_norm": metrics["grad_norm"],
                "train/entropy": metrics["entropy"] / tokens, "train/rows": len(batch),
                "train/tokens_per_row": batch["segment_ids"].gt(0).sum().item() / len(batch)}

    def validate(self) -> dict:
        if not self.val_examples:
            return {}
        batch = self.batch(self.val_examples)
        loss, _ = self.objective(self.policy.logprobs(batch), batch, batch_totals(batch["loss_mask"]))
        return {"val/loss": loss.item()}

    def save(self, checkpoint_dir: str):
        self.policy.call("save_checkpoint", checkpoint_dir, self.cfg.checkpoint.save_format)

    def load(self, checkpoint_dir: str):
        self.policy.call("load_checkpoint", checkpoint_dir, self.cfg.checkpoint.save_format)


class DPO(SFT):
    """Examples are (chosen_ids, chosen_mask, rejected_ids, rejected_mask); they become rows
    chosen_0, rejected_0, chosen_1, ... The frozen reference is the checkpoint at reference_dir."""

    def __init__(self, cfg: RootConfig, policy: PolicyGroup, pad_id: int, train_pairs: list, val_pairs: list,
                 reference_dir: Path):
        super().__init__(cfg, policy, pad_id, train_pairs, val_pairs, pack=False)
        a = cfg.algorithm
        self.loss = DPOLossConfig(a.beta, a.label_smoothing, a.loss_type, a.sft_weight)
        self.objective = DirectPreference(self.loss)
        policy.call("init_reference", str(reference_dir))

    def batch(self, pairs: list) -> Batch:
        """Right-padded rows (never packed: a pair's sequences are scored as wholes) with the
        reference's logprobs; padding pairs (all-pad rows) keep every split even."""
        examples = [seq for c_ids, c_mask, r_ids, r_mask in pairs for seq in ((c_ids, c_mask), (r_ids, r_mask))]
        rows = pack_sequences(examples, self.cfg.data.max_length, self.pad_id, pack=False).select(
            "input_ids", "loss_mask")
        rows = pad_rows(rows, self.policy.layout.dp_size * self.cfg.policy.micro_batch_size, self.pad_id)
        return rows.with_fields(reference_logprobs=self.policy.reference_logprobs(rows))

    def totals(self, batch: Batch) -> BatchTotals:
        """Pairs that have response tokens, and chosen response tokens (the SFT term's denominator)."""
        chosen_mask = batch["loss_mask"][0::2]
        return BatchTotals(num_tokens=float(chosen_mask.sum()), num_sequences=float((chosen_mask.sum(1) > 0).sum()))

    def step(self, pairs: list, step: int) -> dict:
        batch = self.batch(pairs)
        totals = self.totals(batch)
        m = self.policy.train(batch, totals, self.objective)
        return {"train/grad_norm": m["grad_norm"], **self.pair_metrics("train", m, totals)}

    def validate(self) -> dict:
        """The training objective and its per-pair metrics on the validation pairs."""
        if not self.val_examples:
            return {}
        batch = self.batch(self.val_examples)
        totals = self.totals(batch)
        loss, sums = self.objective(self.policy.logprobs(batch), batch, totals)
        return self.pair_metrics("val", {"loss": loss.item(), **{k: v.item() for k, v in sums.items()}}, totals)

    @staticmethod
    def pair_metrics(split: str, sums: dict, totals: BatchTotals) -> dict:
        """Loss, and per-pair means of the objective's sums (accuracy, margins, logprobs)."""
        n = max(totals.num_sequences, 1.0)
        means = {f"{split}/{'preference_accuracy' if k == 'accuracy' else k}": sums[k] / n
                 for k in ("accuracy", "reward_margin", "reward_chosen", "reward_rejected", "chosen_logprob",
                           "rejected_logprob")}
        return {f"{split}/loss": sums["loss"], **means}


def run_supervised(cfg: RootConfig, resolved: DictConfig) -> RunResult:
    """An SFT or DPO run (algorithm.name) on the files of the data section. DPO may warm-start with
    SFT on the chosen responses (algorithm.warm_start); that checkpoint is then its reference."""
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    checkpoints = CheckpointManager(cfg.checkpoint, run_dir)
    resume_from = checkpoints.to_resume()
    model_dir = resolve_model_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dpo = cfg.algorithm.name == "dpo"
    if dpo:
        train, val = load_examples(cfg.data, lambda row, where: tokenize_preference_row(tokenizer, row, where),
                                   lambda path, rows: write_arithmetic_preferences(path, rows, cfg.data.synthetic.seed))
        start_dir, warm_dir = warm_start_dir(cfg, model_dir, resume_from, *_file_identity(cfg.data.train_path))
    else:
        train, val = load_examples(cfg.data, lambda row, where: tokenize_sft_row(tokenizer, row, where),
                                   lambda path, rows: write_arithmetic_sft(path, rows, chat=True))
        start_dir, warm_dir = model_dir, None
    workers = start_workers(cfg, str(start_dir), with_generation=False)
    state_step = CheckpointManager.controller_state(resume_from)["step"] if resume_from else None
    logger = MetricsLogger(cfg.logger, run_dir, cfg.run.name, resolved, resume_step=state_step)
    try:
        pad_id = tokenizer.pad_token_id
        if warm_dir is not None:
            _warm_start_on_chosen(cfg, workers.policy, pad_id, train, warm_dir)
            start_dir = warm_dir
        workers.policy.call("set_learning_rate", cfg.policy.optimizer.lr)
        trainer = DPO(cfg, workers.policy, pad_id, train, val, start_dir) if dpo \
            else SFT(cfg, workers.policy, pad_id, train, val, cfg.data.pack)
        per_step = cfg.policy.train_global_batch_size // (2 if dpo else 1)
        examples = PromptStream(trainer.train_examples, per_step, cfg.run.seed)
        return run_steps(cfg, resolved, trainer, examples, checkpoints, logger, resume_from)
    finally:
        logger.close()
        workers.shutdown()


def _warm_start_on_chosen(cfg: RootConfig, policy: PolicyGroup, pad_id: int, pairs: list, warm_dir: Path):
    w = cfg.algorithm.warm_start
    log.info("warm start: %d SFT steps on the chosen responses before DPO, cached in %s", w.sft_steps, warm_dir)
    sft = SFT(cfg, policy, pad_id, [(ids, mask) for ids, mask, _, _ in pairs], [], pack=True)
    chosen = PromptStream(sft.train_examples, w.batch_size, cfg.run.seed)

    def train():
        policy.call("set_learning_rate", w.lr)
        for step in range(1, w.sft_steps + 1):
            loss = sft.step(next(chosen), step)["train/loss"]
            if step % 10 == 0 or step == w.sft_steps:
                log.info("warm start SFT step %d/%d: loss %.3f", step, w.sft_steps, loss)

    cached_warm_start(policy, warm_dir, train)
    policy.call("reset_optimizer")
