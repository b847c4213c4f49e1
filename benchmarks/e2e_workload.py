"""The end-to-end GRPO workload every framework of benchmarks/e2e.py runs (rlkit, verl, TRL), the
GPU layout rlkit runs it in, and its prompts: rlkit's generated word problems, each padded with a
fixed preamble to exactly max_prompt_tokens tokens."""

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int = 64
    group_size: int = 8
    response_tokens: int = 512
    max_prompt_tokens: int = 256
    # every prompt exactly max_prompt_tokens tokens (a preamble before each word problem); false: the
    # word problems as they come, shorter
    exact_prompt_tokens: bool = True
    # rows per forward/backward (64 x 768 tokens of fp32 logits over a 49k vocab: out of memory)
    micro_batch_per_gpu: int = 16
    train_global_batch: int = 256  # samples per optimizer step
    lr: float = 1e-6
    steps: int = 5
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = False  # False: vLLM captures CUDA graphs
    seed_per_request: bool = False  # False: sampled as the peer samples, without a seed per request
    kl_coef: float = 0.0

    @property
    def tokens_per_step(self) -> int:
        """Prompt and response tokens of one step's samples (both fixed with exact_prompt_tokens)."""
        return self.prompts_per_step * self.group_size * (self.max_prompt_tokens + self.response_tokens)


def add_workload_args(parser) -> None:
    """A command-line flag per Workload field (--prompts-per-step 64, --exact-prompt-tokens false, ...)."""
    for field, value in asdict(Workload()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", default=value,
                            type=(lambda text: text.lower() == "true") if isinstance(value, bool) else type(value))


def workload_of(args) -> Workload:
    return Workload(**{field: getattr(args, field) for field in asdict(Workload())})


LAYOUTS = ("colocated", "disaggregated", "async")


@dataclass(frozen=True)
class Layout:
    """Where rlkit runs the workload. colocated: the policy on every GPU, vLLM asleep while it trains
    (refit through CUDA IPC); disaggregated: the policy on the first policy_gpus GPUs, the engines
    on the rest (refit over NCCL); async: disaggregated, generating the next rollout while the
    policy trains on one up to `staleness` steps old (token_tis correction). On CPU the same
    placements with HF generation workers and the CPU refit."""

    mode: str = "colocated"
    gpus: int = 1  # every device the run uses (CPU: worker slots)
    policy_gpus: int = 0  # disaggregated and async: the policy's share of gpus (0: half)
    tp: int = 1  # the policy's tensor parallelism
    ep: int = 1  # the policy's expert parallelism (MoE)
    engine_tp: int = 1  # GPUs per vLLM engine
    staleness: int = 1  # async only

    @property
    def policy_ranks(self) -> int:
        return self.gpus if self.mode == "colocated" else self.policy_gpus or self.gpus // 2

    @property
    def generation_gpus(self) -> int:
        return self.gpus if self.mode == "colocated" else self.gpus - self.policy_ranks

    @property
    def engines(self) -> int:
        return self.generation_gpus // self.engine_tp


def layout_overrides(layout: Layout, on_gpu: bool) -> list[str]:
    """rlkit's overrides for the layout; ValueError names a layout that does not divide up."""
    if layout.mode not in LAYOUTS:
        raise ValueError(f"--layout: one of {', '.join(LAYOUTS)} (got: {layout.mode})")
    if layout.policy_ranks < 1 or layout.generation_gpus < 1:
        raise ValueError(f"--policy-gpus: {layout.mode} needs GPUs for the policy and for generation "
                         f"(got: {layout.policy_ranks} of {layout.gpus})")
    if layout.generation_gpus % layout.engine_tp:
        raise ValueError(f"--engine-tp: {layout.generation_gpus} generation GPUs do not split into engines of "
                         f"{layout.engine_tp} (got: {layout.engine_tp})")
    if layout.policy_ranks % (layout.tp * layout.ep):
        raise ValueError(f"--tp / --ep: {layout.policy_ranks} policy ranks do not split into TP={layout.tp} x "
                         f"EP={layout.ep} groups")
    if layout.engine_tp > 1 and not on_gpu:
        raise ValueError(f"--engine-tp: engines of several devices are vLLM's; CPU runs HF workers "
                         f"(got: {layout.engine_tp})")
    disaggregated = layout.mode != "colocated"
    refit = "cpu" if not on_gpu else "nccl" if disaggregated else "cuda_ipc"
    staleness = layout.staleness if layout.mode == "async" else 0
    overrides = [f"cluster.placement={'disaggregated' if disaggregated else 'colocated'}", f"refit={refit}",
                 f"policy.num_workers={layout.policy_ranks}", f"policy.tensor_parallel_size={layout.tp}",
                 f"policy.expert_parallel_size={layout.ep}", f"generation.num_workers={layout.engines}",
                 f"algorithm.max_staleness={staleness}",
                 f"algorithm.off_policy_correction={'token_tis' if staleness else 'none'}"]
    if on_gpu:  # checksums cost 0.2 s a 7B refit (docs/performance.md), verl checks none; Adam's state
        # sharded over the data-parallel ranks, as common.training_memory_gb counts it (the one-GPU recipe keeps it whole)
        overrides += [f"generation.vllm.tensor_parallel_size={layout.engine_tp}", "refit.verify_checksums=false",
                      "policy.use_distributed_optimizer=true"]
    return overrides


# the text each prompt starts with, cut to the tokens its word problem leaves
PREAMBLE = ("Read the word problem below carefully. Work through it one step at a time: write each quantity "
            "you know, say which operation changes it and why, compute the new quantity, and check it before "
            "you go on. Keep every count a whole number. ") * 64


def fixed_length_question(question: str, prompt_length, tokens: int, preamble_ids: list[int], decode) -> str:
    """The question behind a head of the preamble, so that prompt_length(it) == tokens: the head's
    length is corrected until it lands (cutting the preamble's tokens and rendering the text again
    can merge or split a token at the cut), else looked for beside where the corrections circled."""
    def padded(head: int) -> str:
        return decode(preamble_ids[:head]) + "\n\n" + question

    head = tokens - prompt_length(question)
    if head < 0:
        raise ValueError(f"a prompt of {tokens - head} tokens is over max_prompt_tokens={tokens}: raise it")
    tried = set()
    while head not in tried and 0 <= head <= len(preamble_ids):
        tried.add(head)
        length = prompt_length(padded(head))
        if length == tokens:
            return padded(head)
        head += tokens - length
    for near in range(max(0, head - 8), head + 8):
        if prompt_length(padded(near)) == tokens:
            return padded(near)
    raise ValueError(f"no head of the preamble renders {question!r} to exactly {tokens} tokens")


def write_prompts(path: Path, w: Workload, prompt_data, tokenizer, rows: int = 1024) -> Path:
    """`rows` word problems ({question, answer}, GSM8K format, as rlkit generates them) in a JSONL
    file for data.train_path, each question padded to render to exactly w.max_prompt_tokens tokens
    with prompt_data's settings (chat template, system prompt, prompt_format) and this tokenizer."""
    from rlkit.config.schema import ArithmeticSetConfig
    from rlkit.data.prompts import PromptRenderer
    from rlkit.data.word_problems import word_problem_splits

    problems, _ = word_problem_splits(ArithmeticSetConfig(train_size=rows, val_size=0, max_operand=20,
                                                          operations=["+", "-"], seed=0))
    random.Random(0).shuffle(problems)
    renderer = PromptRenderer.of(tokenizer, prompt_data, observation_format="{observation}")

    def prompt_length(question: str) -> int:
        return len(renderer.prompt_ids(renderer.messages(question)))

    if w.exact_prompt_tokens:
        preamble_ids = tokenizer(PREAMBLE, add_special_tokens=False)["input_ids"]
        problems = [{**p, "question": fixed_length_question(p["question"], prompt_length, w.max_prompt_tokens,
                                                             preamble_ids, tokenizer.decode)} for p in problems]
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_suffix(".tmp")
    written.write_text("".join(json.dumps(p) + "\n" for p in problems))
    written.replace(path)
    return path


def prompt_data(recipe: str, model_dir: Path, overrides: list[str] = ()):
    """The data settings (PromptDataConfig) the workload's prompts render with in every framework's
    run: the recipe's, with data=word_problems and `overrides`."""
    from rlkit.launch.config import load_config

    return load_config(recipe, [f"policy.model_path={model_dir}", "data=word_problems", *overrides])[0].data


def workload_prompts(w: Workload, recipe: str, model_dir: Path, path: Path, overrides: list[str] = ()) -> Path:
    """The workload's prompts file (write_prompts) for this model and the recipe's data settings."""
    from rlkit.models.tokenizer import load_tokenizer

    return write_prompts(path, w, prompt_data(recipe, model_dir, overrides), load_tokenizer(str(model_dir)))
