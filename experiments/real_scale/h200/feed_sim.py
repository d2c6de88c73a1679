"""Re-simulate real_scale run 3's systems with the simulator's predictor-feed term.

``python experiments/real_scale/h200/feed_sim.py FEED_MS``: the store/test split and the
truncation of ``moeexp.bench.real_scale`` (64 x 128 store passes, 4 x 32 test passes), run 3's
calibration (``run3_calibrate/calibration.json``), each prefetching system of
``run3_systems/systems.csv`` simulated without and with ``predictor_feed_s = FEED_MS`` ms per
MoE layer (``deepspeed`` has no predictor: none), against the engine's TPOT of that run.
Routing source: the real gpt-oss-20b trace; cost regime: the H200 engine's calibration.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pandas as pd

from moeexp.bench import real_scale as rs
from moeexp.costmodel.fitted import CalibratedCostModel, CalibratedProfile
from moeexp.paths import load_group_yaml
from moeexp.simulator import simulate
from moeexp.traces.importers import load_imported

HERE = Path(__file__).resolve().parent


def main(feed_ms: float) -> None:
    arch = dict(load_group_yaml("model", rs.MODEL)["arch"])
    trace = load_imported(rs.MODEL, arch, model=rs.MODEL, seed=0)
    calib = CalibratedProfile.load(HERE / "run3_calibrate" / "calibration.json")
    dims = dataclasses.replace(trace.dims, expert_bytes=calib.expert_bytes)  # bf16 engine
    store = dataclasses.replace(rs.truncate(trace.split("store"), 64, 128), dims=dims)
    test = dataclasses.replace(rs.truncate(trace.split("test"), 4, 32), dims=dims)
    cost = CalibratedCostModel.from_calibration(calib, dims, dtype_bytes=2)
    engine = pd.read_csv(HERE / "run3_systems" / "systems.csv")
    fits: dict = {}
    for r in engine[engine.status == "ok"].itertuples():
        if r.system == "no_offload":
            continue
        pred, _, pol, _, _ = rs._fitted(r.system, r.capacity, store, dims, fits)
        feed = 0.0 if pred.name == "none" else feed_ms * 1e-3
        tpot = [simulate(test, copy.deepcopy(pred), copy.deepcopy(pol), cost, progress=False,
                         predictor_feed_s=f).metrics["tpot_ms_mean"] for f in (0.0, feed)]
        e = r.engine_tpot_ms_mean
        print(f"{r.system:20s} {r.capacity:.2f} engine {e:6.1f}  sim {tpot[0]:6.1f} "
              f"({100 * (tpot[0] / e - 1):+5.1f} %)  sim+feed {tpot[1]:6.1f} "
              f"({100 * (tpot[1] / e - 1):+5.1f} %)", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]))
