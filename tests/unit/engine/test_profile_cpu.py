"""profile_cpu: the engine's own CPU-path timings (every expert on the host, nothing copied)."""

from __future__ import annotations

import types

import numpy as np

from moeexp.costmodel.cpu_fit import fit_cpu_block
from moeexp.engine.profile_cpu import profile_cpu, read_bandwidth
from moeexp.models.adapters import adapter_for


def test_profile_cpu_times_every_expert_call(mixtral) -> None:
    """Prefills and decodes: one sample per CPU expert call (rows >= 1, several row counts),
    one trip per layer call, a positive read bandwidth; the fit of them is a valid block;
    the model is plain afterwards."""
    ad = adapter_for(mixtral)
    loaded = types.SimpleNamespace(model=mixtral, adapter=ad, name="tiny")
    reqs = [([5, 9, 17, 33, 60, 71, 80, 99], 4), ([7, 8, 9, 10, 11, 12], 3)]
    s = profile_cpu(loaded, reqs, warmup=1, read_mb=16)
    passes = len(reqs) + sum(n for _, n in reqs) - len(reqs)  # prefill + (new - 1) decodes
    assert len(s.trip_bytes) == passes * ad.num_layers
    assert len(s.rows) >= passes * ad.num_layers and min(s.rows) >= 1
    assert len(np.unique(s.rows)) >= 2 and all(t > 0 for t in s.seconds)
    assert s.read_bytes_per_s > 0
    cpu, q = fit_cpu_block(s.rows, s.seconds, s.trip_bytes, s.trip_seconds,
                           read_bytes_per_s=s.read_bytes_per_s, hidden_size=ad.hidden_size,
                           intermediate_size=ad.expert_intermediate_size,
                           expert_bytes=ad.expert_bytes())
    assert cpu.tflops > 0 and q["n"] == len(s.rows)
    assert mixtral.config._experts_implementation == "grouped_mm"


def test_read_bandwidth_is_a_rate() -> None:
    assert read_bandwidth(8, repeats=2) > 1e8  # any host reads 8 MiB faster than 100 MB/s
