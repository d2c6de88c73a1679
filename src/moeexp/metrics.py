"""The metric keys (algorithms.md §8), emitted identically by the simulator and the engine.

Names follow ``<quantity>_<unit>[_<stat>]``. Two hit-rate definitions exist and are never
mixed: ``hit_rate`` is the real cache hit rate (resident *and* ready when the layer needed
it); ``prediction_recall`` is FineMoE's "overlapped expert ratio" (what its figures call
"hit rate").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Keys every backend emits for every run (values may be NaN where undefined).
CORE_KEYS: tuple[str, ...] = (
    "hit_rate",
    "prediction_recall",
    "prediction_precision",
    "prediction_f1",
    "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99",
    "tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p99",
    "e2e_ms_mean", "e2e_ms_p50", "e2e_ms_p99",
    "stall_ms_total",
    "h2d_bytes_total",
    "prefetch_waste_bytes",
    "expert_cache_bytes",
    "gpu_mem_peak_bytes",
    "predictor_query_us_mean",
    "accesses_total",
    "requests_total",
)


def summarize(prefix: str, values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """``{prefix}_mean``, ``_p50`` and ``_p99`` of ``values`` (NaN when empty)."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        nan = float("nan")
        return {f"{prefix}_mean": nan, f"{prefix}_p50": nan, f"{prefix}_p99": nan}
    return {
        f"{prefix}_mean": float(a.mean()),
        f"{prefix}_p50": float(np.percentile(a, 50)),
        f"{prefix}_p99": float(np.percentile(a, 99)),
    }


def f1(precision: float, recall: float) -> float:
    """Harmonic mean; 0 when both are 0, NaN when either is NaN."""
    if np.isnan(precision) or np.isnan(recall):
        return float("nan")
    s = precision + recall
    return 0.0 if s == 0 else 2 * precision * recall / s


def prediction_overlap(predicted: set[int] | None,
                       activated: Sequence[int]) -> tuple[float | None, float | None]:
    """(recall, precision) of one (pass, layer): P = ``predicted``, A = ``activated``.

    recall = |P ∩ A| / |A| and precision = |P ∩ A| / |P|. recall is 0 when nothing was
    predicted (it still counts: recall averages over every (pass, layer)), None when A is
    empty; precision is None when nothing was predicted (it averages only over pairs with a
    prediction). The simulator and the engine both account through this one definition.
    """
    if not predicted:
        return (0.0 if activated else None), None
    inter = sum(1 for e in activated if e in predicted)
    return (inter / len(activated) if activated else None), inter / len(predicted)


@dataclass
class PredictionTally:
    """Running means of :func:`prediction_overlap` over (pass, layer) pairs; the simulator
    and the engine each keep one."""

    recall_sum: float = 0.0
    recall_n: int = 0
    precision_sum: float = 0.0
    precision_n: int = 0

    def add(self, predicted: set[int] | None, activated: Sequence[int]) -> None:
        """Account one (pass, layer): ``predicted`` P (None = nothing), ``activated`` A."""
        self.recall_n += 1
        recall, precision = prediction_overlap(predicted, activated)
        if recall is not None:
            self.recall_sum += recall
        if precision is not None:
            self.precision_sum += precision
            self.precision_n += 1

    @property
    def recall(self) -> float:
        """Mean recall (NaN before any pair)."""
        return self.recall_sum / self.recall_n if self.recall_n else float("nan")

    @property
    def precision(self) -> float:
        """Mean precision over pairs with a prediction (NaN when there was none)."""
        return self.precision_sum / self.precision_n if self.precision_n else float("nan")
