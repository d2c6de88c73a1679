"""notebooks/analysis.ipynb is stored without outputs and runs headless on a summary."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pandas as pd
from nbclient import NotebookClient

NB = Path(__file__).resolve().parents[2] / "notebooks" / "analysis.ipynb"


def test_stored_without_outputs():
    nb = nbformat.read(NB, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_executes_headless(tmp_path, monkeypatch):
    d = tmp_path / "experiments" / "finemoe_vs_moeinfinity" / "x"
    d.mkdir(parents=True)
    pd.DataFrame({"system": ["deepspeed", "oracle"], "hit_rate": [0.4, 0.9],
                  "prediction_recall": [float("nan"), 1.0], "ttft_ms_mean": [2.0, 1.0],
                  "tpot_ms_mean": [2.0, 1.0]}).to_csv(d / "summary.csv", index=False)
    monkeypatch.setenv("MOEEXP_RESULTS", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NB, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "summary:" in text and "finemoe_vs_moeinfinity" in text
