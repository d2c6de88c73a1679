"""The CPU block of a hardware profile: the shipped CPUs load with a source for every number,
bad blocks are refused naming what is valid, host-memory sharing by hand."""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any

import pytest

from moeexp.costmodel import load_profile
from moeexp.costmodel.cpu import CpuProfile, share_host_bandwidth
from moeexp.costmodel.formats import EXPERT_FORMATS
from moeexp.costmodel.hardware import HardwareProfile
from moeexp.errors import ConfigError

WITH_CPU = {"rtx3090_pcie4_xeon_e5v4": 60.0, "rtx3090_pcie4_epyc7532": 102.0,
            "rtx3090_pcie4_xeon6454s": 105.0}


def _block() -> dict[str, Any]:
    return copy.deepcopy(load_profile("rtx3090_pcie4_xeon_e5v4").cpu.to_mapping())  # type: ignore[union-attr]


def test_shipped_cpus_carry_the_anchors_and_a_source_for_every_number() -> None:
    """E5-2683 v4 60 GB/s (llama.cpp #5484), EPYC 7532 102 (STREAM), Xeon 6454S 105
    (kTransformers); int8 0.73 and int4 0.47 of read bandwidth; every format has an
    efficiency and every number a non-empty source."""
    for name, gbps in WITH_CPU.items():
        cpu = load_profile(name).cpu
        assert cpu is not None and cpu.dram_gbps == gbps
        assert (cpu.efficiency_of("int8"), cpu.efficiency_of("int4")) == (0.73, 0.47)
        assert {f for f, _ in cpu.efficiency} == set(EXPERT_FORMATS)
        src = dict(cpu.source)
        assert all(src[k].strip() for k in ("dram_gbps", "tflops", "call_overhead_us",
                                            "hidden_latency_us"))
        assert all(src[f"efficiency.{f}"].strip() for f in EXPERT_FORMATS)
        assert cpu.host_memory_gbps == cpu.dram_gbps  # the optional key's default
    assert "5484" in dict(load_profile("rtx3090_pcie4_xeon_e5v4").cpu.source)["dram_gbps"]  # type: ignore[union-attr]


def test_gpu_part_of_the_cpu_profiles_is_rtx3090_pcie4() -> None:
    """The profiles with a CPU repeat rtx3090_pcie4's GPU and link: they must not drift."""
    base = asdict(load_profile("rtx3090_pcie4"))
    for name in WITH_CPU:
        mine = asdict(load_profile(name))
        assert {k: v for k, v in mine.items() if k not in ("name", "cpu")} == \
               {k: v for k, v in base.items() if k not in ("name", "cpu")}


def test_round_trip_and_hashable() -> None:
    p = load_profile("rtx3090_pcie4_epyc7532")
    assert CpuProfile.from_mapping(p.cpu.to_mapping()) == p.cpu  # type: ignore[union-attr]
    hash(p)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda b: b.update(dram_gbps=-5.0), "dram_gbps"),
    (lambda b: b.update(dram_gbps=0), "dram_gbps"),
    (lambda b: b.update(tflops=0.0), "tflops"),
    (lambda b: b.update(call_overhead_us=-1.0), "call_overhead_us"),
    (lambda b: b.update(host_memory_gbps=0.0), "host_memory_gbps"),
    (lambda b: b["efficiency"].update(int4=1.2), r"efficiency\.int4.*\(0, 1\]"),
    (lambda b: b["efficiency"].update(int8=0.0), r"efficiency\.int8"),
    (lambda b: b["efficiency"].update(int3=0.5), r"unknown format.*int3.*valid formats: dense"),
    (lambda b: b["source"].pop("tflops"), "no source for tflops"),
    (lambda b: b["source"]["efficiency"].pop("hqq2"), r"no source for efficiency\.hqq2"),
    (lambda b: b.pop("dram_gbps"), r"missing key\(s\) \['dram_gbps'\]"),
    (lambda b: b.update(dram_gb=1.0), r"unknown key\(s\) \['dram_gb'\]"),
    (lambda b: b.update(dram_gbps="fast"), "dram_gbps must be a number"),
])
def test_bad_blocks_refused_naming_what_is_valid(edit, match) -> None:  # type: ignore[no-untyped-def]
    b = _block()
    edit(b)
    with pytest.raises(ConfigError, match=match):
        CpuProfile.from_mapping(b)


def test_bad_block_refused_when_the_profile_loads() -> None:
    """A negative bandwidth in a profile's cpu: block fails at HardwareProfile.from_mapping,
    i.e. when the run's config is validated, before any work."""
    cfg = asdict(load_profile("rtx3090_pcie4"))
    cfg["cpu"] = _block()
    cfg["cpu"]["dram_gbps"] = -60.0
    with pytest.raises(ConfigError, match="dram_gbps"):
        HardwareProfile.from_mapping(cfg)
    cfg["cpu"] = None  # an explicit null: a copy-only profile
    assert HardwareProfile.from_mapping(cfg) == load_profile("rtx3090_pcie4")


def test_missing_format_and_missing_block() -> None:
    """A format without an efficiency names the ones the CPU has; a CPU request on a
    profile with no block names the profiles that have one."""
    b = _block()
    b["efficiency"].pop("hqq3")
    b["source"]["efficiency"].pop("hqq3")
    cpu = CpuProfile.from_mapping(b)
    with pytest.raises(ConfigError, match=r"no kernel efficiency for expert_format=hqq3; it has: "
                                          r"dense, hqq2, int4, int8, mxfp4"):
        cpu.efficiency_of("hqq3")
    with pytest.raises(ConfigError, match="hardware=rtx3090_pcie4 has no cpu: block; profiles "
                                          "with one: rtx3090_pcie4_epyc7532"):
        load_profile("rtx3090_pcie4").require_cpu("execution=cpu_on_miss")


def test_share_host_bandwidth_by_hand() -> None:
    """CPU 28.2 GB/s + link 25.6 GB/s fit 60 GB/s: unchanged. CPU 60 + link 25.6 = 85.6 over
    60: both times 60/85.6, summing to 60. Zero bandwidth is refused."""
    assert share_host_bandwidth(28.2e9, 25.6e9, 60e9) == (28.2e9, 25.6e9)
    cpu, link = share_host_bandwidth(60e9, 25.6e9, 60e9)
    assert cpu == pytest.approx(60e9 * 60 / 85.6) and link == pytest.approx(25.6e9 * 60 / 85.6)
    assert cpu + link == pytest.approx(60e9)
    with pytest.raises(ConfigError):
        share_host_bandwidth(0.0, 1.0, 1.0)
