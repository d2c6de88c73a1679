"""Trace cache: record a trace once per content hash, reuse it afterwards.

``get_or_record(loaded, prompts, trace_cfg)`` stores traces as ``<cache_dir>/<hash>.npz`` +
``<hash>.json``. The sha256 content hash covers everything that determines a trace:

- the model weights (:func:`weights_hash`: every tensor's name, dtype, shape and bytes,
  sampled for models over 8 GiB; computed once per model object), its class and config
  (without the path it was loaded from, :func:`config_identity`);
- the tokenizer (:func:`tokenizer_hash`: vocabulary and special tokens);
- the prompts: id, token ids, prompt/output length, split, dataset, task, text;
- the recording settings: sampling (top_k/temperature only when sampling), spec_depth,
  record_hidden, prompt_embedder, seed;
- :data:`~moeexp.traces.schema.SCHEMA_VERSION` and the recorder's version.

A cached file is used only when it loads and validates (:func:`moeexp.traces.io.load`) and
its ``meta["content_hash"]`` equals the hash; a corrupt, old-schema or mismatching file is
reported with a warning and re-recorded, never silently used. Writes are atomic
(:func:`moeexp.traces.io.save`), and an exclusive ``fcntl.flock`` on ``<hash>.lock`` is held
while checking and recording, so two jobs wanting the same trace never both record it: the
second waits and then reuses the first's file. (flock is advisory and per host; on network
file systems without flock support the lock degrades to what the FS offers.)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeexp.data.prompts import tokenizer_hash
from moeexp.errors import ConfigError, TraceError
from moeexp.traces import io
from moeexp.traces.schema import SCHEMA_VERSION, Trace

if TYPE_CHECKING:
    from moeexp.data.prompts import Prompt
    from moeexp.traces.recorder import LoadedLike

log = logging.getLogger(__name__)

#: Keys of the ``trace`` config block and their defaults.
TRACE_DEFAULTS: dict[str, Any] = {
    "sampling": "top_k", "top_k": 50, "temperature": 1.0, "spec_depth": 4,
    "record_hidden": False, "seed": 0, "cache_dir": None, "prompt_embedder": "minilm",
    "progress": True, "source": "record", "request_filter": "non_repetitive",
    "task_label": "family",
}
_WEIGHT_HASHES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_CHUNK = 1 << 24  # bytes hashed per update (16 MiB)


#: Models with more parameter bytes than this are hashed by sampling (see weights_hash).
FULL_HASH_MAX_BYTES = 8 << 30
_SAMPLE = 1 << 16  # elements sampled per tensor in sampled mode


def _checkpoint_identity(model: Any) -> str:
    """Names, sizes and safetensors headers of a local checkpoint dir (or its hub id)."""
    src = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    d = Path(src)
    if not d.is_dir():
        return f"id:{src}"
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")):
        size = f.stat().st_size
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = fh.read(min(n, 1 << 26))
        h.update(f"{f.name}|{size}|".encode() + header)
    return f"dir:{h.hexdigest()}"


#: Config keys that say where a model was loaded from, not what it is.
_LOCATION_KEYS = frozenset({"_name_or_path", "_commit_hash", "transformers_version"})


def config_identity(config: Any) -> str:
    """The model config as sorted JSON, without where it was loaded from (``_name_or_path``):
    two checkouts of one project, or a model moved on disk, name the same trace."""
    if config is None or not hasattr(config, "to_dict"):
        return ""
    data = {k: v for k, v in config.to_dict().items() if k not in _LOCATION_KEYS}
    return json.dumps(data, sort_keys=True, default=str)


def weights_hash(model: Any) -> str:
    """sha256 (hex) identifying the model's weights; cached per model object.

    Full mode (models up to :data:`FULL_HASH_MAX_BYTES`, e.g. every tiny model): every
    state-dict tensor's name, dtype, shape and raw bytes, plus class and config (~1 GB/s).
    Sampled mode (bigger models, or tensors offloaded to the meta device): names, dtypes,
    shapes, an evenly strided sample of up to 65,536 elements of every materialised tensor,
    and the checkpoint's safetensors headers and sizes; any fine-tune changes the samples
    with overwhelming probability. Modifying weights in place after the first call is not
    detected (the hash is cached on the model object).
    """
    cached = _WEIGHT_HASHES.get(model)
    if cached is not None:
        return cached
    import torch

    state = sorted(model.state_dict(keep_vars=False).items())
    total = sum(t.numel() * t.element_size() for _, t in state)
    sampled = total > FULL_HASH_MAX_BYTES or any(t.device.type == "meta" for _, t in state)
    h = hashlib.sha256()
    h.update(type(model).__name__.encode())
    h.update(config_identity(getattr(model, "config", None)).encode())
    if sampled:
        h.update(_checkpoint_identity(model).encode())
    for name, t in state:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        if t.device.type == "meta":
            continue
        flat = t.detach().reshape(-1)
        if sampled and flat.numel() > _SAMPLE:
            flat = flat[:: flat.numel() // _SAMPLE]
        flat = flat.contiguous().view(torch.uint8)
        for i in range(0, flat.numel(), _CHUNK):
            h.update(flat[i:i + _CHUNK].cpu().numpy().tobytes())
    digest = ("s:" if sampled else "") + h.hexdigest()
    _WEIGHT_HASHES[model] = digest
    return digest


def _settings(trace_cfg: Mapping[str, Any]) -> dict[str, Any]:
    cfg = {str(k): trace_cfg[k] for k in trace_cfg}
    unknown = sorted(set(cfg) - set(TRACE_DEFAULTS))
    if unknown:
        raise ConfigError(f"trace: unknown key(s) {unknown}; valid keys: "
                          f"{', '.join(sorted(TRACE_DEFAULTS))}")
    return {**TRACE_DEFAULTS, **cfg}


def content_hash(loaded: LoadedLike, prompts: Sequence[Prompt], trace_cfg: Mapping[str, Any]) -> str:
    """The sha256 (hex) that names the trace of ``prompts`` on ``loaded`` with ``trace_cfg``."""
    from moeexp.traces.recorder import RECORDER_VERSION

    s = _settings(trace_cfg)
    greedy = s["sampling"] == "greedy"
    key = {
        "schema_version": SCHEMA_VERSION,
        "recorder_version": RECORDER_VERSION,
        "weights": weights_hash(loaded.model),
        "tokenizer": tokenizer_hash(loaded.tokenizer),
        "prompts": [[p.request_id, list(p.input_ids), p.prompt_len, p.output_len, p.split,
                     p.dataset, p.task, p.text] for p in prompts],
        "sampling": s["sampling"],
        "top_k": None if greedy else int(s["top_k"]),
        "temperature": None if greedy else float(s["temperature"]),
        "spec_depth": int(s["spec_depth"]),
        "record_hidden": bool(s["record_hidden"]),
        "prompt_embedder": s["prompt_embedder"],
        "seed": int(s["seed"]),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _cache_dir(value: Any) -> Path:
    if value:
        return Path(str(value)).expanduser()
    from moeexp.paths import results_dir

    return results_dir() / "traces"


def _try_reuse(stem: Path, digest: str) -> Trace | None:
    """The cached trace if present and valid; None (with a warning if it was bad) otherwise."""
    if not (io.paths(stem)[0].exists() or io.paths(stem)[1].exists()):
        return None
    try:
        trace = io.load(stem)
    except TraceError as exc:
        log.warning("cached trace %s is unusable (%s); re-recording it", stem, exc)
        return None
    if trace.meta.get("content_hash") != digest:
        log.warning("cached trace %s has content hash %r, expected %s; re-recording it", stem,
                    trace.meta.get("content_hash"), digest)
        return None
    return trace


def get_or_record(loaded: LoadedLike, prompts: Sequence[Prompt],
                  trace_cfg: Mapping[str, Any]) -> Trace:
    """The trace of ``prompts`` on ``loaded``: reused from the cache or recorded and cached.

    Args:
        loaded: model, tokenizer, adapter, name (a ``LoadedModel``).
        prompts: the requests (from :func:`moeexp.data.prompts.sample_prompts`).
        trace_cfg: the ``trace`` config block: sampling, top_k, temperature, spec_depth,
            record_hidden, seed, cache_dir (None: ``results/traces``), prompt_embedder,
            progress (not part of the hash).

    Returns:
        The trace; ``meta["content_hash"]`` is its hash, ``meta["cache_path"]`` its npz file.
    """
    from moeexp.traces.recorder import check_settings, record_trace

    s = _settings(trace_cfg)
    check_settings(s["sampling"], s["top_k"], s["temperature"], s["spec_depth"],
                   s["prompt_embedder"])
    digest = content_hash(loaded, prompts, s)
    root = _cache_dir(s["cache_dir"])
    stem = root / digest
    with file_lock(root / f"{digest}.lock"):
        trace = _try_reuse(stem, digest)
        if trace is not None:
            log.info("reusing trace %s", io.paths(stem)[0])
        else:
            log.info("recording trace %s (%d prompts, model %s)", io.paths(stem)[0],
                     len(prompts), loaded.name)
            trace = record_trace(
                loaded, prompts, sampling=s["sampling"], top_k=int(s["top_k"]),
                temperature=float(s["temperature"]), spec_depth=int(s["spec_depth"]),
                record_hidden=bool(s["record_hidden"]), seed=int(s["seed"]),
                prompt_embedder=s["prompt_embedder"], progress=bool(s["progress"]))
            trace.meta["content_hash"] = digest
            io.save(trace, stem)
    trace.meta["cache_path"] = str(io.paths(stem)[0])
    return trace
