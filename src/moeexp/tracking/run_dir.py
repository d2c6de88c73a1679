"""The local results of one run: ``metrics.json``, ``series.parquet``, ``env.json``.

``results/`` is the source of truth (W&B only mirrors it). Every file is written
atomically (:mod:`moeexp.atomic`), so a reader never sees half a file.

- ``metrics.json``: one flat JSON object. Keys follow ``<quantity>_<unit>[_<stat>]``;
  values are numbers, strings (``system``, ``predictor``, ``cache``, ``model``, ...) or
  ``null`` (a NaN or infinite number is written as ``null`` so that the file is strict
  JSON; :func:`read_metrics` turns it back into NaN).
- ``series.parquet``: per-step series in long format, columns ``series`` (str), ``step``
  (int, position in that series) and ``value`` (float64), so series of different lengths
  (per request, per iteration, ...) share one table.
- ``env.json``: see :mod:`moeexp.tracking.env`.
- ``done.json``: the completion marker, written **last** and atomically once every other
  output exists (and the W&B run is closed): ``{"config": <resolved config>, "outputs":
  [<files>], "wandb_run_id": <id or null>, "finished_utc": <time>}``. A job is complete
  only with it and its listed outputs (:func:`resume_state`); a job killed between two
  outputs has none. ``config`` is the resolved config without :data:`RESUME_IGNORED`, so
  a resumed job is skipped only when its config equals the new one.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from moeexp.atomic import atomic_path, write_json
from moeexp.errors import ConfigError

METRICS_FILE = "metrics.json"
SERIES_FILE = "series.parquet"
ENV_FILE = "env.json"
DONE_FILE = "done.json"

#: Config keys (dotted) that do not change a job's results: display only.
RESUME_IGNORED: tuple[str, ...] = ("resume", "trace.progress", "backend.progress")

log = logging.getLogger(__name__)

Scalar = float | int | str | bool | None


def flat_scalars(metrics: Mapping[str, Any]) -> dict[str, Scalar]:
    """``metrics`` as JSON-ready flat scalars; non-finite floats become None.

    Raises:
        ConfigError: a value is not a scalar (a list, a dict, an array with more than
            one element): metrics must be flat; per-step values belong in the series.
    """
    out: dict[str, Scalar] = {}
    for key, value in metrics.items():
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, np.ndarray) and value.size == 1:
            value = value.reshape(()).item()
        if value is None or isinstance(value, (str, bool)):
            out[str(key)] = value
        elif isinstance(value, (int, float)):
            out[str(key)] = value if math.isfinite(value) else None
        else:
            raise ConfigError(
                f"metric {key!r} is a {type(value).__name__}, not a scalar: metrics.json holds "
                "flat scalars only (put per-step values in the series)"
            )
    return out


def write_metrics(run_dir: str | Path, metrics: Mapping[str, Any]) -> Path:
    """Write ``run_dir/metrics.json`` atomically (sorted keys); returns its path."""
    path = Path(run_dir) / METRICS_FILE
    data = flat_scalars(metrics)
    # allow_nan=False: flat_scalars already mapped NaN/inf to None; fail loudly otherwise.
    text = json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


def read_metrics(path: str | Path) -> dict[str, Scalar]:
    """Read a ``metrics.json`` (a file or its run directory); ``null`` becomes NaN."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    data = json.loads(p.read_text())
    return {k: (float("nan") if v is None else v) for k, v in data.items()}


def write_series(run_dir: str | Path, series: Mapping[str, Sequence[float] | np.ndarray]) -> Path:
    """Write ``run_dir/series.parquet`` (long format, see module docstring); returns its path.

    Args:
        series: name -> float[n] values (any length per name; an empty series is kept as
            zero rows). Non-numeric values raise ConfigError.
    """
    import pandas as pd

    frames = []
    for name, values in series.items():
        try:
            arr = np.asarray(values, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"series {name!r} is not numeric: {err}") from None
        frames.append(pd.DataFrame({
            "series": pd.Series([str(name)] * arr.size, dtype="string"),
            "step": np.arange(arr.size, dtype=np.int64),
            "value": arr,
        }))
    empty = pd.DataFrame({"series": pd.Series([], dtype="string"),
                          "step": np.zeros(0, np.int64), "value": np.zeros(0)})
    df = pd.concat(frames, ignore_index=True) if frames else empty
    path = Path(run_dir) / SERIES_FILE
    with atomic_path(path, suffix=".parquet") as tmp:
        df.to_parquet(tmp, index=False)
    return path


def read_series(path: str | Path) -> dict[str, np.ndarray]:
    """Read ``series.parquet`` (a file or its run directory) back to name -> float64[n]."""
    import pandas as pd

    p = Path(path)
    if p.is_dir():
        p = p / SERIES_FILE
    df = pd.read_parquet(p)
    out: dict[str, np.ndarray] = {}
    for name, group in df.groupby("series", sort=False):
        out[str(name)] = group.sort_values("step")["value"].to_numpy(np.float64)
    return out


def write_env(run_dir: str | Path, env: Mapping[str, Any]) -> Path:
    """Write ``run_dir/env.json`` atomically; returns its path."""
    path = Path(run_dir) / ENV_FILE
    write_json(path, dict(env))
    return path


# ---------------------------------------------------------------------- completion marker
def comparable_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as JSON values (what ``done.json`` holds) without :data:`RESUME_IGNORED`."""
    out: dict[str, Any] = json.loads(json.dumps(dict(config), sort_keys=True, default=str))
    for dotted in RESUME_IGNORED:
        *parents, leaf = dotted.split(".")
        node: Any = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``["cache.capacity: 0.25 -> 0.5", ...]``: the dotted keys whose values differ."""
    a, b = _flat(old), _flat(new)
    missing = "<absent>"
    return [f"{k}: {a.get(k, missing)!r} -> {b.get(k, missing)!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, missing) != b.get(k, missing)]


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def write_done(run_dir: str | Path, config: Mapping[str, Any], outputs: Sequence[str],
               wandb_run_id: str | None = None) -> Path:
    """Write the completion marker ``done.json`` (atomically; call it last)."""
    path = Path(run_dir) / DONE_FILE
    write_json(path, {"config": comparable_config(config), "outputs": sorted(outputs),
                      "wandb_run_id": wandb_run_id,
                      "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return path


def read_done(run_dir: str | Path) -> dict[str, Any] | None:
    """The completion marker of ``run_dir``, or None when absent or unreadable."""
    path = Path(run_dir) / DONE_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s is unreadable (%s): the job counts as incomplete", path, exc)
        return None
    return data if isinstance(data, dict) else None


def clear_done(run_dir: str | Path) -> None:
    """Remove the marker before a job's outputs are replaced (a kill then leaves it
    incomplete, not complete with outputs of two configs)."""
    (Path(run_dir) / DONE_FILE).unlink(missing_ok=True)


@dataclass(frozen=True)
class ResumeState:
    """What a job directory holds, against the config about to run in it.

    ``status``: ``new`` (no outputs), ``incomplete`` (outputs without the marker, or a
    listed output missing), ``changed`` (complete, with another config: ``changes``),
    ``complete`` (complete with this config: resume skips it).
    """

    status: Literal["new", "incomplete", "changed", "complete"]
    reason: str = ""
    changes: list[str] = field(default_factory=list)


def is_complete(run_dir: str | Path) -> bool:
    """The job in ``run_dir`` finished: its marker and every output it lists exist."""
    done = read_done(run_dir)
    return done is not None and not _missing(Path(run_dir), done)


def _missing(run_dir: Path, done: Mapping[str, Any]) -> list[str]:
    return [str(f) for f in done.get("outputs", []) if not (run_dir / str(f)).is_file()]


def resume_state(run_dir: str | Path, config: Mapping[str, Any]) -> ResumeState:
    """Whether the job about to run with ``config`` in ``run_dir`` is already complete."""
    run_dir = Path(run_dir)
    done = read_done(run_dir)
    if done is None:
        if (run_dir / METRICS_FILE).is_file():
            return ResumeState("incomplete", f"{METRICS_FILE} without {DONE_FILE} (killed or "
                               "failed before its last output, or written by an older moeexp)")
        return ResumeState("new")
    missing = _missing(run_dir, done)
    if missing:
        return ResumeState("incomplete", f"{', '.join(missing)} missing")
    changes = config_changes(done.get("config") or {}, comparable_config(config))
    if changes:
        return ResumeState("changed", "its results were made with another config", changes)
    return ResumeState("complete")
