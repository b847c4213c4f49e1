"""PyTorch FSDP2 model worker (policy.backend=fsdp2): one Ray actor per rank, each holding a shard
of every weight of one transformers causal LM (torch.distributed.fsdp.fully_shard per decoder
layer, then the whole model), so any architecture transformers implements trains without a bridge.
Every rank is a data-parallel rank with its own shard of each batch, and every rank's results are
its shard's answer. Weights and Adam stay fp32 (policy.precision=bf16 computes in bf16 through
FSDP2's MixedPrecisionPolicy); logprobs and entropy come from rlkit's token head (token_head.py),
losses from the objectives the controller sends, exactly as the Megatron worker computes them. It
hosts the policy, PPO's critic or a reward model (a scalar head in the LM head's place), and
policy.peft's LoRA through HF peft (fsdp2_peft.py); checkpoints and HF exports: fsdp2_checkpoint.py."""

import os
import uuid
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rlkit.bridge.adapters import write_hf_peft_adapter
from rlkit.checkpoint import WrittenFiles
from rlkit.config.schema import PolicyConfig
from rlkit.data.batch import Batch, BatchTotals
from rlkit.data.micro_batches import micro_batches, restore_rows
from rlkit.observability.profiling import profiled
from rlkit.observability.startup import PhaseTimes
from rlkit.workers.policy.fsdp2_checkpoint import FSDP2Checkpoints, load_hf_weights
from rlkit.workers.policy.fsdp2_export import DtypeOf, as_held, in_checkpoint_layout, whole_weights
from rlkit.workers.policy.fsdp2_peft import adapter_weights, base_names, merged_weights, restart_adapters, with_adapters
from rlkit.workers.policy.hand_over import MemoryHandOver
from rlkit.workers.policy.pool_lifecycle import collect
from rlkit.workers.policy.rank import ON_GPU, TrainingRank
from rlkit.workers.policy.schedule import summed_on_host
from rlkit.workers.policy.token_head import token_logprobs_and_entropy
from rlkit.workers.rendezvous import init_process_group

# policy.attention_backend -> transformers' attn_implementation
ATTENTION = {"sdpa": "sdpa", "local": "eager"}


class FSDP2ModelWorker(TrainingRank):
    def __init__(self, cfg: PolicyConfig, model_dir: str, rank: int, world_size: int, seed: int, threads: int,
                 collective_timeout_s: float, head: str = "lm", stage_checkpoints: bool = False):
        """Imports only; setup() builds. head: "lm" (token logprobs), "value" (PPO's critic: a
        zero-initialised scalar head, with a bias, in the LM head's place) or "reward" (a reward
        model: that head without its bias, exported as an HF sequence classifier);
        stage_checkpoints: unused, checkpoints are written before save_checkpoint returns."""
        self.startup = PhaseTimes()
        torch.set_num_threads(threads)
        with self.startup.phase("imports"):
            from torch.distributed import fsdp  # noqa: F401
            import transformers  # noqa: F401
        self.cfg, self.rank, self.head = cfg, rank, head
        self.name = "critic" if head == "value" else "policy"  # its folder in a checkpoint
        self.adapters = cfg.peft if head == "lm" else None  # policy.peft adapts the policy; a critic trains all
        self._setup_args = (model_dir, world_size, seed, collective_timeout_s)

    def setup(self, master_addr: str, master_port: int):
        import ray  # where used: a fork server imports this module before Ray

        model_dir, world_size, seed, collective_timeout_s = self._setup_args
        if ON_GPU:
            torch.cuda.set_device(0)  # Ray gives each actor its GPU as device 0
        with self.startup.phase("process_group"):
            init_process_group("nccl" if ON_GPU else "gloo", master_addr, master_port, self.rank, world_size,
                               timedelta(seconds=collective_timeout_s), node_address=ray.util.get_node_ip_address())
        torch.manual_seed(seed)
        self.world_size = world_size
        self.mesh = _device_mesh(world_size)
        with self.startup.phase("build"):
            self.model = self._sharded_model(model_dir, trained=True)
        self.hand_over = MemoryHandOver(self.cfg.offload, ON_GPU)
        self.checkpoints = FSDP2Checkpoints(self.name, self.rank, model_dir, adapters=self.adapters is not None,
                                            reward=self.head == "reward")
        if self.adapters is not None and self.adapters.init_from is not None:
            self.checkpoints.load_adapters(self.adapters.init_from, self.model)
        self.base_dir = model_dir  # the HF checkpoint under policy.peft's adapters (init_reference may replace it)
        self.reference_is_base = False  # the reference is the policy with its adapters off (init_reference)
        self.start_collaborators()
        self.temperature = 1.0
        self.reference = None

    def _sharded_model(self, model_dir: str, trained: bool) -> torch.nn.Module:
        """model_dir's weights in fp32 (the trained policy under policy.peft's adapters), each
        decoder layer (transformers' _no_split_modules) and then the whole model sharded over every
        rank; computing in bf16 under policy.precision=bf16 (an untied LM head in fp32 under
        policy.fp32_lm_head), with activation checkpointing per layer under
        policy.fsdp2.activation_checkpointing."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        # a scalar head replaces the LM head, which must not stay tied to the embeddings
        untied = {"tie_word_embeddings": False} if self.head != "lm" else {}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation=ATTENTION[self.cfg.attention_backend],
                                                     **untied)
        if self.head != "lm":
            model.set_output_embeddings(_scalar_head(model.config.get_text_config().hidden_size,
                                                     bias=self.head == "value"))
        if ON_GPU:
            model = model.cuda()
        if trained and self.cfg.fsdp2.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if trained and self.adapters is not None:
            model = with_adapters(model, self.adapters)
        bf16 = self.cfg.precision == "bf16"
        shard = dict(mesh=self.mesh, reshard_after_forward=self.cfg.fsdp2.reshard_after_forward,
                     mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                                    reduce_dtype=torch.float32))
        layer_classes = set(model._no_split_modules or [])
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, **shard)
        if self._fp32_head(model):
            # fp32 logits from the bf16 hidden states, as the generation engines compute them
            fully_shard(model.get_output_embeddings(),
                        **{**shard, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32)})
        fully_shard(model, **shard)
        if not trained:
            model.requires_grad_(False)
        return model

    # ---- setup -------------------------------------------------------------------------
    def layout(self) -> dict:
        return {"rank": self.rank, "tp": 0, "pp": 0, "cp": 0, "dp": self.rank, "is_output": self.is_output()}

    def set_temperature(self, temperature: float):
        self.temperature = temperature

    def init_reference(self, hf_dir: str):
        """The frozen KL reference: hf_dir's weights, sharded as the policy's are. With adapters
        (policy.peft) the policy's own base with the adapters off, no second copy: hf_dir's weights
        become the base, and adapters over another base restart from adding nothing."""
        if self.adapters is None:
            self.reference = self._sharded_model(hf_dir, trained=False)
            return
        if os.path.realpath(hf_dir) != os.path.realpath(self.base_dir):
            load_hf_weights(self.model, hf_dir, base_names(self.model))
            restart_adapters(self.model)
            self.base_dir = hf_dir
        self.reference_is_base = True

    # ---- memory while a colocated engine generates ----------------------------------------
    @profiled
    def sleep(self) -> dict:
        models = [self.model] + ([self.reference] if self.reference is not None else [])
        return self.hand_over.sleep(models, [], self.optimizer)

    # ---- forward / backward ------------------------------------------------------------
    def _head_outputs(self, model, mb: Batch, entropy: bool = False,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token-aligned head outputs [b, S] of a micro-batch's rows: the policy's logprobs
        (position t: log p(token t | the tokens before it); 0 at t = 0) at the sampling temperature,
        and with entropy their distributions' entropy aligned likewise; or a critic's values or
        a reward model's rewards (position t: that of the prefix before token t) and no entropy."""
        device = torch.cuda.current_device() if ON_GPU else "cpu"
        input_ids = mb["input_ids"].to(device)
        logits = model(input_ids=input_ids, **_positions_and_mask(mb, device)).logits
        width = input_ids.shape[1]
        if self.head != "lm":
            return _token_aligned(logits[..., 0].float(), width), None
        next_ids = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))  # the last position predicts nothing read
        logprobs, token_entropy = token_logprobs_and_entropy(logits, next_ids, self.temperature, entropy=entropy,
                                                             entropy_grad=entropy_grad)
        return _token_aligned(logprobs, width), None if token_entropy is None else _token_aligned(token_entropy,
                                                                                                     width)

    def _micro_batches(self, batch: Batch) -> tuple[list[Batch], list[int]]:
        return micro_batches(batch, self.cfg.micro_batch_size, self.cfg.max_tokens_per_microbatch)

    def _forward_with(self, model, batch: Batch) -> torch.Tensor:
        self.wake()
        model.eval()
        parts, row_order = self._micro_batches(batch)
        with torch.no_grad():
            outputs = [self._head_outputs(model, mb)[0] for mb in parts]
        return restore_rows(outputs, row_order, batch["input_ids"].shape[1]).cpu()

    def forward(self, batch: Batch) -> torch.Tensor:
        return self._forward_with(self.model, batch)

    def reference_logprobs(self, batch: Batch) -> torch.Tensor:
        if self.reference_is_base:
            with self.model.disable_adapter():
                return self._forward_with(self.model, batch)
        if self.reference is None:
            raise RuntimeError("the reference policy was asked for before init_reference")
        return self._forward_with(self.reference, batch)

    @profiled
    def train(self, batch: Batch, totals: BatchTotals, objective: Callable) -> dict:
        """One optimizer step over this rank's shard, minimising objective(head outputs, micro_batch,
        totals) (algorithms/objectives.py), whose value on a micro-batch is its exact share of the
        global batch's loss; its summed metrics (the policy's entropy among them) and the gradient
        norm before clipping."""
        optimizer = self._optimizer_ready()
        self.model.train()
        parts, _ = self._micro_batches(batch)
        sums = []
        for i, mb in enumerate(parts):
            # gradients are reduced over the ranks once, after the last micro-batch
            self.model.set_requires_gradient_sync(i == len(parts) - 1)
            output, entropy = self._head_outputs(self.model, mb, entropy=self.head == "lm",
                                                 entropy_grad=objective.uses_entropy)
            mb = Batch({k: v.to(output.device) for k, v in mb.tensors.items()})
            if objective.uses_entropy:  # the objective reads it, with its gradient
                mb = mb.with_fields(entropy=entropy)
            value, metrics = objective(output, mb, totals)
            # FSDP2 averages gradients over the ranks; the losses are exact shares of the whole already
            (value * self.world_size).backward()
            sums.append({**{k: v.detach() for k, v in metrics.items()}, "loss": value.detach()})
            if entropy is not None:
                sums[-1]["entropy"] = (entropy.detach() * mb[objective.mask_key]).sum()
        grad_norm = _clip_grad_norm(self.model, self.cfg.optimizer.clip_grad)
        if not torch.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            raise self.non_finite_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {**summed_on_host(sums), "grad_norm": float(grad_norm)}

    def evaluate_held(self, totals: BatchTotals, objective: Callable) -> dict:
        """The objective's loss and sums on the held rows, without a step (validation)."""
        self.wake()
        self.model.eval()
        parts, _ = self._micro_batches(self.rollout.held)
        sums = []
        with torch.no_grad():
            for mb in parts:
                output, _ = self._head_outputs(self.model, mb)
                value, metrics = objective(output, Batch({k: v.to(output.device) for k, v in mb.tensors.items()}),
                                           totals)
                sums.append({"loss": value, **metrics})
        return summed_on_host(sums)

    def is_output(self) -> bool:
        return True

    def data_parallel_group(self) -> None:
        return None  # every rank is a data-parallel rank

    def new_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the fp32 shards, without weight decay on biases and norms (as Megatron's
        optimizer groups them)."""
        o = self.cfg.optimizer
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if not _no_decay(n, p)], "weight_decay": o.weight_decay},
                  {"params": [p for n, p in named if _no_decay(n, p)], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr,
                                 betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)

    # ---- weights out: HF names straight from the shards ----------------------------------
    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Refit's export (rlkit/refit/sender.py): every weight in the dtype the model computes in,
        as Megatron's parameters export (bf16 under policy.precision=bf16). Collective."""
        return self._weights(self._compute_dtype)

    def _full_precision_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._weights(as_held)

    def _weights(self, dtype_of: DtypeOf) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor in dtype_of(its parameter)) of every weight as the HF checkpoint
        holds it (fsdp2_export.py; policy.peft's adapters merged in), each gathered from its shards
        in turn; checkpoints and HF exports take them as held (fp32). Collective."""
        self.wake()
        if self.adapters is None:
            yield from in_checkpoint_layout(self.model, whole_weights(self.model, dtype_of))
        else:
            yield from in_checkpoint_layout(self.model.get_base_model(),
                                            merged_weights(self.model, self.adapters, dtype_of))

    def _fp32_head(self, model: torch.nn.Module) -> bool:
        """policy.fp32_lm_head under bf16 compute: an untied LM head computes in fp32."""
        return (self.cfg.precision == "bf16" and self.cfg.fp32_lm_head
                and not model.config.get_text_config().tie_word_embeddings)

    def _compute_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        """The dtype FSDP2's MixedPrecisionPolicy gathers the parameter in for the forward pass."""
        if self.cfg.precision != "bf16" or (self._fp32_head(self.model) and any(
                param is head for head in self.model.get_output_embeddings().parameters())):
            return torch.float32
        return torch.bfloat16

    def export_rows(self):
        return None  # each tensor is gathered whole from its shards

    def export_refit_adapters(self, dtype: str) -> dict[str, torch.Tensor] | None:
        """refit.peft=adapter: {HF PEFT name: CPU tensor in dtype} of policy.peft's adapters on rank
        0, None elsewhere. Collective."""
        self.wake()
        adapters = {name: tensor.to("cpu", getattr(torch, dtype), copy=True)
                    for name, tensor in adapter_weights(self.model)}
        return adapters if self.rank == 0 else None

    # ---- checkpoints and exports (fsdp2_checkpoint.py) ------------------------------------
    def save_checkpoint(self, ckpt_dir: str, save_format: str) -> dict[str, float]:
        return self.checkpoints.save(ckpt_dir, save_format, self.model, self._optimizer_ready(), self.lr,
                                     self._full_precision_weights, self.base_dir)

    def finish_checkpoint(self, wait: bool) -> WrittenFiles | None:
        return WrittenFiles({})  # written before save_checkpoint returned

    def load_checkpoint(self, ckpt_dir: str, save_format: str):
        self.set_learning_rate(self.checkpoints.load(ckpt_dir, save_format, self.model, self._optimizer_ready()))

    def export_hf_weights(self) -> dict[str, torch.Tensor] | None:
        weights = {name: tensor.cpu().clone() for name, tensor in self._full_precision_weights()}
        return weights if self.rank == 0 else None

    def save_hf(self, out_dir: str):
        self.checkpoints.save_hf(out_dir, self._full_precision_weights)

    def save_peft_adapter(self, out_dir: str):
        """policy.peft's adapters as an HF PEFT folder over the base. Collective."""
        self.wake()
        adapters = dict(adapter_weights(self.model))
        if self.rank == 0:
            write_hf_peft_adapter(out_dir, adapters, self.adapters, self.base_dir)
        dist.barrier()

    # ---- a warm pool's idle process ---------------------------------------------------
    def release(self):
        """Leave the process group and drop the model. torch's DTensor caches keep this run's mesh
        (their keys hold it), and the mesh its process group, whose gloo threads would run on in the
        idle process: the mesh lets go of the group."""
        if "mesh" in self.__dict__:
            self.mesh._pg_registry.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.__dict__.clear()
        collect()


def _device_mesh(world_size: int):
    """Every rank in one data-parallel dimension, named afresh at each setup (rank 0's random name):
    torch caches DTensor sharding by mesh equality, which ignores the rank, so a pooled process set up
    again at another rank would otherwise get its old rank's shards of its new model."""
    from torch.distributed.device_mesh import init_device_mesh

    name = [f"fsdp2_{uuid.uuid4().hex}"]
    dist.broadcast_object_list(name, src=0)
    return init_device_mesh("cuda" if ON_GPU else "cpu", (world_size,), mesh_dim_names=(name[0],))


def _positions_and_mask(mb: Batch, device) -> dict:
    """Right-padded rows read causally as they are; packed rows (segment_ids) keep each sequence's
    attention to itself through a 4D mask (transformers: True = attend), with their own positions."""
    if "segment_ids" not in mb:
        return {}
    from rlkit.data.packing import packed_attention_mask

    return {"position_ids": mb["position_ids"].to(device),
            "attention_mask": ~packed_attention_mask(mb["segment_ids"].to(device))}


def _scalar_head(hidden_size: int, bias: bool) -> torch.nn.Linear:
    """One value per position, zero-initialised (a critic first predicts 0 and learns the rewards'
    scale), as Megatron's ValueHead: with a bias for a critic, without for a reward model (the
    Bradley-Terry loss is blind to a constant; HF's sequence classifiers' score layer has none)."""
    head = torch.nn.Linear(hidden_size, 1, bias=bias)
    torch.nn.init.zeros_(head.weight)
    if bias:
        torch.nn.init.zeros_(head.bias)
    return head


def _token_aligned(per_position: torch.Tensor, width: int) -> torch.Tensor:
    """Position t's output is about token t + 1: shifted one right, position 0 holding 0."""
    return torch.nn.functional.pad(per_position[:, :width - 1], (1, 0))


def _no_decay(name: str, param: torch.Tensor) -> bool:
    return name.endswith(".bias") or param.dim() == 1


def _clip_grad_norm(model: torch.nn.Module, clip_grad: float) -> torch.Tensor:
    """The global gradient norm over every shard (before clipping), gradients scaled to clip_grad
    where it is larger (clip_grad 0: no clipping)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, clip_grad if clip_grad > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
