"""HF transformers generation worker: the CPU backend behind the GenerationWorker interface."""

import torch

from rlkit.config.schema import PeftConfig
from rlkit.data.generation import Generations, SamplingParams
from rlkit.models.checkpoint_names import checkpoint_tensors
from rlkit.observability.startup import PhaseTimes
from rlkit.models.tokenizer import load_tokenizer
from rlkit.refit.delta import EncodedBucket
from rlkit.refit.plan import PackedBucket, RefitIntegrityError, RefitPlan, bucket_checksum
from rlkit.refit.receiver import (CheckpointTensors, ObjectStoreReceiver, Received, StandingReceiver,
                                  check_plan_fits, receiving_half, sender_for)
from rlkit.refit.transport import transport_spec
from rlkit.workers.generation.base import GenerationWorker


class HFGenerationWorker(GenerationWorker):
    """Holds an HF model built from the checkpoint's config with random weights: real weights
    arrive only through refit, so a refit that misses a tensor is caught, not masked. With
    `adapter` (policy.peft under refit.peft=adapter) it holds the checkpoint's real weights
    under HF peft's LoRA instead, and refits set the adapters alone."""

    def __init__(self, model_dir: str, precision: str, threads: int, rank: int, adapter: PeftConfig | None = None):
        self.startup = PhaseTimes()
        with self.startup.phase("transformers_import"):
            from transformers import AutoConfig, AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.rank, self.name = rank, f"generation worker {rank}"
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        with self.startup.phase("build"):
            base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype) \
                if adapter is None else AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        tokenizer = load_tokenizer(model_dir)
        self.pad_id, self.eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        # the checkpoint's tensors under its names, as the exporter sends them (persistent buffers such as an
        # expert bias included, fused MoE experts as views, tied weights once); peft's LoRA layers wrap these
        self._tensors = checkpoint_tensors(base)
        self.receiver = ObjectStoreReceiver(self._tensors, self.name) if adapter is None else None
        self.standing_receiver: StandingReceiver | None = None  # a refit transport's with halves
        self._refit_communicator = None  # what that transport's handshake made
        self.model = (base if adapter is None else _with_lora(base, adapter)).eval()

    def reset(self, args: dict):
        """Drop the model and take new constructor arguments (another model or rank): the process
        and its imports stay, for a WarmPool (rlkit/cluster/warm_pool.py) to reuse."""
        self.close()
        self.__dict__.clear()
        self.__init__(**args)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generations:
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(prompt_ids):  # left padding: generation continues at the right edge
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        torch.manual_seed(params.seed)
        greedy = params.temperature == 0
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention, max_new_tokens=params.max_new_tokens,
            do_sample=not greedy, temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p, top_k=None if greedy else params.top_k,
            min_new_tokens=params.max_new_tokens if params.ignore_eos else None,
            pad_token_id=self.pad_id, eos_token_id=self.eos_id, output_logits=True,
            return_dict_in_generate=True)
        new_tokens = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T, V] raw, before any processor
        logprobs = torch.log_softmax(logits / (params.temperature or 1.0), dim=-1)
        token_logprobs = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        token_ids, token_lps = [], []
        for ids, lps in zip(new_tokens.tolist(), token_logprobs.tolist()):
            length = ids.index(self.eos_id) + 1 if self.eos_id in ids and not params.ignore_eos else len(ids)
            token_ids.append(ids[:length])
            token_lps.append(lps[:length])
        return Generations(token_ids, token_lps)

    def generate_requests(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> Generations:
        # one at a time: a request alone has no padding, and its seed alone draws its samples
        answers = [self.generate([p], q) for p, q in zip(prompt_ids, params)]
        return Generations([a.token_ids[0] for a in answers], [a.logprobs[0] for a in answers])

    # the object-store refit, one Ray call per bucket (rlkit/cluster/refit_driver.py drives it)
    def begin_refit(self, plan: RefitPlan, verify_checksums: bool) -> bool:
        """Whether this worker holds the last version of every bucket (refit.delta may send deltas)."""
        return self.receiver.begin(plan, verify_checksums)

    def load_bucket(self, bucket: PackedBucket | EncodedBucket) -> None:
        self.receiver.load(bucket)

    def end_refit(self) -> Received:
        return self.receiver.end()

    # refit through a transport's halves (rlkit/refit/transport.py): a standing receiver in this process
    def join_refit_communicator(self, transport: str, host: str, port: int, world_size: int, first_rank: int,
                                timeout_s: float) -> None:
        self._refit_communicator = transport_spec(transport).join(host, port, first_rank, world_size, timeout_s)

    def start_refit_receiver(self, transport: str, senders: dict[str, tuple], timeout_s: float) -> None:
        model = CheckpointTensors(self._tensors)
        self.standing_receiver = StandingReceiver(
            receiving_half(transport, self._refit_communicator), lambda: model, sender_for(senders, None, self.name),
            self.name, timeout_s, check_plan=lambda plan: check_plan_fits(plan, self._tensors, self.name))

    # refit.peft=adapter: the adapters alone, one Ray call (rlkit/cluster/refit_driver.py AdapterTransfer)
    def load_adapters(self, adapters: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        loaded = set_peft_model_state_dict(self.model, {PEFT_PREFIX + name: t for name, t in adapters.items()})
        missing = [key for key in loaded.missing_keys if ".lora_" in key]  # the base is not in the state set
        if missing or loaded.unexpected_keys:
            raise RefitIntegrityError(f"refit.peft=adapter: the policy's adapters do not match {self.name}'s LoRA: "
                                      f"missing {missing[:3]}, unexpected {loaded.unexpected_keys[:3]}")

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The adapters as this worker holds them, named as load_adapters takes them (tests)."""
        from peft import get_peft_model_state_dict

        return {name.removeprefix(PEFT_PREFIX): t.detach().clone()
                for name, t in get_peft_model_state_dict(self.model).items()}

    def weights(self) -> dict:
        """HF-named tensors as this worker holds them (tests compare them bit for bit)."""
        return {n: p.detach().clone() for n, p in self._tensors.items()}

    def weight_checksums(self) -> list[dict[str, int]]:
        return [{n: bucket_checksum(p.detach().contiguous().view(-1).view(torch.uint8))
                 for n, p in self._tensors.items()}]

    def sleep(self) -> None:
        pass  # nothing to release on CPU

    def wake(self, part: str = "all") -> None:
        pass


# HF peft's state-dict names are the HF model's under this prefix (a PeftModel wraps the model twice)
PEFT_PREFIX = "base_model.model."


def _with_lora(model, peft: PeftConfig):
    """The model under HF peft's LoRA on policy.peft's modules, computing as the policy does:
    alpha / rank scaling, no dropout at inference, adapters in the model's dtype (peft's default
    would compute bf16 models' adapters in fp32). Refits set the adapters."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=peft.rank, lora_alpha=peft.alpha, lora_dropout=0.0,
                                            target_modules=list(peft.target_modules)), autocast_adapter_dtype=False)
