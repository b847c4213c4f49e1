"""The local HF model directories that model rewards load: what one must hold, checked as the
config loads (its config.json and tokenizer, no weights), and loading one, where running out of
memory is one line naming the model and what to do."""

import json
from pathlib import Path

# the Auto class each kind of model loads with, and the ending of the architecture its config.json names
REWARD_MODEL = ("AutoModelForSequenceClassification", "ForSequenceClassification")
CAUSAL_LM = ("AutoModelForCausalLM", "ForCausalLM")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def model_dir_problem(key: str, path: str, kind: tuple[str, str]) -> str | None:
    """Why `path` is not a directory of `kind` (REWARD_MODEL: one score, num_labels=1), naming
    the env key; None if it is."""
    auto_class, suffix = kind
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return (f"{key}: {path} is not a local HF model directory (no config.json there); give a directory "
                f"saved by {auto_class}.save_pretrained")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"{key}: cannot read {config_file} ({e}); give a directory saved by {auto_class}.save_pretrained"
    architectures = config.get("architectures") or []
    if not any(name.endswith(suffix) for name in architectures):
        return (f"{key}: {path} holds no *{suffix} model (config.json architectures: {architectures}); give a "
                f"directory saved by {auto_class}.save_pretrained")
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if kind == REWARD_MODEL and labels != 1:
        return (f"{key}: {path} has {labels} labels; a reward model gives one score (num_labels=1): export it "
                f"with AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)")
    return None


# a tokenizer's own files: fast (tokenizers), sentencepiece, byte-level BPE
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def tokenizer_problem(key: str, path: str, needs_chat_template: bool) -> str | None:
    """Why the tokenizer in `path` cannot render the conversations (no tokenizer, no chat template
    where needed, no pad or EOS token to batch with), naming the env key; None if it can. Read from
    its files, not loaded: a config's checks import no transformers (nor torch behind it)."""
    folder = Path(path)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return f"{key}: no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)}); save the model's tokenizer there"
    try:
        settings = {**_json_or_empty(folder / "special_tokens_map.json"),
                    **_json_or_empty(folder / "tokenizer_config.json")}
    except (OSError, json.JSONDecodeError) as e:
        return f"{key}: cannot read the tokenizer's settings in {path} ({e}); save the model's tokenizer there"
    template = settings.get("chat_template") or any((folder / name).is_file() for name in
                                                    ("chat_template.jinja", "chat_template.json"))
    if needs_chat_template and not template:
        return (f"{key}: the tokenizer in {path} has no chat template to render the conversation with; save one "
                f"with the model (tokenizer.chat_template), or set env.chat_template=false to score the prompt "
                f"and response as plain text")
    if not settings.get("pad_token") and not settings.get("eos_token"):
        return f"{key}: the tokenizer in {path} has neither a pad nor an EOS token to batch with; set pad_token " \
               f"in its tokenizer_config.json"
    return None


def _json_or_empty(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def dtype_problem(dtype: str) -> str | None:
    if dtype not in DTYPES:
        return f"env.dtype: must be one of {list(DTYPES)} (got: {dtype!r}); auto keeps the checkpoint's"
    return None


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(error, RuntimeError) and ("out of memory" in str(error) or "can't allocate memory" in str(error)))


def load_model(kind: tuple[str, str], path: str, device: str, dtype: str, what: str):
    """The model in `path` on `device`, in eval mode. Out of memory is a MemoryError of one
    line naming the model and what to do."""
    import transformers

    try:
        model = getattr(transformers, kind[0]).from_pretrained(path, dtype=dtype)
        return model.to(device).eval()
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        raise MemoryError(out_of_memory_line(what, device)) from None


def out_of_memory_line(what: str, device: str) -> str:
    where = "its GPU" if device.startswith("cuda") else "this machine's memory"
    return (f"{what}: out of memory loading it on {device}: it does not fit in {where}; give it a GPU of its own "
            f"(env.num_gpus=1), a smaller dtype (env.dtype=bfloat16) or a smaller model")
