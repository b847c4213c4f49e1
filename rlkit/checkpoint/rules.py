"""The config's rules for checkpoints (checkpoint.*): one ConfigError line each, as the config loads.
Its folder is checked with the run's other folders, last (rlkit/launch/config.py)."""

from rlkit.checkpoint import named_checkpoint
from rlkit.config.schema import ConfigError, RootConfig, check_choice

# checkpoint.save_format: Megatron's distributed checkpoint, or HF weights with per-rank optimizer state
SAVE_FORMATS = ("dist", "hf")


def check_checkpoint(cfg: RootConfig) -> None:
    c, p = cfg.checkpoint, cfg.policy
    check_choice("checkpoint.save_format", c.save_format, SAVE_FORMATS)
    if c.save_format == "hf" and p.use_distributed_optimizer:
        raise ConfigError("checkpoint.save_format: hf keeps per-rank optimizer state, which the distributed optimizer "
                          "does not expose that way, so a resume would restore stale weights; use "
                          "checkpoint.save_format=dist (or policy.use_distributed_optimizer=false)")
    if c.save_format == "hf" and p.peft is not None:
        raise ConfigError("checkpoint.save_format: hf saves the policy with its adapters merged into the weights, "
                          "which a resume would load as the base under the adapters again; use "
                          "checkpoint.save_format=dist with policy.peft")
    if c.every < 0 or c.keep_last < 0:
        raise ConfigError(f"checkpoint.every / checkpoint.keep_last: must be >= 0 (got: {c.every}, "
                          f"{c.keep_last}); 0 means only at the end / keep all")
    c.check_timeouts()
    if c.resume not in ("auto", "none"):
        named_checkpoint(c.resume)
