"""Hardware profiles: the four shipped YAML files load; bad names and files fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeexp.costmodel import HardwareProfile, available_profiles, load_profile
from moeexp.errors import ConfigError
from moeexp.paths import CONF_DIR

SHIPPED = ["a100_80g_pcie4", "a5000_pcie4", "h100_pcie5", "rtx3090_pcie4"]


def test_shipped_profiles_load() -> None:
    """Every profile the issue asks for exists, named like its file, with sane numbers."""
    assert set(SHIPPED) <= set(available_profiles())
    for name in SHIPPED:
        p = load_profile(name)
        assert p.name == name
        assert 10 <= p.h2d_gbps <= 128 and 500 <= p.hbm_gbps <= 5000 and p.peak_tflops > 10
    assert load_profile("rtx3090_pcie4").hbm_gbps == 936.0
    assert load_profile("h100_pcie5").h2d_gbps == 2 * load_profile("a100_80g_pcie4").h2d_gbps


def test_unknown_profile_lists_valid_ones() -> None:
    with pytest.raises(ConfigError) as e:
        load_profile("rtx9090")
    assert "unknown hardware profile 'rtx9090'" in str(e.value)
    for name in SHIPPED:
        assert name in str(e.value)


def test_bad_files(tmp_path: Path) -> None:
    """A name mismatch, a missing key and an unknown key each fail naming the problem."""
    good = CONF_DIR / "hardware" / "a5000_pcie4.yaml"
    text = good.read_text()
    (tmp_path / "other.yaml").write_text(text)
    with pytest.raises(ConfigError, match="!= file name"):
        load_profile("other", conf_dir=tmp_path)
    (tmp_path / "a5000_pcie4.yaml").write_text(text.replace("hbm_gbps", "hbm_gbs"))
    with pytest.raises(ConfigError, match=r"missing key\(s\) hbm_gbps; unknown key\(s\) hbm_gbs"):
        load_profile("a5000_pcie4", conf_dir=tmp_path)


def test_invalid_values_rejected() -> None:
    base = load_profile("a5000_pcie4")
    cfg = {k: getattr(base, k) for k in base.__dataclass_fields__}
    with pytest.raises(ConfigError, match="h2d_efficiency"):
        HardwareProfile.from_mapping({**cfg, "h2d_efficiency": 1.5})
    with pytest.raises(ConfigError, match="must be a number"):
        HardwareProfile.from_mapping({**cfg, "hbm_gbps": "fast"})
    with pytest.raises(ConfigError, match="peak_tflops"):
        HardwareProfile.from_mapping({**cfg, "peak_tflops": 0})
