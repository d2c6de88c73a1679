"""Hardware profiles: the numbers a cost model needs, stored as data in ``conf/hardware``.

A profile is one YAML file ``conf/hardware/NAME.yaml`` whose ``name:`` equals ``NAME``;
its keys are exactly the fields of :class:`HardwareProfile`. Spec-sheet values (link and
memory bandwidth, peak FLOPS, memory size) carry a comment naming their source; the
efficiencies, copy latency and launch overheads are estimates meant to be calibrated from
engine runs.

A profile may add a ``cpu:`` block (:class:`~moeexp.costmodel.cpu.CpuProfile`: the host
CPU's achieved DRAM bandwidth, kernel efficiency per expert format, FLOP/s, overheads,
each with a source). It is optional: a profile without one is a copy-only machine, and its
cost numbers do not depend on whether the field exists (CPU execution needs the block and
is refused without it, :meth:`HardwareProfile.require_cpu`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from moeexp.costmodel.cpu import CpuProfile
from moeexp.errors import ConfigError
from moeexp.paths import CONF_DIR, read_option


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU + host link.

    Attributes:
        name: profile name (== YAML file name).
        h2d_gbps: host-to-device link bandwidth per direction, GB/s (1e9 bytes/s), nominal.
        h2d_efficiency: achieved / nominal link bandwidth, in (0, 1].
        copy_latency_us: fixed cost of one copy (launch + DMA set-up), microseconds.
        peak_tflops: dense FP16/BF16 tensor-core peak, TFLOPS (1e12 FLOP/s).
        compute_efficiency: achieved / peak FLOPS for the expert and dense GEMMs, in (0, 1].
        hbm_gbps: device memory bandwidth, GB/s.
        memory_efficiency: achieved / peak memory bandwidth, in (0, 1].
        memory_gb: device memory, GB.
        dense_overhead_us: launch overhead of one layer's attention + router part, us.
        expert_overhead_us: launch overhead of one active expert's FFN, us.
        copy_chunk_mb: copy granularity, MB (1e6 bytes): 0 (default) = an expert crosses
            the link as one copy, which a demand load cannot overtake; > 0 = in chunks of
            this size, each paying ``copy_latency_us``, after any of which a demand load
            may go first (:mod:`moeexp.costmodel.copies`). Optional in a profile file.
        cpu: the host CPU (:mod:`moeexp.costmodel.cpu`), or None: a copy-only profile.
            Optional in a profile file.
        devices: GPUs of this machine, each with its own host link (at ``h2d_gbps``), copy
            worker and expert slots (:mod:`moeexp.simulator.topology`); 1 (default) = one
            GPU, every result as without it. Optional in a profile file.
    """

    name: str
    h2d_gbps: float
    h2d_efficiency: float
    copy_latency_us: float
    peak_tflops: float
    compute_efficiency: float
    hbm_gbps: float
    memory_efficiency: float
    memory_gb: float
    dense_overhead_us: float
    expert_overhead_us: float
    copy_chunk_mb: float = 0.0
    cpu: CpuProfile | None = None
    devices: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise ConfigError(f"hardware profile {self.name!r}: devices must be an integer >= 1, "
                              f"got {self.devices!r}")
        bad = [f.name for f in fields(self)
               if f.name not in _NON_NUMERIC and not _finite_nonneg(getattr(self, f.name))]
        for eff in ("h2d_efficiency", "compute_efficiency", "memory_efficiency"):
            if not 0 < float(getattr(self, eff)) <= 1:
                bad.append(eff)
        for rate in ("h2d_gbps", "peak_tflops", "hbm_gbps"):
            if not float(getattr(self, rate)) > 0:
                bad.append(rate)
        if bad:
            raise ConfigError(
                f"hardware profile {self.name!r}: invalid value(s) for {', '.join(sorted(set(bad)))}"
                " (rates must be > 0, efficiencies in (0, 1], the rest >= 0)"
            )

    @property
    def h2d_bytes_per_s(self) -> float:
        """Achieved host-to-device bandwidth, bytes/s."""
        return self.h2d_gbps * 1e9 * self.h2d_efficiency

    @property
    def flops_per_s(self) -> float:
        """Achieved GEMM throughput, FLOP/s."""
        return self.peak_tflops * 1e12 * self.compute_efficiency

    @property
    def hbm_bytes_per_s(self) -> float:
        """Achieved device-memory bandwidth, bytes/s."""
        return self.hbm_gbps * 1e9 * self.memory_efficiency

    def require_cpu(self, what: str) -> CpuProfile:
        """The CPU block, or ConfigError saying that ``what`` needs one and which shipped
        profiles have one."""
        if self.cpu is None:
            with_cpu = [n for n in available_profiles() if _has_cpu(n)]
            raise ConfigError(f"{what} computes experts on the CPU, but hardware={self.name} has "
                              f"no cpu: block; profiles with one: {', '.join(with_cpu) or '(none)'}")
        return self.cpu

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> HardwareProfile:
        """Build from a mapping (a YAML file or the composed ``hardware`` config group).

        Raises ConfigError naming missing or unknown keys.
        """
        want = {f.name for f in fields(cls)}
        got = set(cfg)
        missing, unknown = sorted(want - got - _OPTIONAL_KEYS), sorted(got - want)
        if missing or unknown:
            name = cfg.get("name", "?")
            parts = []
            if missing:
                parts.append(f"missing key(s) {', '.join(missing)}")
            if unknown:
                parts.append(f"unknown key(s) {', '.join(unknown)}")
            raise ConfigError(
                f"hardware profile {name!r}: {'; '.join(parts)}. Keys: {', '.join(sorted(want))}"
            )
        kwargs: dict[str, Any] = {"name": str(cfg["name"])}
        if "devices" in cfg:  # an integral float (a profile written from asdict) counts
            d = cfg["devices"]
            kwargs["devices"] = int(d) if isinstance(d, float) and d.is_integer() else d
        if cfg.get("cpu") is not None:
            kwargs["cpu"] = CpuProfile.from_mapping(cfg["cpu"], f"hardware {cfg['name']!r} cpu")
        for f in fields(cls):
            if f.name not in _NON_NUMERIC and f.name in cfg:
                try:
                    kwargs[f.name] = float(cfg[f.name])
                except (TypeError, ValueError):
                    raise ConfigError(
                        f"hardware profile {cfg['name']!r}: {f.name} must be a number, "
                        f"got {cfg[f.name]!r}"
                    ) from None
        return cls(**kwargs)


#: Profile keys a file may omit (their field default applies): added after the first profiles.
_OPTIONAL_KEYS: frozenset[str] = frozenset({"copy_chunk_mb", "cpu", "devices"})
#: Fields that are not plain numbers.
_NON_NUMERIC: frozenset[str] = frozenset({"name", "cpu", "devices"})


def _has_cpu(name: str) -> bool:
    """Whether shipped profile ``name`` has a CPU block (False if it does not load)."""
    try:
        return load_profile(name).cpu is not None
    except ConfigError:
        return False


def _finite_nonneg(v: Any) -> bool:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return False
    return x == x and x >= 0 and x != float("inf")


def _profiles_dir(conf_dir: str | Path | None) -> Path:
    """The folder of profile files: ``conf_dir`` itself, or the repository's ``conf/hardware``."""
    return Path(conf_dir) if conf_dir is not None else CONF_DIR / "hardware"


def available_profiles(conf_dir: str | Path | None = None) -> list[str]:
    """Sorted names of the profiles in ``conf_dir`` (default: ``conf/hardware``)."""
    return sorted(p.stem for p in _profiles_dir(conf_dir).glob("*.yaml"))


def load_profile(name: str, conf_dir: str | Path | None = None) -> HardwareProfile:
    """Read ``conf/hardware/NAME.yaml`` (or ``conf_dir/NAME.yaml``).

    Raises ConfigError for an unknown name (listing the valid profiles), a file whose
    ``name:`` differs from its file name, or missing/unknown/invalid keys.
    """
    cfg = read_option(_profiles_dir(conf_dir), name, "hardware profile")
    if cfg.get("name") != name:
        raise ConfigError(f"hardware profile {name}.yaml: name: {cfg.get('name')!r} != file "
                          f"name {name!r}")
    return HardwareProfile.from_mapping(cfg)
