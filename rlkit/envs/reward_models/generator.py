"""A judge's generation: greedy, so that its answer depends on its prompt alone (and a cached
answer is the answer), with HF transformers (CPU, or a GPU) or vLLM (a GPU). The judge is never
refitted: its weights are the directory's. Prompts arrive rendered (the judge's chat template
applied by the environment) and are tokenized here without special tokens added again."""

from rlkit.envs.reward_models.model_dirs import CAUSAL_LM, is_out_of_memory, load_model, out_of_memory_line

BACKENDS = ("auto", "hf", "vllm")  # auto: vllm with a GPU (env.num_gpus > 0), else hf


def pick_backend(backend: str, num_gpus: float) -> str:
    if backend == "auto":
        return "vllm" if num_gpus else "hf"
    return backend


class HFGenerator:
    def __init__(self, model_path: str, device: str, dtype: str, max_new_tokens: int):
        from rlkit.models.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(CAUSAL_LM, model_path, device, dtype, f"judge {model_path}")
        self.device, self.max_new_tokens = device, max_new_tokens

    def __call__(self, prompts: list[str]) -> list[str]:
        import torch

        rows = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, ids in enumerate(rows):  # left padding: generation continues at the right edge
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention[i, width - len(ids):] = 1
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                      max_new_tokens=self.max_new_tokens, do_sample=False, temperature=None,
                                      top_p=None, top_k=None, pad_token_id=self.tokenizer.pad_token_id,
                                      eos_token_id=self.tokenizer.eos_token_id)
        return self.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def vllm_memory_share(num_gpus: float) -> float:
    """vLLM's gpu_memory_utilization for a server of num_gpus: below one GPU it shares the run's GPU
    (rlkit/envs/reward_models/server.py shared_gpus), so it takes that share of the memory and no
    more; whole GPUs are its own."""
    return num_gpus if num_gpus < 1 else 0.9


class VLLMGenerator:
    """vLLM on the server's GPU(s): its own, or its share of the run's."""

    def __init__(self, model_path: str, dtype: str, max_new_tokens: int, num_gpus: float):
        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        try:
            self.llm = LLM(model=model_path, dtype=dtype, tensor_parallel_size=max(int(num_gpus), 1),
                           gpu_memory_utilization=vllm_memory_share(num_gpus))
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            raise MemoryError(out_of_memory_line(f"judge {model_path}", "cuda")) from None
        self.params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)

    def __call__(self, prompts: list[str]) -> list[str]:
        rows = [{"prompt_token_ids": self.tokenizer(p, add_special_tokens=False)["input_ids"]} for p in prompts]
        return [out.outputs[0].text for out in self.llm.generate(rows, self.params, use_tqdm=False)]
