"""Megatron-Core model worker: one Ray actor per rank of a TP x CP x PP x DP grid. It hosts the policy
(head="lm": outputs token logprobs) or PPO's critic (head="value": the same GPTModel with a scalar
value head, its trunk initialised from the policy checkpoint).

Each call that takes a Batch receives this rank's DP shard; the controller gathers results
from the output ranks (TP and CP rank 0 on the last pipeline stage) of each DP group. Under context
parallelism every rank of a CP group holds the same shard, runs the model on its share of each
row's tokens (rlkit/bridge/context_parallel.py) and gathers the per-token outputs back, so the
losses and every result are the whole rows', as at CP=1. A step's rollout
is held here (hold): logprobs, values and token-level advantages are computed into the held
shard where it lives, and training reads it, so token tensors cross the controller once.
"""

import functools
import gc
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rlkit.bridge.adapters import write_hf_peft_adapter
from rlkit.bridge.common import unwrap
from rlkit.checkpoint import WrittenFiles
from rlkit.bridge.context_parallel import gather_sequence, padded_length, positions_on_rank, share_of_rank
from rlkit.config.schema import ConfigError, PolicyConfig
from rlkit.data.batch import MODEL_INPUTS, Batch, BatchTotals
from rlkit.data.micro_batches import LENGTH_MASKS, micro_batches, restore_rows
from rlkit.data.packing import packed_attention_mask
from rlkit.observability.logprob_agreement import agreement_sums, reference_kl_sums
from rlkit.observability.profiling import profiled
from rlkit.observability.startup import PhaseTimes, without_wandb
from rlkit.refit.delta import EncodedBucket
from rlkit.refit.plan import PackedBucket, RefitPlan
from rlkit.refit.sender import RefitSender, sending_half
from rlkit.workers.policy import dist_checkpoint
from rlkit.workers.policy.adapter_base import record_base, weights_digest
from rlkit.workers.policy.offload import HostOffload, pinned_bandwidth
from rlkit.workers.policy.schedule import min_micro_batches, run_schedule, summed_on_host
from rlkit.workers.policy.token_head import token_logprobs_and_entropy
from rlkit.workers.rendezvous import init_process_group

ON_GPU = torch.cuda.is_available()
# The distributed optimizer's state in a canonical per-parameter layout, so a checkpoint loads at
# any TP/PP/DP (megatron-core's default layout for it is deprecated and refuses to save).
OPTIMIZER_CHECKPOINT_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}

# Expected, and otherwise repeated by every worker process: megatron-core's PyTorch fallbacks when
# Apex / TransformerEngine are absent (the driver says so once: optional_kernels_missing), the
# "full" cuda_graph_scope that mbridge's configs still name (graphs are off), and mbridge's note
# that a checkpoint saved from a single-file model has no safetensors index (none is needed). And
# PyTorch's deprecation of the ShardedTensor and dcp.load_state_dict that megatron-core 0.16's
# torch_dist load strategy is built on (a resume, `rlkit convert`); the CPU path's TorchFunctionMode
# (cpu_compat) is only where the first is reported from, as the frame that calls into ShardedTensor.
for _expected in (r".*(Apex|Transformer Engine).* (is|are) not installed", r"full scope is deprecated",
                  r"No index file found", r"Please use DTensor instead and we are deprecating ShardedTensor",
                  r"`load_state_dict` is deprecated"):
    warnings.filterwarnings("ignore", message=_expected)


def optional_kernels_missing() -> list[str]:
    """Which of Megatron's optional fused-kernel packages are not installed here."""
    import importlib.util

    return [name for name, module in [("Apex", "apex"), ("TransformerEngine", "transformer_engine")]
            if importlib.util.find_spec(module) is None]


class MegatronModelWorker:
    def __init__(self, cfg: PolicyConfig, model_dir: str, rank: int, world_size: int, seed: int, threads: int,
                 collective_timeout_s: float, head: str = "lm", stage_checkpoints: bool = False):
        """Imports only, no device memory: a run starts these processes while its generation engines
        start (vLLM sizes its KV cache from the GPU memory it sees free then). setup() builds.
        stage_checkpoints: the run writes distributed checkpoints in the background: their host
        buffers are allocated (pinned, on a GPU) ahead, after the first optimizer step (dist_checkpoint.py)."""
        self.startup = PhaseTimes()
        torch.set_num_threads(threads)
        with self.startup.phase("megatron_imports"), without_wandb():
            if not ON_GPU:
                from rlkit.workers.policy import cpu_compat
                cpu_compat.enable()
            import megatron.core.parallel_state  # noqa: F401
            import megatron.core.tensor_parallel.random  # noqa: F401

            from rlkit.bridge import import_backend
            import_backend(cfg.bridge)
        self.cfg, self.rank, self.head, self.stage_checkpoints = cfg, rank, head, stage_checkpoints
        self._setup_args = (model_dir, world_size, seed, collective_timeout_s)

    def setup(self, master_addr: str, master_port: int):
        """Join the process group (its rendezvous at master_addr:master_port), build the model and
        load its weights. Collective."""
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from rlkit.bridge import open_bridge

        cfg, rank, head = self.cfg, self.rank, self.head
        model_dir, world_size, seed, collective_timeout_s = self._setup_args
        if ON_GPU:
            torch.cuda.set_device(0)  # Ray gives each actor its GPU as device 0
        import ray  # where used: a fork server imports this module before Ray (rlkit/cluster/fork_server.py)

        with self.startup.phase("process_group"):
            init_process_group("nccl" if ON_GPU else "gloo", master_addr, master_port, rank, world_size,
                               timedelta(seconds=collective_timeout_s), node_address=ray.util.get_node_ip_address())
        mpu.initialize_model_parallel(tensor_model_parallel_size=cfg.tensor_parallel_size,
                                      pipeline_model_parallel_size=cfg.pipeline_parallel_size,
                                      virtual_pipeline_model_parallel_size=(cfg.virtual_pipeline_parallel_size
                                                                            if cfg.virtual_pipeline_parallel_size > 1
                                                                            else None),
                                      context_parallel_size=cfg.context_parallel_size,
                                      expert_model_parallel_size=cfg.expert_parallel_size)
        self.mpu = mpu
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        self.bf16 = cfg.precision == "bf16"
        self.base_dir = model_dir  # the HF checkpoint under policy.peft's adapters (init_reference may replace it)
        self._base_digest = None  # its weights_digest, taken at the first adapter checkpoint
        self.name = "policy" if head == "lm" else "critic"  # its folder in a checkpoint
        with self.startup.phase("build"):
            # policy.peft adapts the policy; PPO's critic trains all of its weights
            self.bridge = open_bridge(cfg.bridge, model_dir, torch.bfloat16 if self.bf16 else torch.float32,
                                      cfg.attention_backend, cfg.peft if head == "lm" else None)
            self.model = self.bridge.build(bf16=self.bf16, wrap_with_ddp=True, value_head=head == "value",
                                           fp32_lm_head=cfg.fp32_lm_head,
                                           use_distributed_optimizer=cfg.use_distributed_optimizer)
        with self.startup.phase("hf_load"):
            if head == "value":
                self.bridge.load_trunk_weights(self.model, self.bf16)
            else:
                self.bridge.load_hf_weights(self.model)
                if cfg.peft is not None and cfg.peft.init_from is not None:
                    self.bridge.load_adapter_checkpoint(self.model, os.path.join(cfg.peft.init_from, self.name))
        self.offload = HostOffload(pin=ON_GPU)  # what sleep() moved off the GPU, in reused pinned buffers
        self.background_save = dist_checkpoint.BackgroundSave()  # the checkpoint being written, if any
        self.pinned_bandwidth = None  # GB/s each way, measured at the first sleep()
        self.refit_sender = RefitSender(self)  # this rank's half of refit (policy only)
        self.held: Batch | None = None  # this rank's shard of the step's rollout
        # built at the first train() call: inference-only uses (verify-refit, benchmarks) never
        # pay for fp32 main weights and Adam state
        self.optimizer = None
        self.lr = cfg.optimizer.lr
        self.reference = None
        self.reference_is_base = False  # the reference is self.model with its adapters off (init_reference)
        self.temperature = 1.0

    # ---- setup -------------------------------------------------------------------------
    def startup_phases(self) -> dict:
        return self.startup.report()

    def _build_optimizer(self, lr: float):
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = self.bridge.transformer_config
        if config.num_moe_experts and config.tensor_model_parallel_size > 1:
            # megatron-core's MoE layer refuses TP without sequence parallelism in training mode; with its
            # check bypassed, the gradients were wrong (measured)
            raise ConfigError(f"policy.tensor_parallel_size: an MoE model trains at TP > 1 only with sequence "
                              f"parallelism, which rlkit does not enable (got: {config.tensor_model_parallel_size}); "
                              f"train it at TP=1 and spread its experts with policy.expert_parallel_size")
        o = self.cfg.optimizer
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=self.bf16,
            params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
            use_distributed_optimizer=self.cfg.use_distributed_optimizer), self.model)
        config.finalize_model_grads_func = finalize_model_grads
        return optimizer

    def _writes_full_state(self) -> bool:
        """Whether this rank's distributed checkpoint holds its parameters and their optimizer state
        as they are here: megatron-core writes a replicated tensor from its first holder alone
        (data-parallel rank 0); a distributed optimizer's state is gathered to that rank at the
        save instead (a reservation could not be sized from its shard); an adapter's is small."""
        return (self.mpu.get_data_parallel_rank(with_context_parallel=True) == 0
                and not self.cfg.use_distributed_optimizer and not self.bridge.has_adapters)

    def layout(self) -> dict:
        m = self.mpu
        return {"rank": self.rank, "tp": m.get_tensor_model_parallel_rank(),
                "pp": m.get_pipeline_model_parallel_rank(), "cp": m.get_context_parallel_rank(),
                "dp": m.get_data_parallel_rank(),
                "is_output": self._is_output()}

    def device_name(self) -> str | None:
        """The GPU's name (the controller looks up its peak FLOP/s); None on CPU."""
        return torch.cuda.get_device_name() if ON_GPU else None

    def peak_memory_gb(self) -> float:
        """The most GPU memory this rank's tensors held since the last call, which starts the
        next count; 0 on CPU."""
        if not ON_GPU:
            return 0.0
        peak = torch.cuda.max_memory_allocated() / 1e9
        torch.cuda.reset_peak_memory_stats()
        return peak

    def reset_optimizer(self):
        """Drop optimizer state (rebuilt fresh at the next train step), e.g. between a warm start
        and RL, so a run that just did the warm start and one that loaded it from cache agree."""
        self.optimizer = None

    def set_temperature(self, temperature: float):
        """Logprobs are computed on logits / temperature, exactly as the sampler saw them."""
        self.temperature = temperature

    def set_learning_rate(self, lr: float):
        self.lr = lr
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def init_reference(self, hf_dir: str):
        """Load the frozen KL reference policy from an HF checkpoint (the run's starting weights,
        so a resumed run keeps the same anchor). With adapters (policy.peft) the reference is the
        policy's own frozen base with the adapters off, no second copy of the weights: hf_dir's
        weights become the base and the adapters restart from nothing added, which leaves the
        policy as it was where hf_dir holds it merged (a warm start saved from this model)."""
        if self.bridge.has_adapters:
            if os.path.realpath(hf_dir) != os.path.realpath(self.base_dir):
                self.bridge.load_hf_weights(self.model, hf_dir)
                self.bridge.restart_adapters(self.model)
                self.base_dir, self._base_digest = hf_dir, None
            self.reference_is_base = True
            return
        self.reference = self.bridge.build(bf16=self.bf16, wrap_with_ddp=False, fp32_lm_head=self.cfg.fp32_lm_head)
        self.bridge.load_hf_weights(self.reference, hf_dir)
        for chunk in self.reference:
            chunk.requires_grad_(False)

    # ---- GPU memory while a colocated vLLM generates ----------------------------------------
    def _resident_storages(self) -> dict[str, list]:
        """This rank's GPU storages by kind: weights (the reference's too), optimizer (fp32 main
        weights and Adam state) and gradients (buffers that may be dropped)."""
        kinds, seen = {"weights": [], "optimizer": [], "gradients": []}, set()

        def add(tensor, kind):
            storage = tensor.untyped_storage()
            if tensor.is_cuda and storage.data_ptr() not in seen and storage.nbytes() > 0:
                seen.add(storage.data_ptr())
                kinds[kind].append(storage)

        for chunk in self.model + (self.reference or []):
            for param in chunk.parameters():
                add(param.data, "weights")
        for chunk in self.model:
            for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
                add(buffer.grad_data, "gradients")
        if self.optimizer is not None:
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                for group in opt.optimizer.param_groups:
                    for param in group["params"]:
                        add(param.data, "optimizer")
                for state in opt.optimizer.state.values():
                    for value in state.values():
                        if torch.is_tensor(value):
                            add(value, "optimizer")
        return kinds

    @profiled
    def sleep(self) -> dict:
        """Free this rank's GPU memory for a colocated vLLM (policy.offload: all = weights and
        optimizer state to host memory, optimizer = optimizer state only; both drop the gradient
        buffers; none = nothing). Returns bytes and seconds, and the pinned bandwidth (measured at
        the first call) they compare with; {} on CPU, with offload none, or while asleep."""
        if not ON_GPU or self.cfg.offload == "none" or self.offload.is_asleep:
            return {}
        kinds = self._resident_storages()
        keep = kinds["optimizer"] + (kinds["weights"] if self.cfg.offload == "all" else [])
        if self.pinned_bandwidth is None:
            self.pinned_bandwidth = pinned_bandwidth()
        freed = sum(s.nbytes() for s in keep + kinds["gradients"])
        copied, seconds = self.offload.sleep(keep, kinds["gradients"])
        return {"freed_bytes": freed, "copied_bytes": copied, "seconds": seconds, "pinned": self.pinned_bandwidth}

    @profiled
    def wake(self) -> dict:
        """Undo sleep(); every call that touches the model calls it first. Returns bytes and seconds
        ({} if awake already)."""
        if not self.offload.is_asleep:
            return {}
        copied, seconds = self.offload.wake()
        return {"copied_bytes": copied, "seconds": seconds}

    # ---- forward / backward ------------------------------------------------------------
    def _share(self, x: torch.Tensor) -> torch.Tensor:
        """This CP rank's share of a [b, S, ...] tensor's positions (the whole of it at CP=1)."""
        return share_of_rank(x, self.mpu.get_context_parallel_world_size(), self.mpu.get_context_parallel_rank())

    def _token_aligned(self, per_position: torch.Tensor, width: int) -> torch.Tensor:
        """[b, width] from this CP rank's share of per-position outputs (position t: about token
        t + 1): the whole rows gathered over CP (their padding dropped), shifted one right so that
        position t holds the output for token t; position 0 has none and holds 0. Every CP rank
        computes the same loss from the result, so each keeps its own share of its gradient."""
        whole = gather_sequence(per_position, self.mpu.get_context_parallel_group(), sum_grads=False, dim=1)
        return torch.nn.functional.pad(whole[:, :width - 1], (1, 0))

    def _token_logprobs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self._token_logprobs_and_entropy(logits, input_ids, entropy=False)[0]

    def _token_logprobs_and_entropy(self, logits: torch.Tensor, input_ids: torch.Tensor, entropy: bool,
                                    entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token-aligned logprobs [b, S]: position t holds log p(input_ids[t] | input_ids[:t]);
        position 0 has no prediction and holds 0. With entropy, that distribution's entropy [b, S]
        aligned likewise (None without), with its gradient when entropy_grad (an entropy bonus in
        the loss). logits are vocab-parallel [b, S / CP, V/TP] of this CP rank's positions, read at
        the sampling temperature."""
        next_ids = self._share(torch.nn.functional.pad(input_ids[:, 1:], (0, 1)))  # the last predicts nothing read
        logprobs, token_entropy = token_logprobs_and_entropy(
            logits, next_ids, self.temperature, self.mpu.get_tensor_model_parallel_group(),
            entropy=entropy, entropy_grad=entropy_grad)
        width = input_ids.shape[1]
        return (self._token_aligned(logprobs, width),
                None if token_entropy is None else self._token_aligned(token_entropy, width))

    def _model_inputs(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Tokens, positions and attention mask of this CP rank's share of a micro-batch's rows, each
        row padded to a multiple of 2 x CP (nothing read depends on the padding: causal attention,
        and a packed row's padding is segment 0). The mask is None for right-padded rows (the
        default causal mask is exact), else the rows of this rank's queries."""
        tokens = mb["input_ids"]
        if "segment_ids" not in mb:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            return self._share(tokens), self._share(positions), None
        # packed rows: attention stays inside each sequence
        cp_size, cp_rank = self.mpu.get_context_parallel_world_size(), self.mpu.get_context_parallel_rank()
        length = padded_length(tokens.shape[1], cp_size)
        segment_ids = torch.nn.functional.pad(mb["segment_ids"], (0, length - tokens.shape[1]))
        attention_mask = packed_attention_mask(segment_ids, positions_on_rank(length, cp_size, cp_rank))
        return self._share(tokens), self._share(mb["position_ids"]), attention_mask

    def _run(self, batch: Batch, chunks: list, loss_fn: Callable, forward_only: bool) -> tuple[list[dict], list[int]]:
        """Run the Megatron schedule over micro-batches of this rank's shard (rlkit/data/
        micro_batches.py: each cut to its longest row); loss_fn maps (logits, micro_batch) ->
        (loss, outputs), the loss being the micro-batch's exact share of the global batch loss.
        Returns the outputs of each micro-batch (empty on pipeline stages that do not compute the
        loss) and the order of the rows they hold."""
        pipeline_size = self.mpu.get_pipeline_model_parallel_world_size()
        parts, row_order = micro_batches(batch, self.cfg.micro_batch_size, self.cfg.max_tokens_per_microbatch,
                                         min_micro_batches(pipeline_size, len(chunks)))
        device = torch.cuda.current_device() if ON_GPU else "cpu"
        # Megatron divides each micro-batch's loss by their number and DDP averages gradients over
        # DP: undo both, the losses being exact shares already
        undo_scaling = len(parts) * self.mpu.get_data_parallel_world_size()

        def scaled(loss_and_outputs):
            loss, outputs = loss_and_outputs
            return loss * undo_scaling, outputs

        def forward_step(data_iterator: Iterator[Batch], model):
            mb = Batch({k: v.to(device, non_blocking=True) for k, v in next(data_iterator).tensors.items()})
            output = model(*self._model_inputs(mb))
            return output, lambda out: scaled(loss_fn(out, micro_batch=mb))

        return run_schedule(chunks, parts, forward_step, pipeline_size, forward_only), row_order

    def _head_output(self, output: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Token-aligned [b, S]: logprobs for the policy; for the critic, position t holds the
        value of the state before token t (the prefix input_ids[:t]), aligned like the logprobs."""
        if self.head == "lm":
            return self._token_logprobs(output, input_ids)
        return self._token_aligned(output[..., 0].float(), input_ids.shape[1])

    def _forward_with(self, batch: Batch, chunks: list) -> torch.Tensor | None:
        def loss_fn(output, micro_batch):
            out = self._head_output(output, micro_batch["input_ids"])
            return torch.zeros((), device=out.device), {"output": out.detach()}

        self.wake()
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            outputs, row_order = self._run(batch, chunks, loss_fn, forward_only=True)
        if not outputs:
            return None
        # to the host once, not per micro-batch: each copy there would hold the host until the GPU caught up
        return restore_rows([o["output"] for o in outputs], row_order, batch["input_ids"].shape[1]).cpu()

    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Token-aligned logprobs (policy) or values (critic) of every row."""
        return self._forward_with(batch, self.model)

    def reference_logprobs(self, batch: Batch) -> torch.Tensor | None:
        if self.reference_is_base:
            with self.bridge.adapters_disabled(self.model):
                return self._forward_with(batch, self.model)
        if self.reference is None:
            raise RuntimeError("the reference policy was asked for before init_reference")
        return self._forward_with(batch, self.reference)

    @profiled
    def train(self, batch: Batch, totals: BatchTotals, objective: Callable) -> dict | None:
        """One optimizer step over this rank's shard of a mini-batch, minimising
        objective(head output, micro_batch, totals) (see algorithms/objectives.py). Returns summed
        metrics on output ranks (None elsewhere); the controller sums them across DP ranks."""
        if self.mpu.is_pipeline_last_stage():  # where the loss is computed: exactly what it declares
            # (and the length masks, so every stage cuts the same micro-batches)
            present = [k for k in (*MODEL_INPUTS, *LENGTH_MASKS) if k in batch]
            batch = batch.select(*dict.fromkeys([*present, *objective.fields]))
        def loss_fn(output, micro_batch):
            entropy = None  # the policy's, a metric
            if self.head == "lm":
                head_output, entropy = self._token_logprobs_and_entropy(output, micro_batch["input_ids"], entropy=True,
                                                                        entropy_grad=objective.uses_entropy)
            else:
                head_output = self._head_output(output, micro_batch["input_ids"])
            if objective.uses_entropy:  # the objective reads it, with its gradient
                micro_batch = micro_batch.with_fields(entropy=entropy)
            value, sums = objective(head_output, micro_batch, totals)
            sums = {k: v.detach() for k, v in sums.items()}
            if entropy is not None:
                sums["entropy"] = (entropy.detach() * micro_batch[objective.mask_key]).sum()
            sums["loss"] = value.detach()
            return value, sums

        self.wake()
        if self.optimizer is None:
            self.optimizer = self._build_optimizer(self.lr)
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs, _ = self._run(batch, self.model, loss_fn, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"{self.name} optimizer step failed on rank {self.rank} (non-finite gradients); lower "
                               f"its learning rate or optimizer.clip_grad, or look for inf/nan in the batch")
        if self.stage_checkpoints and not self.background_save.reserved and self._writes_full_state():
            # the optimizer's state exists now: reserve (pin, on a GPU) the host memory the first
            # checkpoint stages into while training goes on
            self.background_save.reserve(dist_checkpoint.state_bytes(self.model, self.optimizer))
        if not outputs:
            return None
        return {**summed_on_host(outputs), "grad_norm": float(grad_norm)}

    # ---- the step's rollout, held where it is used ------------------------------------
    @profiled
    def hold(self, shard: Batch) -> None:
        """Keep this rank's DP shard of the step's rollout; the calls below read and extend it."""
        self.held = shard

    def extend_held(self, fields: Batch) -> None:
        """Add fields (one per sample of the held shard, e.g. advantages) to the held shard."""
        self.held = self.held.with_fields(**fields.tensors)

    def export_held(self, names: list[str]) -> list | None:
        """Output ranks: [an object ref to the held shard's `names`], for another worker group
        (PPO: the policy's logprobs for the critic, its advantages back); the bytes go through
        the object store, not the controller."""
        import ray

        return [ray.put(self.held.select(*names))] if self._is_output() else None

    @profiled
    def forward_held(self, into: str, reference: bool = False) -> dict | None:
        """Head outputs of the held rows (policy: logprobs, critic: values) from the model, or the
        frozen reference, stored as field `into` where they are computed (the last pipeline
        stage). Returns, from output ranks, the agreement sums of these logprobs with the
        sampler's when the held rows carry them, and for the reference its KL sums to the held
        old_logprobs (rlkit/observability/logprob_agreement.py)."""
        output = self.reference_logprobs(self.held) if reference else self._forward_with(self.held, self.model)
        if output is None:
            return None
        self.held = self.held.with_fields(**{into: output})
        if reference and "old_logprobs" in self.held:
            return reference_kl_sums(output, self.held["old_logprobs"], self.held["response_mask"])
        if reference or self.head != "lm" or "generation_logprobs" not in self.held:
            return {}
        return agreement_sums(output, self.held["generation_logprobs"], self.held["response_mask"])

    @profiled
    def estimate_held(self, rewards: torch.Tensor, estimator: Callable) -> dict | None:
        """Token-level advantages where the data is (rewards: this shard's, per sample):
        estimator(held, rewards, reduce) returns new fields (stored) and metric sums (returned
        from output ranks); reduce(tensor, op) combines a statistic over this rank's
        data-parallel group, so whitening sees the whole batch. Runs on the ranks that hold the
        estimator's inputs (the last pipeline stage)."""
        if not all(k in self.held for k in estimator.fields):
            return None
        fields, sums = estimator(self.held, rewards, self._reduce_over_data_parallel)
        self.held = self.held.with_fields(**fields)
        return sums if self._is_output() else None

    def train_held(self, part: int, parts: int, totals: BatchTotals, objective: Callable) -> dict | None:
        """One optimizer step on part `part` of `parts` equal slices of the held shard."""
        return self.train(self.held.split(parts)[part], totals, objective)

    def evaluate_held(self, totals: BatchTotals, objective: Callable) -> dict | None:
        """The objective's loss and sums on the held rows, without a step (validation); from
        output ranks, summed over micro-batches (each is its exact share of the whole)."""
        def loss_fn(output, micro_batch):
            value, sums = objective(self._head_output(output, micro_batch["input_ids"]), micro_batch, totals)
            return value, {"loss": value.detach(), **{k: v.detach() for k, v in sums.items()}}

        self.wake()
        for chunk in self.model:
            chunk.eval()
        with torch.no_grad():
            outputs, _ = self._run(self.held, self.model, loss_fn, forward_only=True)
        return summed_on_host(outputs) if outputs and self._is_output() else None

    def _is_output(self) -> bool:
        return (self.mpu.get_tensor_model_parallel_rank() == 0 and self.mpu.get_context_parallel_rank() == 0
                and self.mpu.is_pipeline_last_stage())

    def _reduce_over_data_parallel(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.mpu.get_data_parallel_world_size() == 1:
            return tensor
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        on_device = tensor.to(torch.cuda.current_device() if ON_GPU else "cpu", copy=True)
        dist.all_reduce(on_device, op=ops[op], group=self.mpu.get_data_parallel_group())
        return on_device.to(tensor.device)

    # ---- weights out: this rank's half of refit (rlkit/refit/sender.py) ------------------
    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The bridge's HF-named export stream (the sender's export interface). Collective."""
        return self.bridge.export_hf_weights(self.model)

    def export_rows(self):
        return self.bridge.export_rows(self.model)

    def refit_manifest(self) -> list[tuple[str, tuple[int, ...], str]]:
        return self.refit_sender.manifest()

    def stream_refit_buckets(self, plan: RefitPlan, with_checksum: bool, delta: bool = False,
                             base_held: bool = False) -> Iterator[PackedBucket | EncodedBucket]:
        yield from self.refit_sender.stream_buckets(plan, with_checksum, delta, base_held)

    def join_refit_communicator(self, host: str, port: int, world_size: int, timeout_s: float):
        self.refit_sender.join_communicator(host, port, world_size, timeout_s)

    def refit_gpu(self) -> str:
        """This rank's GPU, as the engine process beside it finds it (cuda_ipc)."""
        from rlkit.refit.transports.cuda_ipc import gpu_identity
        return gpu_identity()

    def open_refit_channel(self, transport: str, receivers: int, timeout_s: float, channel_host: str) -> tuple:
        """channel_host (refit.channel_host): loopback, or node_ip for receivers on other nodes."""
        import ray

        half = sending_half(transport, self.refit_sender.communicator)
        host = "127.0.0.1" if channel_host == "loopback" else ray.util.get_node_ip_address()
        return self.refit_sender.open_channel(half, receivers, timeout_s, host)

    @profiled
    def send_refit(self, plan: RefitPlan, with_checksum: bool, delta: bool = False) -> dict:
        return self.refit_sender.send(plan, with_checksum, delta)

    def refit_stats(self) -> dict:
        return self.refit_sender.stats()

    def export_refit_adapters(self, dtype: str) -> dict[str, torch.Tensor] | None:
        """refit.peft=adapter: policy.peft's adapters alone, {HF PEFT name (<HF module>.lora_A.weight,
        .lora_B.weight): CPU tensor in `dtype`} on rank 0, None elsewhere. Collective."""
        self.wake()
        # copies: the export may hand out the parameters themselves, and a fused layer's A under
        # each of its HF modules' names
        adapters = {name: tensor.detach().to("cpu", getattr(torch, dtype), copy=True)
                    for name, tensor in self.bridge.export_adapter_weights(self.model)}
        return adapters if self.rank == 0 else None

    # ---- checkpoints ---------------------------------------------------------------------
    def _model_state(self) -> dict:
        """The model's sharded state for a distributed checkpoint: its one chunk's, or with virtual
        pipeline stages {"model<i>": chunk i's}, as Megatron lays out several chunks."""
        states = [self.bridge.checkpointed_state(unwrap(chunk)) for chunk in self.model]
        return states[0] if len(states) == 1 else {f"model{i}": state for i, state in enumerate(states)}

    def _load_model_state(self, loaded: dict):
        chunks = [unwrap(chunk) for chunk in self.model]
        for i, chunk in enumerate(chunks):
            self.bridge.load_model_state(chunk, loaded if len(chunks) == 1 else loaded[f"model{i}"])

    def _optimizer_ready(self):
        self.wake()
        if self.optimizer is None:
            self.optimizer = self._build_optimizer(self.lr)
        return self.optimizer

    def save_checkpoint(self, ckpt_dir: str, save_format: str) -> dict[str, float]:
        """Weights, optimizer state and this rank's RNG into ckpt_dir. Collective. Returns the
        seconds training was held ("held"), and in which parts.
        dist: Megatron distributed checkpoint (reshardable to another TP/PP), written in the
        background (dist_checkpoint.py) until finish_checkpoint; with adapters (policy.peft) the
        adapters and their optimizer state alone, and a record of the base (adapter_base.py);
        hf: weights through the bridge (loadable by transformers) + per-rank optimizer state,
        written before this returns."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        held = time.perf_counter()
        own_dir = os.path.join(ckpt_dir, self.name)
        optimizer = self._optimizer_ready()
        if self.rank == 0:
            os.makedirs(os.path.join(ckpt_dir, "rng"), exist_ok=True)
            os.makedirs(own_dir, exist_ok=True)
        dist.barrier()
        torch.save({"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
                    "lr": self.lr}, os.path.join(ckpt_dir, "rng", f"{self.name}_rank_{self.rank}.pt"))
        parts = {}
        if save_format == "dist":
            model_state = self._model_state()
            record = None
            if self.bridge.has_adapters and self.rank == 0:
                self._base_digest = self._base_digest or weights_digest(self.base_dir)
                record = functools.partial(record_base, own_dir, self.base_dir, self._base_digest)
            state = {"model": model_state, "optimizer": optimizer.sharded_state_dict(
                model_state, metadata=OPTIMIZER_CHECKPOINT_FORMAT)}
            parts["state_dict"] = time.perf_counter() - held
            parts.update(self.background_save.start(state, own_dir, on_finished=record))
        else:
            self.bridge.save_hf_weights(self.model, os.path.join(own_dir, "hf"))
            torch.save(optimizer.state_dict(), os.path.join(own_dir, f"optimizer_rank{self.rank}.pt"))
            dist.barrier()
        return {"held": time.perf_counter() - held, **parts}

    def finish_checkpoint(self, wait: bool) -> WrittenFiles | None:
        """None while the last save_checkpoint is being written on some rank; once it is whole
        (finalized here; wait: block until then), what this rank's writer made. Collective."""
        return self.background_save.finish(wait)

    def load_checkpoint(self, ckpt_dir: str, save_format: str):
        """Inverse of save_checkpoint. A dist checkpoint loads into any TP/PP layout."""
        from megatron.core import dist_checkpointing
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        own_dir = os.path.join(ckpt_dir, self.name)
        optimizer = self._optimizer_ready()
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
        rng_file = os.path.join(ckpt_dir, "rng", f"{self.name}_rank_{self.rank}.pt")
        if os.path.exists(rng_file):  # absent when resuming onto more ranks than were saved
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["torch"])
            get_cuda_rng_tracker().set_states(rng["tracker"])
            self.set_learning_rate(rng["lr"])
        dist.barrier()

    def export_hf_weights(self) -> dict[str, torch.Tensor] | None:
        """All HF-named weights on rank 0 (tests and verification). Collective."""
        self.wake()
        weights = {n: t.detach().cpu().clone() for n, t in self.bridge.export_hf_weights(self.model)}
        return weights if self.rank == 0 else None

    def save_hf(self, out_dir: str):
        """Write an HF checkpoint (weights through the bridge, plus config and tokenizer). Collective."""
        self.wake()
        self.bridge.save_hf_weights(self.model, out_dir)
        if self.rank == 0:
            from transformers import AutoTokenizer
            self.bridge.hf_config.save_pretrained(out_dir)
            AutoTokenizer.from_pretrained(self.bridge.hf_dir).save_pretrained(out_dir)
        dist.barrier()

    def save_peft_adapter(self, out_dir: str):
        """policy.peft's adapters as an HF PEFT directory over this policy's base. Collective."""
        self.wake()
        adapters = dict(self.bridge.export_adapter_weights(self.model))
        if self.rank == 0:
            write_hf_peft_adapter(out_dir, adapters, self.cfg.peft, self.base_dir)
        dist.barrier()

    def release(self):
        """Leave the process group and drop the model: a WarmPool's idle worker (rlkit/cluster/
        warm_pool.py) holds no process group, whose gloo threads would keep waking, and no model
        memory. Only reset() may follow."""
        if not self.__dict__:  # released already (given back, now taken again): no second full collection
            return
        _drop_kept_graphs(getattr(self, "model", None) or [])
        if dist.is_initialized():
            assert not self.background_save.pending, "a checkpoint is still being written (finish_checkpoint)"
            self.mpu.destroy_model_parallel()
            _drop_megatron_group_holders(self.mpu)
            dist.destroy_process_group()
        self.__dict__.clear()
        # the model and optimizer reach their process groups through reference cycles: until a full
        # collection frees them, each group's gloo threads stay (about 50 threads per run), and they
        # cost an idle worker a tenth of a core after a few runs
        gc.collect()

    def reset(self, args: dict):
        """release(), then take new constructor arguments (another model, layout or rank) for the
        next setup(). The process and its imports stay, for a WarmPool to reuse."""
        self.release()
        self.__init__(**args)

    def shutdown(self):
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)


def _drop_kept_graphs(chunks: list[torch.nn.Module]) -> None:
    """Drop the tensors with an autograd graph that modules (or their helpers) keep after a step:
    megatron-core's MoE token dispatcher keeps its last routing probs. Such a graph reaches the
    gradient hooks of the DDP wrapper, and so the whole model: a cycle through autograd's C++ nodes
    that no garbage collection frees, so a pooled worker would keep every MoE model it trained."""
    for chunk in chunks:
        for module in chunk.modules():
            helpers = [v for v in vars(module).values()
                       if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type))]
            for holder in (module, *helpers):
                for name, value in list(vars(holder).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(holder, name, None)


def _drop_megatron_group_holders(mpu) -> None:
    """What still holds a run's process groups after megatron-core 0.16's destroy_model_parallel,
    each group keeping its gloo threads (and rank 0 its store's server thread) alive: two groups it
    does not reset, and the rotary embeddings' forward, an lru_cache keyed by the module, whose
    entries keep every run's rotary module (and its context-parallel group) until 32 are cached."""
    mpu._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
    mpu._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
    for module, cls in [("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding"),
                        ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding")]:
        if module in sys.modules:  # imported only by the models that use it
            getattr(sys.modules[module], cls).forward.cache_clear()


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
