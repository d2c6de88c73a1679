"""Expert formats: bits per weight with their scale overhead, lossiness, what a model can take."""

from __future__ import annotations

import pytest

from moeexp.config import ModelSpec
from moeexp.costmodel.formats import (
    EXPERT_FORMATS,
    check_format_fits,
    format_spec,
    is_lossy,
    matrix_bytes,
)
from moeexp.errors import ConfigError


def test_bits_per_weight_by_hand() -> None:
    """int4: 4 + 32/128 = 4.25; mxfp4: 4 + 8/32 = 4.25; hqq2 (Mixtral-Offloading: group 16,
    8-bit scale + zero, meta fp16 pairs per 128 groups): 2 + 16/16 + 64/2048 = 3.03125; hqq3
    (group 64, 10 values per int32 = 3.2 bits): 3.2 + 16/64 + 64/8192 = 3.4578125; int8 per
    row of 4096: 8 + 16/4096; dense: the dtype's bits."""
    assert format_spec("int4").bits_per_weight(16) == 4.25
    assert format_spec("mxfp4").bits_per_weight(16) == 4.25
    assert format_spec("hqq2").bits_per_weight(16) == 3.03125
    assert format_spec("hqq3").bits_per_weight(16) == pytest.approx(3.4578125)
    assert format_spec("int8").bits_per_weight(16, row=4096) == 8 + 16 / 4096
    assert format_spec("dense").bits_per_weight(16) == 16
    assert format_spec("dense").bits_per_weight(32) == 32


def test_matrix_bytes_of_a_mixtral_down_proj() -> None:
    """(4096, 14336) as int4: 58,720,256 weights * 4.25 / 8 = 31,195,136 B; as bf16 twice the
    weights; int8: weights + 2 B per row of 14336 (4096 rows)."""
    shape = (4096, 14336)
    n = 4096 * 14336
    assert matrix_bytes("int4", shape, 16) == n * 4.25 / 8 == 31_195_136
    assert matrix_bytes("dense", shape, 16) == 2 * n
    assert matrix_bytes("int8", shape, 16) == pytest.approx(n + 2 * 4096)


def test_lossy_flags() -> None:
    """Every quantised format is lossy, dense never; gpt-oss ships MXFP4, so MXFP4 is
    lossless for it and lossy for any other model."""
    assert [f for f in EXPERT_FORMATS if is_lossy(f)] == ["int8", "int4", "mxfp4", "hqq3", "hqq2"]
    assert not is_lossy("dense", "mixtral")
    assert not is_lossy("mxfp4", "gpt_oss") and is_lossy("mxfp4", "mixtral")
    assert is_lossy("int4", "gpt_oss")


def test_formats_a_model_cannot_take_are_refused() -> None:
    """Groups must divide both trailing dims: gpt-oss-20b's 2880-wide matrices take groups
    of 16, 32, 64 but not int4's 128; the tiny model's 64-wide ones neither."""
    gpt_oss = [(2880, 5760), (2880, 2880)]
    for f in ("dense", "int8", "mxfp4", "hqq3", "hqq2"):
        check_format_fits(f, gpt_oss)
    with pytest.raises(ConfigError, match=r"int4 needs groups of 128.*\(2880, 5760\).*can take: "
                                          r"dense, int8, mxfp4, hqq3, hqq2"):
        check_format_fits("int4", gpt_oss, "model=gpt_oss_20b")
    with pytest.raises(ConfigError, match="int4"):
        check_format_fits("int4", [(256, 64), (64, 128)])
    check_format_fits("int4", [(28672, 4096), (4096, 14336)])  # Mixtral takes every format


def test_unknown_format_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="expert_format='int3'; valid: dense, int8, int4, mxfp4, "
                                          "hqq3, hqq2"):
        format_spec("int3")
    for f in EXPERT_FORMATS:
        assert ModelSpec(name="m", expert_format=f).expert_format == f
    with pytest.raises(ConfigError, match=r"model=m: expert_format='fp8'; valid"):
        ModelSpec(name="m", expert_format="fp8")
