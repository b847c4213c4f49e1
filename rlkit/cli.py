"""rlkit command line: `rlkit train --config-name <recipe> [key=value ...]`."""

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rlkit.config.schema import ConfigError
from rlkit.launch.config import RECIPES_DIR, load_config, recipe_names
from rlkit.launch.interrupts import STARTING, Stopped, stop_at_once_on_signals
from rlkit.observability import console


def _validation_summary(history: list[dict]) -> str:
    """The validation metrics from the first validation to the last, for the run's closing line."""
    validated = [m for m in history if any(k.startswith("val/") for k in m)]
    if not validated:
        return "no validation ran"
    first, last = validated[0], validated[-1]
    if first is last:
        return ", ".join(f"{k} {v:.3f}" for k, v in first.items() if k.startswith("val/"))
    return ", ".join(f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in first if k.startswith("val/") and k in last)


def _train(args) -> int:
    cfg, resolved = load_config(args.config_name, args.overrides, Path(args.config_dir))
    if args.cfg == "job":
        sys.stdout.write(OmegaConf.to_yaml(resolved, resolve=True))
        return 0
    console.log_run_in(Path(cfg.run.output_dir) / cfg.run.name)
    from rlkit.cluster.fork_server import start_ahead

    fork_server = start_ahead(cfg.cluster, cfg.policy.bridge)  # its imports overlap the driver's
    from rlkit.algorithms.loop import RunStopped
    from rlkit.checkpoint import CheckpointWriteError
    from rlkit.envs.runner import EnvironmentFailure
    from rlkit.launch.run import train
    from rlkit.observability.startup import StartupClock

    try:
        result = train(cfg, resolved, StartupClock(from_rlkit_start=True), fork_server=fork_server)
    except RunStopped as e:
        print(f"rlkit: {e}", file=sys.stderr)
        return 128 + signal.Signals[e.reason]
    except (CheckpointWriteError, EnvironmentFailure) as e:
        print(f"rlkit: {e}", file=sys.stderr)
        return 1
    logging.getLogger("rlkit").info("done: %s; metrics in %s", _validation_summary(result.history),
                                    result.run_dir / "metrics.jsonl")
    return 0


def _verify_refit(args) -> int:
    cfg, _ = load_config(args.config_name, args.overrides, Path(args.config_dir))
    from rlkit.launch.run import verify_refit

    metrics = verify_refit(cfg, args.num_prompts)
    for key in ["refit/logprob_abs_error_mean", "refit/logprob_abs_error_max", "refit/token_mult_prob_error",
                "refit/tokens_compared", "timing/refit_transfer", "timing/refit_gbytes_per_s"]:
        print(f"{key}: {metrics[key]:.6g}")
    return 0


def _env_check(args) -> int:
    from rlkit.envs.check import check, parse_kwargs, read_samples

    failures = check(args.target, parse_kwargs(args.kwargs), read_samples(args.data), args.timeout_s)
    return 1 if failures else 0


def _convert(args) -> int:
    from rlkit.checkpoint import DiskWriteError
    from rlkit.launch.convert import export_hf

    try:
        print(export_hf(Path(args.checkpoint), Path(args.out), args.merged).line())
    except DiskWriteError as e:
        print(f"rlkit: {e}", file=sys.stderr)
        return 1
    return 0


def _eval(args) -> int:
    from rlkit.launch.evaluate import evaluate, plan_eval, write_report
    from rlkit.observability.evaluation import report_table

    plan = plan_eval(args.model, args.config_name, args.overrides, args.n, args.k, args.data, args.out,
                     Path(args.config_dir))
    report = evaluate(plan)
    print(report_table(report))  # first: the figures are on screen even if the report cannot be written
    write_report(report, plan.out)
    print(f"report: {plan.out}")
    return 0


def _pretrained(args) -> int:
    from rlkit.models.pretrained import MaterializeError, smollm2_135m_instruct

    try:
        print(smollm2_135m_instruct(args.cache_dir))
    except MaterializeError as e:
        print(f"rlkit: {e}", file=sys.stderr)
        return 1
    return 0


def _stoppable(command, where: str):
    """command, which a signal (SIGINT, SIGTERM) stops where it is, in one line ("stopped by SIGTERM
    <where>"), exiting with 128 + the signal; from its first line, before its heavy imports."""
    def stoppable(args) -> int:
        try:
            with stop_at_once_on_signals(where):
                return command(args)
        except Stopped as e:
            print(f"rlkit: {e}", file=sys.stderr)
            return 128 + signal.Signals[e.reason]
    return stoppable


def _unfinished(what: str) -> str:
    """Where a signal stopped a command that writes only once it has finished (if at all)."""
    return f"before {what} finished, which wrote nothing; rerun the same command"


# Hydra's own scripts take --config-path: the same directory here
RECIPES_HELP = "directory of recipes (--config-path: the same)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlkit")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run a recipe",
                                epilog=f"recipes in {RECIPES_DIR}: {', '.join(recipe_names())}")
    train.add_argument("--config-name", required=True, help="recipe name (a YAML file in --config-dir)")
    train.add_argument("--config-dir", "--config-path", default=str(RECIPES_DIR), help=RECIPES_HELP)
    train.add_argument("--cfg", choices=["job"], help="print the resolved config and exit")
    train.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. policy.tensor_parallel_size=2")
    verify = commands.add_parser("verify-refit", help="refit once and compare train vs generation logprobs")
    verify.add_argument("--config-name", required=True, help="recipe name (a YAML file in --config-dir)")
    verify.add_argument("--config-dir", "--config-path", default=str(RECIPES_DIR), help=RECIPES_HELP)
    verify.add_argument("--num-prompts", type=int, default=64, help="held-out prompts to sample")
    verify.add_argument("overrides", nargs="*", help="Hydra overrides")
    env = commands.add_parser("env", help="work on environments").add_subparsers(dest="env_command", required=True)
    env_check = env.add_parser("check", help="run an environment on a few samples and print what it returns")
    env_check.add_argument("target", help="importable Environment class or scoring function, e.g. my_env.MyEnv "
                                          "(a recipe's env._target_)")
    env_check.add_argument("--data", help=".jsonl/.json samples with prompt+response (or messages) and metadata")
    env_check.add_argument("--kwargs", default="{}",
                           help="JSON object of constructor arguments (a recipe's env.* keys)")
    env_check.add_argument("--timeout-s", type=float, default=10.0, help="per-call timeout")
    convert = commands.add_parser("convert", help="export HF weights (or a policy.peft run's HF PEFT adapter) from a "
                                                  "checkpoint")
    convert.add_argument("checkpoint", help="a checkpoint directory (.../checkpoints/step_NNNNNN)")
    convert.add_argument("out", help="a new (or empty) directory for the HF checkpoint or adapter")
    convert.add_argument("--merged", action="store_true",
                         help="policy.peft runs: the base with the adapters merged in, instead of the adapter")
    evaluation = commands.add_parser("eval", help="score a model or checkpoint on held-out prompts: greedy accuracy, "
                                                  "pass@k, mean reward, response length")
    evaluation.add_argument("model", help="an HF model directory or a checkpoint (.../checkpoints/step_NNNNNN)")
    evaluation.add_argument("--config-name", help="recipe for data, env and generation (a checkpoint's own run "
                                                  "config by default; required for an HF model)")
    evaluation.add_argument("--config-dir", "--config-path", default=str(RECIPES_DIR), help=RECIPES_HELP)
    evaluation.add_argument("--data", help="a .jsonl/.json/.parquet file of rows to score instead of the data "
                                           "section's validation split")
    evaluation.add_argument("--n", type=int, help="samples per prompt for pass@k (default: greedy only)")
    evaluation.add_argument("--k", help="comma-separated k for pass@k, each <= --n (default: 1,n)")
    evaluation.add_argument("--out", help="JSON report path, new (default: <model>.eval.json beside the model)")
    evaluation.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data=gsm8k env._target_=my_env.MyEnv")
    pretrained = commands.add_parser("pretrained", help="materialize a pretrained model into the cache, print its path")
    pretrained.add_argument("model", choices=["smollm2-135m-instruct"], help="which model")
    pretrained.add_argument("--cache-dir", default=".rlkit_cache", help="cache directory (a recipe's run.cache_dir)")
    args, rest = parser.parse_known_args(argv)
    # argparse leaves `rlkit eval MODEL --n 8 key=value`'s overrides after an option unparsed
    if rest and (args.command != "eval" or any(word.startswith("-") for word in rest)):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:
        args.overrides += rest
    console.setup()
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        # a log file: Ray colours the "[repeated Nx across cluster]" it puts in place of the lines
        # its workers repeat, and says so at length; it gets each worker's line instead, plain.
        # Read when Ray is imported (only commands that start workers import it, after this).
        # Ray's coloured "(Worker pid=...)" prefixes: rlkit/cluster/ray_runtime.py
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        commands = {"train": _stoppable(_train, STARTING),
                    "verify-refit": _stoppable(_verify_refit, _unfinished("the check")), "env": _env_check,
                    "convert": _stoppable(_convert, _unfinished("the export")),
                    "eval": _stoppable(_eval, _unfinished("the evaluation")), "pretrained": _pretrained}
        return commands[args.command](args)
    except ConfigError as e:
        print(f"rlkit: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
