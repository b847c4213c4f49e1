"""A Megatron rank's checkpoints and exports: weights, optimizer state and RNG into a checkpoint
folder and back (a distributed checkpoint written in the background, dist_checkpoint.py, or HF
weights with per-rank optimizer state), and the HF and PEFT exports. The worker hands in what
changes between calls (the optimizer, the learning rate, the adapters' base) with each call."""

import functools
import os
import time

import torch
import torch.distributed as dist

from rlkit.bridge.adapters import write_hf_peft_adapter
from rlkit.bridge.common import unwrap
from rlkit.checkpoint import WrittenFiles
from rlkit.workers.policy import dist_checkpoint
from rlkit.workers.policy.adapter_base import record_base, weights_digest
from rlkit.workers.policy.reward_export import save_sequence_classifier

# The distributed optimizer's state in a canonical per-parameter layout, so a checkpoint loads at
# any TP/PP/DP (megatron-core's default layout for it is deprecated and refuses to save).
OPTIMIZER_CHECKPOINT_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


class CheckpointIO:
    def __init__(self, name: str, rank: int, bridge, model: list, head: str, writes_full_state: bool):
        """name: the model's folder in a checkpoint (policy, critic); head: the worker's (a reward
        model's HF export is a sequence classifier); writes_full_state: whether this rank's
        distributed checkpoint holds its parameters and their optimizer state as they are here
        (megatron-core writes a replicated tensor from its first holder alone, data-parallel rank 0;
        a distributed optimizer's state is gathered to that rank at the save instead, so a
        reservation could not be sized from its shard; an adapter's is small)."""
        self.name, self.rank, self.bridge, self.model, self.head = name, rank, bridge, model, head
        self.writes_full_state = writes_full_state
        self.background_save = dist_checkpoint.BackgroundSave()  # the checkpoint being written, if any
        self._digests = {}  # the adapters' base folder -> its weights_digest, taken at its first checkpoint

    def reserve_staging(self, optimizer) -> None:
        """Once the optimizer's state exists: reserve (pin, on a GPU) the host memory the first
        checkpoint stages into, while training goes on."""
        if not self.background_save.reserved and self.writes_full_state:
            self.background_save.reserve(dist_checkpoint.state_bytes(self.model, optimizer))

    def save(self, ckpt_dir: str, save_format: str, optimizer, lr: float, base_dir: str) -> dict[str, float]:
        """Weights, optimizer state and this rank's RNG into ckpt_dir. Collective. Returns the
        seconds training was held ("held"), and in which parts.
        dist: Megatron distributed checkpoint (reshardable to another TP/PP), written in the
        background until finish(); with adapters the adapters and their optimizer state alone, and a
        record of their base, base_dir (adapter_base.py); hf: weights through the bridge (loadable
        by transformers) + per-rank optimizer state, written before this returns."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        held = time.perf_counter()
        own_dir = checkpoint_folders(ckpt_dir, self.name, self.rank)
        torch.save({"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(), "lr": lr},
                   rng_file(ckpt_dir, self.name, self.rank))
        parts = {}
        if save_format == "dist":
            model_state = self._model_state()
            record = None
            if self.bridge.has_adapters and self.rank == 0:
                if base_dir not in self._digests:
                    self._digests[base_dir] = weights_digest(base_dir)
                record = functools.partial(record_base, own_dir, base_dir, self._digests[base_dir])
            state = {"model": model_state, "optimizer": optimizer.sharded_state_dict(
                model_state, metadata=OPTIMIZER_CHECKPOINT_FORMAT)}
            parts["state_dict"] = time.perf_counter() - held
            parts.update(self.background_save.start(state, own_dir, on_finished=record))
        else:
            self.bridge.save_hf_weights(self.model, os.path.join(own_dir, "hf"))
            torch.save(optimizer.state_dict(), os.path.join(own_dir, f"optimizer_rank{self.rank}.pt"))
            dist.barrier()
        return {"held": time.perf_counter() - held, **parts}

    def finish(self, wait: bool) -> WrittenFiles | None:
        """None while the last save is being written on some rank; once it is whole (finalized
        here; wait: block until then), what this rank's writer made. Collective."""
        return self.background_save.finish(wait)

    def load(self, ckpt_dir: str, save_format: str, optimizer) -> float | None:
        """Inverse of save; a dist checkpoint loads into any TP/PP layout. Collective. Returns the
        learning rate saved with this rank's RNG (None where the checkpoint had fewer ranks)."""
        from megatron.core import dist_checkpointing
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        own_dir = os.path.join(ckpt_dir, self.name)
        if save_format == "dist":
            _fill_empty_optimizer_states(optimizer)
            model_state = self._model_state()
            loaded = dist_checkpointing.load({"model": model_state, "optimizer": optimizer.sharded_state_dict(
                model_state, is_loading=True, metadata=OPTIMIZER_CHECKPOINT_FORMAT)}, own_dir)
            self._load_model_state(loaded["model"])
            _load_optimizer_state(optimizer, loaded["optimizer"])
        else:
            self.bridge.load_hf_weights(self.model, os.path.join(own_dir, "hf"))
            optimizer.load_state_dict(torch.load(os.path.join(own_dir, f"optimizer_rank{self.rank}.pt"),
                                                 weights_only=False))
        lr = None
        own_rng = rng_file(ckpt_dir, self.name, self.rank)
        if os.path.exists(own_rng):  # absent when resuming onto more ranks than were saved
            rng = torch.load(own_rng, weights_only=False)
            torch.set_rng_state(rng["torch"])
            get_cuda_rng_tracker().set_states(rng["tracker"])
            lr = rng["lr"]
        dist.barrier()
        return lr

    def export_hf_weights(self) -> dict[str, torch.Tensor] | None:
        """All HF-named weights on rank 0 (tests and verification). Collective."""
        weights = {n: t.detach().cpu().clone() for n, t in self.bridge.export_hf_weights(self.model)}
        return weights if self.rank == 0 else None

    def save_hf(self, out_dir: str) -> None:
        """An HF checkpoint (weights through the bridge, plus config and tokenizer); a reward
        model's as an HF sequence classifier (reward_export.py). Collective."""
        if self.head == "reward":
            return save_sequence_classifier(self.bridge, self.model, out_dir)
        self.bridge.save_hf_weights(self.model, out_dir)
        if self.rank == 0:
            from transformers import AutoTokenizer
            self.bridge.hf_config.save_pretrained(out_dir)
            AutoTokenizer.from_pretrained(self.bridge.hf_dir).save_pretrained(out_dir)
        dist.barrier()

    def save_peft_adapter(self, out_dir: str, peft, base_dir: str) -> None:
        """policy.peft's adapters as an HF PEFT directory over base_dir. Collective."""
        adapters = dict(self.bridge.export_adapter_weights(self.model))
        if self.rank == 0:
            write_hf_peft_adapter(out_dir, adapters, peft, base_dir)
        dist.barrier()

    def _model_state(self) -> dict:
        """The model's sharded state for a distributed checkpoint: its one chunk's, or with virtual
        pipeline stages {"model<i>": chunk i's}, as Megatron lays out several chunks."""
        states = [self.bridge.checkpointed_state(unwrap(chunk)) for chunk in self.model]
        return states[0] if len(states) == 1 else {f"model{i}": state for i, state in enumerate(states)}

    def _load_model_state(self, loaded: dict):
        chunks = [unwrap(chunk) for chunk in self.model]
        for i, chunk in enumerate(chunks):
            self.bridge.load_model_state(chunk, loaded if len(chunks) == 1 else loaded[f"model{i}"])


def checkpoint_folders(ckpt_dir: str, name: str, rank: int) -> str:
    """The model's folder in a checkpoint and the ranks' RNG folder, made by rank 0 before any
    rank writes. Collective. Returns the model's folder."""
    own_dir = os.path.join(ckpt_dir, name)
    if rank == 0:
        os.makedirs(os.path.join(ckpt_dir, "rng"), exist_ok=True)
        os.makedirs(own_dir, exist_ok=True)
    dist.barrier()
    return own_dir


def rng_file(ckpt_dir: str, name: str, rank: int) -> str:
    """Where a rank's RNG state (and the learning rate) goes in a checkpoint."""
    return os.path.join(ckpt_dir, "rng", f"{name}_rank_{rank}.pt")


def _fill_empty_optimizer_states(optimizer):
    """Give a distributed optimizer that has not stepped yet its state tensors, as loading a dist
    checkpoint into it needs: without Apex or TransformerEngine, megatron-core 0.16 reads every
    parameter's Adam "step" (DistributedOptimizer.state_dict) before it would create them. The
    values are placeholders that the load overwrites."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _load_optimizer_state(optimizer, state_dict: dict):
    """optimizer.load_state_dict, around a megatron-core 0.16 gap without Apex or TransformerEngine:
    its DistributedOptimizer gives every Adam state a "step", then copies the checkpoint's parameter
    state (main weights, exp_avg, exp_avg_sq) by the state's keys, "step" included, which the
    checkpoint keeps in the param groups instead (KeyError). So the parameter state is loaded apart,
    with the steps set aside meanwhile. Each parameter gets a step tensor of its own: megatron-core
    hands them all one, which torch's Adam would then advance once per parameter each step."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(chained) != 1 or not isinstance(chained[0], DistributedOptimizer) or "param_state" not in state_dict:
        optimizer.load_state_dict(state_dict)
        return
    inner, state_dict = chained[0], dict(state_dict)
    param_state, sharding = state_dict.pop("param_state"), state_dict.pop("param_state_sharding_type")
    assert sharding == OPTIMIZER_CHECKPOINT_FORMAT["distrib_optim_sharding_type"], sharding
    inner.load_state_dict(state_dict)
    steps = {param: state.pop("step") for param, state in inner.optimizer.state.items() if "step" in state}
    inner.load_parameter_state_from_fully_reshardable(param_state)
    for param, step in steps.items():
        inner.optimizer.state[param]["step"] = step.clone()
