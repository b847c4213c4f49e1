"""What every policy.bridge backend is to the rest of rlkit (ModelBridge), and what each one is
known to build and convert, declared as data (BRIDGES) and checked as the config loads
(check_bridge). Free of torch and of the backends' libraries: loading a config imports it."""

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from rlkit.config.schema import ConfigError, PolicyConfig

if TYPE_CHECKING:
    import torch

    from rlkit.bridge.common import RowExport

# policy.attention_backend: torch SDPA (sdpa_attention.py) or Megatron's unfused DotProductAttention
ATTENTION_BACKENDS = ("sdpa", "local")


@dataclass(frozen=True)
class BridgeSupport:
    """What a backend builds and converts as rlkit's tests check it; the rest is refused at config load."""
    # HF model types it converts with parity to HF and a bit-exact export; None: whatever the backend maps
    model_types: tuple[str, ...] | None
    expert_parallel: bool  # policy.expert_parallel_size > 1
    context_parallel: bool  # policy.context_parallel_size > 1
    virtual_pipeline: bool  # policy.virtual_pipeline_parallel_size > 1
    peft: bool  # adapters (policy.peft)


# policy.bridge
BRIDGES = {
    "mbridge": BridgeSupport(None, expert_parallel=True, context_parallel=True, virtual_pipeline=True, peft=False),
    # experts on one rank: its conversion numbers a rank's local experts as global ones only in TE's
    # grouped layout; never run with context parallelism or virtual stages here
    "megatron_bridge": BridgeSupport(("qwen2", "qwen3", "llama", "qwen3_moe", "glm4_moe"), expert_parallel=False,
                                     context_parallel=False, virtual_pipeline=False, peft=True),
}


def _bridge_that(supports: Callable[[BridgeSupport], bool]) -> str:
    """The first backend that `supports` (the fix a refusal names)."""
    return next(name for name, support in BRIDGES.items() if supports(support))


def check_bridge(p: PolicyConfig, model_type: str | None) -> None:
    """policy.bridge against what its backend supports (BRIDGES): the model's architecture, then each
    layout and the adapters it does not build; one ConfigError naming the key that asks for it."""
    support = BRIDGES[p.bridge]
    if support.model_types is not None and model_type not in support.model_types:
        raise ConfigError(f"policy.bridge: {p.bridge} converts the architectures {list(support.model_types)}, not "
                          f"{model_type!r}; use policy.bridge={_bridge_that(lambda s: s.model_types is None)} for it")
    layouts = [("policy.expert_parallel_size", p.expert_parallel_size, lambda s: s.expert_parallel),
               ("policy.context_parallel_size", p.context_parallel_size, lambda s: s.context_parallel)]
    for key, size, supports in layouts:
        if size > 1 and not supports(support):
            raise ConfigError(f"{key}: policy.bridge={p.bridge} runs with {key}=1 only (got: {size}); set "
                              f"{key}=1 or policy.bridge={_bridge_that(supports)}")
    vpp = p.virtual_pipeline_parallel_size
    if vpp > 1 and not support.virtual_pipeline:
        key, other = "policy.virtual_pipeline_parallel_size", _bridge_that(lambda s: s.virtual_pipeline)
        raise ConfigError(f"{key}: virtual stages are built and converted through {other} (got: policy.bridge="
                          f"{p.bridge}); set policy.bridge={other}, or {key}=1")
    if p.peft is not None and not support.peft:
        raise ConfigError(f"policy.peft: adapters are built by Megatron-Bridge's PEFT, which policy.bridge={p.bridge} "
                          f"does not run; set policy.bridge={_bridge_that(lambda s: s.peft)} or policy.peft=null")


def transformer_engine_installed() -> bool:
    """Whether the backends build TransformerEngine's layer spec (they do wherever it imports)."""
    return importlib.util.find_spec("transformer_engine") is not None


def check_transformer_engine_context_parallel(context_parallel_size: int) -> None:
    """With TransformerEngine installed, its attention replaces rlkit's SDPA attention, which is what
    takes rlkit's context-parallel split: a ConfigError for a run that splits its rows."""
    if context_parallel_size > 1 and transformer_engine_installed():
        # the worker splits rows and cuts packed masks the way rlkit/bridge/context_parallel.py attends;
        # TE's context-parallel attention takes neither, and this pairing has never run
        raise ConfigError(f"policy.context_parallel_size: context parallelism runs on rlkit's SDPA attention, "
                          f"which TransformerEngine's layer spec replaces (TE is installed here; got "
                          f"context_parallel_size={context_parallel_size}); set "
                          f"policy.context_parallel_size=1 or run without transformer_engine")


def check_transformer_engine_packing(packing_key: str, packing_off: str) -> None:
    """With TransformerEngine installed, its attention (causal over the whole row) replaces rlkit's
    SDPA attention, whose mask keeps each sequence of a packed row to itself: a ConfigError for a run
    that packs rows. packing_key names the key that packs them, packing_off its setting that doesn't."""
    if transformer_engine_installed():
        raise ConfigError(f"{packing_key}: packed rows keep each sequence's attention to itself through rlkit's "
                          f"SDPA attention, which TransformerEngine's layer spec replaces (TE is installed here, "
                          f"and its attention would cross sequences); set {packing_off} or run without "
                          f"transformer_engine")


class ModelBridge(ABC):
    """One HF checkpoint directory (hf_dir, its hf_config) seen as Megatron model chunks. Create it
    after megatron's parallel_state is initialized: the bridge reads TP/PP/CP/EP from it."""

    hf_dir: str
    hf_config: object

    @property
    @abstractmethod
    def transformer_config(self):
        """The TransformerConfig every model built here holds."""

    @abstractmethod
    def build(self, bf16: bool, wrap_with_ddp: bool, use_distributed_optimizer: bool = False,
              value_head: bool = False, fp32_lm_head: bool = False, value_bias: bool = True) -> list:
        """Model chunks of this rank; value_head=True swaps the LM head for a ValueHead (a critic;
        value_bias=False: without its bias, a reward model) before DDP wraps the model, so DDP and
        the optimizer see the head's parameters; fp32_lm_head computes the logits in fp32
        (common.lm_head_in_fp32)."""

    @abstractmethod
    def load_hf_weights(self, chunks: list, hf_dir: str | None = None):
        """The checkpoint's weights (hf_dir, else the bridge's own) into the chunks. Collective."""

    @abstractmethod
    def export_hf_weights(self, chunks: list) -> Iterator[tuple[str, "torch.Tensor"]]:
        """Yield (hf_name, tensor) gathered across TP/PP/EP, one tensor at a time, in the same order
        at every call. Collective: every model-parallel rank must iterate it to the end. No
        autograd: the broadcasts and gathers inside must not record graphs on parameters that
        require grad."""

    @abstractmethod
    def export_rows(self, chunks: list) -> "RowExport | None":
        """The export as row moves (common.probe_rows): for each HF tensor, in export order, the
        Megatron parameter rows it is made of. Only where this rank holds every weight (TP=PP=EP=1,
        one chunk); None otherwise, or where a conversion does more than move rows. The caller
        checks the result against a real export before trusting it (see policy refit_manifest)."""

    @abstractmethod
    def save_hf_weights(self, chunks: list, out_dir: str):
        """The chunks' weights as an HF safetensors checkpoint in out_dir. Collective."""

    def checkpointed_state(self, model) -> dict:
        """The unwrapped model chunk's sharded state dict as a distributed checkpoint holds it:
        every weight, or with adapters the adapters alone (the frozen base is the HF checkpoint
        it was loaded from)."""
        return model.sharded_state_dict()

    def load_model_state(self, model, state: dict):
        """A distributed checkpoint's model state (as checkpointed_state laid it out, loaded) into
        the unwrapped model chunk."""
        model.load_state_dict(state)

    # policy.peft: every model built here carries trainable adapters over frozen weights; exports
    # and saves hold the adapters merged into the weights
    has_adapters: bool = False

    def adapters_disabled(self, chunks: list):
        """A context in which the chunks compute without their adapters: the base model."""
        raise NotImplementedError(f"{type(self).__name__} builds no adapters")

    def load_adapter_checkpoint(self, chunks: list, checkpoint_dir: str):
        """The adapters of a distributed adapter checkpoint (a policy.peft run's policy/ folder),
        saved at any TP/PP. Collective."""
        raise NotImplementedError(f"{type(self).__name__} builds no adapters")

    def restart_adapters(self, chunks: list):
        """Adapters back to adding nothing (as created), so the chunks compute their base model."""
        raise NotImplementedError(f"{type(self).__name__} builds no adapters")

    def export_adapter_weights(self, chunks: list) -> list[tuple[str, "torch.Tensor"]]:
        """(PEFT name, tensor) of every adapter weight, gathered whole (refit.peft=adapter).
        Collective."""
        raise NotImplementedError(f"{type(self).__name__} builds no adapters")

    def load_trunk_weights(self, critic_chunks: list, bf16: bool):
        """Initialise a critic (or a reward model) from the HF checkpoint: every weight but the LM
        head (which the critic replaced). Goes through a temporary LM so the bridge's own name
        mapping is used."""
        from rlkit.bridge.common import copy_trunk

        lm = self.build(bf16=bf16, wrap_with_ddp=False)
        self.load_hf_weights(lm)
        copy_trunk(lm, critic_chunks)
