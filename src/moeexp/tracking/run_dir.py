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
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moeexp.atomic import atomic_path, write_json
from moeexp.errors import ConfigError

METRICS_FILE = "metrics.json"
SERIES_FILE = "series.parquet"
ENV_FILE = "env.json"

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
