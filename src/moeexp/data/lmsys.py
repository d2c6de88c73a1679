"""LMSYS-Chat-1M conversations: from local parquet/jsonl files or the (gated) hub dataset.

Schema (one row per conversation, as published on the hub)::

    conversation_id: str, model: str, turn: int, language: str, redacted: bool,
    conversation: list[{"role": "user"|"assistant", "content": str}],
    openai_moderation: list[{...}]

Only ``conversation`` is required here (``language`` too when filtering by language). Every
source is turned into one :class:`pyarrow.Table`, read lazily row by row, so the 1M-row
hub dataset (memory-mapped Arrow) is never converted to Python objects as a whole.

Two ways to get the data, and :class:`DataError` naming both when neither works:

1. ``dataset.path=/file.parquet|.jsonl`` or a directory holding such files (the hub's
   ``data/train-*.parquet`` shards, downloaded once);
2. the hub: ``datasets.load_dataset("lmsys/lmsys-chat-1m")``. The dataset is gated: accept its
   terms on the hub page and log in (``hf auth login`` or ``HF_TOKEN``), with network access
   (unset ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE``) or with the dataset already cached.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moeexp.errors import DataError

log = logging.getLogger(__name__)

HUB_ID = "lmsys/lmsys-chat-1m"
_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
_COLUMNS = ("conversation", "language")

HOW_TO_GET = (
    "Either pass local files: dataset.path=/path/to/lmsys (a .parquet or .jsonl file, or a "
    "directory of them, e.g. the hub's data/train-*.parquet shards), or load it from the hub: "
    f"'{HUB_ID}' is gated, so accept its terms at https://huggingface.co/datasets/{HUB_ID}, "
    "log in (`hf auth login` or HF_TOKEN) and run with network access "
    "(HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0) or with the dataset already in the HF cache."
)


#: What one jsonl line looks like, for error messages.
LINE_SHAPE = ("one conversation object per line, {\"conversation\": [{\"role\": \"user\", "
              "\"content\": str}, ...], \"language\": str, ...}")


def _jsonl_row(path: Path, lineno: int, raw: bytes) -> dict[str, Any] | None:
    """The columns of one jsonl line (None for a blank line); DataError naming the line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}:{lineno}: byte {exc.start} of the line is not UTF-8 "
                        f"({exc.reason}); expected UTF-8 JSON lines, {LINE_SHAPE}") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{lineno} is not valid JSON ({exc.msg}); LMSYS jsonl "
                        f"files hold {LINE_SHAPE}") from exc
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{lineno} is a JSON {type(obj).__name__}, not an object; "
                        f"LMSYS jsonl files hold {LINE_SHAPE}")
    conv = obj.get("conversation")
    if conv is not None and not (isinstance(conv, list)
                                 and all(isinstance(t, dict) for t in conv)):
        what = ("a " + type(conv).__name__ if not isinstance(conv, list) else
                "a list with a " + next(type(t).__name__ for t in conv if not isinstance(t, dict)))
        raise DataError(f"{path}:{lineno}: 'conversation' is {what}, not a list of turn objects; "
                        f"LMSYS jsonl files hold {LINE_SHAPE}")
    return {k: obj.get(k) for k in _COLUMNS}


def _read_jsonl(path: Path) -> pa.Table:
    rows: list[dict[str, Any]] = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            row = _jsonl_row(path, lineno, raw)
            if row is not None:
                rows.append(row)
    return pa.Table.from_pylist(rows)


def _read_file(path: Path) -> pa.Table:
    try:
        if path.suffix == ".parquet":
            schema = pq.read_schema(path)
            return pq.read_table(path, columns=[c for c in _COLUMNS if c in schema.names])
        return _read_jsonl(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"cannot read LMSYS file {path}: {exc}") from exc


def _from_path(path: str | Path) -> pa.Table:
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"dataset.path={str(path)!r} does not exist. {HOW_TO_GET}")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _FILE_SUFFIXES)
        if not files:
            raise DataError(f"dataset.path={str(path)!r} is a directory without .parquet/.jsonl "
                            f"files. {HOW_TO_GET}")
    elif p.suffix in _FILE_SUFFIXES:
        files = [p]
    else:
        raise DataError(f"dataset.path={str(path)!r}: unsupported file type {p.suffix!r}; valid: "
                        f"{', '.join(_FILE_SUFFIXES)} (or a directory of such files)")
    tables = [_read_file(f) for f in files]
    for f, t in zip(files, tables, strict=True):
        if "conversation" not in t.column_names:
            raise DataError(f"{f} has no 'conversation' column (columns: {t.column_names}); "
                            "expected the LMSYS-Chat-1M schema")
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as exc:
        raise DataError(f"LMSYS files under {p} have incompatible schemas: {exc}") from exc
    log.info("LMSYS-Chat-1M from %s: %d conversations in %d file(s)", p, table.num_rows, len(files))
    return table


def _from_hub() -> pa.Table:
    try:
        import datasets

        ds = datasets.load_dataset(HUB_ID, split="train")
    except Exception as exc:  # noqa: BLE001 - offline, gated, missing token: all end the same
        raise DataError(f"LMSYS-Chat-1M is not available from the hub ({type(exc).__name__}: "
                        f"{exc}) and dataset.path is not set. {HOW_TO_GET}") from exc
    table = ds.data.table
    keep = [c for c in _COLUMNS if c in table.column_names]
    log.info("LMSYS-Chat-1M from the hub: %d conversations", table.num_rows)
    return table.select(keep)


def load_lmsys(path: str | Path | None = None) -> pa.Table:
    """The conversations as a table with column ``conversation`` (and ``language``).

    Args:
        path: a parquet/jsonl file or a directory of them; None loads ``lmsys/lmsys-chat-1m``
            from the hub (gated).

    Raises:
        DataError: the path does not exist / has no usable files, or (path None) the hub
            dataset cannot be loaded; the message names both ways to provide the data.
    """
    return _from_path(path) if path is not None else _from_hub()


def first_pair(conversation: Any) -> tuple[str, str] | None:
    """(first user turn, first assistant reply) if the conversation opens with such a pair."""
    if not isinstance(conversation, (list, tuple)) or len(conversation) < 2:
        return None
    u, a = conversation[0], conversation[1]
    if not (isinstance(u, dict) and isinstance(a, dict)):
        return None
    if u.get("role") != "user" or a.get("role") != "assistant":
        return None
    text, reply = u.get("content"), a.get("content")
    if not isinstance(text, str) or not text.strip():
        return None
    return text, reply if isinstance(reply, str) else ""


def row_pair(table: pa.Table, index: int) -> tuple[str, str] | None:
    """:func:`first_pair` of row ``index`` of a table from :func:`load_lmsys`."""
    return first_pair(table.column("conversation")[index].as_py())
