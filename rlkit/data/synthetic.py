"""Arithmetic rows ({"prompt": "12+7=", "answer": "19"}) written as SFT / preference jsonl files,
so recipes and tests read them through `datasets` exactly like user data."""

import json
import os
import random
import tempfile
from pathlib import Path


def write_arithmetic_sft(path: str | os.PathLike, rows: list[dict], chat: bool) -> Path:
    """One line per row: {"messages": [user prompt, assistant answer]} if chat, else {"prompt", "response"}."""
    if chat:
        records = [{"messages": [{"role": "user", "content": r["prompt"]},
                                 {"role": "assistant", "content": r["answer"]}]} for r in rows]
    else:
        records = [{"prompt": r["prompt"], "response": r["answer"]} for r in rows]
    return _write_jsonl(path, records)


def write_arithmetic_preferences(path: str | os.PathLike, rows: list[dict], seed: int) -> Path:
    """One line per row: {"prompt", "chosen": the answer, "rejected": the answer off by 1 to 3},
    the offsets drawn deterministically from seed."""
    rng = random.Random(seed)
    records = [{"prompt": r["prompt"], "chosen": r["answer"],
                "rejected": str(int(r["answer"]) + rng.choice([-3, -2, -1, 1, 2, 3]))} for r in rows]
    return _write_jsonl(path, records)


def _write_jsonl(path: str | os.PathLike, records: list[dict]) -> Path:
    """Write to a temporary file beside `path`, then rename it over `path`: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
