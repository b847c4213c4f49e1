"""An FSDP2 rank's checkpoints and HF exports. checkpoint.save_format=dist: the model's and AdamW's
sharded state through torch.distributed.checkpoint (each rank writes its shards; it loads onto any
number of ranks), with policy.peft the adapters' alone and a record of their base (adapter_base.py);
hf: the HF weights (loadable by transformers) with the optimizer's state as a distributed
checkpoint beside them. Either way each rank's RNG state and the learning rate, so a resumed run
continues exactly. Written before save() returns."""

import os
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from rlkit.workers.policy.adapter_base import record_base, weights_digest
from rlkit.workers.policy.checkpoint_io import checkpoint_folders, rng_file
from rlkit.workers.policy.fsdp2_export import persistent_buffers
from rlkit.workers.policy.fsdp2_peft import is_adapter
from rlkit.workers.policy.reward_export import LM_HEAD, SCORE, write_sequence_classifier

HFWeights = Callable[[], Iterator[tuple[str, torch.Tensor]]]  # the worker's collective HF-named export


class FSDP2Checkpoints:
    def __init__(self, name: str, rank: int, model_dir: str, adapters: bool, reward: bool):
        """name: the model's folder in a checkpoint; model_dir: the HF checkpoint it was built from
        (its config and tokenizer go with every HF export); adapters: the model trains policy.peft's
        adapters alone, which are all its checkpoints hold; reward: a reward model, whose HF export
        is a sequence classifier."""
        self.name, self.rank, self.model_dir, self.adapters, self.reward = name, rank, model_dir, adapters, reward
        self._digests = {}  # the adapters' base folder -> its weights_digest, taken at its first checkpoint

    def save(self, ckpt_dir: str, save_format: str, model, optimizer, lr: float, hf_weights: HFWeights,
             base_dir: str) -> dict:
        """Weights (or the adapters, over base_dir's weights), optimizer state, this rank's RNG and
        the learning rate into ckpt_dir/<name>. Collective. The seconds training was held."""
        held = time.perf_counter()
        own_dir = checkpoint_folders(ckpt_dir, self.name, self.rank)
        rng = {"torch": torch.get_rng_state(), "lr": lr}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, rng_file(ckpt_dir, self.name, self.rank))
        model_state, optimizer_state = get_state_dict(model, optimizer)
        if save_format == "dist":
            dcp.save({"model": self._trained(model_state), "optimizer": optimizer_state}, checkpoint_id=own_dir)
            if self.adapters and self.rank == 0:
                if base_dir not in self._digests:
                    self._digests[base_dir] = weights_digest(base_dir)
                record_base(own_dir, base_dir, self._digests[base_dir])
        else:
            self.save_hf(os.path.join(own_dir, "hf"), hf_weights)
            dcp.save({"optimizer": optimizer_state}, checkpoint_id=os.path.join(own_dir, "optimizer"))
        dist.barrier()
        return {"held": time.perf_counter() - held}

    def load(self, ckpt_dir: str, save_format: str, model, optimizer) -> float:
        """Inverse of save, onto any number of ranks. Collective. Returns the saved learning rate."""
        own_dir = os.path.join(ckpt_dir, self.name)
        model_state, optimizer_state = get_state_dict(model, optimizer)  # the layout to read into
        if save_format == "dist":
            state = {"model": self._trained(model_state), "optimizer": optimizer_state}
            dcp.load(state, checkpoint_id=own_dir)
            set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not self.adapters))
        else:
            load_hf_weights(model, os.path.join(own_dir, "hf"))
            state = {"optimizer": optimizer_state}
            dcp.load(state, checkpoint_id=os.path.join(own_dir, "optimizer"))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        own_rng = rng_file(ckpt_dir, self.name, self.rank)
        if os.path.exists(own_rng):  # absent when resuming onto more ranks than were saved
            rng = torch.load(own_rng, weights_only=False)
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        dist.barrier()
        return torch.load(rng_file(ckpt_dir, self.name, 0), weights_only=False)["lr"]

    def load_adapters(self, ckpt_dir: str, model) -> None:
        """policy.peft.init_from: the adapters of a checkpoint's ckpt_dir/<name>, without their
        optimizer state. Collective."""
        state = {"model": self._trained(get_model_state_dict(model))}
        dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, self.name))
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))

    def _trained(self, model_state: dict) -> dict:
        """What a checkpoint holds of the model: the adapters alone under policy.peft."""
        return {k: v for k, v in model_state.items() if is_adapter(k)} if self.adapters else model_state

    def save_hf(self, out_dir: str, hf_weights: HFWeights) -> None:
        """An HF checkpoint in out_dir: every weight (gathered on each rank in turn, written by rank
        0 as one model.safetensors), the model's config and its tokenizer; a reward model's as an HF
        sequence classifier (its head's weight as score.weight). Collective."""
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoTokenizer

        # copies: a gathered tensor may view a larger buffer (a weight of fewer rows than ranks)
        weights = {name: tensor.cpu().clone() for name, tensor in hf_weights()}
        if self.reward:
            weights[SCORE] = weights.pop(LM_HEAD)
            if self.rank == 0:
                write_sequence_classifier(AutoConfig.from_pretrained(self.model_dir), self.model_dir, weights, out_dir)
        elif self.rank == 0:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
            AutoConfig.from_pretrained(self.model_dir).save_pretrained(out_dir)
            AutoTokenizer.from_pretrained(self.model_dir).save_pretrained(out_dir)
        dist.barrier()


def load_hf_weights(model, hf_dir: str, names: dict[str, str] | None = None) -> None:
    """hf_dir's safetensors weights into the sharded model, each under names[its HF name] (None: as
    named), every weight of the model's but a tied head and the adapters. Collective."""
    from safetensors.torch import load_file

    whole = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        whole.update(load_file(path))
    if names is not None:
        whole = {names.get(name, name): tensor for name, tensor in whole.items()}
    expected = {name for name, _ in model.named_parameters() if not is_adapter(name)}
    expected |= {name for name, _ in persistent_buffers(model)}
    unknown, missing = sorted(set(whole) - expected), sorted(expected - set(whole))
    if unknown or missing:
        # e.g. MoE experts, which transformers fuses as it loads their checkpoint
        raise RuntimeError(f"{hf_dir} holds weights in another layout than the model's (not the model's: "
                           f"{unknown[:3]}; missing: {missing[:3]}), which transformers converts as it loads; "
                           f"rlkit's FSDP2 backend reads that layout only through checkpoint.save_format=dist")
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, strict=False))
