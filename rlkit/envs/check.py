"""`rlkit env check`: run an environment on a few samples, offline, and show what it returns."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlkit.envs.base import load_environment
from rlkit.envs.runner import safe_step

EXAMPLES = [{"prompt": "2+3=", "response": "5", "answer": "5"},
            {"prompt": "7+8=", "response": "14", "answer": "15"},
            {"prompt": "What is 6*7? End with \\boxed{}.", "response": "\\boxed{42}", "answer": "42"}]


def read_samples(path: str | None) -> list[dict]:
    """Rows with "prompt" and "response" (or "messages"), the rest is metadata; .jsonl or .json."""
    if path is None:
        return EXAMPLES
    text = Path(path).read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()] if path.endswith(".jsonl") \
        else json.loads(text)
    for i, row in enumerate(rows):
        if "messages" not in row and not {"prompt", "response"} <= set(row):
            raise ValueError(f"{path}: sample {i} needs 'prompt' and 'response' (or 'messages'); it has {sorted(row)}")
    return rows


def check(target: str, kwargs: dict, samples: list[dict], timeout_s: float) -> int:
    """Prints one block per sample; returns the number of failed calls."""
    env = load_environment(target, kwargs)
    executor, failures = ThreadPoolExecutor(max_workers=1), 0
    for i, row in enumerate(samples):
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                           {"role": "assistant", "content": row["response"]}]
        metadata = {k: v for k, v in row.items() if k not in ("prompt", "response", "messages")}
        outcome, stuck = safe_step(env, messages, metadata, timeout_s, executor)
        print(f"--- sample {i}: {messages[-1]['content']!r:.80} metadata={metadata}")
        if outcome.step is not None:
            print(f"    {outcome.step}")
        else:
            failures += 1
            print(f"    FAILED ({outcome.failure}): {outcome.detail.strip()}")
        if stuck:
            executor = ThreadPoolExecutor(max_workers=1)
    print(f"{target}: {len(samples) - failures}/{len(samples)} samples scored, {failures} failed")
    return failures
