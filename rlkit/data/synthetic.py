"""Arithmetic rows ({"prompt": "12+7=", "answer": "19"}) written as SFT / preference jsonl files,
so recipes and tests read them through `datasets` exactly like user data."""

import os
import random
from pathlib import Path

from rlkit.data.files import write_jsonl


def write_arithmetic_sft(path: str | os.PathLike, rows: list[dict], chat: bool) -> Path:
    """One line per row: {"messages": [user prompt, assistant answer]} if chat, else {"prompt", "response"}."""
    if chat:
        records = [{"messages": [{"role": "user", "content": r["prompt"]},
                                 {"role": "assistant", "content": r["answer"]}]} for r in rows]
    else:
        records = [{"prompt": r["prompt"], "response": r["answer"]} for r in rows]
    write_jsonl(path, records)
    return Path(path)


def write_arithmetic_preferences(path: str | os.PathLike, rows: list[dict], seed: int) -> Path:
    """One line per row: {"prompt", "chosen": the answer, "rejected": the answer off by 1 to 3},
    the offsets drawn deterministically from seed."""
    rng = random.Random(seed)
    records = [{"prompt": r["prompt"], "chosen": r["answer"],
                "rejected": str(int(r["answer"]) + rng.choice([-3, -2, -1, 1, 2, 3]))} for r in rows]
    write_jsonl(path, records)
    return Path(path)
