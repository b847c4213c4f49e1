"""Data files: rows read through HF `datasets` (local .json/.jsonl/.parquet files, dataset
folders, hub names) and jsonl files written atomically."""

import json
import os
import tempfile
from pathlib import Path

import datasets

LOCAL_LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_rows(source: str, max_row_bytes: int, split: str = "train", subset: str | None = None) -> list[dict]:
    """All rows of a local .json/.jsonl/.parquet file, or of one split of a local dataset folder or
    a hub dataset (subset: the hub dataset's configuration, e.g. "main" for openai/gsm8k). A row
    whose text is over max_row_bytes (data.max_row_bytes) is an error naming it and its largest field."""
    path = Path(source).expanduser()
    loader = LOCAL_LOADERS.get(path.suffix.lower())
    looks_local = loader is not None or source.startswith(("/", "./", "../", "~"))
    if looks_local and not path.exists():
        raise FileNotFoundError(f"{source}: no such file; check the path (it is read as a local data file)")
    if path.is_file():
        if loader is None:
            raise ValueError(f"{source}: unsupported file type '{path.suffix}'; give a .json, .jsonl or .parquet file")
        try:
            dataset = datasets.load_dataset(loader, data_files=str(path), split="train")
        except Exception as e:
            raise ValueError(f"{source}: could not be read as {loader} ({type(e).__name__}: {e}); "
                             f"fix the file so every row is a record with the same fields") from e
    else:
        try:
            dataset = datasets.load_dataset(str(path) if path.is_dir() else source, subset, split=split)
        except Exception as e:
            which = f"split '{split}'" + (f" of subset '{subset}'" if subset else "")
            raise ValueError(f"{source}: not a local file, and loading it as a Hugging Face hub dataset ({which}) "
                             f"failed ({type(e).__name__}: {e}); give a local .json, .jsonl or .parquet file, or "
                             f"run where the hub is reachable") from e
    if len(dataset) == 0:
        raise ValueError(f"{source}: has no rows; give a file with at least one row")
    rows = dataset.to_list()
    for i, row in enumerate(rows):
        sizes = {field: _text_bytes(value) for field, value in row.items()}
        if sum(sizes.values()) > max_row_bytes:
            field = max(sizes, key=sizes.get)
            raise ValueError(f"{source} row {i}: {sum(sizes.values())} bytes of text, over data.max_row_bytes="
                             f"{max_row_bytes} (field '{field}' holds {sizes[field]}); shorten or drop the row, "
                             f"or raise data.max_row_bytes")
    return rows


def _text_bytes(value) -> int:
    """UTF-8 bytes of the strings in a field (nested in lists and records, as chat messages are)."""
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, dict):
        return sum(map(_text_bytes, value.values()))
    if isinstance(value, (list, tuple)):
        return sum(map(_text_bytes, value))
    return 0


def write_jsonl(path: str | os.PathLike, records: list[dict], only_if_changed: bool = False) -> bool:
    """Write to a temporary file beside `path`, then rename it over `path`: readers never see half
    a file. only_if_changed: leave a file that already holds these records alone (its time too).
    Returns whether it wrote."""
    path = Path(path)
    text = "".join(json.dumps(record) + "\n" for record in records)
    if only_if_changed and path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return True
