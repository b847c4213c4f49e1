"""Config loading: every error the loader produces names the offending dotted key and says how to fix it;
applying the fix makes the same config load. Also: every recipe validates, every YAML key is commented,
and the CLI's config-error and `--cfg job` paths. Fast: no Ray, no workers, no model is built."""

import json
import re
from pathlib import Path

import pytest
import yaml

from rlkit.cli import main
from rlkit.algorithms.registry import load_algorithm
from rlkit.config.schema import ConfigError, RootConfig
from rlkit.launch.config import CONFIG_GROUPS_DIR, RECIPES_DIR, compose_recipe, load_config
from recipe_stand_ins import reward_model_overrides

RECIPE = "grpo_tiny_cpu"  # defaults: DP=2 (2 workers, TP=PP=1), micro-batch 16, global batch 128,
# rollout 32 prompts x 8 samples = 256, warm start 40 SFT steps of 64 samples, tiny://qwen2 (4 heads / 2 KV heads)
RECIPE_NAMES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
YAML_FILES = sorted([*CONFIG_GROUPS_DIR.rglob("*.yaml"), *RECIPES_DIR.glob("*.yaml")])


# The sizes the cases below are written against, pinned so recipe tuning cannot move them.
PINNED = {"policy.train_global_batch_size": "128", "algorithm.prompts_per_step": "32",
          "algorithm.warm_start.sft_steps": "40"}


def pinned(overrides: list[str]) -> list[str]:
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return [f"{k}={v}" for k, v in PINNED.items() if k not in given] + list(overrides)


def load_error(overrides, name=RECIPE, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(name, pinned(overrides) if name == RECIPE else overrides, **kwargs)
    message = str(info.value)
    assert "\n" not in message, f"config errors are one line: {message!r}"
    return message


def assert_names_key(message: str, key: str) -> None:
    assert message.startswith(f"{key}: "), f"error should start with the offending key {key!r}: {message!r}"


# ---- every error, its key, its fix, and that the fix loads ------------------------------------------------
# (id, overrides, offending key, fragments that must appear in the message (problem and fix), overrides that fix it)
# validate() checks in this order: choices, tiny:// name, values >= 1, num_workers % (TP x PP), global batch %
# (DP x mbs), group_size >= 2, rollout % global batch, TP | heads and KV heads, bucket_mb > 0, warm start batch.
# Each case's overrides only break the check it is about, so that check is the one that fires.
ERRORS = [
    # unknown keys: via a plain override (Hydra refuses it) and via +key (the schema refuses it)
    ("unknown-key", ["policy.foo=1"], "policy.foo", ["unknown key", "remove it or fix its spelling"], []),
    ("unknown-key-plus", ["+policy.foo=1"], "policy.foo", ["unknown key", "remove it or fix its spelling"], []),
    ("unknown-nested-key", ["policy.optimizer.betas=1"], "policy.optimizer.betas",
     ["unknown key", "remove it or fix its spelling"], []),
    ("unknown-nested-key-plus", ["+algorithm.warm_start.epochs=1"], "algorithm.warm_start.epochs",
     ["unknown key", "remove it or fix its spelling"], []),
    ("unknown-top-level-key", ["+polcy.num_workers=2"], "polcy", ["unknown key", "fix its spelling"], []),
    # wrong types
    ("wrong-type-int", ["policy.micro_batch_size=abc"], "policy.micro_batch_size",
     ["'abc'", "Integer", "give a value of the right type"], ["policy.micro_batch_size=16"]),
    ("wrong-type-float", ["policy.optimizer.lr=fast"], "policy.optimizer.lr",
     ["'fast'", "Float", "give a value of the right type"], ["policy.optimizer.lr=1e-4"]),
    ("wrong-type-bool", ["algorithm.normalize_std=maybe"], "algorithm.normalize_std",
     ["'maybe'", "bool", "give a value of the right type"], ["algorithm.normalize_std=false"]),
    ("null-for-int", ["policy.num_workers=null"], "policy.num_workers",
     ["None", "give a value of the right type"], ["policy.num_workers=2"]),
    # a removed default leaves the value missing
    ("missing-value", ["~policy.num_workers"], "policy.num_workers",
     ["no value set", "policy.num_workers=..."], ["policy.num_workers=2"]),
    # bad choices
    ("placement", ["cluster.placement=spread"], "cluster.placement",
     ["must be one of", "'colocated'", "'disaggregated'", "(got: 'spread')"], ["cluster.placement=disaggregated"]),
    ("policy-precision", ["policy.precision=fp16"], "policy.precision",
     ["must be one of", "'fp32'", "'bf16'", "(got: 'fp16')"], ["policy.precision=fp32"]),
    ("attention-backend", ["policy.attention_backend=bogus"], "policy.attention_backend",
     ["must be one of", "'sdpa'", "'local'", "(got: 'bogus')"], ["policy.attention_backend=local"]),
    ("generation-precision", ["generation.precision=fp16"], "generation.precision",
     ["must be one of", "'fp32'", "'bf16'", "(got: 'fp16')"], ["generation.precision=bf16"]),
    ("generation-backend", ["generation.backend=sglang"], "generation.backend",
     ["must be one of", "'hf'", "(got: 'sglang')"], ["generation.backend=hf"]),
    ("vllm-without-engine-settings", ["generation.backend=vllm"], "generation.vllm",
     ["needs engine settings", "use generation=vllm"], ["generation.backend=hf"]),
    ("vllm-with-cpu-transport", ["generation=vllm"], "refit.transport",
     ["take weights through", "(got: 'cpu')"], ["generation=vllm", "refit=cuda_ipc", "policy.num_workers=1",
                                                 "policy.train_global_batch_size=128"]),
    ("gpu-transport-with-hf", ["refit.transport=nccl"], "refit.transport",
     ["needs generation.backend=vllm", "use refit=cpu"], ["refit.transport=cpu"]),
    ("ipc-needs-colocated", ["generation=vllm", "refit=cuda_ipc", "cluster.placement=disaggregated"],
     "refit.transport", ["cuda_ipc needs cluster.placement=colocated"],
     ["generation=vllm", "refit=nccl", "cluster.placement=disaggregated"]),
    ("nccl-needs-disaggregated", ["generation=vllm", "refit=nccl"], "refit.transport",
     ["nccl needs cluster.placement=disaggregated"], ["generation=vllm", "refit=nccl", "cluster.placement=disaggregated"]),
    ("vllm-tp-heads", ["generation=vllm", "refit=nccl", "cluster.placement=disaggregated",
                       "generation.vllm.tensor_parallel_size=3"], "generation.vllm.tensor_parallel_size",
     ["must divide the model's 4 attention heads", "(got: 3)"],
     ["generation=vllm", "refit=nccl", "cluster.placement=disaggregated", "generation.vllm.tensor_parallel_size=2"]),
    ("vllm-quantization", ["generation=vllm", "refit=nccl", "cluster.placement=disaggregated",
                           "generation.vllm.quantization=int4"], "generation.vllm.quantization",
     ["must be one of", "'fp8'", "(got: 'int4')"],
     ["generation=vllm", "refit=nccl", "cluster.placement=disaggregated", "generation.vllm.quantization=fp8"]),
    ("fp8-from-fp32", ["generation=vllm", "refit=nccl", "cluster.placement=disaggregated",
                       "generation.vllm.quantization=fp8", "generation.precision=fp32"], "generation.vllm.quantization",
     ["quantize bf16 weights", "(got: generation.precision=fp32)", "generation.precision=bf16"],
     ["generation=vllm", "refit=nccl", "cluster.placement=disaggregated", "generation.vllm.quantization=fp8"]),
    ("vllm-tp-zero", ["generation=vllm", "refit=nccl", "cluster.placement=disaggregated",
                      "generation.vllm.tensor_parallel_size=0"], "generation.vllm.tensor_parallel_size",
     ["must be >= 1", "(got: 0)"], ["generation=vllm", "refit=nccl", "cluster.placement=disaggregated"]),
    # colocated, every GPU of the engines needs a policy rank: 2 engines x 2 GPUs on 2 policy ranks leave two bare
    ("ipc-engine-gpus", ["generation=vllm", "refit=cuda_ipc", "generation.num_workers=2",
                         "generation.vllm.tensor_parallel_size=2"], "refit.transport",
     ["generation.num_workers x generation.vllm.tensor_parallel_size == policy.num_workers", "2 x 2 vs 2"],
     ["generation=vllm", "refit=cuda_ipc", "generation.num_workers=1", "generation.vllm.tensor_parallel_size=2"]),
    # refit.delta: refused by name with cuda_ipc (no link to save bytes on)
    ("delta-with-cuda-ipc", ["generation=vllm", "refit=cuda_ipc", "policy.num_workers=1",
                             "policy.train_global_batch_size=128", "refit.delta=true"], "refit.delta",
     ["no gain on one GPU", "refit.transport=cuda_ipc", "set refit.delta=false"],
     ["generation=vllm", "refit=cuda_ipc", "policy.num_workers=1", "policy.train_global_batch_size=128"]),
    ("delta-with-adapter-refit", ["refit.peft=adapter", "refit.delta=true"], "refit.delta",
     ["moves the LoRA adapters alone", "refit.peft=merged"], ["refit.peft=merged", "refit.delta=true"]),
    ("broadcast-groups-choice", ["refit.broadcast_groups=ring"], "refit.broadcast_groups",
     ["must be one of", "'spread'", "(got: 'ring')"], ["refit.broadcast_groups=one"]),
    ("env-runner-flow", ["env_runner.flow=async"], "env_runner.flow",
     ["must be one of", "'per_turn'", "'per_trajectory'", "(got: 'async')"], ["env_runner.flow=per_trajectory"]),
    ("tool-seconds-negative", ["env_runner.max_tool_seconds=-1"], "env_runner.max_tool_seconds",
     ["must be >= 0", "(got: -1.0)", "0 for no limit"], ["env_runner.max_tool_seconds=30"]),
    ("transport", ["refit.transport=rdma"], "refit.transport",
     ["must be one of", "'cpu'", "(got: 'rdma')"], ["refit.transport=cpu"]),
    ("algorithm-name", ["algorithm.name=a2c"], "algorithm.name",
     ["must be one of", "'grpo'", "'ppo'", "'dpo'", "(got: 'a2c')", "algorithm=<name>"], ["algorithm.name=grpo"]),
    ("algorithm-keys-of-another", ["algorithm.name=rloo"], "algorithm.normalize_std",
     ["unknown key"], ["algorithm=rloo"]),
    ("loss-aggregation", ["algorithm.loss_aggregation=sum"], "algorithm.loss_aggregation",
     ["must be one of", "'token-mean'", "'seq-mean-token-mean'", "'seq-mean-token-sum'", "(got: 'sum')"],
     ["algorithm.loss_aggregation=seq-mean-token-sum"]),
    ("tiny-unknown", ["policy.model_path=tiny://gpt2"], "policy.model_path",
     ["'tiny://gpt2' is unknown", "use one of", "'tiny://qwen2'", "'tiny://qwen3'", "'tiny://llama'"],
     ["policy.model_path=tiny://llama"]),
    ("model-path-missing", ["policy.model_path=/nonexistent/rlkit/checkpoint"], "policy.model_path",
     ["/nonexistent/rlkit/checkpoint/config.json does not exist", "give an HF checkpoint directory",
      "tiny://<qwen2|qwen3|qwen3_moe|glm4_moe|llama|phi3>"], ["policy.model_path=tiny://qwen3"]),
    ("async-needs-disaggregated", ["algorithm.max_staleness=1"], "algorithm.max_staleness",
     ["> 0 only with cluster.placement=disaggregated", "(got: 1 with colocated)"],
     ["algorithm.max_staleness=1", "cluster.placement=disaggregated"]),
    ("staleness-negative", ["algorithm.max_staleness=-1", "cluster.placement=disaggregated"], "algorithm.max_staleness",
     ["must be >= 0", "(got: -1 with disaggregated)"], ["algorithm.max_staleness=0"]),
    # positive counts
    ("micro-batch-zero", ["policy.micro_batch_size=0"], "policy.micro_batch_size", ["must be >= 1", "(got: 0)"],
     ["policy.micro_batch_size=16"]),
    ("steps-zero", ["algorithm.num_steps=0"], "algorithm.num_steps", ["must be >= 1", "(got: 0)"],
     ["algorithm.num_steps=1"]),
    ("bucket-zero", ["refit.bucket_mb=0"], "refit.bucket_mb", ["must be > 0", "(got: 0"], ["refit.bucket_mb=0.5"]),
    # parallel layout and batch arithmetic
    ("workers-not-multiple-tp", ["policy.tensor_parallel_size=2", "policy.num_workers=3"], "policy.num_workers",
     ["must be a multiple of", "policy.pipeline_parallel_size = 2", "(got: 3)"],
     ["policy.tensor_parallel_size=2", "policy.num_workers=2", "policy.train_global_batch_size=128"]),
    ("workers-not-multiple-tp-pp", ["policy.tensor_parallel_size=2", "policy.pipeline_parallel_size=2",
                                    "policy.num_workers=6"], "policy.num_workers",
     ["must be a multiple of", "= 4", "(got: 6)"],
     ["policy.tensor_parallel_size=2", "policy.pipeline_parallel_size=2", "policy.num_workers=4"]),
    ("global-batch-not-divisible", ["policy.train_global_batch_size=100"], "policy.train_global_batch_size",
     ["divisible by DP (2) x policy.micro_batch_size (32) = 64", "(got: 100)", "set it to a multiple of 64"],
     ["policy.train_global_batch_size=128"]),
    ("group-size-one", ["algorithm.group_size=1"], "algorithm.group_size",
     ["at least 2", "(got: 1)", "set it to 2 or more"],
     ["algorithm.group_size=4"]),  # 2 would then trip the rollout check: 32 x 2 = 64 is not a multiple of 128
    # 192 is a multiple of DP x mbs = 64 but does not divide the rollout of 32 x 8 = 256
    ("rollout-not-divisible", ["policy.train_global_batch_size=192"], "policy.train_global_batch_size",
     ["must divide the rollout size", "algorithm.prompts_per_step x algorithm.group_size = 256", "(got: 192)"],
     ["policy.train_global_batch_size=192", "algorithm.prompts_per_step=24"]),  # 24 x 8 = 192
    # TP=3 with 3 workers and micro-batches of 16: DP=1, so 128 % (1 x 16), 256 % 128 and the warm start 64 % 16 all pass, num_workers is a
    # multiple of TP x PP = 3; the first check that fails is TP | 4 attention heads. The TP/heads check is reachable.
    ("tp-not-dividing-heads", ["policy.tensor_parallel_size=3", "policy.num_workers=3",
                               "policy.micro_batch_size=16", "policy.train_global_batch_size=128"],
     "policy.tensor_parallel_size", ["must divide the model's 4 attention heads", "(got: 3)", "pick a divisor of 4"],
     ["policy.tensor_parallel_size=2", "policy.num_workers=2", "policy.micro_batch_size=16",
      "policy.train_global_batch_size=128"]),
    # TP=4 divides the 4 attention heads but not the 2 key/value heads
    ("tp-not-dividing-kv-heads", ["policy.tensor_parallel_size=4", "policy.num_workers=4",
                                  "policy.micro_batch_size=16", "policy.train_global_batch_size=128"],
     "policy.tensor_parallel_size", ["must divide the model's 2 key/value heads", "(got: 4)", "pick a divisor of 2"],
     ["policy.tensor_parallel_size=2", "policy.num_workers=4", "policy.micro_batch_size=16",
      "policy.train_global_batch_size=128"]),
    # expert parallelism: only for a model with experts, dividing them (tiny://qwen3_moe has 4) and DP
    ("ep-zero", ["policy.expert_parallel_size=0"], "policy.expert_parallel_size", ["must be >= 1", "(got: 0)"],
     ["policy.expert_parallel_size=1"]),
    ("ep-dense-model", ["policy.expert_parallel_size=2"], "policy.expert_parallel_size",
     ["tiny://qwen2 is a dense model", "(got: 2)", "set it to 1"], ["policy.expert_parallel_size=1"]),
    # 8 workers of micro-batch 8: DP=8 passes the batch checks, and 8 | DP but not the 4 experts
    ("ep-not-dividing-experts", ["policy.model_path=tiny://qwen3_moe", "policy.num_workers=8",
                                 "policy.micro_batch_size=8", "policy.expert_parallel_size=8"],
     "policy.expert_parallel_size", ["must divide the model's 4 experts", "(got: 8)", "pick a divisor of 4"],
     ["policy.model_path=tiny://qwen3_moe", "policy.num_workers=8", "policy.micro_batch_size=8",
      "policy.expert_parallel_size=4"]),
    ("ep-not-dividing-dp", ["policy.model_path=tiny://qwen3_moe", "policy.expert_parallel_size=4"],
     "policy.expert_parallel_size", ["must divide the data-parallel size", "= 2 (got: 4)",
                                     "policy.num_workers to a multiple of TP x PP x EP = 4"],
     ["policy.model_path=tiny://qwen3_moe", "policy.expert_parallel_size=2"]),
    # virtual pipeline stages: over PP > 1, in chunks of equal depth, built by mbridge, a micro-batch per pipeline rank
    ("vpp-zero", ["policy.virtual_pipeline_parallel_size=0"], "policy.virtual_pipeline_parallel_size",
     ["must be >= 1", "(got: 0)"], ["policy.virtual_pipeline_parallel_size=1"]),
    ("vpp-without-pp", ["policy.virtual_pipeline_parallel_size=2"], "policy.virtual_pipeline_parallel_size",
     ["policy.pipeline_parallel_size is 1", "(got: 2)"], ["policy.pipeline_parallel_size=2", "policy.virtual_pipeline_parallel_size=2", "policy.tiny_model.num_layers=4"]),
    ("vpp-uneven-chunks", ["policy.pipeline_parallel_size=2", "policy.virtual_pipeline_parallel_size=2"], "policy.virtual_pipeline_parallel_size",
     ["2 layers must split evenly", "= 4 chunks (got: 2)", "pick one of [1]"],
     ["policy.pipeline_parallel_size=2", "policy.virtual_pipeline_parallel_size=2", "policy.tiny_model.num_layers=4"]),
    ("vpp-megatron-bridge", ["policy.pipeline_parallel_size=2", "policy.virtual_pipeline_parallel_size=2", "policy.tiny_model.num_layers=4", "policy.bridge=megatron_bridge"],
     "policy.virtual_pipeline_parallel_size", ["through mbridge", "policy.bridge=megatron_bridge)"],
     ["policy.pipeline_parallel_size=2", "policy.virtual_pipeline_parallel_size=2", "policy.tiny_model.num_layers=4", "policy.bridge=mbridge"]),
    ("vpp-rows-per-rank", ["policy.pipeline_parallel_size=2", "policy.virtual_pipeline_parallel_size=2", "policy.tiny_model.num_layers=4", "policy.micro_batch_size=1",
                           "policy.train_global_batch_size=1"], "policy.train_global_batch_size",
     ["at least policy.pipeline_parallel_size=2 rows", "(got: 1)", "at least 2"],
     ["policy.pipeline_parallel_size=2", "policy.virtual_pipeline_parallel_size=2", "policy.tiny_model.num_layers=4", "policy.micro_batch_size=1", "policy.train_global_batch_size=2"]),
    # context parallelism: a factor of the layout, only with rlkit's sdpa attention, not for MoE models (untested)
    ("cp-zero", ["policy.context_parallel_size=0"], "policy.context_parallel_size", ["must be >= 1", "(got: 0)"],
     ["policy.context_parallel_size=1"]),
    ("workers-not-multiple-cp", ["policy.context_parallel_size=2", "policy.num_workers=3"], "policy.num_workers",
     ["must be a multiple of", "policy.context_parallel_size x policy.pipeline_parallel_size = 2", "(got: 3)"],
     ["policy.context_parallel_size=2", "policy.num_workers=2"]),
    ("cp-local-attention", ["policy.context_parallel_size=2", "policy.attention_backend=local"],
     "policy.context_parallel_size", ["needs policy.attention_backend=sdpa", "(got: 'local'"],
     ["policy.context_parallel_size=2", "policy.attention_backend=sdpa"]),
    ("cp-moe", ["policy.model_path=tiny://qwen3_moe", "policy.context_parallel_size=2"], "policy.context_parallel_size",
     ["tiny://qwen3_moe is an MoE model", "(got: 2)", "set policy.context_parallel_size=1"],
     ["policy.model_path=tiny://qwen3_moe", "policy.context_parallel_size=1"]),
    # the HF <-> Megatron backend; megatron_bridge keeps experts on one rank and runs without context parallelism
    ("bridge", ["policy.bridge=nemo"], "policy.bridge", ["must be one of", "'mbridge'", "'megatron_bridge'",
                                                          "(got: 'nemo')"], ["policy.bridge=megatron_bridge"]),
    ("megatron-bridge-ep", ["policy.bridge=megatron_bridge", "policy.model_path=tiny://qwen3_moe",
                            "policy.expert_parallel_size=2"], "policy.expert_parallel_size",
     ["policy.bridge=megatron_bridge runs with policy.expert_parallel_size=1 only", "(got: 2)", "policy.bridge=mbridge"],
     ["policy.bridge=mbridge", "policy.model_path=tiny://qwen3_moe", "policy.expert_parallel_size=2"]),
    ("megatron-bridge-cp", ["policy.bridge=megatron_bridge", "policy.context_parallel_size=2"],
     "policy.context_parallel_size", ["runs with policy.context_parallel_size=1 only", "(got: 2)"],
     ["policy.bridge=mbridge", "policy.context_parallel_size=2"]),
    # the recipe turns the warm start on (40 SFT steps); 48 is not a multiple of DP (2) x mbs (32) = 64
    ("warm-start-batch-not-divisible", ["algorithm.warm_start.batch_size=48"], "algorithm.warm_start.batch_size",
     ["divisible by DP (2) x policy.micro_batch_size (32)", "(got: 48)"], ["algorithm.warm_start.batch_size=128"]),
    # the synthetic set: an empty or impossible one used to fail only at data loading, once the run had started
    ("synthetic-train-size-zero", ["data.synthetic.train_size=0"], "data.synthetic.train_size",
     ["must be >= 1", "(got: 0)"], ["data.synthetic.train_size=1"]),
    ("synthetic-val-size-zero", ["data.synthetic.val_size=0"], "data.synthetic.val_size",
     ["must be >= 1 while data.val_path is set", "(got: 0)", "data.val_path=null"],
     ["data.synthetic.val_size=0", "data.val_path=null"]),
    ("synthetic-val-size-negative", ["data.synthetic.val_size=-1", "data.val_path=null"], "data.synthetic.val_size",
     ["must be >= 0", "(got: -1)"], ["data.synthetic.val_size=0", "data.val_path=null"]),
    ("synthetic-max-operand-zero", ["data.synthetic.max_operand=0"], "data.synthetic.max_operand",
     ["must be >= 1", "(got: 0)"], ["data.synthetic.max_operand=19"]),
    # operands 0..5 with "+" make 6 x 6 = 36 distinct problems, fewer than the 300 + 100 asked for
    ("synthetic-too-few-problems", ["data.synthetic.max_operand=5"], "data.synthetic.train_size",
     ["400 exceeds the 36 distinct problems", "raise max_operand or lower the sizes"],
     ["data.synthetic.max_operand=5", "data.synthetic.train_size=30", "data.synthetic.val_size=6"]),
    ("synthetic-operation", ["data.synthetic.operations=['^']"], "data.synthetic.operations",
     ["['^']", "choose from ['+', '-', '*']"], ["data.synthetic.operations=['*']"]),
    ("synthetic-kind", ["data.synthetic.kind=geometry"], "data.synthetic.kind",
     ["must be one of ['arithmetic', 'word_problems', 'word_problems_hard']", "(got: 'geometry')"], ["data.synthetic.kind=word_problems"]),
    # env.* keys against the constructor's annotations: a bool is no float, an int is
    ("env-key-type", ["env=math", "env.correct_reward=true"], "env.correct_reward",
     ["rlkit.envs.math_answers.MathEnv takes float", "(got: True, of type bool)"],
     ["env=math", "env.correct_reward=2"]),
    ("env-key-type-plus", ["+env.correct_reward=high"], "env.correct_reward",
     ["ArithmeticEnv takes float", "(got: 'high', of type str)"], ["+env.correct_reward=2.0"]),
]


@pytest.mark.parametrize("overrides, key, fragments, fixed", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_config_error_names_key_and_fix(overrides, key, fragments, fixed):
    message = load_error(overrides)
    assert_names_key(message, key)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message!r}"
    cfg, _ = load_config(RECIPE, pinned(fixed))  # the fix the message points at loads
    assert isinstance(cfg, RootConfig)


# SFT / DPO / PPO recipes: (id, recipe, overrides, offending key, fragments, overrides that fix it)
FAMILY_ERRORS = [
    ("dpo-odd-micro-batch", "dpo_tiny_cpu", ["policy.micro_batch_size=1"], "policy.micro_batch_size",
     ["must be even", "(got: 1)"], ["policy.micro_batch_size=4"]),
    ("dpo-loss-type", "dpo_tiny_cpu", ["algorithm.loss_type=kto"], "algorithm.loss_type",
     ["must be one of", "'ipo'", "'hinge'", "'robust'", "(got: 'kto')"], ["algorithm.loss_type=ipo"]),
    ("dpo-beta", "dpo_tiny_cpu", ["algorithm.beta=0"], "algorithm.beta", ["must be > 0"], ["algorithm.beta=0.1"]),
    ("dpo-label-smoothing", "dpo_tiny_cpu", ["algorithm.label_smoothing=0.5"], "algorithm.label_smoothing",
     ["[0, 0.5)", "(got: 0.5)"], ["algorithm.label_smoothing=0.1"]),
    ("sft-on-preference-data", "sft_tiny_cpu", ["data=arithmetic_preferences"], "data.name",
     ["trains on data of kind 'sft_files'", "(got: 'preference_files')", "data=arithmetic_sft"], ["data=arithmetic_sft"]),
    ("sft-unknown-data", "sft_tiny_cpu", ["data.name=csv"], "data.name",
     ["must be one of", "'sft_files'", "(got: 'csv')"], ["data.name=sft_files"]),
    ("sft-pack-on-dpo", "dpo_tiny_cpu", ["+data.pack=true"], "data.pack", ["unknown key"], []),
    ("rl-without-generation", "sft_tiny_cpu", ["algorithm=grpo", "data=arithmetic"], "generation",
     ["needs this section", "recipes/grpo_tiny_cpu.yaml"], ["algorithm=sft", "data=arithmetic_sft"]),
    ("ppo-kl-mode", "ppo_tiny_cpu", ["algorithm.kl_mode=both"], "algorithm.kl_mode",
     ["must be one of", "'reward'", "'loss'", "(got: 'both')"], ["algorithm.kl_mode=loss"]),
    ("ppo-lambda", "ppo_tiny_cpu", ["algorithm.lam=1.5"], "algorithm.gamma / algorithm.lam",
     ["[0, 1]", "1.5"], ["algorithm.lam=0.9"]),
    ("reinforce-baseline-group", "reinforce_pp_tiny_cpu", ["algorithm.baseline=true", "algorithm.group_size=1",
                                                          "algorithm.prompts_per_step=256"],
     "algorithm.group_size", ["REINFORCE_PP needs at least 2"], ["algorithm.baseline=false", "algorithm.group_size=1",
                                                                   "algorithm.prompts_per_step=256"]),
    ("ipo-with-smoothing", "dpo_tiny_cpu", ["algorithm.loss_type=ipo", "algorithm.label_smoothing=0.1"],
     "algorithm.label_smoothing", ["sigmoid loss only", "loss_type=ipo"], ["algorithm.loss_type=ipo"]),
    ("rl-top-p", "grpo_tiny_cpu", ["generation.top_p=0.9"], "generation.temperature / top_p / top_k",
     ["distribution the trainer scores", "top_p=1.0"], ["generation.top_p=1.0"]),
    ("negative-kl", "rloo_tiny_cpu", ["algorithm.kl_coef=-0.1"], "algorithm.kl_coef / clip_low / clip_high",
     ["kl_coef >= 0", "(got: -0.1"], ["algorithm.kl_coef=0.1"]),
    ("hf-with-distributed-optimizer", "sft_tiny_cpu", ["checkpoint.save_format=hf",
                                                       "policy.use_distributed_optimizer=true"],
     "checkpoint.save_format", ["use checkpoint.save_format=dist"], ["policy.use_distributed_optimizer=true"]),
    ("rloo-group", "rloo_tiny_cpu", ["algorithm.group_size=1"], "algorithm.group_size",
     ["RLOO needs at least 2"], ["algorithm.group_size=4"]),
    ("sft-synthetic-train-size-zero", "sft_tiny_cpu", ["data.synthetic.train_size=0"], "data.synthetic.train_size",
     ["must be >= 1", "(got: 0)"], ["data.synthetic.train_size=1"]),
    ("dpo-synthetic-val-size-zero", "dpo_tiny_cpu", ["data.synthetic.val_size=0"], "data.synthetic.val_size",
     ["data.val_path=null"], ["data.synthetic.val_size=0", "data.val_path=null"]),
    ("reward-model-malformed-fraction", "reward_model_tiny_cpu", ["data.synthetic.malformed_fraction=1.5"],
     "data.synthetic.malformed_fraction", ["must be in [0, 1]", "(got: 1.5)"], ["data.synthetic.malformed_fraction=1"]),
    # a prompt set has no rejected responses
    ("prompts-malformed-fraction", "grpo_tiny_cpu", ["+data.synthetic.malformed_fraction=0.5"],
     "data.synthetic.malformed_fraction", ["unknown key"], []),
    # word problems: operands up to 1 give too few distinct questions for 4000 + 200
    ("word-problems-too-few", "grpo_tiny_cpu", ["data=word_problems", "data.synthetic.max_operand=1"],
     "data.synthetic.max_operand", ["distinct word problems with max_operand=1"],
     ["data=word_problems", "data.synthetic.max_operand=1", "data.synthetic.train_size=50",
      "data.synthetic.val_size=10"]),
]


@pytest.mark.parametrize("recipe, overrides, key, fragments, fixed", [c[1:] for c in FAMILY_ERRORS],
                         ids=[c[0] for c in FAMILY_ERRORS])
def test_algorithm_family_errors_name_key_and_fix(recipe, overrides, key, fragments, fixed):
    message = load_error(overrides, name=recipe)
    assert_names_key(message, key)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message!r}"
    cfg, _ = load_config(recipe, fixed)
    assert isinstance(cfg, RootConfig)


def test_algorithm_group_selects_its_schema():
    """`algorithm=` picks the family; each gets its own typed section and no other family's keys."""
    for name, recipe in [("grpo", RECIPE), ("rloo", "rloo_tiny_cpu"), ("reinforce_pp", "reinforce_pp_tiny_cpu"),
                         ("ppo", "ppo_tiny_cpu"), ("sft", "sft_tiny_cpu"), ("dpo", "dpo_tiny_cpu")]:
        cfg, _ = load_config(recipe, [])
        assert cfg.algorithm.name == name and type(cfg.algorithm) is load_algorithm(name).config
    sft, _ = load_config("sft_tiny_cpu", [])
    assert sft.generation is None and sft.env is None and sft.data.pack is True


def test_tp_heads_check_is_reachable_only_after_workers_check():
    # TP=3 with the default 2 workers: the num_workers check comes first and fires instead of TP | heads
    message = load_error(["policy.tensor_parallel_size=3"])
    assert_names_key(message, "policy.num_workers")
    assert "= 3 (got: 2)" in message


def test_warm_start_batch_not_checked_when_warm_start_off():
    cfg, _ = load_config(RECIPE, pinned(["algorithm.warm_start.batch_size=48", "algorithm.warm_start.sft_steps=0"]))
    assert cfg.algorithm.warm_start.batch_size == 48


def test_warm_start_batch_error_says_what_to_set_it_to():
    """load.py's contract is `key: problem (got: value); fix`; its sibling for train_global_batch_size ends with
    "; set it to a multiple of 64". The warm-start message stops at "(got: 48)" and never states the multiple."""
    message = load_error(["algorithm.warm_start.batch_size=48"])
    assert_names_key(message, "algorithm.warm_start.batch_size")
    assert re.search(r"\(got: 48\); .+", message), f"no fix after the problem: {message!r}"
    assert "multiple of 64" in message, f"should say it must be a multiple of 64: {message!r}"


# ---- values the validator lets through or crashes on (bugs: see the report) --------------------------------

@pytest.mark.parametrize("value", ["0", "-32"])
def test_nonpositive_train_global_batch_size_is_a_config_error(value):
    """0 crashes validate() with ZeroDivisionError (rollout % 0); -32 passes every check. Neither is a ConfigError,
    because policy.train_global_batch_size is missing from validate()'s `>= 1` list."""
    message = load_error([f"policy.train_global_batch_size={value}"])
    assert_names_key(message, "policy.train_global_batch_size")
    assert f"(got: {value})" in message


@pytest.mark.parametrize("value", ["0", "-32"])
def test_nonpositive_warm_start_batch_size_is_a_config_error(value):
    """With the warm start on, batch_size 0 or -32 passes (0 % 32 == -32 % 32 == 0); it is not in the `>= 1` list."""
    message = load_error([f"algorithm.warm_start.batch_size={value}"])
    assert_names_key(message, "algorithm.warm_start.batch_size")
    assert f"(got: {value})" in message


# every learning-rate key of every algorithm
LEARNING_RATES = [(RECIPE, "policy.optimizer.lr"), (RECIPE, "algorithm.warm_start.lr"),
                  ("ppo_tiny_cpu", "algorithm.critic.lr"), ("dpo_tiny_cpu", "algorithm.warm_start.lr"),
                  ("sft_tiny_cpu", "policy.optimizer.lr")]


@pytest.mark.parametrize("value", ["-1e-4", "0", "nan", "inf"])
@pytest.mark.parametrize("recipe, key", LEARNING_RATES, ids=[f"{r}-{k}" for r, k in LEARNING_RATES])
def test_learning_rate_must_be_finite_and_positive(recipe, key, value):
    """Negative and zero rates were refused already (policy.optimizer.lr in one message naming three keys);
    nan and inf passed every check and turn the weights into nan at the first step."""
    message = load_error([f"{key}={value}"], name=recipe)
    assert_names_key(message, key)
    assert f"(got: {float(value)})" in message


# ---- directories and checkpoints the run will use: checked at load, not when first written -------------------

@pytest.mark.parametrize("case", ["under-a-file", "is-a-file", "not-writable"])
@pytest.mark.parametrize("key", ["run.output_dir", "run.cache_dir", "checkpoint.dir"])
def test_unusable_directory_is_a_config_error(tmp_path, key, case):
    """Tests run as root, to whom a chmod-ed read-only directory is still writable: a path under a regular file
    cannot be created, a regular file is no directory, and /proc takes no new files even from root."""
    file = tmp_path / "file"
    file.write_text("")
    path = {"under-a-file": file / "dir", "is-a-file": file, "not-writable": Path("/proc")}[case]
    message = load_error([f"{key}={path}"])
    assert_names_key(message, key)
    assert str(path) in message


def test_loading_leaves_nothing_behind(tmp_path):
    """The directories are probed, not made: a config error later (or --cfg job) leaves no folder."""
    load_config(RECIPE, pinned([f"run.output_dir={tmp_path / 'out'}", f"run.cache_dir={tmp_path / 'cache' / 'deep'}"]))
    assert list(tmp_path.rglob("*")) == []


def test_resume_from_a_missing_checkpoint_fails_at_load(tmp_path):
    """It used to fail only in train(); at load, `--cfg job` and verify-refit see it too."""
    checkpoint = tmp_path / "step_000004"
    message = load_error([f"checkpoint.resume={checkpoint}"])
    assert message.startswith(f"checkpoint.resume={checkpoint}: not a complete checkpoint directory (step_NNNNNN)")
    checkpoint.mkdir()  # its files are verified when the run starts (checkpoint.to_resume), not at load
    load_config(RECIPE, pinned([f"checkpoint.resume={checkpoint}"]))


# ---- HF checkpoint directories: heads come from config.json ---------------------------------------------

def write_checkpoint(path: Path, hf_config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(hf_config if isinstance(hf_config, str) else json.dumps(hf_config))
    return path


def test_checkpoint_dir_heads_from_config_json(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", {"num_attention_heads": 6, "num_key_value_heads": 2})
    cfg, _ = load_config(RECIPE, [f"policy.model_path={ckpt}", "policy.tensor_parallel_size=2"])
    assert cfg.policy.model_path == str(ckpt)
    message = load_error([f"policy.model_path={ckpt}", "policy.tensor_parallel_size=3", "policy.num_workers=3"])
    assert_names_key(message, "policy.tensor_parallel_size")
    assert "6 attention heads" not in message and "2 key/value heads" in message and "pick a divisor of 2" in message


def test_checkpoint_dir_kv_heads_default_to_attention_heads(tmp_path):
    ckpt = write_checkpoint(tmp_path / "mha", {"num_attention_heads": 6})
    cfg, _ = load_config(RECIPE, [f"policy.model_path={ckpt}", "policy.tensor_parallel_size=3",
                                  "policy.num_workers=3"])
    assert cfg.policy.tensor_parallel_size == 3


@pytest.mark.parametrize("experts_key", ["num_experts", "num_local_experts", "n_routed_experts"])
def test_checkpoint_dir_experts_from_config_json(tmp_path, experts_key):
    """Each family's name for its routed experts is what policy.expert_parallel_size must divide."""
    ckpt = write_checkpoint(tmp_path / "moe", {"num_attention_heads": 4, experts_key: 6})
    load_config(RECIPE, [f"policy.model_path={ckpt}", "policy.expert_parallel_size=2"])
    message = load_error([f"policy.model_path={ckpt}", "policy.expert_parallel_size=4", "policy.num_workers=4",
                          "policy.micro_batch_size=8"])
    assert_names_key(message, "policy.expert_parallel_size")
    assert "must divide the model's 6 experts" in message


def test_megatron_bridge_refuses_an_architecture_it_is_not_checked_on(tmp_path):
    ckpt = write_checkpoint(tmp_path / "mistral", {"num_attention_heads": 4, "model_type": "mistral"})
    load_config(RECIPE, [f"policy.model_path={ckpt}"])
    message = load_error([f"policy.model_path={ckpt}", "policy.bridge=megatron_bridge"])
    assert_names_key(message, "policy.bridge")
    assert "not 'mistral'" in message and "use policy.bridge=mbridge" in message


def test_checkpoint_dir_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    message = load_error([f"policy.model_path={tmp_path / 'empty'}"])
    assert_names_key(message, "policy.model_path")
    assert "config.json does not exist" in message and "give an HF checkpoint directory" in message


@pytest.mark.parametrize("hf_config", [{"hidden_size": 64}, "{not json"], ids=["no-heads-field", "bad-json"])
def test_unreadable_checkpoint_config_is_a_config_error(tmp_path, hf_config):
    """A config.json without num_attention_heads raises KeyError and a malformed one JSONDecodeError out of
    _model_shape(); neither becomes a ConfigError naming policy.model_path."""
    ckpt = write_checkpoint(tmp_path / "ckpt", hf_config)
    message = load_error([f"policy.model_path={ckpt}"])
    assert_names_key(message, "policy.model_path")


# ---- recipe and group lookups -----------------------------------------------------------------------------

def test_unknown_recipe_lists_the_recipes():
    message = load_error([], name="no_such_recipe")
    assert message.startswith("recipe 'no_such_recipe': no no_such_recipe.yaml in ")
    assert "grpo_tiny_cpu, " in message and "sft_tiny_cpu" in message


@pytest.mark.parametrize("override,suggestion", [
    ("algorithm.kl_coeff=0.1", "did you mean algorithm.kl_coef?"),  # Hydra refuses it
    ("+algorithm.kl_coeff=0.1", "did you mean algorithm.kl_coef?"),  # the schema refuses it
    ("+polcy.num_workers=2", "did you mean policy?"),
    ("polcy.num_workers=2", "did you mean policy.num_workers?"),  # a misspelled group, then its key
    ("polcy.lr=1e-5", "did you mean policy.optimizer.lr?"),  # ... whose key lies a level deeper
    ("policy.lr=1e-5", "did you mean policy.optimizer.lr?"),
    ("algorithm.lr=1e-5", "did you mean algorithm.warm_start.lr?"),
    ("polcy.no_such_key=1", "did you mean policy?"),  # the group alone, where no key is near
])
def test_unknown_key_suggests_the_near_one(override, suggestion):
    message = load_error([override])
    assert "unknown key; remove it or fix its spelling" in message and message.endswith(f"({suggestion})")


def test_unknown_key_without_a_near_one_suggests_nothing():
    assert load_error(["policy.zzz_qqq=1"]).endswith("policy.zzz_qqq: unknown key; remove it or fix its spelling")


def test_unknown_group_option():
    message = load_error(["policy=no_such_policy"])
    assert "Could not find 'policy/no_such_policy'" in message


# ---- every shipped recipe loads and validates --------------------------------------------------------------

def test_recipes_exist():
    assert RECIPE in RECIPE_NAMES


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_recipe_loads_and_validates(name, tmp_path):
    overrides = []
    if not str(compose_recipe(name, []).policy.model_path).startswith("tiny://"):
        # pretrained recipes: a stand-in directory with the config.json validation reads
        (tmp_path / "config.json").write_text('{"num_attention_heads": 12, "num_key_value_heads": 4}')
        overrides = [f"policy.model_path={tmp_path}"]
    overrides += reward_model_overrides(name, tmp_path)
    cfg, resolved = load_config(name, overrides)
    assert isinstance(cfg, RootConfig)
    assert cfg.run.name == name  # each recipe names its run after itself
    assert resolved.policy.model_path == cfg.policy.model_path


def test_overrides_reach_typed_config():
    cfg, resolved = load_config(RECIPE, ["policy.micro_batch_size=32", "algorithm.loss_aggregation=seq-mean-token-sum",
                                         "refit.bucket_mb=0.5"])
    assert cfg.policy.micro_batch_size == 32 and resolved.policy.micro_batch_size == 32
    assert cfg.algorithm.loss_aggregation == "seq-mean-token-sum"
    assert cfg.refit.bucket_mb == 0.5


# ---- style: every YAML key has a comment line directly above it -------------------------------------------

KEY_LINE = re.compile(r"^\s*([A-Za-z_]\w*):")


def uncommented_keys(path: Path, root: Path = RECIPES_DIR.parent) -> list[str]:
    """`file:line key` for each key line whose previous line is not a `# ...` comment."""
    lines = path.read_text().splitlines()
    offenders = []
    for i, line in enumerate(lines):
        match = KEY_LINE.match(line)
        if match and (i == 0 or not lines[i - 1].lstrip().startswith("#")):
            offenders.append(f"{path.relative_to(root)}:{i + 1} {match.group(1)}")
    return offenders


def test_yaml_files_found():
    assert YAML_FILES and any(p.parent == RECIPES_DIR for p in YAML_FILES)


def test_every_yaml_key_has_a_comment_above():
    offenders = [o for path in YAML_FILES for o in uncommented_keys(path)]
    assert not offenders, "keys without a `# ...` comment line directly above:\n" + "\n".join(offenders)


def test_style_check_flags_uncommented_key(tmp_path):
    sample = tmp_path / "sample.yaml"
    sample.write_text("# ok\ngood: 1\n\nbad:\n  # fine\n  nested: 2\n  other: 3\n# ok\ndefaults:\n  - /x: y\n")
    assert uncommented_keys(sample, tmp_path) == ["sample.yaml:4 bad", "sample.yaml:7 other"]


# ---- CLI ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, key", [(["policy.foo=1"], "policy.foo"),
                                             (["policy.train_global_batch_size=100"], "policy.train_global_batch_size"),
                                             # bug: ZeroDivisionError escapes main() as a traceback instead of exit 2
                                             (["policy.train_global_batch_size=0"], "policy.train_global_batch_size")],
                         ids=["unknown-key", "batch-not-divisible", "batch-zero"])
def test_cli_config_error_exit_code_and_one_line(capsys, overrides, key):
    code = main(["train", "--config-name", RECIPE, *overrides])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, f"stderr should be one line: {err!r}"
    assert lines[0].startswith(f"rlkit: config error: {key}: ")


def test_cli_cfg_job_prints_resolved_yaml(capsys):
    code = main(["train", "--config-name", RECIPE, "--cfg", "job", "policy.micro_batch_size=32"])
    out, _ = capsys.readouterr()
    assert code == 0
    printed = yaml.safe_load(out)
    assert set(printed) == {"run", "cluster", "policy", "generation", "refit", "algorithm", "env", "env_runner", "data", "logger", "checkpoint"}
    assert printed["policy"]["micro_batch_size"] == 32
    assert printed["policy"]["model_path"] == "tiny://qwen2"
    assert printed["run"]["name"] == RECIPE and printed["algorithm"]["warm_start"]["sft_steps"] > 0
    assert "hydra" not in printed and "defaults" not in printed
