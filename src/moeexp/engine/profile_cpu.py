"""Profiling the engine's CPU path for the calibrated profile's CPU block
(:mod:`moeexp.costmodel.cpu_fit`).

:func:`profile_cpu` serves requests with every expert computed on the host CPU: the
``layer_split`` execution over every layer (llama.cpp's ``--cpu-moe``) with a batch
threshold no pass reaches, so nothing is copied or streamed, and every expert call and
hidden-state trip is timed by the engine itself (:mod:`moeexp.engine.host_experts`:
``Counters.cpu_samples``, ``cpu_transfer_samples``). :func:`read_bandwidth` measures the
host's achieved DRAM read bandwidth on the same threads (a streaming read of a buffer far
larger than the caches), which the fit needs to split the expert call's intercept into
the weights' read and the call overhead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from moeexp.costmodel.hardware import load_profile
from moeexp.costmodel.roofline import CostModel
from moeexp.engine.build import build_offloaded
from moeexp.engine.runtime import EngineSettings
from moeexp.execution import EXECUTIONS
from moeexp.traces.recorder import trace_dims

log = logging.getLogger(__name__)

#: A profile with a cpu: block for the policy's check; layer_split's placement reads no cost.
_ANY_CPU_PROFILE = "rtx3090_pcie4_xeon_e5v4"


@dataclass
class CpuSamples:
    """The engine's CPU-path timings (seconds) and the host's read bandwidth (bytes/s).

    Attributes:
        rows / seconds: per CPU expert call, its routing rows and its kernel seconds.
        trip_bytes / trip_seconds: per layer, the hidden states' bytes both ways and the
            seconds of the two trips.
        read_bytes_per_s: achieved DRAM read bandwidth (:func:`read_bandwidth`).
    """

    rows: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    trip_bytes: list[float] = field(default_factory=list)
    trip_seconds: list[float] = field(default_factory=list)
    read_bytes_per_s: float = float("nan")


def read_bandwidth(mb: int = 512, repeats: int = 5) -> float:
    """bytes/s: the median rate of ``repeats`` full reads (``torch.sum``) of an ``mb`` MiB
    fp32 buffer on the host, with torch's current threads (a STREAM-like read)."""
    x = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    float(x.sum())  # touch every page before timing
    rates = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        float(x.sum())
        rates.append(x.numel() * 4 / (time.perf_counter() - t0))
    return float(np.median(rates))


def profile_cpu(loaded: Any, requests: Sequence[tuple[Sequence[int], int]], *,
                settings: EngineSettings | None = None, warmup: int = 1,
                progress: bool = False, read_mb: int = 512) -> CpuSamples:
    """Serve ``requests`` (``(prompt ids, tokens to generate)``, greedy, EOS suppressed)
    with every expert on the host CPU; returns the engine's own CPU timings and the host's
    read bandwidth. The model must already be on the profiled device."""
    from moeexp.cache import CACHES
    from moeexp.predictors import PREDICTORS

    st = replace(settings or EngineSettings(), restricted_routing=False, predictor_async=False)
    dims = trace_dims(loaded.adapter, st.spec_depth)
    L, J = dims.num_layers, dims.num_experts
    policy = EXECUTIONS.build("layer_split", num_layers=L, num_experts=J, n_cpu_layers=None,
                              min_batch=2**31 - 1)
    cost = CostModel.from_profile(load_profile(_ANY_CPU_PROFILE), dims)
    pred = PREDICTORS.build("none", dims=dims)
    pol = CACHES.build("lru", capacity_slots=dims.top_k, num_layers=L, num_experts=J)
    device = next(loaded.model.parameters()).device
    out = CpuSamples()
    with build_offloaded(loaded.model, loaded.adapter, pred, pol, st, system="profile_cpu",
                         execution=policy, cost=cost) as om:
        for ids, new in list(requests)[:warmup]:
            _generate(om, device, ids, min(4, new))
        om.reset_metrics()
        for ids, new in tqdm(requests, desc="profile cpu", unit="req", disable=not progress):
            _generate(om, device, ids, new)
        c = om.engine.counters
        assert c.demand_loads == 0 and c.stream_copies == 0, "the CPU profile copied experts"
        out.rows = [float(n) for n, _ in c.cpu_samples]
        out.seconds = [float(s) for _, s in c.cpu_samples]
        out.trip_bytes = [float(b) for b, _ in c.cpu_transfer_samples]
        out.trip_seconds = [float(s) for _, s in c.cpu_transfer_samples]
    out.read_bytes_per_s = read_bandwidth(read_mb)
    log.info("CPU profile: %d expert calls, %d trips, host read %.2f GB/s", len(out.rows),
             len(out.trip_bytes), out.read_bytes_per_s / 1e9)
    return out


def _generate(om: Any, device: torch.device, ids: Sequence[int], new: int) -> None:
    x = torch.tensor([list(ids)], dtype=torch.long, device=device)
    om.generate(x, max_new_tokens=int(new), min_new_tokens=int(new), do_sample=False)
