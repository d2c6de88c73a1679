"""The metric keys (algorithms.md §8), emitted identically by the simulator and the engine.

Names follow ``<quantity>_<unit>[_<stat>]``. Two hit-rate definitions exist and are never
mixed: ``hit_rate`` is the real cache hit rate (resident *and* ready when the layer needed
it); ``prediction_recall`` is FineMoE's "overlapped expert ratio" (what its figures call
"hit rate").
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
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
    # where the bytes and the stalls go (traffic_metrics)
    "output_tokens_total",
    "demand_loads_total", "prefetches_issued", "prefetches_used", "prefetches_wasted",
    "prefetches_dropped",
    "h2d_demand_bytes_total", "h2d_prefetch_bytes_total", "prefetch_used_bytes",
    "h2d_demand_bytes_per_token", "prefetch_used_bytes_per_token",
    "prefetch_waste_bytes_per_token",
    "stall_demand_ms_total", "stall_late_prefetch_ms_total", "stall_link_ms_total",
)

#: Parts that add up to a total (the identity tests hold both backends to them).
PARTS_OF: dict[str, tuple[str, ...]] = {
    "h2d_bytes_total": ("h2d_demand_bytes_total", "h2d_prefetch_bytes_total"),
    "h2d_prefetch_bytes_total": ("prefetch_used_bytes", "prefetch_waste_bytes"),
    "prefetches_issued": ("prefetches_used", "prefetches_wasted"),
    "stall_ms_total": ("stall_demand_ms_total", "stall_late_prefetch_ms_total",
                       "stall_link_ms_total"),
}


def traffic_metrics(*, expert_bytes: int, output_tokens: int, demand_loads: int,
                    prefetches_issued: int, prefetches_used: int, prefetches_wasted: int,
                    prefetches_dropped: int, stall_demand_ms: float, stall_late_prefetch_ms: float,
                    stall_link_ms: float) -> dict[str, float]:
    """Where the bytes and the stalls go: the one definition both backends emit.

    Every host-to-device copy moves one expert (``expert_bytes``) and is either a demand
    load (a layer needed an expert that held no slot) or a started prefetch. A prefetched
    copy is *used* when a layer computes with it before it leaves the device (a hit, or a
    wait for it still in flight), else *wasted* (evicted unused, or unused at the end).
    Prefetch requests *dropped* before their copy started (their layer ran, no victim, the
    pass ended) moved no bytes and are only counted. Per-token values divide by the output
    tokens: one per request and forward pass it took part in (the prefill's token
    included). The stall time (``stall_ms_total``) is split by what the compute waited
    for: ``stall_demand_ms_total`` a demand copy's own transfer, ``stall_late_prefetch_ms_total``
    a copy already in flight when the layer needed it (a prefetch started too late), and
    ``stall_link_ms_total`` a demand copy queued behind other copies on the link before its
    transfer began. Identities (:data:`PARTS_OF`): demand + prefetch bytes =
    ``h2d_bytes_total``; used + wasted = prefetch bytes; the three stalls = ``stall_ms_total``.
    """
    per = 1.0 / output_tokens if output_tokens > 0 else float("nan")
    demand_b = float(demand_loads * expert_bytes)
    used_b = float(prefetches_used * expert_bytes)
    waste_b = float(prefetches_wasted * expert_bytes)
    return {
        "output_tokens_total": float(output_tokens),
        "demand_loads_total": float(demand_loads),
        "prefetches_issued": float(prefetches_issued),
        "prefetches_used": float(prefetches_used),
        "prefetches_wasted": float(prefetches_wasted),
        "prefetches_dropped": float(prefetches_dropped),
        "h2d_demand_bytes_total": demand_b,
        "h2d_prefetch_bytes_total": float(prefetches_issued * expert_bytes),
        "prefetch_used_bytes": used_b,
        "h2d_demand_bytes_per_token": demand_b * per,
        "prefetch_used_bytes_per_token": used_b * per,
        "prefetch_waste_bytes_per_token": waste_b * per,
        "stall_demand_ms_total": float(stall_demand_ms),
        "stall_late_prefetch_ms_total": float(stall_late_prefetch_ms),
        "stall_link_ms_total": float(stall_link_ms),
    }


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


def prediction_overlap(predicted: AbstractSet[int] | None,
                       activated: Sequence[int]) -> tuple[float | None, float | None]:
    """(recall, precision) of one (pass, layer): P = ``predicted``, A = ``activated``.

    recall = |P ∩ A| / |A| and precision = |P ∩ A| / |P|. recall is 0 when nothing was
    predicted (it still counts: recall averages over every (pass, layer)), None when A is
    empty; precision is None when nothing was predicted (it averages only over pairs with a
    prediction). The simulator and the engine both account through this one definition.
    """
    if not predicted:
        return (0.0 if activated else None), None
    inter = sum(map(predicted.__contains__, activated))  # |P ∩ A|, A as listed
    return (inter / len(activated) if activated else None), inter / len(predicted)


@dataclass
class PredictionTally:
    """Running means of :func:`prediction_overlap` over (pass, layer) pairs; the simulator
    and the engine each keep one."""

    recall_sum: float = 0.0
    recall_n: int = 0
    precision_sum: float = 0.0
    precision_n: int = 0

    def add(self, predicted: AbstractSet[int] | None, activated: Sequence[int]) -> None:
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
