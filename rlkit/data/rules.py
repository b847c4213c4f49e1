"""The config's rules for the data section: its kind against the algorithm's, the prompt template
and its settings, and a synthetic set's sizes; one ConfigError line each, as the config loads."""

from rlkit.config.choices import TOOL_PROMPTS
from rlkit.config.schema import ConfigError, FileDataConfig, PromptDataConfig, check_choice, check_positive

# data.name -> config groups of that kind, for error messages
DATA_GROUPS = {"prompts": "data=arithmetic, gsm8k, math, word_problems or prompt_files", "sft_files": "data=arithmetic_sft",
               "preference_files": "data=arithmetic_preferences, arithmetic_preferences_large or "
                                                   "word_problem_preferences"}


def check_data(d: PromptDataConfig | FileDataConfig, algorithm: str, kind: str) -> None:
    """data.*, for an algorithm that trains on data of `kind` (its spec's data)."""
    if d.name != kind:
        raise ConfigError(f"data.name: algorithm {algorithm} trains on data of kind {kind!r} (got: "
                          f"{d.name!r}); select a group of that kind: {DATA_GROUPS[kind]}")
    if d.name == "prompts":
        _check_prompts(d)
    if d.synthetic is not None:
        _check_synthetic(d)


def check_prompt_format(key: str, template: str) -> None:
    try:
        template.format(prompt="")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"{key}: must be a template with {{prompt}} and no other fields (got: "
                          f"{template!r}: {type(e).__name__} {e}); write literal braces as {{{{ }}}}") from None
    if "{prompt}" not in template:
        raise ConfigError(f"{key}: must contain {{prompt}} (got: {template!r})")


def _check_prompts(d: PromptDataConfig) -> None:
    check_prompt_format("data.prompt_format", d.prompt_format)
    if d.system_prompt is not None and not d.chat_template:
        raise ConfigError("data.system_prompt: needs data.chat_template=true (raw prompts have no system turn); "
                          "set data.system_prompt=null or data.chat_template=true")
    check_positive(("data.max_prompt_tokens", d.max_prompt_tokens),
                   *([("data.val_size", d.val_size)] if d.val_size else []))
    check_choice("data.tool_prompt", d.tool_prompt, TOOL_PROMPTS)
    if d.val_size == 0:
        raise ConfigError("data.val_size: must be >= 1 or null (all rows) (got: 0); to skip validation set "
                          "data.val_path=null")


def _check_synthetic(d: PromptDataConfig | FileDataConfig) -> None:
    """data.synthetic: the sizes. The generator's own checks (kind, operations, enough distinct
    problems for the sizes) run when preflight generates the set to check where it goes."""
    s = d.synthetic
    check_positive(("data.synthetic.train_size", s.train_size), ("data.synthetic.max_operand", s.max_operand))
    if s.val_size < 0:
        raise ConfigError(f"data.synthetic.val_size: must be >= 0 (got: {s.val_size}); set a count of problems")
    if s.val_size == 0 and d.val_path is not None:
        raise ConfigError("data.synthetic.val_size: must be >= 1 while data.val_path is set (got: 0); to skip "
                          "validation set data.val_path=null")
    if hasattr(s, "prompt_format"):  # preference sets only
        check_prompt_format("data.synthetic.prompt_format", s.prompt_format)
    malformed = getattr(s, "malformed_fraction", 0.0)  # preference sets only
    if not 0.0 <= malformed <= 1.0:
        raise ConfigError(f"data.synthetic.malformed_fraction: must be in [0, 1] (got: {malformed}); the share of "
                          f"rejected responses that are malformed instead of near misses")
