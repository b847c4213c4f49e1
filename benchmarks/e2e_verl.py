"""verl 0.9.1's side of the end-to-end GRPO comparison (benchmarks/e2e.py): the same workload run by
verl (FSDP actor with SDPA attention, colocated vLLM 0.24.0 rollout, its default V1 sync trainer)
from verl's own install directory, with its per-step phase times read from its console.

  python3 benchmarks/e2e_verl.py --model DIR --site /tmp/site-verl --work /tmp/e2e_verl --out verl.json
  python3 benchmarks/e2e_verl.py --model DIR --site SITE --work DIR --dry-run   # no Ray, no GPU

This process runs in rlkit's environment: it renders the prompts with rlkit's own loader. verl runs
in a subprocess whose PYTHONPATH is verl's install directory alone (verl pins vLLM 0.24.0, rlkit
runs 0.26.0). --dry-run runs verl's own code up to Ray's start instead (benchmarks/verl_check.py):
it composes and validates the config, reads the parquet files, renders the prompts with the agent
loop's tokenizer path and scores a reward; on the CPU machine SITE is a CPU install of verl.

GPU session: device calls sent back to back (< 30 s apart), each carrying the named folder:
  1. rlkit's set (6 parts of 60 MiB): `.gpucarry/cK` with `bash .gpucarry/cK/bootstrap.sh`, staged by
     a wheel-staging kit with scripts/gpu-wheels.txt (docs/gpu.md, machines without network); it runs
     this driver and makes the model (`rlkit pretrained smollm2-135m-instruct`, in gpu_session.sh).
  2. verl's set (5 parts: 276 MiB, 51 wheels): `.gpucarry-verl/cK` with `bash scripts/verl_stack.sh install`,
     staged by `bash scripts/verl_stack.sh stage`; the last part installs it into /tmp/site-verl.
  3. on the last verl part: `bash scripts/verl_stack.sh install --need-all && bash scripts/gpu_session.sh
     e2e-verl` (.gpucarry-verl/CALLS.txt lists every call).
GPU time: 11 part calls (the first ~33 s with the machine's start, then 6-8 s each on a good day,
up to ~150 s each on a slow one) and the run: verl took ~207 s from start to its first step with eager
vLLM and one agent worker, then ~15 s a step on 64 x 8 short samples on one H100; 5 steps of 128
tokens, about 6 minutes. In all ~8 minutes on a good day, ~33 on a slow one.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from e2e_workload import Workload  # noqa: E402
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

def verl_overrides(w: Workload, model_dir: Path, data_dir: Path, work_dir: Path, agent_workers: int,
                   poll_interval_s: float | None) -> list[str]:
    """Hydra overrides of verl's ppo_trainer config for the workload: GRPO as rlkit runs it
    (clip 0.2/0.28, token-mean, std-normalized advantages, k3 KL loss when kl_coef > 0), fixed-length
    responses, and the settings the GPU image needs (no flash-attn: SDPA and no remove-padding)."""
    if w.train_global_batch % w.group_size:
        raise ValueError(f"train_global_batch ({w.train_global_batch}) must be a multiple of group_size "
                         f"({w.group_size}): verl's ppo_mini_batch_size counts prompts")
    kl, micro = w.kl_coef > 0, w.micro_batch_per_gpu
    out = [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "algorithm.norm_adv_by_std_in_grpo=true",
        f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'val.parquet'}",
        f"data.train_batch_size={w.prompts_per_step}", f"data.max_prompt_length={w.max_prompt_tokens}",
        f"data.max_response_length={w.response_tokens}", "data.filter_overlong_prompts=false",
        "data.truncation=error", "data.dataloader_num_workers=0", "data.seed=0",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_remove_padding=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.actor.strategy=fsdp", f"actor_rollout_ref.actor.optim.lr={w.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={w.train_global_batch // w.group_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.use_kl_loss={str(kl).lower()}", f"actor_rollout_ref.actor.kl_loss_coef={w.kl_coef}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.param_offload=false",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={w.group_size}",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.ignore_eos=true",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={w.gpu_memory_utilization}",
        "actor_rollout_ref.rollout.free_cache_engine=true",
        f"actor_rollout_ref.rollout.max_model_len={w.max_prompt_tokens + w.response_tokens}",
        f"actor_rollout_ref.rollout.enforce_eager={str(w.enforce_eager).lower()}",
        # the engine limits rlkit's vLLM runs with: vLLM's own defaults for its LLM class on an H100/H200
        # (vllm/engine/arg_utils.py get_batch_defaults); verl's rollout config would set 256 and 8192
        "actor_rollout_ref.rollout.max_num_seqs=1024", "actor_rollout_ref.rollout.max_num_batched_tokens=16384",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.agent.num_workers={agent_workers}",
        f"reward.custom_reward_function.path={HERE / 'verl_reward.py'}",
        "reward.custom_reward_function.name=compute_score", "reward.num_workers=2",
        "trainer.critic_warmup=0", "trainer.logger=[console]", "trainer.project_name=rlkit_e2e",
        "trainer.experiment_name=verl", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        f"trainer.total_training_steps={w.steps}", "trainer.total_epochs=1000", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={work_dir / 'checkpoints'}",
        # a new local Ray cluster even when one of rlkit's is still registered on this machine
        "+ray_kwargs.ray_init.address=local",
    ]
    if poll_interval_s is not None:
        out += [f"trainer.v1.sampler.custom_sampler.path={HERE / 'verl_poll.py'}",
                "trainer.v1.sampler.custom_sampler.name=PollingReplayBuffer",
                f"+trainer.v1.sampler.sampler_kwargs.poll_interval_s={poll_interval_s}"]
    return out


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


def median_phases(steps: list[dict], skip: int = 1) -> dict[str, float]:
    """Median seconds per phase over the steps after the first `skip` (warm-up)."""
    kept = steps[skip:] or steps
    return {phase: statistics.median(s["phases"][phase] for s in kept) for phase in kept[0]["phases"]}


# --- running verl ------------------------------------------------------------------------------------

def prepare(w: Workload, model_dir: Path, work_dir: Path, prompts_jsonl: Path, prompt_data, agent_workers: int,
            poll_interval_s: float | None, extra_overrides: list[str]) -> list[str]:
    """Writes the data under work_dir/data (checking verl renders rlkit's prompt tokens) and
    returns verl's overrides, extra_overrides last (a later value for the same key wins)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = rlkit_prompts(prompts_jsonl, prompt_data, w.max_prompt_tokens, tokenizer)
    check_same_prompts(prompts, tokenizer)
    write_verl_data(prompts, work_dir / "data")
    return verl_overrides(w, model_dir, work_dir / "data", work_dir, agent_workers, poll_interval_s) + extra_overrides


def _run_logged(command: list[str], env: dict, cwd: Path, log: Path, timeout_s: int):
    """Runs command in a process group of its own with its output in log; returns (returncode,
    timed_out, [(seconds since start, step, metrics)] of each step line). Past timeout_s the group is
    stopped; after the command ends, whatever of its group is left (Ray's or vLLM's processes) is
    killed, so that the GPU is free for what runs next."""
    start, seen = time.monotonic(), []
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)

        def read():
            for line in proc.stdout:
                out.write(line)
                out.flush()
                for part in line.split("\r"):
                    parsed = parse_step_line(part)
                    if parsed:
                        seen.append((time.monotonic() - start, *parsed))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                _signal_group(proc.pid, sig)
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    pass
        _kill_group(proc.pid, timeout_s=10)
        reader.join(timeout=10)
    return proc.returncode, timed_out, seen


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _live_group_members(pgid: int) -> list[int]:
    """Processes of group pgid that still run (zombies hold no memory, so they do not count)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] not in "ZX":
                    members.append(int(entry.name))
    return members


def _kill_group(pgid: int, timeout_s: float) -> None:
    """SIGKILL group pgid and wait until none of it runs: a kill is delivered asynchronously, and the GPU is
    free only once the processes holding it are gone."""
    _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while _live_group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def run_verl(workload: Workload, model_dir: Path, work_dir: Path, site_dir: str, timeout_s: int, *,
             prompts_jsonl: Path, prompt_data, agent_workers: int = 1, poll_interval_s: float | None = None,
             extra_overrides: Sequence[str] = ()) -> dict:
    """One verl GRPO run of the workload; its steps as phases (seconds) and verl's raw metrics.

    prompt_data: the rlkit run's data config (PromptDataConfig). agent_workers: verl's agent-loop
    workers (1 starts fastest). poll_interval_s: None keeps verl's 2 s rollout poll (verl_poll.py).
    extra_overrides: more Hydra overrides for verl, e.g. its own engine limits back. The result's
    to_first_step_s is from launch to step 1's start (its line's arrival less its timing_s/step)."""
    work_dir = Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    overrides = prepare(workload, Path(model_dir).resolve(), work_dir, Path(prompts_jsonl), prompt_data, agent_workers,
                        poll_interval_s, list(extra_overrides))
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    log = work_dir / "verl.log"
    started = time.monotonic()
    returncode, timed_out, seen = _run_logged(command, verl_env(site_dir, dict(os.environ)), work_dir, log, timeout_s)
    steps = [{"step": step, "phases": step_phases(metrics), "metrics": metrics} for _, step, metrics in seen]
    if not steps:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"verl logged no step (returncode {returncode}, timed out: {timed_out}); "
                           f"the end of {log}:\n" + "\n".join(tail))
    return {"framework": "verl", "returncode": returncode, "timed_out": timed_out,
            "wall_s": time.monotonic() - started, "to_first_step_s": seen[0][0] - steps[0]["phases"]["step"],
            "median": median_phases(steps), "steps": steps, "log": str(log), "command": command}


def dry_run_verl(workload: Workload, model_dir: Path, work_dir: Path, site_dir: str, timeout_s: int, *,
                 prompts_jsonl: Path, prompt_data, agent_workers: int = 1, poll_interval_s: float | None = None,
                 extra_overrides: Sequence[str] = ()) -> None:
    """run_verl up to Ray's start: verl_check.py runs verl's config, data, prompt and reward code."""
    work_dir = Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    overrides = prepare(workload, Path(model_dir).resolve(), work_dir, Path(prompts_jsonl), prompt_data, agent_workers,
                        poll_interval_s, list(extra_overrides))
    command = [sys.executable, str(HERE / "verl_check.py"), str(work_dir / "data" / "expected_ids.jsonl"), *overrides]
    subprocess.run(command, env=verl_env(site_dir, dict(os.environ)), cwd=work_dir, timeout=timeout_s, check=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory (rlkit pretrained smollm2-135m-instruct)")
    p.add_argument("--site", required=True, help="verl's install directory (on the GPU machine /tmp/site-verl)")
    p.add_argument("--work", required=True, help="folder for verl's data, log and checkpoints")
    p.add_argument("--recipe", default="grpo_smollm2_gpu", help="the rlkit recipe whose data settings render prompts")
    p.add_argument("--prompts", help="JSONL of {question, answer} rows; default: the recipe's data.train_path, "
                                     "generated from its data.synthetic when missing")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--timeout", type=int, default=540)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--agent-workers", type=int, default=1)
    p.add_argument("--poll-interval", type=float, default=None, help="seconds; default verl's own 2 s")
    p.add_argument("--override", action="append", default=[], help="a Hydra override for verl (repeatable)")
    p.add_argument("--like", help="the workload of this rlkit result (benchmarks/e2e.py --out JSON); default: "
                                  "benchmarks/e2e.py's Workload defaults")
    a = p.parse_args()
    from rlkit.data.arithmetic import synthetic_splits
    from rlkit.data.files import write_jsonl
    from rlkit.launch.config import load_config

    data = load_config(a.recipe, [f"policy.model_path={a.model}"])[0].data
    prompts = Path(a.prompts or data.train_path)
    if not prompts.is_file():
        write_jsonl(prompts, synthetic_splits(data.synthetic)[0])
    workload = Workload(**json.loads(Path(a.like).read_text())["workload"]) if a.like else Workload()
    run = dry_run_verl if a.dry_run else run_verl
    result = run(workload, Path(a.model), Path(a.work), a.site, a.timeout, prompts_jsonl=prompts, prompt_data=data,
                 agent_workers=a.agent_workers, poll_interval_s=a.poll_interval, extra_overrides=a.override)
    if result is not None:
        result["workload"] = dataclasses.asdict(workload)
        print(json.dumps({k: result[k] for k in ("returncode", "timed_out", "wall_s", "to_first_step_s", "median")}))
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
