"""TRL's side of the end-to-end GRPO comparison (benchmarks/e2e.py): the same workload run by TRL's
GRPOTrainer (vLLM colocated in sleep mode, in rlkit's own environment: the vLLM rlkit runs serves
TRL too), with the seconds from its launch to its first step, the first step and the steady ones.

  python3 benchmarks/e2e_trl.py --model DIR --work /tmp/e2e_trl --out trl.json [--like rlkit.json]

One rlkit step is one TRL generation round: prompts x samples completions, sampled at once, then
train_global_batch-sample optimizer steps over them (TRL's steps_per_generation), so TRL's
"step" here is the sum of that round's optimizer steps. TRL times its own parts (its profiling
contexts); generate (vLLM.generate) and weight_sync (sync_weights) are read from them, the rest of
the step (its logprobs, training and rewards) is not split. The reward is rlkit's own answer check
on the word problems; with EOS ignored at a fixed length it shapes nothing that is timed.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from e2e_workload import Workload  # noqa: E402

# TRL's profiling names (GRPOTrainer.<name>) -> the comparison's phases
PHASES = {"generate": "GRPOTrainer.vLLM.generate", "weight_sync": "GRPOTrainer.sync_weights"}


def trl_config(w: Workload, out_dir: Path):
    from trl import GRPOConfig

    samples = w.prompts_per_step * w.group_size
    if samples % w.train_global_batch or w.train_global_batch % w.micro_batch_per_gpu:
        raise ValueError(f"the workload's {samples} samples per step must split into optimizer steps of "
                         f"{w.train_global_batch}, and those into micro-batches of {w.micro_batch_per_gpu}")
    return GRPOConfig(
        output_dir=str(out_dir), max_steps=w.steps * samples // w.train_global_batch, seed=0,
        per_device_train_batch_size=w.micro_batch_per_gpu,
        gradient_accumulation_steps=w.train_global_batch // w.micro_batch_per_gpu,
        generation_batch_size=samples, num_generations=w.group_size, max_completion_length=w.response_tokens,
        temperature=1.0, top_p=1.0, top_k=0, generation_kwargs={"ignore_eos": True},
        learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0, beta=w.kl_coef, bf16=True,
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=w.gpu_memory_utilization,
        vllm_max_model_length=w.max_prompt_tokens + w.response_tokens,
        logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0)


def child(args) -> None:
    """The TRL run itself, in its own process so its start-up counts from its launch."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer
    from trl.extras import profiling

    from rlkit.envs.math_answers import answers_match

    launched = float(os.environ["E2E_LAUNCHED_AT"])
    w = Workload(**json.loads(args.workload))
    prompts = json.loads(Path(args.prompts_json).read_text())
    timings: list[tuple[int, str, float]] = []  # (optimizer step, TRL's name, seconds)
    original = profiling.ProfilingContext._log_metrics

    def record(self, duration):
        timings.append((self.step, self.name, duration))
        original(self, duration)

    profiling.ProfilingContext._log_metrics = record

    def reward(completions, answer, **_):
        return [float(answers_match(c[-1]["content"], a)) for c, a in zip(completions, answer)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.begins: list[float] = []
            self.ends: list[float] = []

        def on_step_begin(self, *_, **__):
            self.begins.append(time.time())

        def on_step_end(self, *_, **__):
            self.ends.append(time.time())

    clock = Clock()
    config = trl_config(w, Path(args.work) / "trl_run")
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config, callbacks=[clock],
                          train_dataset=Dataset.from_list(prompts))
    trainer.train()
    steps = rounds(clock.begins, clock.ends, timings, config.generation_batch_size // w.train_global_batch)
    Path(args.result).write_text(json.dumps({"to_first_step_s": clock.begins[0] - launched, "steps": steps,
                                             "log_history": trainer.state.log_history}, default=str))


def rounds(begins: list[float], ends: list[float], timings: list[tuple[int, str, float]], per_round: int) -> list[dict]:
    """TRL's optimizer steps (their start and end times) grouped into generation rounds of
    per_round steps: each round's seconds from its first step's start to its last one's end, and
    the seconds TRL's profiling gave each phase within it. A profiling record carries TRL's
    global_step when it began: the number of optimizer steps completed before it."""
    steps = []
    for first in range(0, len(ends) - per_round + 1, per_round):
        phases = {phase: sum(s for done, name, s in timings if name == trl_name and first <= done < first + per_round)
                  for phase, trl_name in PHASES.items()}
        steps.append({"step": ends[first + per_round - 1] - begins[first], **phases})
    return steps


def trl_prompts(w: Workload, recipe: str, model_dir: Path, prompts_jsonl: Path | None, work_dir: Path) -> list[dict]:
    """rlkit's prompts for the recipe's data (prompts_jsonl, else the workload's, written to
    work_dir), as TRL conversational rows (the same messages, so the same chat-templated ids:
    checked as for verl), with each row's answer for the reward."""
    from e2e_verl import check_same_prompts, rlkit_prompts
    from e2e_workload import prompt_data, write_prompts

    from rlkit.models.tokenizer import load_tokenizer

    data, tokenizer = prompt_data(recipe, model_dir), load_tokenizer(str(model_dir))
    path = Path(prompts_jsonl) if prompts_jsonl else write_prompts(work_dir / "prompts.jsonl", w, data, tokenizer)
    prompts = rlkit_prompts(path, data, w.max_prompt_tokens, tokenizer)
    check_same_prompts(prompts, tokenizer)
    return [{"prompt": p.messages, "answer": str(p.metadata["answer"])} for p in prompts]


def run_trl(w: Workload, model_dir: Path, work_dir: Path, timeout_s: int, recipe: str = "grpo_smollm2_gpu",
            prompts_jsonl: Path | None = None) -> dict:
    """One TRL run of the workload: launch to first step, each step (generation round) and the
    medians over steps 2..N, in the shape of benchmarks/e2e.py's rlkit result."""
    work_dir = Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    prompts_json, result = work_dir / "trl_prompts.json", work_dir / "trl_raw.json"
    prompts_json.write_text(json.dumps(trl_prompts(w, recipe, model_dir, prompts_jsonl, work_dir)))
    command = [sys.executable, __file__, "--child", "--model", str(model_dir), "--work", str(work_dir),
               "--workload", json.dumps(dataclasses.asdict(w)), "--prompts-json", str(prompts_json),
               "--result", str(result)]
    started = time.time()
    with open(work_dir / "trl.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=True,
                       env={**os.environ, "E2E_LAUNCHED_AT": repr(started)})
    raw = json.loads(result.read_text())
    steps = [{**s, "other": s["step"] - s["generate"] - s["weight_sync"]} for s in raw["steps"]]
    steady = steps[1:] or steps
    return {"framework": "trl", "wall_s": time.time() - started, "to_first_step_s": raw["to_first_step_s"],
            "first_step_s": steps[0]["step"], "median": {k: statistics.median(s[k] for s in steady) for k in steady[0]},
            "steps": steps, "log_history": raw["log_history"], "log": str(work_dir / "trl.log")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory (rlkit pretrained smollm2-135m-instruct)")
    p.add_argument("--work", required=True, help="folder for TRL's prompts, log and output")
    p.add_argument("--recipe", default="grpo_smollm2_gpu", help="the rlkit recipe whose data settings render prompts")
    p.add_argument("--prompts", help="JSONL of {question, answer} rows; default: the recipe's data.train_path")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--timeout", type=int, default=540)
    p.add_argument("--like", help="the workload of this rlkit result (benchmarks/e2e.py --out JSON)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--prompts-json", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    workload = Workload(**json.loads(Path(a.like).read_text())["workload"]) if a.like else Workload()
    result = run_trl(workload, Path(a.model), Path(a.work), a.timeout, a.recipe, a.prompts)
    result["workload"] = dataclasses.asdict(workload)
    print(json.dumps({k: result[k] for k in ("to_first_step_s", "first_step_s", "median")}))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
