"""The values a choice key may take, where the code that acts on them imports torch or Ray. They
live here, and that code imports them from here, so loading and checking a config (rlkit's help
texts and config errors) imports neither: tests/unit/test_cli_startup.py holds it to that."""

# algorithm.loss_aggregation (rlkit/algorithms/losses.py aggregate)
LOSS_AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# algorithm.kl_estimator (rlkit/algorithms/losses.py kl_estimate)
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "low_var_kl", "k1+", "k3+")
# algorithm.importance_ratio (rlkit/algorithms/losses.py importance_log_ratio)
IMPORTANCE_RATIOS = ("token", "sequence")
# algorithm.loss_type of DPO (rlkit/algorithms/losses.py dpo_loss)
DPO_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "ipo", "hinge", "robust")
# algorithm.off_policy_correction (rlkit/algorithms/off_policy.py)
OFF_POLICY_CORRECTIONS = ("none", "token_tis", "seq_mask")
# refit.broadcast_groups: who feeds whom over nccl (rlkit/refit/transport.py broadcast_groups)
BROADCAST_GROUPS = ("one", "spread")
# refit.peft: what a policy.peft run's refit moves (rlkit/cluster/refit_driver.py)
PEFT_MODES = ("merged", "adapter")
# policy.offload (rlkit/workers/policy/offload.py)
OFFLOAD_MODES = ("all", "optimizer", "none")
# data.tool_prompt: where a tool environment's tools are shown (rlkit/data/prompts.py PromptRenderer)
TOOL_PROMPTS = ("chat_template", "system_prompt")
# env_runner.flow: episodes turn by turn together, or each on its own (rlkit/algorithms/episodes.py)
FLOWS = ("per_turn", "per_trajectory")
