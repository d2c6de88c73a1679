"""FineMoE's baseline comparison: relative changes per matching row, and the markdown."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from moeexp.tracking.compare import (
    PAPER_CHANGES,
    baseline_changes,
    comparison_markdown,
    match_keys,
)


def _df() -> pd.DataFrame:
    systems = ["deepspeed", "mixtral_offloading", "promoe", "moe_infinity", "finemoe"]
    return pd.DataFrame({
        "run": [f"{i}_{s}" for i, s in enumerate(systems * 2)],
        "system": systems * 2,
        "dataset": ["sharegpt"] * 5 + ["lmsys"] * 5,
        "predictor": ["none", "speculative_gate", "promoe", "eam", "expert_map"] * 2,
        "ttft_ms_mean": [10.0, 8, 7, 6, 3, 20, 16, 14, 12, 5],
        "tpot_ms_mean": [5.0, 4, 3.5, 3, 2.5] * 2,
        "prediction_recall": [0.0, 0.7, 0.6, 0.5, 0.8] * 2,
        "hit_rate": [0.3, 0.5, 0.5, 0.5, 0.6] * 2,
    })


def test_changes_match_the_same_dataset() -> None:
    """finemoe/sharegpt: TTFT 3 vs deepspeed 10 -> -70%; lmsys 5 vs 20 -> -75% (rows are
    matched on dataset, never across); recall 0.8 vs MO 0.7 -> +14.29% and +10 pp; vs
    deepspeed's recall 0 -> NaN (undefined, not infinite)."""
    assert match_keys(_df()) == ["dataset"]
    ch = baseline_changes(_df()).set_index(["system", "dataset"])
    assert ch.loc[("finemoe", "sharegpt"), "ttft_vs_deepspeed_pct"] == pytest.approx(-70.0)
    assert ch.loc[("finemoe", "lmsys"), "ttft_vs_deepspeed_pct"] == pytest.approx(-75.0)
    assert ch.loc[("finemoe", "lmsys"), "tpot_vs_moe_infinity_pct"] == pytest.approx(
        100 * (2.5 / 3 - 1))
    assert ch.loc[("finemoe", "sharegpt"), "recall_vs_mixtral_offloading_pct"] == \
        pytest.approx(100 / 7)
    assert ch.loc[("finemoe", "sharegpt"), "recall_vs_mixtral_offloading_pp"] == \
        pytest.approx(10.0)
    assert math.isnan(ch.loc[("finemoe", "sharegpt"), "recall_vs_deepspeed_pct"])
    assert math.isnan(ch.loc[("promoe", "sharegpt"), "ttft_vs_promoe_pct"])  # never itself


def test_a_key_that_follows_the_system_is_not_matched() -> None:
    """A bundle column (one value per system) must not prevent matching the baseline row."""
    df = _df().assign(**{"experiment/online": lambda d: d["system"] + "_bundle"})
    assert match_keys(df) == ["dataset"]
    ch = baseline_changes(df)
    own = ch["system"] == "deepspeed"  # deepspeed's own rows: never compared with themselves
    assert not ch.loc[~own, "ttft_vs_deepspeed_pct"].isna().any()
    assert ch.loc[own, "ttft_vs_deepspeed_pct"].isna().all()


def test_markdown_has_paper_numbers_and_is_empty_without_baselines() -> None:
    """The paper's -74% TTFT vs DeepSpeed sits beside the measured -70.0%; a sweep without
    any of the four baselines (e.g. an ablation) gets no extra section."""
    md = comparison_markdown(_df())
    assert "| sharegpt | deepspeed | 1 | -70.0% | -74.0% |" in md
    assert PAPER_CHANGES["recall"]["moe_infinity"] == 68.0 and "+68.0%" in md
    abl = pd.DataFrame({"system": ["map_t", "map_ts"], "ttft_ms_mean": [1.0, 2.0]})
    assert comparison_markdown(abl) == ""
    assert comparison_markdown(pd.DataFrame({"x": [1]})) == ""
