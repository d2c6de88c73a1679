"""Issue 27, stage 3: is a learned (LRB-style) next-use model better than ``reuse_prob``'s?

    python experiments/regime_map/lrb_offline.py embedded TRACE_STEM [SEED]
    python experiments/regime_map/lrb_offline.py real - SEED

Offline, before any wiring. Each (pass t, layer l, expert e) of a split walked in replay order
is one row: the features computable online at the end of pass t - 1 and the label, the number
of passes until layer l uses e again (1: the next pass; censored at the split's end). Two
scores of "next use":

* ``logistic``: ``reuse_prob``'s next-pass model (last, fast, slow, logpop;
  :func:`moeexp.predictors.reuse_features.fit_logistic`), whose P the ``next_use`` cache turns
  into a geometric expected wait;
* ``hgb``: a HistGradientBoostingRegressor of log(reuse distance) on
  :data:`moeexp.predictors.lrb.FEATURES` (LRB, NSDI'20);
* ``table``: the same on the discrete :data:`moeexp.predictors.lrb.TABLE` features (what
  ``reuse_prob`` ``next_model: lrb`` tabulates and looks up at run time).

Both fitted on store folds (3 folds by request; fold k scored by the model of the others),
then on the whole store and scored on the test split (for reporting only). Printed per score:
ROC AUC of "used at the next pass", and Belady agreement: over random pairs of rows of the same
pass with different true distances, the share ordered the same way by the score.
"""

from __future__ import annotations

import sys

import numpy as np
from sklearn.metrics import roc_auc_score

from moeexp.predictors.lrb import LrbState, fit_lrb, table_rows, walk_rows
from moeexp.predictors.reuse_features import fit_logistic, sigmoid
from moeexp.traces.schema import Trace


def _load(kind: str, stem: str, seed: int) -> Trace:
    if kind == "embedded":
        from moeexp.traces import io

        return io.load(stem)
    from omegaconf import OmegaConf

    from moeexp.traces.importers import load_imported

    arch = OmegaConf.to_container(OmegaConf.load("conf/model/gpt_oss_20b.yaml").arch)
    return load_imported("gpt_oss_20b", arch, model="gpt_oss_20b", seed=seed)


def _agreement(score: np.ndarray, dist: np.ndarray, group: np.ndarray,
               rng: np.random.Generator) -> float:
    """Share of random same-pass pairs (different true distances) that ``score`` (higher:
    later next use) orders as ``dist`` does."""
    idx = np.arange(len(dist))
    other = idx.copy()
    for g in np.unique(group):
        m = np.nonzero(group == g)[0]
        other[m] = rng.permutation(m)
    keep = dist[idx] != dist[other]
    a, b = idx[keep], other[keep]
    return float(np.mean(np.sign(score[a] - score[b]) == np.sign(dist[a] - dist[b])))


def _scores(train: tuple, test: tuple) -> dict[str, np.ndarray]:
    Xtr, _, dtr, _ = train
    Xte = test[0]
    lo = fit_logistic(Xtr[:, :4], (dtr == 1).astype(float), 4)
    model = fit_lrb(Xtr, dtr)
    table = fit_lrb(table_rows(Xtr), dtr)
    return {"logistic": -sigmoid(Xte[:, :4] @ lo.coef + lo.intercept),
            "hgb": model.predict(Xte), "table": table.predict(table_rows(Xte))}


def _report(name: str, sc: dict[str, np.ndarray], dist: np.ndarray, group: np.ndarray) -> None:
    rng = np.random.default_rng(0)
    for k, s in sc.items():
        auc = roc_auc_score((dist == 1).astype(int), -s)
        agr = _agreement(s, dist, group, rng)
        print(f"{name:10s} {k:9s} AUC(next pass) {auc:.3f}  Belady agreement {agr:.3f}")


def main(kind: str, stem: str, seed: str = "0") -> None:
    trace = _load(kind, stem, int(seed))
    store = trace.split("store")
    X, rid, dist, group = walk_rows(store, LrbState)
    folds = np.array([r % 3 for r in rid])
    for k in range(3):
        tr, te = folds != k, folds == k
        sc = _scores((X[tr], rid[tr], dist[tr], group[tr]), (X[te],))
        _report(f"fold {k}", sc, dist[te], group[te])
    test = trace.split("test")
    Xt, _, dt, gt = walk_rows(test, LrbState, check_store=False)
    _report("test", _scores((X, rid, dist, group), (Xt,)), dt, gt)


if __name__ == "__main__":
    main(*sys.argv[1:])
