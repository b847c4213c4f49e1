"""Data files: rows of local .json/.jsonl files (read with Python's json, so every value keeps its
own type and an error names its line), of .parquet files, dataset folders and hub datasets (through
HF `datasets`); jsonl files written atomically; and generated sets, each marked as rlkit's so that
generated data never overwrites a file rlkit did not write."""

import hashlib
import json
import os
import tempfile
from pathlib import Path

LOCAL_FORMATS = (".json", ".jsonl", ".parquet")
# beside a generated file: who wrote it, from what, and its SHA-256 (a file changed since is not rlkit's)
GENERATED_MARKER = ".rlkit-generated.json"


def load_rows(source: str, max_row_bytes: int, split: str = "train", subset: str | None = None) -> list[dict]:
    """All rows of a local .json/.jsonl/.parquet file, or of one split of a local dataset folder or
    a hub dataset (subset: the hub dataset's configuration, e.g. "main" for openai/gsm8k). A row
    whose text is over max_row_bytes (data.max_row_bytes) is an error naming it and its largest field."""
    missing = missing_file(source)
    if missing:
        raise FileNotFoundError(missing)
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix not in LOCAL_FORMATS:
            raise ValueError(f"{source}: unsupported file type '{path.suffix}'; give a .json, .jsonl or .parquet file")
        if path.stat().st_size == 0:
            raise ValueError(f"{source}: the file is empty; give a file with at least one row")
        rows = _parquet_rows(path, source) if suffix == ".parquet" else _json_rows(path, source)
    else:
        rows = _dataset_rows(path, source, split, subset)
    if not rows:
        raise ValueError(f"{source}: has no rows; give a file with at least one row")
    for i, row in enumerate(rows):
        sizes = {field: _text_bytes(value) for field, value in row.items()}
        if sum(sizes.values()) > max_row_bytes:
            field = max(sizes, key=sizes.get)
            raise ValueError(f"{source} row {i}: {sum(sizes.values())} bytes of text, over data.max_row_bytes="
                             f"{max_row_bytes} (field '{field}' holds {sizes[field]}); shorten or drop the row, "
                             f"or raise data.max_row_bytes")
    return rows


def missing_file(source: str) -> str | None:
    """Why `source`, read as a local data file, cannot be: it is not there. None when it is, or
    when it names a dataset folder or a hub dataset."""
    if _looks_local(source) and not Path(source).expanduser().exists():
        return f"{source}: no such file; check the path (it is read as a local data file)"
    return None


def is_local(source: str) -> bool:
    """Whether `source` names a local file or folder (there or not), not a hub dataset."""
    return _looks_local(source) or Path(source).expanduser().exists()


def _looks_local(source: str) -> bool:
    return Path(source).suffix.lower() in LOCAL_FORMATS or source.startswith(("/", "./", "../", "~"))


def _json_rows(path: Path, source: str) -> list[dict]:
    """JSON Lines (.jsonl), or a .json file's one JSON document (a list of rows) or JSON Lines.
    Read as written: `datasets` casts a column to one type for every row (one row's number turned
    every other row's text into numbers, so the error named the wrong row), and names no line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{source}: not UTF-8 text (byte {e.start} cannot be decoded); save it as UTF-8") from None
    numbered = None
    if path.suffix.lower() == ".json":
        try:
            document = json.loads(text)
            numbered = [(f"{source} row {i}", row) for i, row in
                         enumerate(document if isinstance(document, list) else [document])]
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # several documents, one per line: JSON Lines
                raise ValueError(f"{source} line {e.lineno}: not valid JSON ({e.msg}, column {e.colno}); fix the "
                                 f"file: a list of objects, or one object per line") from None
    if numbered is None:
        numbered = []
        # split on newlines only: JSON strings may hold other line separators (U+2028) unescaped
        for n, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                numbered.append((f"{source} line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{source} line {n}: not valid JSON ({e.msg}, column {e.colno}); fix that line "
                                 f"(one JSON object per line)") from None
    for where, row in numbered:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: is a JSON {type(row).__name__}, not an object of the row's fields; give "
                             f"one object per row")
    return [row for _, row in numbered]


def _parquet_rows(path: Path, source: str) -> list[dict]:
    import datasets  # here, not at the top: seconds of start-up that config errors and json files do without

    try:
        return datasets.load_dataset("parquet", data_files=str(path), split="train").to_list()
    except Exception as e:
        raise ValueError(f"{source}: could not be read as parquet ({type(e).__name__}: {e}); write it again as a "
                         f"parquet table with one row per example") from e


def _dataset_rows(path: Path, source: str, split: str, subset: str | None) -> list[dict]:
    import datasets  # as in _parquet_rows

    try:
        return datasets.load_dataset(str(path) if path.is_dir() else source, subset, split=split).to_list()
    except Exception as e:
        which = f"split '{split}'" + (f" of subset '{subset}'" if subset else "")
        raise ValueError(f"{source}: not a local file, and loading it as a Hugging Face hub dataset ({which}) "
                         f"failed ({type(e).__name__}: {e}); give a local .json, .jsonl or .parquet file, or "
                         f"run where the hub is reachable") from e


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
    path, text = Path(path), _jsonl(records)
    if only_if_changed and path.is_file() and path.read_text() == text:
        return False
    _write_atomically(path, text)
    return True


def foreign_file(path: str | os.PathLike, records: list[dict]) -> str | None:
    """Why the generated `records` may not be written to `path`, or None: they may where nothing
    is, over a file rlkit generated (its marker holds the file's SHA-256), or over a file that
    already holds exactly these records (as rlkit wrote them before it marked its files)."""
    path = Path(path)
    if not path.exists():
        return None
    if not path.is_file():
        return f"{path} exists and is not a file"
    content = path.read_bytes()
    marker = _marker(path)
    if (marker and marker.get("sha256") == hashlib.sha256(content).hexdigest()) or content == _jsonl(records).encode():
        return None
    if marker is None:
        return f"{path} exists and rlkit did not generate it (no {path.name}{GENERATED_MARKER} beside it)"
    return f"{path} was changed since rlkit generated it"


def write_generated(path: str | os.PathLike, records: list[dict], origin: dict) -> bool:
    """Write a generated set to `path` (atomically; only when its records change) and its marker
    beside it: that rlkit generated it, from what (`origin`, e.g. the data.synthetic config) and the
    file's SHA-256. Raises FileExistsError instead of writing over a file rlkit did not write
    (foreign_file). Returns whether the set was written."""
    problem = foreign_file(path, records)
    if problem:
        raise FileExistsError(problem)
    wrote = write_jsonl(path, records, only_if_changed=True)
    marker = {"generated_by": "rlkit", **origin, "sha256": hashlib.sha256(_jsonl(records).encode()).hexdigest()}
    if _marker(Path(path)) != marker:  # the data first: a kill in between leaves a file foreign_file accepts
        _write_atomically(_marker_path(Path(path)), json.dumps(marker, indent=1) + "\n")
    return wrote


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + GENERATED_MARKER)


def _marker(path: Path) -> dict | None:
    try:
        marker = json.loads(_marker_path(path).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
