"""verl 0.9.1's side of the end-to-end GRPO comparison (benchmarks/e2e.py): the same workload run by
verl (an FSDP2 actor by default, vLLM 0.24.0 colocated, its default V1 sync trainer, tuned as its
performance guide says: VerlSetup) from verl's own install directory, on the same GPUs, with its
per-step phase times and figures read from its console.

  python3 benchmarks/e2e_verl.py --model qwen2.5-7b --site /tmp/site-verl --work /tmp/e2e_verl --gpus 4 \
      --max-prompt-tokens 256 --response-tokens 1024 --steps 4 --poll-interval 0.2 --out verl.json
  python3 benchmarks/e2e_verl.py --model DIR --site SITE --work DIR --dry-run   # no Ray, no GPU
  python3 benchmarks/e2e_verl.py --model DIR --site SITE --work DIR --print-overrides   # no verl either

This process runs in rlkit's environment: it makes a named model as e2e.py does (the same
--cache-dir), writes the workload's prompts (e2e_workload.py: exactly --max-prompt-tokens tokens)
and renders them with rlkit's own loader. verl runs in a subprocess whose PYTHONPATH is verl's
install directory alone (verl pins vLLM 0.24.0, rlkit runs 0.26.0). --dry-run runs verl's own code
up to Ray's start instead (benchmarks/verl_check.py): it composes and validates the config, builds
its model, actor and rollout configs, reads the parquet files, renders the prompts with the agent
loop's tokenizer path and scores a reward; on the CPU machine SITE is a CPU install of verl.

A steady step is the median of the steps after the first (at least 3 of them: --steps 4 or more).
Where time goes on a GPU machine: verl's start-up (Ray, its workers, FSDP, the vLLM servers and
their CUDA graphs) took 283 and 297 s for SmolLM2 on one H100, its first step 142-145 s; both runs
there were stopped by the benchmark's own time limit (450-480 s), 27 s and about 2 s after step 1
ended: step 2 never had the time to end, which is no sign of a hang.
Give verl's run the time of its start-up, its first step and the steps after it
(scripts/gpu_session.sh named_run verl-7b runs it in the background across device calls).

GPU session: device calls sent back to back (< 30 s apart), each carrying the named folder:
  1. rlkit's set: `.gpucarry/cK` with `bash .gpucarry/cK/bootstrap.sh` (.gpucarry/CALLS.txt), staged by
     a wheel-staging kit with scripts/gpu-wheels.txt (docs/gpu.md, machines without network).
  2. verl's set (5 parts: 276 MiB, 51 wheels): `.gpucarry-verl/cK` with `bash scripts/verl_stack.sh install`,
     staged by `bash scripts/verl_stack.sh stage`; the last part installs it into /tmp/site-verl.
  3. `bash scripts/gpu_session.sh e2e-queue verl-7b ...`, then `e2e-wait 540` calls until it is done.
"""

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from e2e_workload import Workload, add_workload_args, workload_of  # noqa: E402
from process_group import run_logged  # noqa: E402
from verl_reward import final_answer  # noqa: E402

DATA_SOURCE = "rlkit_word_problems"
# common phase -> verl's marked_timer names, logged as timing_s/<name> (verl 0.9.1:
# trainer/ppo/v1/trainer_base.py PPOTrainer.fit and _step_once; trainer_sync.py on_step_end)
PHASES = {
    # the wait in ReplayBuffer.sample (2 s polls) for rollouts submitted at the step's start (that
    # submission counts in `other`), rewards included (verl's reward loop scores as samples finish), then vLLM sleeps
    "generate": ("gen",),
    "logprobs": ("old_log_prob", "ref"),  # ref only with the KL loss
    "train": ("update_actor",),
    "weight_sync": ("update_weights",),  # vLLM wakes up and loads the new weights
}
REQUIRED_TIMERS = ("step", "gen", "old_log_prob", "update_actor", "update_weights")
# rlkit's name (benchmarks/e2e.py) -> verl's metric of the same figure: its tokens/s per GPU of the
# whole step (metric_utils.compute_throughout_metrics), its MFU of the actor update, its peak memory
FIGURES = {"tokens_per_s_per_gpu": "perf/throughput", "timing/train_mfu": "perf/mfu/actor",
           "memory/policy_peak_gb": "actor/perf/max_memory_allocated_gb"}
# verl's console logger prints `step:N - key:value - ...`, a value as pprint.pformat of a number
# (verl/utils/logger/aggregate_logger.py concat_dict_to_str); Ray puts `(TaskRunnerV1 pid=N) ` first
_STEP_LINE = re.compile(r"(?:^|[\s)])step:(\d+) - (.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")


# --- prompts and data ----------------------------------------------------------------------------

def rlkit_prompts(prompts_jsonl: Path, prompt_data, max_prompt_tokens: int, tokenizer) -> list:
    """The prompts rlkit's run sends: the file's rows through rlkit's own loader
    (rlkit/data/prompts.py) with the run's data settings (prompt_data: its PromptDataConfig, for
    the field names, data.prompt_format and data.system_prompt), longer ones dropped the same way."""
    from rlkit.data.prompts import PromptRenderer, load_prompt_splits

    if not prompt_data.chat_template:
        raise ValueError("data.chat_template=false: verl's agent loop always applies the tokenizer's chat template, "
                         "so raw prompts would differ from rlkit's; run the comparison with data.chat_template=true")
    data = dataclasses.replace(prompt_data, train_path=str(prompts_jsonl), val_path=None, synthetic=None,
                               max_prompt_tokens=max_prompt_tokens)
    train, _ = load_prompt_splits(data, PromptRenderer.of(tokenizer, data, observation_format="{observation}"))
    return train


def verl_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids verl's agent loop sends vLLM for a prompt's messages: its Continuous Token
    builder calls apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
    tools=None, return_dict=False) (verl/utils/tokenizer/continuous_token.py _render_tokens)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, tools=None,
                                        return_dict=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def check_same_prompts(prompts: list, tokenizer) -> None:
    """rlkit renders the chat template to text and tokenizes it without special tokens; verl
    tokenizes inside apply_chat_template. The parquet holds rlkit's messages (system turn and
    data.prompt_format applied), so both see the same text: this checks the token ids agree."""
    for i, prompt in enumerate(prompts):
        ids = verl_prompt_ids(tokenizer, prompt.messages)
        if ids != prompt.token_ids:
            raise ValueError(f"prompt {i}: verl would send {len(ids)} tokens, rlkit {len(prompt.token_ids)}: "
                             f"{tokenizer.decode(ids)!r} vs {tokenizer.decode(prompt.token_ids)!r}")


def write_verl_data(prompts: list, out_dir: Path, val_rows: int = 8) -> tuple[Path, Path]:
    """verl's RL parquet files (RLHFDataset): the prompt as chat messages, the ground truth (the
    number after `####` in the row's answer) for verl_reward.py, and the expected prompt token ids
    (expected_ids.jsonl, for verl_check.py). val.parquet (the first val_rows) is required by verl
    and never used: validation is off."""
    import pandas as pd

    rows = []
    for i, prompt in enumerate(prompts):
        truth = final_answer(str(prompt.metadata["answer"]))
        if truth is None:
            raise ValueError(f"prompt {i}: its answer has no number: {prompt.metadata['answer']!r}")
        rows.append({"data_source": DATA_SOURCE, "prompt": prompt.messages, "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(truth)}, "extra_info": {"index": i}})
    out_dir.mkdir(parents=True, exist_ok=True)
    train, val = out_dir / "train.parquet", out_dir / "val.parquet"
    pd.DataFrame(rows).to_parquet(train)
    pd.DataFrame(rows[:val_rows]).to_parquet(val)
    with open(out_dir / "expected_ids.jsonl", "w") as f:
        f.writelines(json.dumps(prompt.token_ids) + "\n" for prompt in prompts)
    return train, val


# --- verl's command line --------------------------------------------------------------------------

BACKENDS = ("fsdp2", "fsdp", "megatron")


@dataclasses.dataclass(frozen=True)
class VerlSetup:
    """How verl runs the workload, tuned as verl's performance guide (docs/perf/perf_tuning.rst)
    and its GRPO examples for 7-8B models on GPUs (examples/grpo_trainer/run_qwen3_8b_fsdp.sh) say:
    dynamic batch sizes by tokens (forward-only passes at twice the training limit, entropy from
    the logits in chunks), gradient checkpointing, vLLM with CUDA graphs and engines of few GPUs
    (more replicas), no offloading where memory allows, and remove-padding (sequence packing) where
    flash-attn is installed: verl packs through flash-attn's varlen kernel; with SDPA a packed row
    would attend through an explicit mask over the whole pack, and the workload's fixed lengths
    leave no padding to remove."""

    gpus: int = 1
    backend: str = "fsdp2"  # fsdp2 | fsdp | megatron (verl's Megatron engine: needs TransformerEngine)
    tp: int = 1  # megatron: the actor's tensor parallelism
    ep: int = 1  # megatron: the actor's expert parallelism
    rollout_tp: int = 1  # GPUs per vLLM engine
    agent_workers: int = 8  # verl's default agent-loop workers
    max_token_len_per_gpu: int = 24576  # tokens per training micro-batch (verl's Qwen3-8B example)
    flash_attn: bool = False  # flash-attn importable in verl's install


def verl_overrides(w: Workload, model_dir: Path, data_dir: Path, work_dir: Path, setup: VerlSetup,
                   poll_interval_s: float | None) -> list[str]:
    """Hydra overrides of verl's ppo_trainer config for the workload: GRPO as rlkit runs it
    (clip 0.2/0.28, token-mean, std-normalized advantages, k3 KL loss when kl_coef > 0), fixed-length
    responses, verl's tuning (VerlSetup) and the sync V1 trainer with vLLM colocated."""
    if w.train_global_batch % w.group_size:
        raise ValueError(f"train_global_batch ({w.train_global_batch}) must be a multiple of group_size "
                         f"({w.group_size}): verl's ppo_mini_batch_size counts prompts")
    if setup.backend not in BACKENDS:
        raise ValueError(f"--backend: one of {', '.join(BACKENDS)} (got: {setup.backend})")
    if setup.gpus % setup.rollout_tp:
        raise ValueError(f"--rollout-tp: {setup.gpus} GPUs do not split into engines of {setup.rollout_tp}")
    kl, sequence = w.kl_coef > 0, w.max_prompt_tokens + w.response_tokens
    tokens = max(setup.max_token_len_per_gpu, 2 * sequence)  # verl's guide: at least two sequences
    out = [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "algorithm.norm_adv_by_std_in_grpo=true",
        f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'val.parquet'}",
        f"data.train_batch_size={w.prompts_per_step}", f"data.max_prompt_length={w.max_prompt_tokens}",
        f"data.max_response_length={w.response_tokens}", "data.filter_overlong_prompts=false",
        "data.truncation=error", "data.dataloader_num_workers=0", "data.seed=0",
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.use_remove_padding={str(setup.flash_attn).lower()}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        f"actor_rollout_ref.actor.optim.lr={w.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={w.train_global_batch // w.group_size}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={tokens}",
        "actor_rollout_ref.actor.ppo_epochs=1", "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
        f"actor_rollout_ref.actor.use_kl_loss={str(kl).lower()}", f"actor_rollout_ref.actor.kl_loss_coef={w.kl_coef}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={2 * tokens}",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={w.group_size}",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.ignore_eos=true",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={setup.rollout_tp}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={w.gpu_memory_utilization}",
        "actor_rollout_ref.rollout.free_cache_engine=true",
        f"actor_rollout_ref.rollout.max_model_len={sequence}",
        f"actor_rollout_ref.rollout.enforce_eager={str(w.enforce_eager).lower()}",
        # the engine limits rlkit's vLLM runs with: vLLM's own defaults for its LLM class on an H100/H200
        # (vllm/engine/arg_utils.py get_batch_defaults); verl's rollout config would set 256 and 8192
        "actor_rollout_ref.rollout.max_num_seqs=1024", "actor_rollout_ref.rollout.max_num_batched_tokens=16384",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={2 * tokens}",
        f"actor_rollout_ref.rollout.agent.num_workers={setup.agent_workers}",
        f"reward.custom_reward_function.path={HERE / 'verl_reward.py'}",
        "reward.custom_reward_function.name=compute_score", "reward.num_workers=2",
        "trainer.critic_warmup=0", "trainer.logger=[console]", "trainer.project_name=rlkit_e2e",
        "trainer.experiment_name=verl", f"trainer.n_gpus_per_node={setup.gpus}", "trainer.nnodes=1",
        f"trainer.total_training_steps={w.steps}", "trainer.total_epochs=1000", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={work_dir / 'checkpoints'}",
        # a new local Ray cluster even when one of rlkit's is still registered on this machine
        "+ray_kwargs.ray_init.address=local",
    ]
    if setup.backend == "megatron":
        out += ["model_engine=megatron",
                *(f"actor_rollout_ref.{role}.megatron.{key}={value}" for role in ("actor", "ref")
                  for key, value in (("tensor_model_parallel_size", setup.tp), ("expert_model_parallel_size", setup.ep),
                                     ("param_offload", "false"), ("optimizer_offload", "false")))]
    else:
        out += [f"actor_rollout_ref.actor.strategy={setup.backend}",
                "actor_rollout_ref.actor.fsdp_config.param_offload=false",
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false"]
        if not setup.flash_attn:  # verl's default attention is flash_attention_2
            out.append("+actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    if poll_interval_s is not None:
        out += [f"trainer.v1.sampler.custom_sampler.path={HERE / 'verl_poll.py'}",
                "trainer.v1.sampler.custom_sampler.name=PollingReplayBuffer",
                f"+trainer.v1.sampler.sampler_kwargs.poll_interval_s={poll_interval_s}"]
    return out


def flash_attn_installed(site_dir: str) -> bool:
    """Whether verl's install directory holds flash-attn (not in scripts/verl-wheels.txt: PyPI has
    its source alone)."""
    return (Path(site_dir) / "flash_attn" / "__init__.py").is_file()


def verl_env(site_dir: str, base: dict[str, str]) -> dict[str, str]:
    """The environment verl runs in: Python finds verl's install directory and not rlkit's, a Ray
    address of rlkit's is dropped, and the settings the GPU image needs (no flashinfer sampler)."""
    env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    env.update(PYTHONPATH=site_dir, PATH=f"{site_dir}/bin:{base.get('PATH', '')}", VLLM_USE_FLASHINFER_SAMPLER="0",
               RAY_AUTH_MODE="disabled", WANDB_MODE="disabled", HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1")
    return env


# --- verl's console --------------------------------------------------------------------------------

def _number(text: str) -> float | None:
    text = _NUMPY_SCALAR.sub(r"\1", text.strip())  # numpy 2 scalars print as np.float64(1.5)
    if text in ("True", "False"):
        return float(text == "True")
    try:
        return float(text)
    except ValueError:
        return None


def parse_step_line(line: str) -> tuple[int, dict[str, float]] | None:
    """(step, {metric: value}) of one of verl's console step lines, else None."""
    match = _STEP_LINE.search(_ANSI.sub("", line).rstrip())
    if match is None:
        return None
    metrics = {}
    for item in match.group(2).split(" - "):
        key, _, value = item.rpartition(":")
        number = _number(value)
        if key and number is not None:
            metrics[key] = number
    return int(match.group(1)), metrics


def step_phases(metrics: dict[str, float]) -> dict[str, float]:
    """Seconds per common phase of one verl step; `other` is the step's time outside them
    (reward bookkeeping, advantages, batch balancing, handing batches through TransferQueue)."""
    timing = {k.removeprefix("timing_s/"): v for k, v in metrics.items() if k.startswith("timing_s/")}
    missing = [name for name in REQUIRED_TIMERS if name not in timing]
    if missing:
        raise ValueError(f"verl's step line has no timing_s/{', timing_s/'.join(missing)} "
                         f"(timers found: {sorted(timing)})")
    phases = {phase: sum(timing.get(name, 0.0) for name in names) for phase, names in PHASES.items()}
    return {**phases, "step": timing["step"], "other": timing["step"] - sum(phases.values())}


def step_figures(metrics: dict[str, float]) -> dict[str, float]:
    """The step's FIGURES that verl logged, under rlkit's names."""
    return {name: metrics[key] for name, key in FIGURES.items() if key in metrics}


def median_phases(steps: list[dict], skip: int = 1) -> dict[str, float]:
    """Median of each phase (and figure) over the steps after the first `skip` (warm-up)."""
    kept = steps[skip:] or steps
    return {phase: statistics.median(s["phases"][phase] for s in kept if phase in s["phases"])
            for phase in kept[0]["phases"]}


# --- running verl ------------------------------------------------------------------------------------

def prepare(w: Workload, model_dir: Path, work_dir: Path, prompts_jsonl: Path, prompt_data, setup: VerlSetup,
            poll_interval_s: float | None, extra_overrides: list[str]) -> list[str]:
    """Writes the data under work_dir/data (checking verl renders rlkit's prompt tokens) and
    returns verl's overrides, extra_overrides last (a later value for the same key wins)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = rlkit_prompts(prompts_jsonl, prompt_data, w.max_prompt_tokens, tokenizer)
    check_same_prompts(prompts, tokenizer)
    write_verl_data(prompts, work_dir / "data")
    return verl_overrides(w, model_dir, work_dir / "data", work_dir, setup, poll_interval_s) + extra_overrides


def _run_logged(command: list[str], env: dict, cwd: Path, log: Path, timeout_s: int):
    """Runs command as a process group of its own (process_group.run_logged) with its output in
    log; returns (returncode, timed_out, [(seconds since start, step, metrics)] of each step line)."""
    start, seen = time.monotonic(), []

    def on_line(line: str) -> None:
        for part in line.split("\r"):
            parsed = parse_step_line(part)
            if parsed:
                seen.append((time.monotonic() - start, *parsed))

    returncode, timed_out = run_logged(command, env, cwd, log, timeout_s, on_line)
    return returncode, timed_out, seen


def run_verl(workload: Workload, model_dir: Path, work_dir: Path, site_dir: str, timeout_s: int, *,
             prompts_jsonl: Path, prompt_data, setup: VerlSetup = VerlSetup(), poll_interval_s: float | None = None,
             extra_overrides: Sequence[str] = ()) -> dict:
    """One verl GRPO run of the workload; its steps as phases (seconds), figures and verl's raw
    metrics. A run stopped at its time limit reports the steps it finished.

    prompt_data: the rlkit run's data config (PromptDataConfig). setup: verl's GPUs and tuning.
    poll_interval_s: None keeps verl's 2 s rollout poll (verl_poll.py). extra_overrides: more Hydra
    overrides for verl, e.g. its own engine limits back. The result's to_first_step_s is from
    launch to step 1's start (its line's arrival less its timing_s/step)."""
    work_dir = Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    overrides = prepare(workload, Path(model_dir).resolve(), work_dir, Path(prompts_jsonl), prompt_data, setup,
                        poll_interval_s, list(extra_overrides))
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    log = work_dir / "verl.log"
    started = time.monotonic()
    returncode, timed_out, seen = _run_logged(command, verl_env(site_dir, dict(os.environ)), work_dir, log, timeout_s)
    steps = [{"step": step, "phases": {**step_phases(metrics), **step_figures(metrics)}, "metrics": metrics}
             for _, step, metrics in seen]
    if not steps:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"verl logged no step (returncode {returncode}, timed out: {timed_out}); "
                           f"the end of {log}:\n" + "\n".join(tail))
    return {"framework": "verl", "returncode": returncode, "timed_out": timed_out,
            "wall_s": time.monotonic() - started, "to_first_step_s": seen[0][0] - steps[0]["phases"]["step"],
            "first_step_s": steps[0]["phases"]["step"], "steady_steps": max(len(steps) - 1, 1),
            "median": median_phases(steps), "steps": steps, "log": str(log), "command": command,
            "setup": dataclasses.asdict(setup)}


def dry_run_verl(workload: Workload, model_dir: Path, work_dir: Path, site_dir: str, timeout_s: int, *,
                 prompts_jsonl: Path, prompt_data, setup: VerlSetup = VerlSetup(), poll_interval_s: float | None = None,
                 extra_overrides: Sequence[str] = ()) -> None:
    """run_verl up to Ray's start: verl_check.py runs verl's config, data, prompt and reward code."""
    work_dir = Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    overrides = prepare(workload, Path(model_dir).resolve(), work_dir, Path(prompts_jsonl), prompt_data, setup,
                        poll_interval_s, list(extra_overrides))
    command = [sys.executable, str(HERE / "verl_check.py"), str(work_dir / "data" / "expected_ids.jsonl"), *overrides]
    subprocess.run(command, env=verl_env(site_dir, dict(os.environ)), cwd=work_dir, timeout=timeout_s, check=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF checkpoint directory, or a name benchmarks/e2e.py takes "
                                                  "(smollm2, qwen2.5-7b, ...: made in --cache-dir as e2e.py makes it)")
    p.add_argument("--site", required=True, help="verl's install directory (on the GPU machine /tmp/site-verl)")
    p.add_argument("--work", required=True, help="folder for verl's data, log and checkpoints")
    p.add_argument("--cache-dir", default="/tmp/rlkit_e2e/cache", help="where a named model is made (e2e.py's)")
    p.add_argument("--recipe", default="grpo_smollm2_gpu", help="the rlkit recipe whose data settings render prompts")
    p.add_argument("--prompts", help="JSONL of {question, answer} rows; default: the workload's (e2e_workload.py), "
                                     "written to --work")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--timeout", type=int, default=540)
    p.add_argument("--dry-run", action="store_true", help="verl's config, data and reward code up to Ray's start")
    p.add_argument("--print-overrides", action="store_true", help="print verl's overrides and stop (no verl needed)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs verl uses (0: every GPU, 1 on CPU)")
    p.add_argument("--backend", default="fsdp2", help=" | ".join(BACKENDS))
    p.add_argument("--tp", type=int, default=1, help="megatron: the actor's tensor parallelism")
    p.add_argument("--ep", type=int, default=1, help="megatron: the actor's expert parallelism")
    p.add_argument("--rollout-tp", type=int, default=1, help="GPUs per vLLM engine")
    p.add_argument("--agent-workers", type=int, default=VerlSetup.agent_workers)
    p.add_argument("--max-token-len-per-gpu", type=int, default=VerlSetup.max_token_len_per_gpu)
    p.add_argument("--poll-interval", type=float, default=None, help="seconds; default verl's own 2 s")
    p.add_argument("--override", action="append", default=[], help="a Hydra override for verl (repeatable)")
    p.add_argument("--like", help="the workload of this rlkit result (benchmarks/e2e.py --out JSON); default: "
                                  "the workload flags")
    add_workload_args(p)
    a = p.parse_args()
    import torch

    from common import model_dir_for
    from e2e_workload import prompt_data, write_prompts

    from rlkit.models.tokenizer import load_tokenizer

    workload = Workload(**json.loads(Path(a.like).read_text())["workload"]) if a.like else workload_of(a)
    setup = VerlSetup(a.gpus or max(torch.cuda.device_count(), 1), a.backend, a.tp, a.ep, a.rollout_tp, a.agent_workers,
                      a.max_token_len_per_gpu, flash_attn_installed(a.site))
    model = Path(a.model) if Path(a.model).is_dir() else model_dir_for(a.model, Path(a.cache_dir))
    data, work = prompt_data(a.recipe, model), Path(a.work).resolve()
    prompts = Path(a.prompts) if a.prompts else write_prompts(work / "prompts.jsonl", workload, data,
                                                                load_tokenizer(str(model)))
    if a.print_overrides:
        print("\n".join(prepare(workload, model.resolve(), work, prompts, data, setup, a.poll_interval, a.override)))
        return
    run = dry_run_verl if a.dry_run else run_verl
    result = run(workload, model, work, a.site, a.timeout, prompts_jsonl=prompts, prompt_data=data, setup=setup,
                 poll_interval_s=a.poll_interval, extra_overrides=a.override)
    if result is not None:
        result["workload"] = dataclasses.asdict(workload)
        print(json.dumps({k: result[k] for k in ("returncode", "timed_out", "wall_s", "to_first_step_s",
                                                 "steady_steps", "median")}))
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
