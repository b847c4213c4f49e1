"""Multi-turn tool rollouts against single-turn ones on the same prompts, in one benchmark run:
a few GRPO steps of one recipe per mode, and per mode the turns per second of its rollouts, the
share of each rollout the generation engines sat idle (waiting for environment steps: tools) and
the step time, with its ratio to the single-turn step time.

Modes (--modes): single (env_runner.max_turns=1); per_turn (--turns turns, env_runner.flow=per_turn:
each turn generates for every episode, then steps them all); per_trajectory (the same turns, each
episode on its own: a slow tool holds up its own episode alone). So that a mode's turns are its
own and not the model's choice, every turn before the last gets a tool result whatever the model
wrote (benchmarks/tool_turns.py: its own calls answered, else a review of its draft the
environment calls). --sleep-tool S: the review of one problem in --slow-one-in sleeps S seconds.

    python3 benchmarks/multi_turn.py --out multi_turn.json                              (1 GPU, SmolLM2)
    python3 benchmarks/multi_turn.py --sleep-tool 1.5 --out multi_turn_sleep.json
    python3 benchmarks/multi_turn.py --cpu --steps 2 --out x.json                       (CPU dry run)
"""

import argparse
import json
import os
import statistics
from pathlib import Path

import yaml

from train_runs import add_run_options, train

MODES = {"single": ("per_turn", False), "per_turn": ("per_turn", True), "per_trajectory": ("per_trajectory", True)}
# the CPU dry run: grpo_tiny_cpu's tiny model with chat-templated prompts, small steps
CPU_OVERRIDES = ["data.chat_template=true", "data.max_prompt_tokens=2048", "algorithm.prompts_per_step=8",
                 "algorithm.group_size=4", "policy.train_global_batch_size=32", "policy.micro_batch_size=8",
                 "generation.max_new_tokens=32"]


def overrides(mode: str, args) -> list[str]:
    """The recipe's settings for one mode: every mode the same prompts, steps and environment."""
    flow, multi_turn = MODES[mode]
    turns = args.turns if multi_turn else 1
    return ["data=word_problems_hard", "algorithm.warm_start.sft_steps=0", f"algorithm.num_steps={args.steps}",
            "algorithm.val_before_training=false", f"algorithm.val_every={args.steps + 1}", "checkpoint.every=0",
            "env=math_calculator", "env._target_=benchmarks.tool_turns.ToolTurns", f"+env.turns={turns}",
            f"+env.sleep_s={args.sleep_tool}", f"+env.slow_one_in={args.slow_one_in}",
            f"env.tool_timeout_s={args.sleep_tool + 5}", f"env_runner.max_turns={turns}", f"env_runner.flow={flow}",
            f"env_runner.num_workers={args.env_workers}", f"env_runner.timeout_s={args.sleep_tool + 30}",
            f"env_runner.max_total_tokens={turns * args.tokens_per_turn}", f"run.cache_dir={args.cache_dir}",
            *(CPU_OVERRIDES if args.cpu else [])]


def summarize(history: list[dict], episodes: int) -> dict:
    """Medians over the steps after the first (it pays for first allocations and compilation).
    A rollout's seconds: generate + reward under per_turn, generate (the whole rollout) under
    per_trajectory; the engines are busy for generate_busy of them (per_trajectory), or for the
    whole of generate (per_turn: every engine has a share of each turn's batch)."""
    steps = [m for m in history if m["step"] >= 1]
    steady = steps[1:] or steps

    def median(fn) -> float:
        return statistics.median(fn(m) for m in steady)

    def rollout(m) -> float:
        return m["timing/generate"] + m.get("timing/reward", 0.0)

    return {"step_s": median(lambda m: m["timing/step"]), "rollout_s": median(rollout),
            "turns_per_episode": median(lambda m: m["train/turns"]),
            "turns_per_s": median(lambda m: m["train/turns"] * episodes / rollout(m)),
            "engine_idle_share": median(lambda m: 1 - m.get("timing/generate_busy", m["timing/generate"]) / rollout(m)),
            "tool_calls_per_step": median(lambda m: m.get("tools/calls", 0.0))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="grpo_smollm2_gpu_tools_hard")
    parser.add_argument("--cpu", action="store_true", help="the dry run: grpo_tiny_cpu's tiny model, small steps")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--turns", type=int, default=3, help="model turns per multi-turn episode")
    parser.add_argument("--tokens-per-turn", type=int, default=256, help="env_runner.max_total_tokens per turn")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sleep-tool", type=float, default=0.0, help="seconds the slow problems' review sleeps")
    parser.add_argument("--slow-one-in", type=int, default=16, help="one problem in this many has the slow review")
    parser.add_argument("--env-workers", type=int, default=8, help="env_runner.num_workers")
    add_run_options(parser, "/tmp/rlkit_multi_turn", 900)
    args = parser.parse_args()
    recipe = "grpo_tiny_cpu" if args.cpu else args.recipe
    result = {"recipe": recipe, "steps": args.steps, "turns": args.turns, "sleep_tool_s": args.sleep_tool,
              "slow_one_in": args.slow_one_in, "runs": {}}
    for mode in args.modes.split(","):
        command, history = train(recipe, [*overrides(mode, args), *args.extra], Path(args.work_dir), mode,
                                 args.timeout)
        algorithm = yaml.safe_load((Path(args.work_dir) / mode / "config.yaml").read_text())["algorithm"]
        result["runs"][mode] = {"command": command,
                                **summarize(history, algorithm["prompts_per_step"] * algorithm["group_size"])}
    single = result["runs"].get("single", {}).get("step_s", float("nan"))
    for mode, run in result["runs"].items():
        run["step_over_single"] = run["step_s"] / single
        print(f"{mode:>14}: step {run['step_s']:.3g} s ({run['step_over_single']:.2f}x single), rollout "
              f"{run['rollout_s']:.3g} s, {run['turns_per_episode']:.2f} turns/episode, {run['turns_per_s']:.3g} "
              f"turns/s, engines idle {100 * run['engine_idle_share']:.0f}%, {run['tool_calls_per_step']:.0f} calls")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
