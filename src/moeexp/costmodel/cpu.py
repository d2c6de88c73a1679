"""The host CPU of a hardware profile: what computing an expert where its weights live costs.

A profile may carry a ``cpu:`` block (algorithms.md §11); without one the profile is a
copy-only machine and every cost number is what it was before CPUs were modelled. Every
number of the block has a ``source`` entry (a measurement with its reference, or an
estimate saying so)::

    cpu:
      name: xeon_e5_2683v4      # the host CPU
      dram_gbps: 60.0           # achieved DRAM read bandwidth of the expert kernel, GB/s
      tflops: 0.54              # achieved FLOP/s of the expert kernel (prefill), TFLOPS
      call_overhead_us: 30.0    # fixed cost of one expert call (dispatch, thread sync), us
      hidden_latency_us: 10.0   # fixed cost of one hidden-state transfer (each way), us
      host_memory_gbps: 60.0    # optional: host memory bandwidth the CPU's reads and the
                                # link's copies share (default: dram_gbps)
      efficiency: {dense: 1.0, int8: 0.73, int4: 0.47, ...}   # kernel's share of dram_gbps
      source: {dram_gbps: "...", tflops: "...", ..., efficiency: {int8: "...", ...}}

The hidden state crosses the GPU profile's link (its achieved ``h2d`` bandwidth, taken for
both directions: PCIe is symmetric) at ``hidden_size * dtype_bytes`` bytes per token
(:meth:`moeexp.costmodel.roofline.CostModel.hidden_transfer_s`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moeexp.costmodel.formats import EXPERT_FORMATS
from moeexp.errors import ConfigError

#: Numeric keys of the block (each needs a ``source`` entry); ``host_memory_gbps`` optional.
_NUMBERS = ("dram_gbps", "tflops", "call_overhead_us", "hidden_latency_us", "host_memory_gbps")
_RATES = ("dram_gbps", "tflops", "host_memory_gbps")
_KEYS = frozenset({"name", "efficiency", "source", *_NUMBERS})


@dataclass(frozen=True)
class CpuProfile:
    """The host CPU (see the module docstring for the YAML block).

    Attributes:
        name: the CPU.
        dram_gbps: achieved DRAM read bandwidth, GB/s (1e9 bytes/s), > 0.
        tflops: achieved FLOP/s of the expert kernel, TFLOPS (1e12 FLOP/s), > 0.
        call_overhead_us: fixed cost of one expert call on the CPU, us, >= 0.
        hidden_latency_us: fixed cost of one hidden-state transfer, each way, us, >= 0.
        host_memory_gbps: host memory bandwidth shared by the CPU's reads and the link's
            copies, GB/s, > 0 (defaults to ``dram_gbps``).
        efficiency: (format, share) pairs: per expert format, the kernel's achieved share
            of ``dram_gbps``, in (0, 1]; a format missing here cannot run on this CPU.
        source: (key, text) pairs: per number (``efficiency.<format>`` for efficiencies,
            read from the nested ``source.efficiency`` mapping),
            where it comes from. Pairs, not dicts, so that a profile stays immutable and
            hashable.
    """

    name: str
    dram_gbps: float
    tflops: float
    call_overhead_us: float
    hidden_latency_us: float
    host_memory_gbps: float
    efficiency: tuple[tuple[str, float], ...]
    source: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        where = f"hardware cpu {self.name!r}"
        bad = [k for k in _RATES if not (_finite(getattr(self, k)) and getattr(self, k) > 0)]
        bad += [k for k in ("call_overhead_us", "hidden_latency_us")
                if not (_finite(getattr(self, k)) and getattr(self, k) >= 0)]
        eff = dict(self.efficiency)
        bad += [f"efficiency.{f}" for f, e in eff.items() if not (_finite(e) and 0 < e <= 1)]
        if bad:
            raise ConfigError(f"{where}: invalid value(s) for {', '.join(bad)} (bandwidths and "
                              "FLOP/s must be > 0, overheads >= 0, efficiencies in (0, 1])")
        unknown = sorted(set(eff) - set(EXPERT_FORMATS))
        if unknown or not eff:
            raise ConfigError(f"{where}: efficiency for unknown format(s) {unknown or '(none given)'}; "
                              f"valid formats: {', '.join(EXPERT_FORMATS)}")
        need = {k for k in _NUMBERS if k != "host_memory_gbps"} | {f"efficiency.{f}" for f in eff}
        missing = sorted(need - {k for k, v in self.source if str(v).strip()})
        if missing:
            raise ConfigError(f"{where}: no source for {', '.join(missing)} (every number "
                              "names its measurement or says it is an estimate)")

    @property
    def dram_bytes_per_s(self) -> float:
        """Achieved DRAM read bandwidth, bytes/s."""
        return self.dram_gbps * 1e9

    @property
    def flops_per_s(self) -> float:
        """Achieved expert-kernel throughput, FLOP/s."""
        return self.tflops * 1e12

    @property
    def host_memory_bytes_per_s(self) -> float:
        """Host memory bandwidth shared by CPU reads and link copies, bytes/s."""
        return self.host_memory_gbps * 1e9

    def efficiency_of(self, fmt: str) -> float:
        """The kernel's share of ``dram_gbps`` for format ``fmt``; a format the profile has
        no efficiency for raises ConfigError naming the ones it has."""
        eff = dict(self.efficiency)
        if fmt not in eff:
            raise ConfigError(f"hardware cpu {self.name!r} has no kernel efficiency for "
                              f"expert_format={fmt}; it has: {', '.join(sorted(eff))}")
        return float(eff[fmt])

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any], where: str = "hardware.cpu") -> CpuProfile:
        """Build from the ``cpu:`` block; unknown/missing keys and non-numbers raise ConfigError."""
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {cfg!r}")
        got = set(cfg)
        missing = sorted((_KEYS - {"host_memory_gbps"}) - got)
        unknown = sorted(got - _KEYS)
        if missing or unknown:
            raise ConfigError(f"{where}: missing key(s) {missing}, unknown key(s) {unknown}. "
                              f"Keys: {', '.join(sorted(_KEYS))} (host_memory_gbps optional)")
        nums = {k: _number(cfg, k, where) for k in _NUMBERS if k in cfg}
        nums.setdefault("host_memory_gbps", nums["dram_gbps"])
        eff, src = cfg["efficiency"], cfg["source"]
        src_eff = src.get("efficiency", {}) if isinstance(src, Mapping) else None
        if not all(isinstance(m, Mapping) for m in (eff, src, src_eff)):
            raise ConfigError(f"{where}: efficiency, source and source.efficiency must be mappings")
        sources = [(str(k), str(v)) for k, v in src.items() if k != "efficiency"]
        sources += [(f"efficiency.{k}", str(v)) for k, v in src_eff.items()]
        return cls(name=str(cfg["name"]),
                   efficiency=tuple((str(k), _number(eff, k, f"{where}.efficiency")) for k in eff),
                   source=tuple(sources), **nums)

    def to_mapping(self) -> dict[str, Any]:
        """The YAML block this profile was read from (plain types)."""
        src: dict[str, Any] = {k: v for k, v in self.source if not k.startswith("efficiency.")}
        src["efficiency"] = {k.split(".", 1)[1]: v for k, v in self.source
                             if k.startswith("efficiency.")}
        return {"name": self.name, **{k: getattr(self, k) for k in _NUMBERS},
                "efficiency": dict(self.efficiency), "source": src}


def _finite(v: float) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _number(cfg: Mapping[str, Any], key: str, where: str) -> float:
    v = cfg[key]
    if isinstance(v, bool):
        raise ConfigError(f"{where}: {key} must be a number, got {v!r}")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {key} must be a number, got {v!r}") from None


def share_host_bandwidth(cpu_bytes_per_s: float, link_bytes_per_s: float,
                         host_bytes_per_s: float) -> tuple[float, float]:
    """Effective (CPU read, link copy) bandwidths, bytes/s, while both draw on host memory.

    The CPU's expert reads and the link's DMA copies both come out of host DRAM. When their
    demands together fit ``host_bytes_per_s`` each keeps its own rate; above it both are cut
    in proportion to their demand, so the sum equals the host bandwidth (a fluid model of
    a memory controller serving two streams; no priority). Apply it only to the time both
    are active: a copy alone or a CPU expert alone runs at its own rate.
    """
    if min(cpu_bytes_per_s, link_bytes_per_s, host_bytes_per_s) <= 0:
        raise ConfigError("share_host_bandwidth: bandwidths must be > 0, got "
                          f"{cpu_bytes_per_s}, {link_bytes_per_s}, {host_bytes_per_s}")
    demand = cpu_bytes_per_s + link_bytes_per_s
    if demand <= host_bytes_per_s:
        return cpu_bytes_per_s, link_bytes_per_s
    f = host_bytes_per_s / demand
    return cpu_bytes_per_s * f, link_bytes_per_s * f
