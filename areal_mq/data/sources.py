"""Where records come from: JSONL files, Parquet files and Hugging Face `datasets` directories, one iterator.

What: `read_source(name)` yields `(key, where, record)` for every record of a source, whatever it is stored in:
    data.jsonl                 one JSON object per line          where = "data.jsonl:12" (line)
    data.parquet               a Parquet table, a row a record   where = "data.parquet row 12"
    saved/                     `Dataset.save_to_disk("saved")`   where = "saved row 12"
    saved:test                 one split of `DatasetDict.save_to_disk("saved")`
`key` is the line or row number (1-based) that ids default to. Every bad source fails with the file, the row and
what to fix (DataFormatError), never a skipped record.
Why: users keep their data as Parquet or as `datasets` directories as often as JSONL; the field mapping
(prompt_template, answer_field, id_field, level_field) and the checks in loaders.py are the same for all three,
so they read records from here and never care about the format.
Parquet needs `pyarrow`, a `datasets` directory the `datasets` library: `pip install 'areal-mq[datasets]'`.
Nothing is downloaded: a name that is not a local file or directory is an error.
`source_labels(names)` gives each source a short unique label (ids in a mix, evaluation's by_source).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from areal_mq.errors import ConfigError


class DataFormatError(ConfigError):
    """A dataset file is missing, unreadable, or has a bad record. The message names file, line and fix."""


SOURCE_FORMS = "a .jsonl file, a .parquet file, or a `datasets` directory saved with save_to_disk (DIR or DIR:split)"


def locate(name: str | Path) -> tuple[Path, str | None]:
    """(path, split) a source name stands for: the file or directory itself, or DIR and the split of DIR:split
    (a saved DatasetDict). Nothing is read; the path need not exist."""
    text = str(name)
    path = Path(text)
    if not path.exists() and ":" in text:
        head, _, tail = text.rpartition(":")
        if Path(head).is_dir():
            return Path(head), tail
    return path, None


def read_source(name: str | Path) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """Yield (1-based line/row, where, record) of a JSONL file, a Parquet file or a saved `datasets` directory."""
    text = str(name)
    path, split = locate(text)
    if path.is_dir():
        yield from _read_saved_dataset(path, split)
    elif path.is_file() and path.suffix.lower() in (".parquet", ".pq"):
        yield from _read_parquet(path)
    elif path.is_file():
        for lineno, obj in read_jsonl(path):
            yield lineno, f"{path}:{lineno}", obj
    else:
        raise DataFormatError(f"dataset {text} does not exist; pass {SOURCE_FORMS}, or 'arith'")


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) for each non-blank line; DataFormatError on unreadable file or bad JSON."""
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"dataset file {path} does not exist; pass an existing .jsonl file or 'arith'")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                                      "each line must be one JSON object") from None
            if not isinstance(obj, dict):
                raise DataFormatError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _read_parquet(path: Path) -> Iterator[tuple[int, str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataFormatError(f"{path} is a Parquet file: reading it needs pyarrow "
                              "(pip install 'areal-mq[datasets]')") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise DataFormatError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e}); "
                              "write it with pandas.DataFrame.to_parquet or pyarrow.parquet.write_table") from None
    yield from _rows(table.to_pylist(), str(path))


def _read_saved_dataset(path: Path, split: str | None) -> Iterator[tuple[int, str, dict[str, Any]]]:
    if not ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
            or (path / "state.json").is_file()):
        raise DataFormatError(f"{path} is a directory but not a `datasets` directory (no dataset_info.json or "
                              "dataset_dict.json); save one with Dataset.save_to_disk, or pass a .jsonl/.parquet file")
    try:
        import datasets
    except ImportError:
        raise DataFormatError(f"{path} is a `datasets` directory: reading it needs the datasets library "
                              "(pip install 'areal-mq[datasets]')") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataFormatError(f"{path}: datasets.load_from_disk failed ({type(e).__name__}: {e})") from None
    where = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            raise DataFormatError(f"{path} holds the splits {sorted(loaded)}; name one as {path}:SPLIT "
                                  f"(e.g. {path}:{sorted(loaded)[0]})")
        if split not in loaded:
            raise DataFormatError(f"{path} has no split {split!r}; it has {sorted(loaded)}")
        loaded, where = loaded[split], f"{path}:{split}"
    elif split is not None:
        raise DataFormatError(f"{path} is a single Dataset with no splits; drop ':{split}'")
    yield from _rows(loaded, where)


def _rows(rows: Any, where: str) -> Iterator[tuple[int, str, dict[str, Any]]]:
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataFormatError(f"{where} row {i}: expected a record with named fields, got {type(row).__name__}")
        # a table has one schema for all rows: a field a row lacks is null there, so null reads as missing
        yield i, f"{where} row {i}", {k: v for k, v in row.items() if v is not None}


def source_labels(names: list[str]) -> list[str]:
    """Short unique labels of source names: the file stem, with as many parent folders as it takes to tell
    them apart. ["/data/math/train.jsonl", "/data/gsm8k/train.parquet"] -> ["math/train", "gsm8k/train"]."""
    parts = [_label_parts(n) for n in names]
    depth = [1] * len(names)
    while True:
        labels = ["/".join(reversed(p[:d])) for p, d in zip(parts, depth)]
        clashing = [i for i, label in enumerate(labels) if labels.count(label) > 1 and depth[i] < len(parts[i])]
        if not clashing:
            break
        for i in clashing:
            depth[i] += 1
    labels = [label if labels.count(label) == 1 else name for label, name in zip(labels, names)]
    return [label if labels[:i].count(label) == 0 else f"{label}-{labels[:i].count(label) + 1}"
            for i, label in enumerate(labels)]


def _label_parts(name: str) -> list[str]:
    """The stem then its parent folders, innermost first: "/data/math/train.jsonl" -> ["train", "math", "data"]."""
    path = Path(name)
    return [path.stem, *(part for part in reversed(path.parent.parts) if part not in ("/", ".", ""))]
