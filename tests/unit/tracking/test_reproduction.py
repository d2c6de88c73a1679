"""The reproduction table: claims and settings read from hand-made sweep summaries."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from moeexp.tracking.repro_data import by_regime, load, paired
from moeexp.tracking.reproduction import BEGIN, END, NO_WHY, chain_cell, write_table


def _sweep(root: Path, name: str, rows: list[dict[str, object]], sha: str = "abcdef123") -> Path:
    """A sweep directory with ``summary_runs.csv`` and one ``env.json`` per run."""
    d = root / name
    d.mkdir(parents=True)
    df = pd.DataFrame(rows)
    df.insert(0, "run", [f"{i}_{r['system']}" for i, r in enumerate(rows)])
    for run in df["run"]:
        (d / run).mkdir()
        (d / run / "env.json").write_text(json.dumps({"git": {"sha": sha, "dirty": False}}))
    df.to_csv(d / "summary_runs.csv", index=False)
    return d


def _fig10(model: str = "tiny", proj: str = "") -> list[dict[str, object]]:
    """deepspeed TPOT 10 ms on seeds 0-2; finemoe 8, 8.2, 7.8 (changes -20, -18, -22 %)."""
    rows = []
    for seed, fm in enumerate((8.0, 8.2, 7.8)):
        for system, tpot in (("deepspeed", 10.0), ("finemoe", fm)):
            rows.append({"dataset.seed": seed, "system": system, "experiment":
                         "finemoe_vs_moeinfinity", "model": model, "cost_as_model": proj,
                         "status": "ok", "cache_capacity": 0.25, "tpot_ms_mean": tpot,
                         "ttft_ms_mean": 2 * tpot, "prediction_recall": 0.5,
                         "h2d_bytes_total": 100.0 if system == "finemoe" else 50.0,
                         "h2d_prefetch_bytes_total": 40.0, "prefetch_waste_bytes": 10.0,
                         "stall_ms_total": 1.0, "copy_to_compute": 0.3})
    return rows


def test_regime_from_model_and_projection() -> None:
    """gpt-oss-20b routing is the real trace; a cost projection is the projected setting;
    a sweep holding two settings splits into both, in order."""
    def regimes(rows: list[dict[str, object]]) -> list[str]:
        return [g for g, _ in by_regime(pd.DataFrame(rows))]

    assert regimes(_fig10()) == ["embedded"]
    assert regimes(_fig10(proj="mixtral_8x7b")) == ["projected"]
    assert regimes(_fig10(model="gpt_oss_20b")) == ["real"]
    assert regimes(_fig10() + _fig10(proj="mixtral_8x7b")) == ["embedded", "projected"]


def test_the_testbed_column_is_rung_a_on_the_mixtral_projection(tmp_path: Path) -> None:
    """A paper_testbed sweep: only rung (a) on the Mixtral projection is the ``testbed``
    setting (its other rungs and projections are left out); FineMoE is finemoe_artifact
    there, and the MoE-Infinity rows compare against moe_infinity_artifact."""
    rows = []
    for rung, proj in (("a_artifact", "mixtral_8x7b"), ("b_no_leak", "mixtral_8x7b"),
                       ("a_artifact", "qwen1_5_moe_a2_7b")):
        for r in _fig10(proj=proj):
            rows.append({**r, "experiment": "paper_testbed", "experiment/paper_testbed": rung,
                         "cache_capacity": 0.18,
                         "system": {"finemoe": "finemoe_artifact"}.get(r["system"], r["system"])})
    inf = [{**r, "system": "moe_infinity_artifact", "tpot_ms_mean": 16.0}
           for r in rows if r["system"] == "deepspeed"]
    d = _sweep(tmp_path, "testbed", rows + inf)
    data = load([d])
    assert list(data) == [("fig10", "testbed")] and len(data[("fig10", "testbed")].runs) == 9
    out = tmp_path / "README.md"
    write_table([d], out)
    text = out.read_text()
    ds = next(line for line in text.splitlines() if line.startswith("| `a-tpot-deepspeed`"))
    assert ds.count("not measured") == 3 and "-20.0 % [-25.0, -15.0]" in ds
    assert "(finemoe_artifact)" in ds
    mi = next(line for line in text.splitlines() if line.startswith("| `a-tpot-moe_infinity`"))
    assert "-50.0 %" in mi and "(finemoe_artifact vs moe_infinity_artifact)" in mi


def test_a_sweep_over_two_settings_splits(tmp_path: Path) -> None:
    """The default experiment sweeps the embedded costs and the Mixtral projection over the
    same traces: load() files each half under its own setting, both from the one dir."""
    d = _sweep(tmp_path, "both", _fig10() + _fig10(proj="mixtral_8x7b"))
    data = load([d])
    assert set(data) == {("fig10", "embedded"), ("fig10", "projected")}
    for regime in ("embedded", "projected"):
        s = data[("fig10", regime)]
        assert len(s.runs) == 6 and s.dirs == [str(d)]
    proj = data[("fig10", "projected")].runs["cost_as_model"]
    assert (proj == "mixtral_8x7b").all()


def test_paired_change_is_per_seed() -> None:
    """Changes -20, -18, -22 % -> mean -20, half-width t(0.975, 2) * 2 / sqrt(3) = 4.968."""
    st = paired(pd.DataFrame(_fig10()), "system", "finemoe", "deepspeed", "tpot_ms_mean")
    assert st.n == 3
    assert st.mean == pytest.approx(-20.0)
    assert st.half == pytest.approx(4.302653 * 2 / 3 ** 0.5, rel=1e-6)
    assert st.sign() == -1


def test_chain_signs() -> None:
    """Hit rates lru 0.30 < lfu 0.40 (every seed +0.1) ≈ finemoe (+0.05, -0.05, 0): partly;
    a label reported not applicable is listed, not ranked."""
    rows = []
    for seed, fm in enumerate((0.45, 0.35, 0.40)):
        for cache, hit in (("lru", 0.30 + seed / 100), ("lfu", 0.40), ("finemoe", fm)):
            rows.append({"dataset.seed": seed, "cache": cache, "status": "ok", "hit_rate": hit})
    rows.append({"dataset.seed": 0, "cache": "belady", "status": "not_applicable",
                 "not_applicable_reason": "no future", "hit_rate": float("nan")})
    cell = chain_cell(pd.DataFrame(rows), "cache", ["lru", "lfu", "finemoe", "belady"],
                      "hit_rate", higher_better=True)
    assert cell.startswith("**partly**: lru 0.310")
    assert "< lfu 0.400" in cell and "≈ finemoe 0.400" in cell
    assert cell.endswith("(n/a: belady)")


def test_table_is_written_and_keeps_the_why(tmp_path: Path) -> None:
    """The block goes between the markers, the text around it and a hand-written "why"
    survive a regeneration; sources name the sweep dir and the runs' commit."""
    d = _sweep(tmp_path, "fig10", _fig10())
    out = tmp_path / "README.md"
    out.write_text("# Intro\n\nkept\n")
    write_table([d], out)
    text = out.read_text()
    assert text.startswith("# Intro\n\nkept\n") and BEGIN in text and END in text
    row = next(line for line in text.splitlines() if line.startswith("| `a-tpot-deepspeed`"))
    assert "-20.0 % [-25.0, -15.0] **agrees in sign**" in row
    assert "bytes ×2.00" in row and "waste 25 %" in row and row.endswith(f"| {NO_WHY} |")
    assert f"`{d}`" in text and "abcdef1" in text
    assert "| `a-tpot-deepspeed` | Fig. 10" in text
    out.write_text(text.replace(f"{NO_WHY} |", "hand-written reason |", 1) + "\ntail\n")
    write_table([d], out)
    again = out.read_text()
    assert "hand-written reason" in again and again.rstrip().endswith("tail")
    assert again.count(BEGIN) == 1


def test_load_pools_sweeps_and_skips_others(tmp_path: Path) -> None:
    """Two sweeps of one claim and setting are pooled; an unknown experiment is skipped."""
    a = _sweep(tmp_path, "a", _fig10())
    b = _sweep(tmp_path, "b", [{**r, "experiment": "something_else"} for r in _fig10()])
    c = _sweep(tmp_path, "c", _fig10(), sha="1234567ff")
    data = load([a, b, c])
    assert list(data) == [("fig10", "embedded")]
    assert len(data[("fig10", "embedded")].runs) == 12
    assert data[("fig10", "embedded")].commits == ["abcdef1", "1234567"]


def test_ablation_adopts_the_fig10_finemoe_point(tmp_path: Path) -> None:
    """A cache ablation swept over lru, lfu only gets FineMoE's own cache point from the
    Fig. 10 sweep of the same setting (the same configuration), marked in its notes; an
    ablation that measured the point keeps its own."""
    fig10 = _sweep(tmp_path, "fig10", _fig10())
    abl = [{**r, "experiment": "cache_ablation", "cache": c} for c in ("lru", "lfu")
           for r in _fig10() if r["system"] == "finemoe"]
    cabl = _sweep(tmp_path, "cabl", abl)
    s = load([fig10, cabl])[("cache", "embedded")]
    assert sorted(s.runs["cache"].astype(str).unique()) == ["finemoe", "lfu", "lru"]
    assert len(s.runs) == 9 and s.dirs == [str(cabl)]
    assert "adopted as cache=finemoe" in s.notes[0]
    own = _sweep(tmp_path, "own", abl + [{**abl[0], "cache": "finemoe"}])
    assert load([fig10, own])[("cache", "embedded")].notes == []
