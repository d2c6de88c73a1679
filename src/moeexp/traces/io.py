"""Reading and writing traces: the only code that touches trace files.

``save(trace, path)`` writes ``path.npz`` (arrays, ``allow_pickle=False``) and
``path.json`` (sidecar) atomically, sidecar last, so a trace counts as present only when
both exist. ``load(path)`` validates the schema version, dims and array shapes and raises
:class:`TraceError` on anything unexpected; it never returns a half-valid trace.

The two files are bound to each other: the sidecar holds ``digests.arrays`` (sha256 of
every array's name, dtype, shape and bytes) and ``digests.sidecar`` (sha256 of its own
dims, requests and meta). :func:`load` recomputes both, so an ``.npz`` swapped for another
trace's, or a sidecar whose requests or split labels were edited, is refused (and the
trace store re-records it) instead of being used silently.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from moeexp.atomic import write_json, write_with
from moeexp.errors import TraceError
from moeexp.traces.schema import SCHEMA_VERSION, RequestMeta, Trace, TraceDims

_REQUIRED = ("iter_request", "iter_step", "iter_offsets", "topk_idx", "topk_weight")
_OPTIONAL = ("probs", "embed", "token_ids", "spec_probs", "hidden", "prompt_embed")


def array_digest(arrays: dict[str, np.ndarray]) -> str:
    """sha256 (hex) of every array's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.view(np.uint8).reshape(-1).data if a.size else b"")
    return h.hexdigest()


def sidecar_digest(side: dict[str, Any]) -> str:
    """sha256 (hex) of a sidecar's semantic content: dims, requests, meta."""
    blob = json.dumps({k: side.get(k) for k in ("dims", "requests", "meta")}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


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
    sidecar = json.loads(json.dumps(trace.sidecar(), default=str))  # as it will be read
    sidecar["digests"] = {"arrays": array_digest(arrays), "sidecar": sidecar_digest(sidecar)}
    write_with(npz, lambda fh: np.savez(fh, **arrays))  # type: ignore[arg-type]
    write_json(side, sidecar)
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
    _check_digests(npz, meta, arrays)
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


def _check_digests(npz: Path, side: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """TraceError unless the arrays and the sidecar are the ones written together."""
    digests = side.get("digests") or {}
    if digests.get("sidecar") != sidecar_digest(side):
        raise TraceError(f"trace sidecar {npz.with_suffix('.json')} was modified after it was "
                         "written (its dims, requests or meta do not match its digest)")
    if digests.get("arrays") != array_digest(arrays):
        raise TraceError(f"trace arrays {npz} are not the ones its sidecar was written with "
                         "(digest mismatch: a file replaced, mixed up or partly copied)")
