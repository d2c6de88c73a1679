"""External routing traces: the interchange format, its checks, and the routing-only Trace.

**The format** (``moeexp-routing`` version 1): a directory of three plain files::

    format.json     {"format": "moeexp-routing", "version": 1,
                     "model": "gpt_oss_20b",              conf/model preset for the cost dims
                     "num_layers": L, "num_experts": J, "top_k": K,
                     "source": {...},                     where it came from: repository,
                                                          commit, licence, url, notes
                     "content_hash": "<sha256>"}          written by write(), checked by read()
    routing.npz     experts   int[T, L, K]    experts each routed token selected per MoE layer
                    weights   float[T, L, K]  their routing weights (each row sums to 1)
                    offsets   int64[R + 1]    request r owns rows offsets[r]:offsets[r+1]
                    positions int[T]          optional: each row's token position (strictly
                                              increasing within a request)
                    probs     float[T, L, J]  optional: full router probabilities
    requests.jsonl  one JSON object per request, in order; every key optional:
                    prompt (text), dataset, task, prefill_tokens (rows of the request that
                    are its prompt: one prefill iteration; default 0 = decode rows only),
                    prompt_tokens (prompt length in tokens), has_repetition, any other.

Rows of a request are its tokens in generation order: the first ``prefill_tokens`` rows
form one prefill iteration (step 0), each later row is one decode step. A row's decode
step s feeds token s, as the recorder's traces do; ``output_len`` is the number of decode
rows + 1 (the first output token comes from the prefill).

:func:`check` refuses a bad or inconsistent file with a :class:`TraceError` that names the
request and the row: ids out of range or repeated within a row, weights negative or not
summing to 1 (within 1e-2: bf16 weights stored in float16), ragged layers, positions that
repeat (a duplicated step). :func:`to_trace` turns a checked :class:`ExternalRouting` into a
routing-only :class:`~moeexp.traces.schema.Trace` (no embeddings, no token ids; no prefill
unless given). The importers of other layouts are in :mod:`moeexp.traces.importers`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeexp.atomic import write_json, write_text, write_with
from moeexp.errors import TraceError
from moeexp.traces.schema import RequestMeta, Split, Trace, TraceDims

FORMAT = "moeexp-routing"
VERSION = 1
#: |sum of a row's weights - 1| allowed (bf16 weights, stored as float16).
WEIGHT_SUM_TOL = 1e-2
_INFO_KEYS = ("num_layers", "num_experts", "top_k")


@dataclass
class ExternalRouting:
    """One external routing trace in memory (see the module docstring for each field).

    Attributes:
        info: format.json's content (``model``, L/J/K, ``source``, ...).
        experts: int16[T, L, K]; weights: float16[T, L, K]; offsets: int64[R + 1].
        requests: one dict per request.
        positions: int32[T] or None; probs: float16[T, L, J] or None.
    """

    info: dict[str, Any]
    experts: np.ndarray
    weights: np.ndarray
    offsets: np.ndarray
    requests: list[dict[str, Any]]
    positions: np.ndarray | None = None
    probs: np.ndarray | None = None
    _hash: str | None = field(default=None, repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def rows(self, r: int) -> slice:
        """Rows of request ``r``."""
        return slice(int(self.offsets[r]), int(self.offsets[r + 1]))

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays of routing.npz, in their stored dtypes."""
        out = {"experts": self.experts, "weights": self.weights, "offsets": self.offsets}
        if self.positions is not None:
            out["positions"] = self.positions
        if self.probs is not None:
            out["probs"] = self.probs
        return out

    def content_hash(self) -> str:
        """sha256 (hex) of the arrays, the requests and the format info (its source too)."""
        if self._hash is None:
            h = hashlib.sha256()
            for name, a in sorted(self.arrays().items()):
                a = np.ascontiguousarray(a)
                h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
                h.update(a.view(np.uint8).reshape(-1).data if a.size else b"")
            info = {k: v for k, v in self.info.items()
                    if k not in ("content_hash", "format", "version")}
            h.update(json.dumps([info, self.requests], sort_keys=True).encode())
            self._hash = h.hexdigest()
        return self._hash

    def select(self, indices: list[int]) -> ExternalRouting:
        """The requests ``indices`` (in that order), rows copied."""
        rows = [np.arange(self.offsets[i], self.offsets[i + 1]) for i in indices]
        take = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        lens = np.diff(self.offsets)[indices] if indices else np.zeros(0, dtype=np.int64)
        info = {k: v for k, v in self.info.items() if k != "content_hash"}
        return ExternalRouting(
            info=info, experts=self.experts[take], weights=self.weights[take],
            offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            requests=[dict(self.requests[i]) for i in indices],
            positions=None if self.positions is None else self.positions[take],
            probs=None if self.probs is None else self.probs[take])


# ----------------------------------------------------------------------------- checks
def check(ext: ExternalRouting, where: str = "routing trace") -> None:
    """Raise TraceError naming the request and row of the first inconsistency."""
    info = ext.info
    missing = [k for k in _INFO_KEYS if not isinstance(info.get(k), int) or info[k] < 1]
    if missing:
        raise TraceError(f"{where}: format info lacks positive integer(s) {missing}")
    L, J, K = (int(info[k]) for k in _INFO_KEYS)
    off = ext.offsets
    T = ext.experts.shape[0] if ext.experts.ndim else 0
    if off.ndim != 1 or len(off) != ext.num_requests + 1 or off[0] != 0 or off[-1] != T \
            or np.any(np.diff(off) < 1):
        raise TraceError(f"{where}: offsets must be R + 1 = {ext.num_requests + 1} increasing "
                         f"row indices from 0 to {T} with at least one row per request")
    for name, a in (("experts", ext.experts), ("weights", ext.weights)):
        if a.shape != (T, L, K):
            raise TraceError(f"{where}: {name} has shape {a.shape}, expected [T, L, K] = "
                             f"{(T, L, K)} (ragged or missing layers?)")
    _check_rows(ext, where, J)
    if ext.probs is not None and ext.probs.shape != (T, L, J):
        raise TraceError(f"{where}: probs has shape {ext.probs.shape}, expected {(T, L, J)}")
    if ext.positions is not None:
        pos = ext.positions.astype(np.int64)
        for r in range(ext.num_requests):
            p = pos[ext.rows(r)]
            bad = np.flatnonzero(np.diff(p) <= 0)
            if len(bad):
                raise TraceError(f"{where}: request {r}: position {int(p[bad[0] + 1])} follows "
                                 f"{int(p[bad[0]])} (row {int(ext.offsets[r]) + bad[0] + 1}): "
                                 "a duplicated or reordered step")


def _check_rows(ext: ExternalRouting, where: str, J: int) -> None:
    """Ids in range and distinct within a row; weights finite, >= 0, summing to 1."""
    e = ext.experts.astype(np.int64)
    w = ext.weights.astype(np.float64)
    problems = [
        ((e < 0) | (e >= J)).any(axis=2), "an expert id outside [0, J) = [0, {J})",
        (np.sort(e, axis=2)[..., 1:] == np.sort(e, axis=2)[..., :-1]).any(axis=2),
        "the same expert twice",
        ~np.isfinite(w).all(axis=2) | (w < 0).any(axis=2), "a negative or non-finite weight",
        np.abs(w.sum(axis=2) - 1.0) > WEIGHT_SUM_TOL,
        f"weights that do not sum to 1 (tolerance {WEIGHT_SUM_TOL})",
    ]
    for bad, what in zip(problems[::2], problems[1::2], strict=True):
        hits = np.argwhere(bad)
        if len(hits):
            row, layer = (int(x) for x in hits[0])
            r = int(np.searchsorted(ext.offsets, row, side="right") - 1)
            raise TraceError(f"{where}: request {r}, token {row - int(ext.offsets[r])} (row "
                             f"{row}), layer {layer}: {what.format(J=J)}: experts "
                             f"{ext.experts[row, layer].tolist()}, weights "
                             f"{ext.weights[row, layer].astype(float).round(4).tolist()}")


# ----------------------------------------------------------------------------- files
def read(path: str | Path) -> ExternalRouting:
    """Read and :func:`check` an interchange directory; a stored content hash must match."""
    d = Path(path)
    fmt, npz, req = d / "format.json", d / "routing.npz", d / "requests.jsonl"
    for f in (fmt, npz, req):
        if not f.is_file():
            raise TraceError(f"{d} is not a {FORMAT} directory: {f.name} is missing (expected "
                             "format.json, routing.npz, requests.jsonl)")
    info = _json(fmt)
    if info.get("format") != FORMAT or info.get("version") != VERSION:
        raise TraceError(f"{fmt}: format {info.get('format')!r} version {info.get('version')!r};"
                         f" this moeexp reads {FORMAT!r} version {VERSION}")
    with np.load(npz, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    for k in ("experts", "weights", "offsets"):
        if k not in arrays:
            raise TraceError(f"{npz}: array {k!r} is missing")
    requests = []
    for i, line in enumerate(req.read_text(encoding="utf-8").splitlines()):
        obj = json.loads(line) if line.strip() else None
        if not isinstance(obj, dict):
            raise TraceError(f"{req}: line {i + 1} is not a JSON object")
        requests.append(obj)
    ext = ExternalRouting(info=info, experts=arrays["experts"].astype(np.int16),
                          weights=arrays["weights"].astype(np.float16),
                          offsets=arrays["offsets"].astype(np.int64), requests=requests,
                          positions=arrays.get("positions"), probs=arrays.get("probs"))
    check(ext, str(d))
    stored = info.get("content_hash")
    if stored is not None and stored != ext.content_hash():
        raise TraceError(f"{d}: content hash {ext.content_hash()} != the {stored} in "
                         "format.json: a file was changed or mixed up after it was written")
    return ext


def _json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise TraceError(f"{path}: expected a JSON object")
    return obj


def write(ext: ExternalRouting, path: str | Path) -> Path:
    """Check and write ``ext`` as an interchange directory (atomically, format.json last)."""
    check(ext)
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    info = {"format": FORMAT, "version": VERSION,
            **{k: v for k, v in ext.info.items() if k not in ("format", "version")},
            "content_hash": ext.content_hash()}
    write_with(d / "routing.npz",
               lambda fh: np.savez_compressed(fh, **ext.arrays()))  # type: ignore[arg-type]
    write_text(d / "requests.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n"
                                             for r in ext.requests))
    write_json(d / "format.json", info)
    return d


# ----------------------------------------------------------------------------- to a Trace
def split_labels(n: int, store_fraction: float, seed: int) -> list[Split]:
    """FineMoE's store/test split by request: a seeded permutation, the first
    ``round(store_fraction * n)`` requests of it are the store (disjoint, complete)."""
    order = np.random.default_rng(seed).permutation(n)
    n_store = int(round(store_fraction * n))
    labels: list[Split] = ["test"] * n
    for i in order[:n_store]:
        labels[int(i)] = "store"
    return labels


def to_trace(ext: ExternalRouting, dims: TraceDims, splits: list[Split]) -> Trace:
    """The routing-only Trace of ``ext`` on a model of ``dims`` (L, J, K must match).

    Each request's prefill rows (``prefill_tokens``) form iteration 0, each later row one
    decode iteration; request ids are the indices into ``ext.requests``.
    """
    L, J, K = (int(ext.info[k]) for k in _INFO_KEYS)
    if (dims.num_layers, dims.num_experts, dims.top_k) != (L, J, K):
        raise TraceError(f"routing trace of {ext.info.get('model')!r} has L={L}, J={J}, K={K}; "
                         f"the cost model's dims have L={dims.num_layers}, "
                         f"J={dims.num_experts}, K={dims.top_k}")
    it_req, it_step, lens, metas = [], [], [], []
    for r, req in enumerate(ext.requests):
        n = int(ext.offsets[r + 1] - ext.offsets[r])
        pre = int(req.get("prefill_tokens", 0) or 0)
        if not 0 <= pre < n:
            raise TraceError(f"request {r}: prefill_tokens={pre} must be in [0, {n}) (its rows)")
        steps = ([0] if pre else []) + list(range(1, n - pre + 1))
        it_req += [r] * len(steps)
        it_step += steps
        lens += ([pre] if pre else []) + [1] * (n - pre)
        metas.append(RequestMeta(
            request_id=r, prompt=str(req.get("prompt", "") or ""),
            prompt_len=int(req.get("prompt_tokens", pre) or pre), output_len=n - pre + 1,
            split=splits[r], dataset=str(req.get("dataset", "") or ""),
            task=str(req.get("task", req.get("category", "")) or "")))
    trace = Trace(
        dims=dims, requests=metas, iter_request=np.asarray(it_req, dtype=np.int32),
        iter_step=np.asarray(it_step, dtype=np.int32),
        iter_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        probs=ext.probs, topk_idx=ext.experts.astype(np.int16),
        topk_weight=ext.weights.astype(np.float16), embed=None, token_ids=None,
        meta={"source": {**dict(ext.info.get("source") or {}),
                         "model": ext.info.get("model")},
              "content_hash": ext.content_hash(), "routing_source": "imported"})
    trace.validate()
    return trace
