"""How well could a richer model rank eviction (issue 27, twenty-third stage)? The within-h
models of ``reuse_prob`` against a gradient-boosted classifier, with and without five more
per-expert features, on the store split alone.

    python experiments/regime_map/within_models.py --seed 0
    python experiments/regime_map/within_models.py --seed 0 --knn-rows 1000000   # the whole store's kNN

It fits the ``reuse_prob`` predictor (its defaults; the speculative gates off) on the real
gpt-oss-20b trace's store split and keeps the rows and labels each of its ``next`` and
``within[h]`` models was fitted on. Each row set is split in time, the first 70 % to fit and
the last 30 % held out, so no test request is ever read. Per model it prints the held-out
log-loss and ROC AUC of

* ``logistic``: scikit-learn's logistic regression on the shipped features (the model
  ``reuse_prob`` ships, refitted on the 70 %);
* ``logistic+5``: the same with five more features (below);
* ``gbm``: scikit-learn's ``HistGradientBoostingClassifier`` on the shipped features;
* ``gbm+5``: the same with the five.

The five, per expert ``(l, e)`` before the pass (as the shipped state is): a 100-pass use
frequency (decay 0.99), the log of its uses since the start over the passes since it,
the log of the gap between its last two uses (LRB's second delta), its request's own use
rate so far and the log of its age in passes. Units: probabilities; no time here.
"""

from __future__ import annotations

import argparse

import numpy as np
from omegaconf import OmegaConf
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss, roc_auc_score

import moeexp.predictors.reuse_features as rf
from moeexp.predictors import PREDICTORS
from moeexp.traces.importers import load_imported

NEVER = 2048.0  #: the gap and age of an expert not used yet (passes)


def captured_rows(seed: int, knn_rows: int = rf.KNN_ROWS
                  ) -> tuple[list[tuple[np.ndarray, np.ndarray]], object]:
    """The (X, y) of the first 1 + len(HORIZONS) logistic fits ``reuse_prob``'s fit makes
    (``next``, then ``within[h]``; :func:`moeexp.predictors.reuse_features._fit_next`), and
    the store split."""
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    shipped = rf.fit_logistic

    def keep(X: np.ndarray, y: np.ndarray, n: int) -> rf.Logistic:
        rows.append((X.copy(), y.copy()))
        return shipped(X, y, n)

    arch = OmegaConf.to_container(OmegaConf.load("conf/model/gpt_oss_20b.yaml").arch)
    store = load_imported("gpt_oss_20b", arch, model="gpt_oss_20b", seed=seed).split("store")
    rf.fit_logistic = keep
    try:
        PREDICTORS.build("reuse_prob", dims=store.dims, spec="off", knn_rows=knn_rows).fit(store)
    finally:
        rf.fit_logistic = shipped
    return rows[:1 + len(rf.HORIZONS)], store


def five_features(store) -> np.ndarray:  # noqa: ANN001 (a Trace)
    """float64[rows, 5]: the five extra features of the ``next`` model's rows, in the fit's
    order (the decode passes the fit keeps, each L x J in (layer, expert) order)."""
    its = rf.store_iterations(store)
    passes = [rf._pass_used(store, it) for it in its]
    req = store.iter_request[its]
    L, J = passes[0][0].shape
    stride = max(1, int(np.ceil(len(passes) * L * J / rf.MAX_ROWS)))
    freq, count = np.zeros((L, J)), np.zeros((L, J))
    last, prev = np.full((L, J), -1.0), np.full((L, J), -1.0)
    in_req, req_passes, out = np.zeros((L, J)), 0, []
    for n, (used, _, T) in enumerate(passes):
        if n > 0 and req[n] != req[n - 1]:
            in_req[:], req_passes = 0.0, 0
        if T == 1 and n % stride == 0:
            gap = np.where(prev >= 0, last - prev, NEVER)
            age = np.where(last >= 0, n - last, NEVER)
            out.append(np.stack([freq, np.log1p(count) - np.log1p(n), np.log1p(gap),
                                 (in_req + 0.5) / (req_passes + 1.0), np.log1p(age)],
                                axis=-1).reshape(-1, 5))
        u = used > 0
        freq = 0.99 * freq + 0.01 * used
        prev, last = np.where(u, last, prev), np.where(u, float(n), last)
        count += used
        in_req += used
        req_passes += 1
    return np.concatenate(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="the real trace's store/test split")
    ap.add_argument("--knn-rows", type=int, default=rf.KNN_ROWS,
                    help="reuse_prob's knn_rows (store tokens its kNN index keeps)")
    a = ap.parse_args()
    rows, store = captured_rows(a.seed, a.knn_rows)
    extra = five_features(store)
    names = ["next pass"] + [f"within {h}" for h in rf.HORIZONS]
    print("| model | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    cells: dict[str, list[str]] = {k: [] for k in ("logistic", "logistic+5", "gbm", "gbm+5")}
    for X, y in rows:
        if len(X) != len(extra):
            raise SystemExit(f"rows {len(X)} and extra features {len(extra)} differ")
        k = int(0.7 * len(y))
        for name, Z in (("logistic", X), ("logistic+5", np.hstack([X, extra])),
                        ("gbm", X), ("gbm+5", np.hstack([X, extra]))):
            m = (HistGradientBoostingClassifier(random_state=0) if name.startswith("gbm")
                 else LogisticRegression(C=1.0, max_iter=500))
            p = m.fit(Z[:k], y[:k]).predict_proba(Z[k:])[:, 1]
            cells[name].append(f"{log_loss(y[k:], p):.4f} / {roc_auc_score(y[k:], p):.4f}")
    for name, c in cells.items():
        print(f"| {name} (log-loss / AUC) | " + " | ".join(c) + " |", flush=True)


if __name__ == "__main__":
    main()
