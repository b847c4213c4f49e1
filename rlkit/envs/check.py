"""`rlkit env check`: run an environment on a few samples, offline, and show what it returns.

A mistake in the command's arguments is a ConfigError naming the argument (the CLI prints it as one
line, exit code 2); the target and --kwargs get the same check as a recipe's env section at load."""

import json
import threading
from concurrent.futures import Executor, Future
from pathlib import Path

from rlkit.config.schema import ConfigError
from rlkit.envs.base import check_environment_config, load_environment
from rlkit.envs.runner import safe_step
from rlkit.envs.tools import ToolEnvironment

EXAMPLES = [{"prompt": "2+3=", "response": "5", "answer": "5"},
            {"prompt": "7+8=", "response": "14", "answer": "15"},
            {"prompt": "What is 6*7? End with \\boxed{}.", "response": "\\boxed{42}", "answer": "42"}]
# a tool environment's default: a transcript that calls a tool, and one whose call is malformed
_CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'
TOOL_EXAMPLES = [{"messages": [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": _CALL},
                               {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}],
                  "answer": "408"},
                 {"messages": [{"role": "user", "content": "12*34="},
                               {"role": "assistant", "content": "<tool_call>{multiply 12 34}</tool_call>"}],
                  "answer": "408"}]
SAMPLE_FORM = "an object with 'prompt' and 'response' (or 'messages': a list of {role, content}) and metadata"


def parse_kwargs(text: str) -> dict:
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--kwargs: not valid JSON ({e}) (got: {text!r}); give a JSON object such as "
                          f"'{{\"correct_reward\": 2.0}}'") from None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--kwargs: must be a JSON object of constructor arguments (got: {text!r}); e.g. "
                          f"'{{\"correct_reward\": 2.0}}'")
    return kwargs


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--data: {where} is not valid JSON ({e}); give .jsonl (one sample per line) or .json "
                          f"(a list of samples)") from None


def read_samples(path: str | None) -> list[dict] | None:
    """Rows with "prompt" and "response" (or "messages"), the rest is metadata; .jsonl or .json.
    None without a path: the environment's kind picks the built-in examples."""
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--data: cannot read {path} ({e.strerror}); give a .jsonl or .json file of "
                          f"samples") from None
    rows = [_json(line, f"{path} line {n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()] \
        if path.endswith(".jsonl") else _json(text, path)
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"--data: {path} holds no list of samples; give one sample per line (.jsonl) or a list of "
                          f"them (.json), each {SAMPLE_FORM}")
    for i, row in enumerate(rows):
        if not _well_formed(row):
            raise ConfigError(f"--data: sample {i} of {path} is not {SAMPLE_FORM} (got: {row!r:.200})")
    return rows


def _well_formed(row) -> bool:
    if not isinstance(row, dict):
        return False
    if "messages" in row:
        messages = row["messages"]
        return isinstance(messages, list) and bool(messages) and all(
            isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages)
    return {"prompt", "response"} <= set(row)


class DaemonThreadExecutor(Executor):
    """Runs each call on a new daemon thread. A call stuck in user code cannot be stopped, and
    ThreadPoolExecutor threads are joined at interpreter exit, so one hung call would keep the
    command from ever exiting; daemon threads are not waited for, so it exits after its summary."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = Future()

        def run():
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, as ThreadPoolExecutor does
                future.set_exception(e)

        threading.Thread(target=run, daemon=True).start()
        return future


def check(target: str, kwargs: dict, samples: list[dict] | None, timeout_s: float) -> int:
    """Prints one block per sample (samples None: the built-in examples); returns the number of
    failed calls. A tool environment is stepped at every assistant turn of a transcript, as a
    run steps it: each turn's tool results, then the answer's score."""
    problem = check_environment_config(target, kwargs)
    if problem:
        raise ConfigError(problem)
    if not timeout_s > 0:
        raise ConfigError(f"--timeout-s: must be > 0 (got: {timeout_s}); give the seconds one call may take")
    env, executor, failures = load_environment(target, kwargs), DaemonThreadExecutor(), 0
    env.setup()
    tools = isinstance(env, ToolEnvironment)
    samples = samples or (TOOL_EXAMPLES if tools else EXAMPLES)
    for i, row in enumerate(samples):
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                           {"role": "assistant", "content": row["response"]}]
        metadata = {k: v for k, v in row.items() if k not in ("prompt", "response", "messages")}
        print(f"--- sample {i}: {messages[-1]['content']!r:.80} metadata={metadata}")
        turns = [n for n, m in enumerate(messages, 1) if m["role"] == "assistant"] if tools else [len(messages)]
        for end in turns:
            # a stuck call holds only its own thread
            outcome, _ = safe_step(env, messages[:end], metadata, timeout_s, executor)
            prefix = f"    turn {end}: " if tools else "    "
            if outcome.step is None:
                failures += 1
                print(f"{prefix}FAILED ({outcome.failure}): {outcome.detail.strip()}")
                break
            if outcome.step.tool_messages:
                for message in outcome.step.tool_messages:
                    print(f"{prefix}{message['name'] or 'call'} -> {message['content']!r:.120}")
            else:
                print(f"{prefix}{outcome.step}")
    print(f"{target}: {len(samples) - failures}/{len(samples)} samples scored, {failures} failed")
    return failures
