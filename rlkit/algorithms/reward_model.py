"""Reward models: a scalar head on the policy's model (policy.*), trained on (prompt, chosen, rejected)
file rows with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin) (losses.py
bradley_terry_loss). A row's reward is the head's output at its last token that is not the pad
token (the whole chat-templated conversation read), where HF's sequence classifiers read theirs:
`rlkit convert` exports a checkpoint as one (rlkit/workers/policy/reward_export.py). One step = one
optimizer step on policy.train_global_batch_size / 2 pairs. An optional SFT warm start on the chosen
responses (algorithm.warm_start, as DPO's) gives the trunk the task's language first."""

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from omegaconf import MISSING

from rlkit.algorithms.dpo import check_pairs_in_micro_batches, warm_start_on_chosen
from rlkit.algorithms.registry import AlgorithmConfig, AlgorithmSpec, Lazy
from rlkit.algorithms.sft import validate_file_data
from rlkit.algorithms.warm_start import validate_warm_start
from rlkit.config.schema import ConfigError, RootConfig, WarmStartConfig
from rlkit.data.sft import file_identity, load_tokenized_splits, tokenize_preference_row
from rlkit.models.shape import model_shape

# torch is imported in the functions that train, not here: loading a config imports this module
if TYPE_CHECKING:
    from rlkit.algorithms.loop import TrainingData


@dataclass
class RewardModelConfig(AlgorithmConfig):
    margin: float = MISSING
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)


class Pair(NamedTuple):
    """A tokenized preference row as DPO's (data/sft.py tokenize_preference_row: each response's
    whole conversation, its mask on the response), and the gap asked between the two rewards."""

    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    margin: float


def load_pairs(cfg: RootConfig, tokenizer) -> "TrainingData":
    """The pairs of the data files; first, that the model has an HF form to export it as (that
    check reads transformers' table of architectures, too slow for the config's checks)."""
    from rlkit.algorithms.loop import TrainingData

    check_exportable(cfg)
    tokenize = functools.partial(tokenize_pair, tokenizer, cfg.algorithm.margin)
    train, val = load_tokenized_splits(cfg.data, tokenize)
    return TrainingData(train, val, identity=file_identity(cfg.data.train_path))


def tokenize_pair(tokenizer, margin: float, row: dict, where: str, max_tokens: int) -> Pair:
    """A preference row as DPO reads it (data/sft.py tokenize_preference_row), with its own margin:
    the row's optional "margin" field, else algorithm.margin."""
    tokens = tokenize_preference_row(tokenizer, row, where, max_tokens)
    own = row.get("margin")
    if own is not None:
        if isinstance(own, bool) or not isinstance(own, (int, float)) or not math.isfinite(own) or own < 0:
            raise ValueError(f"{where}: 'margin' must be a finite number >= 0 (got: {own!r}); give one, or leave the "
                             f"field out for algorithm.margin")
        margin = float(own)
    return Pair(*tokens, margin)


def check_exportable(cfg: RootConfig) -> None:
    """A ConfigError unless transformers has a sequence classifier of the model's architecture,
    which `rlkit convert` exports the reward model as."""
    from rlkit.workers.policy.reward_export import sequence_classifier  # transformers' table: torch

    p = cfg.policy
    model_type = model_shape(p.model_path, p.tiny_model.num_layers, p.tiny_model.hidden_size).model_type
    if sequence_classifier(model_type) is None:
        raise ConfigError(f"policy.model_path: a reward model is exported as an HF sequence classifier, which "
                          f"transformers has none of for {model_type} models (got: {p.model_path}); start from a "
                          f"model of an architecture that has one (e.g. qwen2, qwen3, llama)")


def validate(cfg: RootConfig, dp: int) -> None:
    validate_file_data(cfg, dp)
    if cfg.algorithm.margin < 0:
        raise ConfigError(f"algorithm.margin: must be >= 0 (got: {cfg.algorithm.margin}); 0 is the plain "
                          f"Bradley-Terry loss")
    for section in ("generation", "refit", "env", "env_runner"):
        if getattr(cfg, section) is not None:
            raise ConfigError(f"{section}: a reward model trains on preference files and generates no rollouts, so "
                              f"this section would never be used; remove /{section} from the recipe's defaults "
                              f"(see recipes/reward_model_tiny_cpu.yaml)")
    if cfg.policy.peft is not None:
        raise ConfigError(f"policy.peft: a reward model trains its scalar head, which adapters would freeze and "
                          f"their checkpoints would not hold (got: {cfg.policy.peft.type}); set policy.peft=null")
    if cfg.checkpoint.save_format != "dist":
        raise ConfigError(f"checkpoint.save_format: a reward model's scalar head has no HF name in a resumable "
                          f"checkpoint (got: {cfg.checkpoint.save_format}); use checkpoint.save_format=dist, and "
                          f"rlkit convert for an HF sequence classifier")
    validate_warm_start(cfg, dp)
    check_pairs_in_micro_batches(cfg.policy, "a reward model")


ALGORITHM = AlgorithmSpec(name="reward_model", config=RewardModelConfig, data="preference_files", load_data=load_pairs,
                          trainer=Lazy("rlkit.algorithms.reward_model_trainer:RewardModelTrainer"), validate=validate,
                          head="reward", warm_start=warm_start_on_chosen)
