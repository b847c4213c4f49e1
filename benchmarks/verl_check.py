"""What a verl run of e2e_verl.py starts from, checked with verl's own code and without Ray or a GPU
(e2e_verl.py --dry-run; runs inside verl's install). verl's main_ppo composes and validates the config
from the same overrides as the real run; then, where the real run would start Ray:
  - the model, rollout and actor config dataclasses are built (they validate themselves);
  - verl's RLHFDataset reads the parquet and its agent-loop tokenizer path (the Continuous Token
    builder) renders each prompt: the ids must equal rlkit's (expected_ids.jsonl);
  - the custom reward function loads and scores a right and a wrong answer;
  - a custom replay buffer (verl_poll.py), when set, is built with the trainer's arguments.

usage: python3 verl_check.py EXPECTED_IDS_JSONL [verl overrides...]"""

import json
import sys

import verl.trainer.main_ppo as main_ppo

EXPECTED = sys.argv.pop(1)


def check(config, task_runner_class):
    """Stands in for main_ppo.run_ppo, which main() calls with the validated config."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_extern_object
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    OmegaConf.resolve(config)
    model = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    dataset = create_rl_dataset(config.data.train_files, config.data, model.tokenizer, model.processor)
    builder = create_continuous_token_builder(
        model.tokenizer, hf_model_type=model.hf_config.model_type,
        chat_template_kwargs=config.data.get("apply_chat_template_kwargs", {}),
        mm_processor_kwargs=config.data.get("mm_processor_kwargs", {}), processor=model.processor)
    with open(EXPECTED) as f:
        expected = [json.loads(line) for line in f]
    assert len(dataset) == len(expected), f"{len(dataset)} parquet rows, {len(expected)} expected prompts"
    lengths = []
    for i in range(len(dataset)):
        ids = builder.build_initial_tokens(dataset[i]["raw_prompt"])
        assert ids == expected[i], f"row {i}: verl renders {ids}, rlkit {expected[i]}"
        lengths.append(len(ids))
    row = dataset[0]
    reward = get_custom_reward_fn(config)
    truth = row["reward_model"]["ground_truth"]
    right = reward(data_source=row["data_source"], solution_str=f"So it is\n#### {float(truth):g}",
                   ground_truth=truth, extra_info={})
    wrong = reward(data_source=row["data_source"], solution_str="#### -1", ground_truth=truth, extra_info={})
    assert (right, wrong) == (1.0, 0.0), f"reward of a right and a wrong answer: {right}, {wrong}"
    sampler = config.trainer.v1.sampler
    poll = None
    if sampler.custom_sampler.path:
        cls = load_extern_object(sampler.custom_sampler.path, sampler.custom_sampler.name)
        buffer = cls(trainer_mode=config.trainer.v1.trainer_mode, trainer_config={},
                     max_off_policy_threshold=sampler.max_off_policy_threshold,
                     max_off_policy_strategy=sampler.max_off_policy_strategy, sampler_kwargs=sampler.sampler_kwargs,
                     refill_fn=lambda n: n)
        poll = buffer.poll_interval
    print("verl_check: ok", json.dumps({
        "prompts": len(dataset), "prompt_tokens_min_max": [min(lengths), max(lengths)],
        "attn_implementation": model.hf_config._attn_implementation, "ignore_eos": rollout.ignore_eos,
        "response_length": rollout.response_length, "prompt_length": rollout.prompt_length,
        "max_model_len": rollout.max_model_len, "rollout_n": rollout.n, "max_num_seqs": rollout.max_num_seqs,
        "max_num_batched_tokens": rollout.max_num_batched_tokens,
        "ppo_mini_batch_size": config.actor_rollout_ref.actor.ppo_mini_batch_size,
        "strategy": config.actor_rollout_ref.actor.strategy, "n_gpus": config.trainer.n_gpus_per_node,
        "rollout_tp": rollout.tensor_model_parallel_size, "use_remove_padding": model.use_remove_padding,
        "gradient_checkpointing": model.enable_gradient_checkpointing,
        "dynamic_bsz_tokens": [config.actor_rollout_ref.actor.use_dynamic_bsz,
                               config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu,
                               rollout.log_prob_max_token_len_per_gpu],
        "use_kl_loss": config.actor_rollout_ref.actor.use_kl_loss, "agent_workers": rollout.agent.num_workers,
        "ray_init": OmegaConf.to_container(config.ray_kwargs.ray_init), "reward_right_wrong": [right, wrong],
        "poll_interval_s": poll, "trainer": f"use_v1={config.trainer.use_v1} mode={config.trainer.v1.trainer_mode}"}))


main_ppo.run_ppo = check
main_ppo.main()
