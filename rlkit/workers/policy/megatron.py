"""Megatron-Core model worker: one Ray actor per rank of a TP x CP x PP x DP grid. It hosts the policy
(head="lm": token logprobs), PPO's critic (head="value": the GPTModel with a scalar value head, its trunk
from the policy checkpoint) or a reward model (head="reward": that head without bias; reward_export.py).

Each call that takes a Batch receives this rank's DP shard; the controller gathers results
from the output ranks (TP and CP rank 0 on the last pipeline stage) of each DP group. Under context
parallelism every rank of a CP group holds the same shard, runs the model on its share of each
row's tokens (rlkit/bridge/context_parallel.py) and gathers the per-token outputs back, so the
losses and every result are the whole rows', as at CP=1. What every backend's rank does alike
(the held rollout, its half of refit) is TrainingRank's (rank.py).
"""

import os
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rlkit.checkpoint import WrittenFiles
from rlkit.config.schema import PolicyConfig
from rlkit.data.batch import MODEL_INPUTS, Batch, BatchTotals
from rlkit.data.micro_batches import LENGTH_MASKS, micro_batches, restore_rows
from rlkit.observability.profiling import profiled
from rlkit.observability.startup import PhaseTimes, without_wandb
from rlkit.workers.policy.checkpoint_io import CheckpointIO
from rlkit.workers.policy.expected_warnings import silence_expected_warnings
from rlkit.workers.policy.hand_over import MemoryHandOver
from rlkit.workers.policy.optimizer import build_optimizer
from rlkit.workers.policy.pool_lifecycle import collect, release_process
from rlkit.workers.policy.rank import ON_GPU, TrainingRank
from rlkit.workers.policy.schedule import min_micro_batches, run_schedule, summed_on_host
from rlkit.workers.policy.token_io import TokenIO
from rlkit.workers.rendezvous import init_process_group

silence_expected_warnings()


class MegatronModelWorker(TrainingRank):
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
        self.io = TokenIO(mpu, head)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        self.bf16 = cfg.precision == "bf16"
        self.base_dir = model_dir  # the HF checkpoint under policy.peft's adapters (init_reference may replace it)
        self.name = "critic" if head == "value" else "policy"  # its folder in a checkpoint
        with self.startup.phase("build"):
            # policy.peft adapts the policy; PPO's critic trains all of its weights
            self.bridge = open_bridge(cfg.bridge, model_dir, torch.bfloat16 if self.bf16 else torch.float32,
                                      cfg.attention_backend, cfg.peft if head == "lm" else None)
            self.model = self.bridge.build(bf16=self.bf16, wrap_with_ddp=True, value_head=head != "lm",
                                           value_bias=head == "value", fp32_lm_head=cfg.fp32_lm_head,
                                           use_distributed_optimizer=cfg.use_distributed_optimizer)
        with self.startup.phase("hf_load"):
            if head != "lm":
                self.bridge.load_trunk_weights(self.model, self.bf16)
            else:
                self.bridge.load_hf_weights(self.model)
                if cfg.peft is not None and cfg.peft.init_from is not None:
                    self.bridge.load_adapter_checkpoint(self.model, os.path.join(cfg.peft.init_from, self.name))
        self.hand_over = MemoryHandOver(cfg.offload, ON_GPU)
        self.checkpoints = CheckpointIO(self.name, rank, self.bridge, self.model, head, writes_full_state=(
            mpu.get_data_parallel_rank(with_context_parallel=True) == 0
            and not cfg.use_distributed_optimizer and not self.bridge.has_adapters))
        self.start_collaborators()
        self.reference = None
        self.reference_is_base = False  # the reference is self.model with its adapters off (init_reference)

    # ---- setup -------------------------------------------------------------------------
    def layout(self) -> dict:
        m = self.mpu
        return {"rank": self.rank, "tp": m.get_tensor_model_parallel_rank(), "pp": m.get_pipeline_model_parallel_rank(),
                "cp": m.get_context_parallel_rank(), "dp": m.get_data_parallel_rank(), "is_output": self.is_output()}

    def set_temperature(self, temperature: float):
        self.io.temperature = temperature

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
                self.base_dir = hf_dir
            self.reference_is_base = True
            return
        self.reference = self.bridge.build(bf16=self.bf16, wrap_with_ddp=False, fp32_lm_head=self.cfg.fp32_lm_head)
        self.bridge.load_hf_weights(self.reference, hf_dir)
        for chunk in self.reference:
            chunk.requires_grad_(False)

    # ---- GPU memory while a colocated vLLM generates ----------------------------------------
    @profiled
    def sleep(self) -> dict:
        """Free this rank's GPU memory for a colocated vLLM (policy.offload, hand_over.py): bytes
        and seconds; {} on CPU, with offload none, or while asleep."""
        return self.hand_over.sleep(self.model + (self.reference or []), self.model, self.optimizer)

    # ---- forward / backward ------------------------------------------------------------
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
            output = model(*self.io.model_inputs(mb))
            return output, lambda out: scaled(loss_fn(out, micro_batch=mb))

        return run_schedule(chunks, parts, forward_step, pipeline_size, forward_only), row_order

    def _forward_with(self, batch: Batch, chunks: list) -> torch.Tensor | None:
        def loss_fn(output, micro_batch):
            out = self.io.head_output(output, micro_batch["input_ids"])
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
                head_output, entropy = self.io.logprobs_and_entropy(output, micro_batch["input_ids"], entropy=True,
                                                                        entropy_grad=objective.uses_entropy)
            else:
                head_output = self.io.head_output(output, micro_batch["input_ids"])
            if objective.uses_entropy:  # the objective reads it, with its gradient
                micro_batch = micro_batch.with_fields(entropy=entropy)
            value, sums = objective(head_output, micro_batch, totals)
            sums = {k: v.detach() for k, v in sums.items()}
            if entropy is not None:
                sums["entropy"] = (entropy.detach() * micro_batch[objective.mask_key]).sum()
            sums["loss"] = value.detach()
            return value, sums

        optimizer = self._optimizer_ready()
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        outputs, _ = self._run(batch, self.model, loss_fn, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise self.non_finite_gradients()
        if self.stage_checkpoints:  # the optimizer's state exists now
            self.checkpoints.reserve_staging(optimizer)
        if not outputs:
            return None
        return {**summed_on_host(outputs), "grad_norm": float(grad_norm)}

    # ---- the step's rollout, held where it is used (the rest: rank.py) ---------------------
    def evaluate_held(self, totals: BatchTotals, objective: Callable) -> dict | None:
        """The objective's loss and sums on the held rows, without a step (validation); from
        output ranks, summed over micro-batches (each is its exact share of the whole)."""
        def loss_fn(output, micro_batch):
            value, sums = objective(self.io.head_output(output, micro_batch["input_ids"]), micro_batch, totals)
            return value, {"loss": value.detach(), **{k: v.detach() for k, v in sums.items()}}

        self.wake()
        for chunk in self.model:
            chunk.eval()
        with torch.no_grad():
            outputs, _ = self._run(self.rollout.held, self.model, loss_fn, forward_only=True)
        return summed_on_host(outputs) if outputs and self.is_output() else None

    def is_output(self) -> bool:
        return (self.mpu.get_tensor_model_parallel_rank() == 0 and self.mpu.get_context_parallel_rank() == 0
                and self.mpu.is_pipeline_last_stage())

    def data_parallel_group(self) -> dist.ProcessGroup:
        return self.mpu.get_data_parallel_group()

    # ---- weights out: the export refit's sender reads (the rest of refit: rank.py) ---------
    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The bridge's HF-named export stream (the sender's export interface). Collective."""
        return self.bridge.export_hf_weights(self.model)

    def export_rows(self):
        return self.bridge.export_rows(self.model)

    def export_refit_adapters(self, dtype: str) -> dict[str, torch.Tensor] | None:
        """refit.peft=adapter: policy.peft's adapters alone, {HF PEFT name (<HF module>.lora_A.weight,
        .lora_B.weight): CPU tensor in `dtype`} on rank 0, None elsewhere. Collective."""
        self.wake()
        # copies: the export may hand out the parameters themselves, and a fused layer's A under
        # each of its HF modules' names
        adapters = {name: tensor.detach().to("cpu", getattr(torch, dtype), copy=True)
                    for name, tensor in self.bridge.export_adapter_weights(self.model)}
        return adapters if self.rank == 0 else None

    # ---- checkpoints and exports (checkpoint_io.py) ------------------------------------------
    def new_optimizer(self):
        """Megatron's distributed optimizer: fp32 main weights and Adam state (optimizer.py)."""
        return build_optimizer(self.cfg, self.bridge.transformer_config, self.model, self.lr)

    def save_checkpoint(self, ckpt_dir: str, save_format: str) -> dict[str, float]:
        return self.checkpoints.save(ckpt_dir, save_format, self._optimizer_ready(), self.lr, self.base_dir)

    def finish_checkpoint(self, wait: bool) -> WrittenFiles | None:
        return self.checkpoints.finish(wait)

    def load_checkpoint(self, ckpt_dir: str, save_format: str):
        lr = self.checkpoints.load(ckpt_dir, save_format, self._optimizer_ready())
        if lr is not None:
            self.set_learning_rate(lr)

    def export_hf_weights(self) -> dict[str, torch.Tensor] | None:
        self.wake()
        return self.checkpoints.export_hf_weights()

    def save_hf(self, out_dir: str):
        self.wake()
        self.checkpoints.save_hf(out_dir)

    def save_peft_adapter(self, out_dir: str):
        self.wake()
        self.checkpoints.save_peft_adapter(out_dir, self.cfg.peft, self.base_dir)

    # ---- a warm pool's idle process (pool_lifecycle.py) --------------------------------------
    def release(self):
        if not self.__dict__:  # released already (given back, now taken again): no second full collection
            return
        release_process(getattr(self, "model", None) or [], getattr(self, "mpu", None),
                        "checkpoints" in self.__dict__ and self.checkpoints.background_save.pending)
        self.__dict__.clear()
        collect()
