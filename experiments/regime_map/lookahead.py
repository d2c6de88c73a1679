"""How much of the copy-bound gap a better predictor could close (issue 27): demand-only
eviction with the shipped policies and with perfect knowledge of the next k passes.

    python experiments/regime_map/lookahead.py embedded --trace results/traces/<hash>.npz
    python experiments/regime_map/lookahead.py real --seed 0

In the copy-bound regime ``prefetch_if_pays`` is an on-demand loader (its gate refuses
almost every prefetch), so its latency follows its misses, and those follow its eviction.
This replays the test split's passes (every pass, every layer, the router's experts in
index order) through one total-budget cache, demand loads only, the current layer's experts
protected, the predictor's scores handed over in the replay's order (request and iteration
starts, then each layer's router observation before its accesses; before 2026-12-04 the
observation came after them, which left the layer's own scores one pass old at its demand
loads and undercounted the model's share by ~0.03), and counts misses for:

* ``lru``: the ``lru`` policy (on-demand LRU, ``deepspeed``'s cache);
* ``model:<next_model>``: ``prefetch_if_pays``'s eviction: the ``reuse_prob`` predictor
  with that ``next_model`` (``--models``; fitted on the store split) bound to the ``next_use`` cache and the run's cost model (``rtx3090_pcie4``
  at ``--gbps``: copy-bound by default, 0.1 GB/s embedded and 3.2 GB/s real, the maps'
  copy/compute ~24 and ~36; ``--within``: its ``horizons``; ``--knn-rows``: its
  ``knn_rows``), its offers dropped (no prefetch);
* ``look{k}``: ``model``, but told each resident expert's true next use when it falls within
  the next k runs of its layer (beyond that, k runs later plus the model's wait): a
  predictor that knows the next k tokens' routing exactly;
* ``belady``: the ``belady`` policy (MIN: the whole future).

``gap`` is the share of LRU's extra misses over Belady's that a rule removes. The trace is
loaded as the regime maps load it: the embedded one from its file (``results/traces``,
``trace_hash`` in the runs CSV names it), the real one by seed (``regime_map_real``'s split).
Units: misses are expert copies; no time here.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf
from tqdm import tqdm

from moeexp.cache import CACHES
from moeexp.cache.next_use import NextUseCache
from moeexp.costmodel.hardware import load_profile
from moeexp.costmodel.roofline import CostModel
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import IterationStart, LayerObservation, RequestStart
from moeexp.predictors.reuse_features import HORIZONS, KNN_ROWS
from moeexp.traces.schema import Trace


def load(kind: str, seed: int, path: str | None) -> Trace:
    if kind == "real":
        from moeexp.traces.importers import load_imported
        arch = OmegaConf.to_container(OmegaConf.load("conf/model/gpt_oss_20b.yaml").arch)
        return load_imported("gpt_oss_20b", arch, model="gpt_oss_20b", seed=seed)
    from moeexp.traces import io
    if path is None:
        raise SystemExit("embedded: pass --trace results/traces/<hash>.npz")
    return io.load(path.removesuffix(".npz"))


def passes(test: Trace) -> list[tuple[int, int, list[np.ndarray], int]]:
    """(request, step, per-layer sorted experts, tokens T) per pass."""
    out = []
    for r in test.requests:
        for it in test.request_iterations(r.request_id):
            a, b = int(test.iter_offsets[it]), int(test.iter_offsets[it + 1])
            idx = test.topk_idx[a:b]  # [T, L, K]
            used = [np.unique(idx[:, layer]) for layer in range(idx.shape[1])]
            out.append((int(r.request_id), int(test.iter_step[it]), used, b - a))
    return out


class Lookahead(NextUseCache):
    """``next_use`` told the true next use of experts used within the next k runs of their
    layer (``nxt[p, l, e]``: the first pass >= p that uses (l, e), inf if none)."""

    def __init__(self, k: int, nxt: np.ndarray, **kw: Any) -> None:
        super().__init__(**kw)
        self.k, self.nxt, self.pass_no = k, nxt, 0

    def expected_next_use(self) -> np.ndarray:
        E0 = super().expected_next_use()
        L = self.num_layers
        first = self.pass_no + (np.arange(L) <= self.cur)  # pass of each layer's next run
        true = self.nxt[np.minimum(first, len(self.nxt) - 1), np.arange(L)]  # [L, J]
        ahead = true - first[:, None]
        delta = (np.arange(L) - self.cur - 1) % L + 1.0
        return np.where(ahead < self.k, ahead * L + delta[:, None], E0 + self.k * L)


def replay(test: Trace, store: Trace, rule: str, slots: int, nxt: np.ndarray,
           gbps: float, within: tuple[int, ...] = HORIZONS, knn_rows: int = KNN_ROWS) -> int:
    """Misses of ``rule`` over the test passes (demand loads only)."""
    d = test.dims
    L, J = d.num_layers, d.num_experts
    P = passes(test)
    kw = {"capacity_slots": slots, "num_layers": L, "num_experts": J}
    pred = None
    if rule == "lru":
        cache = CACHES.build("lru", **kw)
    elif rule == "belady":
        cache = CACHES.build("belady", prefetch_rule="aggressive", **kw)  # furthest next use
        cache.prepare_future([(layer, int(e)) for _, _, used, _ in P
                              for layer in range(L) for e in used[layer]])
    else:
        model = rule.split(":")[1] if ":" in rule else "logistic"
        model, _, flag = model.partition("/")  # <next_model>/no_horizon: horizon=false
        cache = (NextUseCache(**kw) if rule.startswith("model")
                 else Lookahead(int(rule[4:]), nxt, **kw))
        cache.fit(store)
        pred = PREDICTORS.build("reuse_prob", dims=d, spec="off", next_model=model,
                                horizon=flag != "no_horizon", horizons=within,
                                knn_rows=knn_rows)
        pred.fit(store)
        prof = dataclasses.replace(load_profile("rtx3090_pcie4"), h2d_gbps=gbps)
        pred.bind(CostModel.from_profile(prof, d), [cache])
    now = misses = 0
    by_id = {r.request_id: r for r in test.requests}
    for n, (rid, step, used, T) in enumerate(tqdm(P, desc=rule, leave=False)):
        if isinstance(cache, Lookahead):
            cache.pass_no = n
        if pred is not None:  # the replay's order: request, iteration, then per layer
            if step == 0:  # the router's observation before the layer's accesses
                _scores(cache, pred.start_request(RequestStart(request=by_id[rid])))
            _scores(cache, pred.start_iteration(IterationStart(
                request_ids=np.array([rid]), step=step, embed=None,
                token_request=np.full(T, rid))))
        for layer in range(L):
            keys = [(layer, int(e)) for e in used[layer]]
            if pred is not None:
                counts = np.bincount(used[layer], minlength=J)
                _scores(cache, pred.observe_layer(LayerObservation(  # reuse_prob reads no probs
                    layer=layer, probs=np.zeros((T, J), np.float32), experts=used[layer],
                    counts=counts)))
            for key in keys:
                hit = key in cache.resident
                if not hit:
                    misses += 1
                    if not cache.has_room(key):
                        v = cache.victim(key, set(keys), now)
                        cache.on_evict(v)
                    cache.on_insert(key, now, False)
                cache.on_access(key, now, hit)
                now += 1
    return misses


def _scores(cache: Any, pred: Any) -> None:
    """Hand a prediction's scores to the cache, as the replay's ``take`` does."""
    if pred is not None and pred.scores:
        cache.observe_scores(pred.scores)


def next_pass_use(test: Trace) -> np.ndarray:
    """float64[N + 1, L, J]: the first pass >= p that uses (l, e) (inf: none)."""
    P = passes(test)
    L, J = test.dims.num_layers, test.dims.num_experts
    nxt = np.full((len(P) + 1, L, J), np.inf)
    for p in range(len(P) - 1, -1, -1):
        nxt[p] = nxt[p + 1]
        for layer in range(L):
            nxt[p, layer, P[p][2][layer]] = p
    return nxt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=("embedded", "real"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--capacity", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--horizons", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--gbps", type=float, default=None, help="link (default: copy-bound)")
    ap.add_argument("--models", nargs="+", default=["logistic"],
                    help="reuse_prob next_model values, one `model:<name>` column each; "
                         "<name>/no_horizon: with horizon=false (look{k} reads the "
                         "shipped default, logistic)")
    ap.add_argument("--within", type=int, nargs="+", default=list(HORIZONS),
                    help="reuse_prob's horizons (the within-h models the cache picks from)")
    ap.add_argument("--knn-rows", type=int, default=KNN_ROWS,
                    help="reuse_prob's knn_rows (store tokens its kNN index keeps)")
    a = ap.parse_args()
    tr = load(a.kind, a.seed, a.trace)
    test, store = tr.split("test"), tr.split("store")
    nxt = next_pass_use(test)
    L, J = tr.dims.num_layers, tr.dims.num_experts
    rules = ["lru", *(f"model:{m}" for m in a.models), *(f"look{k}" for k in a.horizons),
             "belady"]
    print("| trace | budget | " + " | ".join(rules) + " |")
    print("|---|---|" + "---|" * len(rules))
    for cap in a.capacity:
        gbps = a.gbps or (3.2 if a.kind == "real" else 0.1)
        m = {r: replay(test, store, r, int(round(cap * L * J)), nxt, gbps, tuple(a.within),
                       a.knn_rows)
             for r in rules}
        gap = m["lru"] - m["belady"]
        cells = [f"{m[r]:,} ({(m['lru'] - m[r]) / gap:.2f})" if gap else f"{m[r]:,}"
                 for r in rules]
        name = f"real seed {a.seed}" if a.kind == "real" else f"embedded {Path(a.trace).stem[:8]}"
        print(f"| {name} | {cap:.0%} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
