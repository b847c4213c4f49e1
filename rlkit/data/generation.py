"""What the controller asks of a generation worker, and what it answers."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float  # 0 means greedy
    top_p: float
    top_k: int  # 0 disables
    seed: int
    ignore_eos: bool = False  # sample all max_new_tokens (benchmarks fix the response length so)


@dataclass
class Generations:
    """Per prompt, in input order: the generated token ids (ending with EOS unless truncated)
    and the sampler's logprob of each, computed on logits / temperature over the full vocab
    (before top-p/top-k), i.e. the distribution the trainer's logprobs describe."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
