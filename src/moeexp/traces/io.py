"""Reading and writing traces: the only code that touches trace files.

``save(trace, path)`` writes ``path.npz`` (arrays, ``allow_pickle=False``) and
``path.json`` (sidecar) atomically, sidecar last, so a trace counts as present only when
both exist. ``load(path)`` validates the schema version, dims and array shapes and raises
:class:`TraceError` on anything unexpected; it never returns a half-valid trace.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from moeexp.atomic import write_json, write_with
from moeexp.errors import TraceError
from moeexp.traces.schema import SCHEMA_VERSION, RequestMeta, Trace, TraceDims

_REQUIRED = ("iter_request", "iter_step", "iter_offsets", "probs", "topk_idx",
             "topk_weight", "embed", "token_ids")
_OPTIONAL = ("spec_probs", "hidden", "prompt_embed")


def paths(path: str | Path) -> tuple[Path, Path]:
    """(npz, json) paths of the trace stem ``path`` (an extension is ignored)."""
    p = Path(path)
    if p.suffix in (".npz", ".json"):
        p = p.with_suffix("")
    return p.with_suffix(".npz"), p.with_suffix(".json")


def exists(path: str | Path) -> bool:
    """True when both files of the trace exist (the sidecar is written last)."""
    npz, side = paths(path)
    return npz.exists() and side.exists()


def save(trace: Trace, path: str | Path) -> Path:
    """Validate and write ``trace`` atomically; returns the npz path."""
    trace.validate()
    npz, side = paths(path)
    arrays: dict[str, np.ndarray] = {k: getattr(trace, k) for k in _REQUIRED}
    for k in _OPTIONAL:
        a = getattr(trace, k)
        if a is not None:
            arrays[k] = a
    write_with(npz, lambda fh: np.savez(fh, **arrays))  # type: ignore[arg-type]
    write_json(side, trace.sidecar())
    return npz


def read_sidecar(path: str | Path) -> dict[str, Any]:
    """The sidecar dict; TraceError if missing, unparsable or of another schema version."""
    _, side = paths(path)
    if not side.exists():
        raise TraceError(f"trace sidecar {side} does not exist")
    try:
        meta = json.loads(side.read_text())
    except json.JSONDecodeError as exc:
        raise TraceError(f"trace sidecar {side} is corrupt: {exc}") from exc
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TraceError(
            f"trace {side} has schema version {version!r}; this moeexp reads version "
            f"{SCHEMA_VERSION}. Delete it (it will be re-recorded) or record it again."
        )
    return dict(meta)


def load(path: str | Path) -> Trace:
    """Load and validate a trace written by :func:`save`."""
    npz, _ = paths(path)
    meta = read_sidecar(path)
    if not npz.exists():
        raise TraceError(f"trace arrays {npz} do not exist (sidecar without arrays)")
    try:
        with np.load(npz, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise TraceError(f"trace arrays {npz} are corrupt: {exc}") from exc
    missing = [k for k in _REQUIRED if k not in arrays]
    if missing:
        raise TraceError(f"trace {npz} lacks arrays {missing}")
    fields: dict[str, Any] = {k: arrays[k] for k in _REQUIRED}
    fields.update({k: arrays.get(k) for k in _OPTIONAL})
    try:
        trace = Trace(
            dims=TraceDims(**meta["dims"]),
            requests=[RequestMeta(**r) for r in meta["requests"]],
            meta=meta.get("meta", {}),
            **fields,
        )
    except (KeyError, TypeError) as exc:
        raise TraceError(f"trace sidecar of {npz} does not match the schema: {exc}") from exc
    trace.validate()
    return trace
