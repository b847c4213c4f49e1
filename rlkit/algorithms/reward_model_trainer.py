"""The reward model's trainer (the algorithm, its config and checks: rlkit/algorithms/reward_model.py):
SFT's loop of one optimizer step per step on file rows, on pairs, with the Bradley-Terry objective."""

from typing import TYPE_CHECKING, Iterator

import torch

from rlkit.algorithms.lr_schedule import schedule_of
from rlkit.algorithms.objectives import BradleyTerry
from rlkit.algorithms.reward_model import Pair
from rlkit.algorithms.sft import SFT
from rlkit.data.batch import Batch, BatchTotals, masked_batch
from rlkit.data.packing import pad_rows

if TYPE_CHECKING:
    from rlkit.algorithms.loop import RunContext

# per-pair means of the objective's sums, under the names DPO gives them
PAIR_METRICS = {"accuracy": "preference_accuracy", "reward_margin": "reward_margin", "reward_chosen": "reward_chosen",
                "reward_rejected": "reward_rejected"}


class RewardModelTrainer(SFT):
    """Examples are Pairs; they become rows chosen_0, rejected_0, chosen_1, ... (never packed: a
    row's reward reads all of it)."""

    def __init__(self, ctx: "RunContext"):
        cfg = ctx.cfg
        super().__init__(cfg, ctx.workers.policy, ctx.tokenizer.pad_token_id, ctx.data.val, pack=False,
                         rows_per_step=cfg.policy.train_global_batch_size // 2,
                         lr=schedule_of(cfg.policy.optimizer, cfg.algorithm.num_steps))
        self.objective = BradleyTerry()

    def rows(self, pairs: list[Pair]) -> tuple[Batch, BatchTotals]:
        """Right-padded rows, padded with all-pad pairs so every split stays even, and their totals
        (pairs with a response). A row's loss_mask is 1 at one position: after its last token that
        is not the pad token (HF's sequence classifiers read there too), where the head's output,
        token-aligned, has read the whole sequence; margins [B] holds each pair's margin on its
        rows."""
        sequences = [self.read_up_to(ids) for pair in pairs for ids in (pair.chosen_ids, pair.rejected_ids)]
        rows = masked_batch([(ids + [self.pad_id], [False] * len(ids) + [True]) for ids in sequences], self.pad_id)
        margins = torch.tensor([pair.margin for pair in pairs], dtype=torch.float32).repeat_interleave(2)
        rows = pad_rows(rows.with_fields(margins=margins), self.policy.layout.dp_size * self.cfg.policy.micro_batch_size,
                        self.pad_id)
        return rows, BatchTotals(num_tokens=float(len(sequences)), num_sequences=float(len(pairs)))

    def read_up_to(self, ids: list[int]) -> list[int]:
        """The first data.max_length tokens, up to the last that is not the pad token."""
        ids = ids[:self.cfg.data.max_length]
        while len(ids) > 1 and ids[-1] == self.pad_id:  # where the pad token is EOS, and ends the row
            ids = ids[:-1]
        return ids

    def step(self, rows: Iterator[list], step: int) -> dict:
        batch, totals = self.rows(next(rows))
        lr = self.set_learning_rate(step)
        sums = self.policy.train(batch, totals, self.objective)
        return {**lr, "train/grad_norm": sums["grad_norm"], **pair_metrics("train", sums, totals)}

    def validate(self) -> dict:
        """The objective and its per-pair metrics on the validation pairs."""
        if not self.val_examples:
            return {}
        batch, totals = self.rows(self.val_examples)
        self.policy.hold(batch)
        return pair_metrics("val", self.policy.evaluate_held(totals, self.objective), totals)


def pair_metrics(split: str, sums: dict, totals: BatchTotals) -> dict:
    """Loss, and per-pair means of the objective's sums (accuracy, the reward gap, each reward)."""
    pairs = max(totals.num_sequences, 1.0)
    return {f"{split}/loss": sums["loss"], **{f"{split}/{name}": sums[key] / pairs for key, name in PAIR_METRICS.items()}}
