"""The paper-testbed ladder's tables, from a hand-made summary_runs.csv."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from moeexp.analysis.ladder import RUNG_KEY, ladder_markdown, ladder_rows


def _runs() -> pd.DataFrame:
    """Rung a: finemoe_artifact 60 ms against deepspeed 100 ms on every seed (-40 %), bytes
    equal; rung f: finemoe 120 ms (+20 %), twice the bytes."""
    rows = []
    for seed in range(3):
        for rung, system, tpot, nbytes in (("a_artifact", "deepspeed", 100.0, 10.0),
                                           ("a_artifact", "finemoe_artifact", 60.0, 10.0),
                                           ("f_one_device", "deepspeed", 100.0, 10.0),
                                           ("f_one_device", "finemoe", 120.0, 20.0)):
            rows.append({"dataset.seed": seed, "cost_as_model": "mixtral_8x7b", RUNG_KEY: rung,
                         "system": system, "status": "ok", "tpot_ms_mean": tpot,
                         "ttft_ms_mean": tpot, "h2d_bytes_total": nbytes,
                         "stall_ms_total": tpot - 50})
    return pd.DataFrame(rows)


def test_each_rung_pairs_finemoe_with_the_baselines() -> None:
    """-40 % and +20 % on every seed: zero-width intervals; bytes x1.00 and x2.00; a
    baseline that did not run is a dash."""
    df = ladder_rows(_runs()).set_index("rung")
    assert df.loc["a_artifact", "finemoe"] == "finemoe_artifact"
    assert df.loc["a_artifact", "vs deepspeed"] == "-40.0% ±0.0"
    assert df.loc["f_one_device", "vs deepspeed"] == "+20.0% ±0.0"
    assert df.loc["a_artifact", "bytes / DS"] == "×1.00"
    assert df.loc["f_one_device", "bytes / DS"] == "×2.00"
    assert df.loc["a_artifact", "stall / DS"] == "×0.20"
    assert df.loc["a_artifact", "vs promoe"] == "–"
    assert (df["n"] == 3).all()


def test_markdown_names_both_latencies_and_the_paper(tmp_path: Path) -> None:
    _runs().to_csv(tmp_path / "summary_runs.csv", index=False)
    text = ladder_markdown(tmp_path)
    assert "FineMoE's TPOT change" in text and "FineMoE's TTFT change" in text
    assert "deepspeed -46%" in text
