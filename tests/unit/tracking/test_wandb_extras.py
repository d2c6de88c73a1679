"""W&B mirrors a run's series (tables), figures and trace reference; checked on local files.

wandb 0.31 cannot read its ``.wandb`` files back, so each check reads what the offline run
wrote next to it: our ``wandb_logged.json`` and the run's own ``files/media`` directory.
"""

from __future__ import annotations

import json

import numpy as np

from moeexp.tracking.loggers import LOGGED_FILE, LOGGERS
from moeexp.tracking.run_dir import write_metrics, write_series


def _png(path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1], [0, 1])
    fig.savefig(path)
    plt.close(fig)


def test_series_tables_figures_and_trace_reference(tmp_path, monkeypatch):
    """Two series of 3 and 2 steps -> tables series/ttft_ms (3 rows) and series/tpot_ms
    (2 rows) with columns step, value; one PNG -> figures/['hit.png']; the trace hash 'abc'
    with trace.cache_dir=<dir> -> trace {path: <dir>/abc.npz, content_hash: abc, exists}."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir, traces = tmp_path / "run", tmp_path / "traces"
    run_dir.mkdir()
    traces.mkdir()
    (traces / "abc.npz").write_bytes(b"not really a trace")
    metrics = {"hit_rate": 0.5, "trace_hash": "abc", "system": "deepspeed"}
    write_metrics(run_dir, metrics)
    write_series(run_dir, {"ttft_ms": [1.0, 2.0, 3.5], "tpot_ms": np.array([0.25, 0.5])})
    _png(run_dir / "hit.png")
    config = {"trace": {"cache_dir": str(traces)}, "system": {"name": "deepspeed"}}
    lg = LOGGERS.build("wandb")
    lg.start(run_dir, config=config, group="exp", name="r", tags=["system:deepspeed"])
    lg.log_metrics(metrics)
    lg.finish()

    rec = json.loads((run_dir / LOGGED_FILE).read_text())
    assert rec["tables"] == {"series/ttft_ms": {"columns": ["step", "value"], "rows": 3},
                             "series/tpot_ms": {"columns": ["step", "value"], "rows": 2}}
    assert rec["figures"] == ["hit.png"]
    assert rec["trace"] == {"path": str((traces / "abc.npz").resolve()), "content_hash": "abc",
                            "exists": True}
    assert rec["group"] == "exp" and rec["finished"] and rec["metrics"]["hit_rate"] == 0.5

    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    media = offline / "files" / "media"
    tables = sorted(p.name for p in media.glob("table/series/*.table.json"))
    assert len(tables) == 2 and any(t.startswith("ttft_ms") for t in tables)
    ttft = next(media.glob("table/series/ttft_ms*.table.json"))
    data = json.loads(ttft.read_text())
    assert data["columns"] == ["step", "value"] and data["data"] == [[0, 1.0], [1, 2.0], [2, 3.5]]
    assert list(media.glob("images/figures/hit*.png"))


def test_missing_trace_file_is_recorded_not_fatal(tmp_path, monkeypatch):
    """A trace hash whose file is not in the cache dir: the reference is recorded with
    exists=false (summary keys only, no artifact); no series file -> no tables."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    lg = LOGGERS.build("wandb")
    lg.start(tmp_path, config={"trace": {"cache_dir": str(tmp_path / "none")}}, group="g",
             name="n", tags=[])
    lg.log_metrics({"trace_hash": "def"})
    lg.finish()
    rec = json.loads((tmp_path / LOGGED_FILE).read_text())
    assert rec["trace"]["exists"] is False and rec["trace"]["content_hash"] == "def"
    assert "tables" not in rec and "figures" not in rec
