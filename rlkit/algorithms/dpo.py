"""DPO and its variants (sigmoid_norm, IPO, hinge, robust, LD-DPO) on (prompt, chosen, rejected) file rows against the
frozen starting policy. One step = one optimizer step on policy.train_global_batch_size / 2 pairs. An optional SFT warm
start on the chosen responses (algorithm.warm_start) becomes both the start and the reference."""

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from omegaconf import MISSING

from rlkit.algorithms.lr_schedule import LearningRateSchedule, schedule_of
from rlkit.algorithms.registry import AlgorithmConfig, AlgorithmSpec
from rlkit.algorithms.sft import SFT, validate_file_data
from rlkit.algorithms.warm_start import validate_warm_start
from rlkit.config.choices import DPO_LOSS_TYPES
from rlkit.config.schema import ConfigError, PolicyConfig, RootConfig, WarmStartConfig
from rlkit.data.sft import file_identity, load_tokenized_splits, tokenize_preference_row
from rlkit.data.stream import ShuffledStream

# torch and Ray are imported in the methods that train, not here: loading a config imports this module
if TYPE_CHECKING:
    from rlkit.algorithms.loop import RunContext, TrainingData
    from rlkit.data.batch import BatchTotals

log = logging.getLogger("rlkit")


@dataclass
class DPOConfig(AlgorithmConfig):
    beta: float = MISSING
    label_smoothing: float = MISSING
    loss_type: str = MISSING
    ld_alpha: float = MISSING
    sft_weight: float = MISSING
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)


def load_pairs(cfg: RootConfig, tokenizer) -> "TrainingData":
    from rlkit.algorithms.loop import TrainingData

    train, val = load_tokenized_splits(cfg.data, functools.partial(tokenize_preference_row, tokenizer))
    return TrainingData(train, val, identity=file_identity(cfg.data.train_path))


class DPO(SFT):
    """Examples are (chosen_ids, chosen_mask, rejected_ids, rejected_mask); they become rows
    chosen_0, rejected_0, chosen_1, ... The frozen reference is the checkpoint at ctx.start_dir."""

    def __init__(self, ctx: "RunContext"):
        from rlkit.algorithms.losses import DPOLossConfig
        from rlkit.algorithms.objectives import DirectPreference

        cfg, policy = ctx.cfg, ctx.workers.policy
        super().__init__(cfg, policy, ctx.tokenizer.pad_token_id, ctx.data.val, pack=False,
                         rows_per_step=cfg.policy.train_global_batch_size // 2,
                         lr=schedule_of(cfg.policy.optimizer, cfg.algorithm.num_steps))
        a = cfg.algorithm
        self.objective = DirectPreference(DPOLossConfig(a.beta, a.label_smoothing, a.loss_type, a.sft_weight,
                                                        a.ld_alpha))
        policy.init_reference(str(ctx.start_dir))

    def hold(self, pairs: list) -> "BatchTotals":
        """Right-padded rows (never packed: a pair's sequences are scored as wholes), padded with
        all-pad pairs so every split stays even, held on the workers with the reference's
        logprobs; their totals: pairs with a response, and chosen response tokens (the SFT
        term's denominator)."""
        from rlkit.data.batch import BatchTotals
        from rlkit.data.packing import pack_sequences, pad_rows

        examples = [seq for c_ids, c_mask, r_ids, r_mask in pairs for seq in ((c_ids, c_mask), (r_ids, r_mask))]
        rows = pack_sequences(examples, self.cfg.data.max_length, self.pad_id, pack=False).select(
            "input_ids", "loss_mask")
        rows = pad_rows(rows, self.policy.layout.dp_size * self.cfg.policy.micro_batch_size, self.pad_id)
        self.policy.hold(rows)
        self.policy.forward_held("reference_logprobs", reference=True)
        chosen_mask = rows["loss_mask"][0::2]
        return BatchTotals(num_tokens=float(chosen_mask.sum()), num_sequences=float((chosen_mask.sum(1) > 0).sum()))

    def step(self, rows: Iterator[list], step: int) -> dict:
        totals = self.hold(next(rows))
        lr = self.set_learning_rate(step)
        m = self.policy.train_held(0, 1, totals, self.objective)
        return {**lr, "train/grad_norm": m["grad_norm"], **self.pair_metrics("train", m, totals)}

    def validate(self) -> dict:
        """The training objective and its per-pair metrics on the validation pairs."""
        if not self.val_examples:
            return {}
        totals = self.hold(self.val_examples)
        sums = self.policy.evaluate_held(totals, self.objective)
        return self.pair_metrics("val", sums, totals)

    @staticmethod
    def pair_metrics(split: str, sums: dict, totals: "BatchTotals") -> dict:
        """Loss, and per-pair means of the objective's sums (accuracy, margins, logprobs)."""
        n = max(totals.num_sequences, 1.0)
        means = {f"{split}/{'preference_accuracy' if k == 'accuracy' else k}": sums[k] / n
                 for k in ("accuracy", "reward_margin", "reward_chosen", "reward_rejected", "chosen_logprob",
                           "rejected_logprob")}
        return {f"{split}/loss": sums["loss"], **means}


def warm_start_on_chosen(cfg: RootConfig, policy, tokenizer, data: "TrainingData", out_dir) -> None:
    """SFT on the chosen responses (packed) before DPO (or a reward model: its pairs hold a margin
    after these four)."""
    w = cfg.algorithm.warm_start
    sft = SFT(cfg, policy, tokenizer.pad_token_id, [], pack=True, rows_per_step=w.batch_size,
              lr=LearningRateSchedule(w.lr, w.sft_steps))
    chosen = ShuffledStream([(ids, mask) for ids, mask, _, _, *_ in data.train], w.batch_size, cfg.run.seed)
    for step in range(1, w.sft_steps + 1):
        loss = sft.step(chosen, step)["train/loss"]
        if step % 10 == 0 or step == w.sft_steps:
            log.info("warm start SFT step %d/%d: loss %.3f", step, w.sft_steps, loss)


def validate(cfg: RootConfig, dp: int) -> None:
    a, p = cfg.algorithm, cfg.policy
    validate_file_data(cfg, dp)
    if a.loss_type not in DPO_LOSS_TYPES:
        raise ConfigError(f"algorithm.loss_type: must be one of {list(DPO_LOSS_TYPES)} (got: {a.loss_type!r}); "
                          f"pick one of those")
    if a.beta <= 0:
        raise ConfigError(f"algorithm.beta: must be > 0 (got: {a.beta}); DPO's usual range is 0.01-0.5")
    if not 0 <= a.label_smoothing < 0.5:
        raise ConfigError(f"algorithm.label_smoothing: must lie in [0, 0.5) (got: {a.label_smoothing}); "
                          f"0 is plain DPO")
    if a.loss_type in ("ipo", "hinge", "sigmoid_norm") and a.label_smoothing > 0:
        raise ConfigError(f"algorithm.label_smoothing: applies to the sigmoid loss only (cDPO) and its robust "
                          f"variant (got: {a.label_smoothing} with loss_type={a.loss_type}); set it to 0 or use "
                          f"loss_type=sigmoid or robust")
    if not 0 <= a.ld_alpha <= 1:
        raise ConfigError(f"algorithm.ld_alpha: must lie in [0, 1] (got: {a.ld_alpha}); 1.0 is DPO, LD-DPO's "
                          f"down-weighting of the longer response's verbose tokens is below 1 (e.g. 0.5)")
    if a.sft_weight < 0:
        raise ConfigError(f"algorithm.sft_weight: must be >= 0 (got: {a.sft_weight}); 0 disables the SFT term")
    validate_warm_start(cfg, dp)
    check_pairs_in_micro_batches(p, "DPO")


def check_pairs_in_micro_batches(p: PolicyConfig, who: str) -> None:
    """Each chosen/rejected pair's rows (consecutive) stay in one micro-batch, where its loss is
    computed; `who` (DPO, a reward model) names the algorithm in the message."""
    if p.max_tokens_per_microbatch:
        raise ConfigError(f"policy.max_tokens_per_microbatch: {who} keeps each chosen/rejected pair in one "
                          f"micro-batch, which a token budget would split (got: {p.max_tokens_per_microbatch}); "
                          f"set it to 0")
    if p.micro_batch_size % 2:
        raise ConfigError(f"policy.micro_batch_size: {who} keeps each chosen/rejected pair in one micro-batch, "
                          f"so it must be even (got: {p.micro_batch_size})")


ALGORITHM = AlgorithmSpec(name="dpo", config=DPOConfig, data="preference_files", load_data=load_pairs, trainer=DPO,
                          validate=validate, warm_start=warm_start_on_chosen,
                          uses_reference=lambda a: True)
