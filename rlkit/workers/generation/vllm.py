"""vLLM generation worker: one vllm.LLM engine per Ray actor, behind the GenerationWorker interface.

Logprobs: vLLM runs with logprobs_mode="processed_logprobs", i.e. the logprob of each sampled
token under the distribution it was sampled from, after temperature (and top-k/top-p, which
rlkit's recipes leave off). The trainer computes log_softmax(logits / temperature) over the full
vocabulary, so with top_p=1 and top_k off the two describe the same distribution; with top-k/p
on they would differ by the truncation, which is why the recipes keep them off for RL.

refit.peft=adapter: the engine loads the checkpoint's real weights with LoRA enabled, and each
refit writes the policy's adapters as an HF PEFT adapter directory (vLLM loads adapters from files
only) that every generate() after it names in its LoRARequest.
"""

import os
import pickle
import shutil
import tempfile
import threading
import time

import torch

from rlkit.bridge.adapters import write_hf_peft_adapter
from rlkit.config.schema import ConfigError, GenerationConfig, PeftConfig
from rlkit.data.generation import Generations, SamplingParams
from rlkit.observability.startup import PhaseTimes
from rlkit.workers.generation.base import GenerationWorker
from rlkit.workers.rendezvous import use_interface_of


def _inspect_architectures_here() -> None:
    """vLLM 0.26 learns what a model's architecture supports in a Python process of its own, so
    that this process would not initialize CUDA: on a fresh machine about 20 s, until its cache
    under VLLM_CACHE_ROOT holds the answer. An engine of one GPU in this process initializes CUDA
    here anyway, so the inspection (an import of the model's module) runs here."""
    from vllm.model_executor.models import registry

    if hasattr(registry, "_run_in_subprocess"):  # a private function: other versions keep their own way
        registry._run_in_subprocess = lambda inspect: inspect()


# generation.vllm.torch_compile=false: no compilation (its ~20 s on a machine without vLLM's cache),
# and whole-model CUDA graphs for the decode steps, which are most of a rollout's steps
WITHOUT_TORCH_COMPILE = {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"}


class VLLMGenerationWorker(GenerationWorker):
    """Starts with dummy weights: real weights arrive only through refit. With `adapter`
    (policy.peft under refit.peft=adapter) it starts from the checkpoint's real weights, with LoRA
    on, and refits bring the adapters alone."""

    def __init__(self, model_dir: str, cfg: GenerationConfig, seed: int, rank: int, sleep_mode: bool,
                 fp32_lm_head: bool, adapter: PeftConfig | None = None, visible_devices: str | None = None):
        """visible_devices: an engine of several GPUs (tensor parallelism) is given their ids, as
        Ray gives an actor the GPU of one bundle alone; vLLM starts a process on each."""
        self.startup = PhaseTimes()
        if visible_devices is not None:  # before anything initializes CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        v = cfg.vllm
        # in this process, the engine skips spawning and importing a second one and the handshake
        # with it: 30 s of a warm start on an H100 (docs/performance.md)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if v.engine_process else "0"
        # a process of the engine's other than this one (its core, or a GPU's worker under tensor
        # parallelism) takes IPC handles and plans by pickle
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        import ray  # where used: a fork server imports this module before Ray (rlkit/cluster/fork_server.py)

        # the engine's process group on this node's address alone (its store: vllm_ext.py)
        node_address = ray.util.get_node_ip_address()
        os.environ.setdefault("VLLM_HOST_IP", node_address)
        use_interface_of(node_address)
        with self.startup.phase("vllm_import"):
            from vllm import LLM
        if not v.engine_process and v.tensor_parallel_size == 1:
            _inspect_architectures_here()

        self.rank, self.sleep_mode, self.seed_per_request = rank, sleep_mode, v.seed_per_request
        self.model_dir, self.adapter = model_dir, adapter
        # LoRA on the adapted modules alone (q_proj etc. name vLLM's fused qkv_proj too): a LoRA
        # wrapper on the LM head would add a kernel on every step's logits
        lora = {} if adapter is None else dict(enable_lora=True, max_lora_rank=_max_lora_rank(adapter.rank),
                                               max_loras=1, lora_target_modules=list(adapter.target_modules))
        with self.startup.phase("vllm_engine"):
            self.llm = LLM(model=model_dir, tensor_parallel_size=v.tensor_parallel_size,
                           # one process per GPU, children of this actor: never Ray's executor, which
                           # would ask Ray for GPUs this run's placement group already holds
                           distributed_executor_backend="mp" if v.tensor_parallel_size > 1 else None,
                           gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=v.max_model_len,
                           enforce_eager=v.enforce_eager, seed=seed + rank,
                           compilation_config=None if v.torch_compile else WITHOUT_TORCH_COMPILE,
                           load_format="dummy" if adapter is None else "auto",
                           dtype="bfloat16" if cfg.precision == "bf16" else "float32",
                           enable_sleep_mode=sleep_mode, logprobs_mode="processed_logprobs",
                           quantization=v.quantization,
                           # logits as the policy computes them (policy.fp32_lm_head)
                           hf_overrides={"head_dtype": "float32"} if fp32_lm_head else None,
                           worker_extension_cls="rlkit.workers.generation.vllm_ext.RefitExtension", **lora)
        # refit.peft=adapter: the last refit's adapter (None: the base alone) and where each is written
        self.lora_request = None
        self.adapter_root = None if adapter is None else tempfile.mkdtemp(
            prefix="rlkit-adapters-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)  # tmpfs where there is one
        self._watch_engine()
        self._asleep_tags: set[str] = set()
        # set by a refit, cleared by the next generate(): resetting there keeps an engine round
        # trip off the refit's critical path
        self._prefix_cache_stale = False

    def _watch_engine(self):
        """When the engine core process dies, vLLM 0.26's synchronous client marks itself dead but
        leaves a generate() or an RPC already waiting for the engine's answer waiting forever. Hand
        those waits the error instead: the run then stops at once, naming this worker, rather than
        at cluster.call_timeout_s."""
        from vllm.v1.engine.exceptions import EngineDeadError

        client = self.llm.llm_engine.engine_core
        if not hasattr(client, "outputs_queue"):  # an in-process engine raises by itself
            return

        def watch():
            while not client.resources.engine_dead:
                time.sleep(0.5)
            client.outputs_queue.put_nowait(EngineDeadError())
            for pending in list(client.utility_results.values()):
                if not pending.done():
                    pending.set_exception(EngineDeadError())

        threading.Thread(target=watch, daemon=True, name="rlkit-engine-watch").start()

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generations:
        # samples depend on the call's seed and this engine's rank, not on what the engine sampled before
        call_seed = params.seed * 1_000_003 + self.rank
        if self.seed_per_request:  # exact on resume (generation.vllm.seed_per_request)
            sampling = [_vllm_params(params, (call_seed * 2**20 + i) % 2**63) for i in range(len(prompt_ids))]
        else:  # one noise draw for the whole batch: its rows follow vLLM's batching, so not exact on resume
            self._rpc("rlkit_seed_sampler", call_seed)
            sampling = _vllm_params(params, None)
        return self._generate(prompt_ids, sampling)

    def generate_requests(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> Generations:
        # each request's own seed draws its samples, whatever else the engine batches with it
        return self._generate(prompt_ids, [_vllm_params(q, q.seed) for q in params])

    def _generate(self, prompt_ids: list[list[int]], sampling) -> Generations:
        from vllm.inputs import TokensPrompt

        if self._prefix_cache_stale:  # cached KV was computed with the old weights
            self.llm.reset_prefix_cache()
            self._prefix_cache_stale = False
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], sampling,
                                    use_tqdm=False, lora_request=self.lora_request)
        token_ids, logprobs = [], []
        for out in outputs:
            sample, flat = out.outputs[0], out.outputs[0].logprobs
            # each position's first entry is the sampled token's
            if [flat.token_ids[i] for i in flat.start_indices] != list(sample.token_ids):
                raise RuntimeError(f"generation worker {self.rank}: vLLM's logprobs do not follow its sampled tokens")
            token_ids.append(list(sample.token_ids))
            logprobs.append([flat.logprobs[i] for i in flat.start_indices])
        return Generations(token_ids, logprobs)

    def _rpc(self, method: str, *args):
        # pickled by hand: vLLM's msgspec RPC would turn dataclasses such as the plan into dicts
        return self.llm.collective_rpc(method, args=(pickle.dumps(args),))

    def start_refit_receiver(self, transport: str, senders: dict[str, tuple], timeout_s: float) -> None:
        self._rpc("rlkit_start_refit_receiver", transport, senders, f"generation worker {self.rank}", timeout_s)

    def weights_changing(self) -> None:
        self._prefix_cache_stale = True  # reset at the next generate()

    def load_adapters(self, adapters: dict[str, torch.Tensor]) -> None:
        """A new adapter directory and LoRARequest (a new id: vLLM loads an id once and reuses it),
        loaded into the engine now, so that a bad adapter (vLLM's loader refuses modules the model
        does not have) fails the refit rather than the next generate(). The engine holds one
        adapter (max_loras=1) and evicts the last one, whose directory goes too. The prefix cache
        keys on the adapter's name: nothing computed under the old adapter is reused."""
        from vllm.lora.request import LoRARequest

        replaced = self.lora_request
        version = 1 if replaced is None else replaced.lora_int_id + 1
        path = os.path.join(self.adapter_root, f"refit-{version}")
        write_hf_peft_adapter(path, adapters, self.adapter, self.model_dir)
        request = LoRARequest(lora_name=f"rlkit-refit-{version}", lora_int_id=version, lora_path=path)
        self.llm.llm_engine.add_lora(request)
        self.lora_request = request
        if replaced is not None:
            shutil.rmtree(replaced.lora_path)

    def close(self) -> None:
        if self.adapter_root is not None:
            shutil.rmtree(self.adapter_root, ignore_errors=True)

    def join_refit_communicator(self, transport: str, host: str, port: int, world_size: int, first_rank: int,
                                timeout_s: float) -> None:
        self._rpc("rlkit_join_refit_communicator", transport, host, port, world_size, first_rank, timeout_s)

    def weight_checksums(self) -> list[dict[str, int]]:
        return self._rpc("rlkit_param_checksums")

    def sleep(self) -> None:
        if self.sleep_mode and not self._asleep_tags:
            self.llm.sleep(level=1)
            self._asleep_tags = {"weights", "kv_cache"}

    def wake(self, part: str = "all") -> None:
        tags = sorted(self._asleep_tags & ({"weights"} if part == "weights" else {"weights", "kv_cache"}))
        if tags:
            self.llm.wake_up(tags=tags)
            self._asleep_tags -= set(tags)



def _vllm_params(params: SamplingParams, seed: int | None):
    """vLLM's sampling parameters for rlkit's, with this seed (None: the engine's sampler)."""
    from vllm import SamplingParams as VllmSamplingParams

    return VllmSamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k if params.top_k > 0 else -1, logprobs=0,
                              ignore_eos=params.ignore_eos, seed=seed,
                              # rlkit decodes what it needs itself; flat logprobs are a few lists per request,
                              # not a dict and an object per token
                              detokenize=False, flat_logprobs=True)


def _max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM takes (its own list) that holds a rank-`rank` adapter;
    vLLM pads a smaller adapter to it and scales by the adapter's own alpha / rank."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    ranks = sorted(get_args(MaxLoRARanks))
    fits = [r for r in ranks if r >= rank]
    if not fits:
        raise ConfigError(f"policy.peft.rank: vLLM serves LoRA adapters up to rank {ranks[-1]} (got: {rank}); lower "
                          f"it, or use refit.peft=merged")
    return fits[0]
