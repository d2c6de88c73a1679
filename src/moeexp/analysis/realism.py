"""The routing-realism card: how each routing source routes, side by side.

``python -m moeexp.analysis.realism [--trace DIR ...] [--out DIR]`` computes, on the
**decode tokens** of every routing source (the embedded ``tiny`` model's trace, recorded on
the default experiment's prompts; the shipped gpt-oss-20b trace; any interchange directory
given with ``--trace``), and writes ``card.json`` and ``README.md`` (default
``experiments/routing_realism/``):

- ``temporal_reuse``: share of a layer's top-k experts that the previous decode token of
  the same request also chose (mean over tokens and layers), and ``/ random`` = that share
  over K/J (what independent uniform routing gives);
- ``interlayer_recall``: predictability of layer l+1 from layer l: a table of
  P(expert e at l+1 | expert a at l) counted on the store split's tokens, the K most likely
  experts given a token's layer-l experts (summed rows) compared with its real layer-l+1
  experts on the test split (recall, mean over tokens and layers; random = K/J);
- ``top1_weight``: mean routing weight of the first of the K selected experts (the
  weights as the trace holds them: renormalised over the K);
- ``load_balance``: normalised entropy of each layer's expert usage (1 = perfectly even),
  mean over layers;
- ``lru_hit_rate@{12.5,25,50}%``: on-demand LRU (system ``deepspeed``: one global pool,
  the running layer's experts protected) at that share of all experts, replayed by the
  simulator over the test split (hit rate only: no cost regime involved).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeexp.atomic import write_json, write_text
from moeexp.cache import build_cache
from moeexp.costmodel import CostModel, load_profile
from moeexp.paths import REPO_DIR
from moeexp.predictors import build_predictor
from moeexp.simulator import simulate
from moeexp.traces.schema import Trace

log = logging.getLogger(__name__)
BUDGETS = (0.125, 0.25, 0.5)
OUT_DIR = REPO_DIR / "experiments" / "routing_realism"


@dataclass(frozen=True)
class Source:
    """One routing source: its label, how it was obtained, and its trace (store + test)."""

    label: str
    origin: str
    trace: Trace


def decode_rows(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(int64[n] token rows of decode iterations in request/step order, int64[n] request)."""
    order = np.lexsort((trace.iter_step, trace.iter_request))
    its = [int(i) for i in order if trace.iter_step[i] > 0]
    rows = np.asarray([int(trace.iter_offsets[i]) for i in its], dtype=np.int64)
    return rows, trace.iter_request[its].astype(np.int64)


def temporal_reuse(trace: Trace) -> float:
    """Mean share of a token's top-k experts (per layer) also chosen by the previous
    decode token of the same request."""
    rows, req = decode_rows(trace)
    same = req[1:] == req[:-1]
    cur, prev = trace.topk_idx[rows[1:][same]], trace.topk_idx[rows[:-1][same]]  # [n, L, K]
    shared = (cur[..., :, None] == prev[..., None, :]).any(-1).sum(-1)  # [n, L]
    return float(shared.mean() / trace.dims.top_k)


def interlayer_recall(store: Trace, test: Trace) -> float:
    """Recall of layer l+1's experts predicted from layer l's through store co-counts."""
    L, J, K = store.dims.num_layers, store.dims.num_experts, store.dims.top_k
    table = np.zeros((L - 1, J, J))
    s_rows, _ = decode_rows(store)
    idx = store.topk_idx[s_rows].astype(np.int64)  # [n, L, K]
    for layer in range(L - 1):
        a = np.repeat(idx[:, layer], K, axis=1).reshape(-1)
        b = np.tile(idx[:, layer + 1], (1, K)).reshape(-1)
        np.add.at(table[layer], (a, b), 1.0)
    t_rows, _ = decode_rows(test)
    tidx = test.topk_idx[t_rows].astype(np.int64)
    recalls = []
    for layer in range(L - 1):
        scores = table[layer][tidx[:, layer]].sum(axis=1)  # [n, J]
        pred = np.argsort(-scores, axis=1, kind="stable")[:, :K]
        hit = (pred[:, :, None] == tidx[:, layer + 1][:, None, :]).any(-1).sum(-1)
        recalls.append(hit.mean() / K)
    return float(np.mean(recalls))


def top1_weight(trace: Trace) -> float:
    rows, _ = decode_rows(trace)
    return float(trace.topk_weight[rows].astype(np.float64).max(axis=-1).mean())


def load_balance(trace: Trace) -> float:
    rows, _ = decode_rows(trace)
    J = trace.dims.num_experts
    ents = []
    for layer in range(trace.dims.num_layers):
        p = np.bincount(trace.topk_idx[rows, layer].reshape(-1), minlength=J) / (len(rows) * trace.dims.top_k)
        nz = p[p > 0]
        ents.append(float(-(nz * np.log(nz)).sum() / np.log(J)))
    return float(np.mean(ents))


def lru_hit_rate(store: Trace, test: Trace, budget: float) -> float:
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), test.dims)
    pred = build_predictor({"name": "none"}, test.dims)
    cache = build_cache({"name": "lru", "capacity": budget}, test.dims)
    pred.fit(store)
    cache.fit(store)
    return float(simulate(test, pred, cache, cost, progress=False).metrics["hit_rate"])


def card_row(src: Source) -> dict[str, Any]:
    """Every statistic of the module docstring for one source."""
    tr = src.trace
    store, test = tr.split("store"), tr.split("test")
    d = tr.dims
    rows, _ = decode_rows(tr)
    reuse = temporal_reuse(tr)
    inter = interlayer_recall(store, test)
    row: dict[str, Any] = {
        "source": src.label, "origin": src.origin, "L": d.num_layers, "J": d.num_experts,
        "K": d.top_k, "requests": len(tr.requests), "decode_tokens": int(len(rows)),
        "temporal_reuse": reuse, "temporal_reuse_vs_random": reuse / (d.top_k / d.num_experts),
        "interlayer_recall": inter,
        "interlayer_recall_vs_random": inter / (d.top_k / d.num_experts),
        "top1_weight": top1_weight(tr), "load_balance": load_balance(tr)}
    for b in BUDGETS:
        row[f"lru_hit_rate@{b:.1%}"] = lru_hit_rate(store, test, b)
    return row


def embedded_source() -> Source:
    """The tiny model's trace on the default experiment's prompts (recorded once, cached)."""
    import dataclasses

    from hydra import compose, initialize_config_dir

    from moeexp.config import validate
    from moeexp.data.prompts import sample_prompts
    from moeexp.models.loading import load_model
    from moeexp.paths import CONF_DIR
    from moeexp.traces.store import get_or_record

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", ["+experiment=finemoe_vs_moeinfinity", "logger=none"])
    spec = validate(cfg)
    loaded: Any = load_model(dataclasses.asdict(spec.model))
    prompts = sample_prompts(spec.dataset, loaded.tokenizer)
    trace = get_or_record(loaded, prompts, dataclasses.asdict(spec.trace))
    return Source("tiny (embedded)", f"recorded, trace {str(trace.meta.get('content_hash'))[:12]}",
                  trace)


def imported_source(source: str) -> Source:
    """An imported trace (shipped name or directory), non-repetitive requests, 7:3 split,
    on the dims of its model's preset."""
    from moeexp.paths import load_group_yaml
    from moeexp.traces.importers import load_imported, resolve_source
    from moeexp.traces.interchange import read

    model = str(read(resolve_source(source)).info.get("model"))
    trace = load_imported(source, load_group_yaml("model", model).get("arch"), model=model)
    return Source(f"{model} (real)", f"imported {source}, {str(trace.meta['content_hash'])[:12]}",
                  trace)


def to_markdown(rows: list[dict[str, Any]]) -> str:
    keys = [k for k in rows[0] if k not in ("origin",)]
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moeexp.analysis.realism")
    ap.add_argument("--trace", action="append", default=[], help="more interchange directories")
    ap.add_argument("--out", default=str(OUT_DIR))
    ap.add_argument("--no-embedded", action="store_true", help="skip the tiny model's trace")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sources = [] if ns.no_embedded else [embedded_source()]
    sources += [imported_source(s) for s in ["gpt_oss_20b", *ns.trace]]
    rows = []
    for src in sources:
        log.info("realism card: %s", src.label)
        rows.append(card_row(src))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "card.json", rows)
    write_text(out / "table.md", to_markdown(rows) + "\n")
    print(to_markdown(rows))  # noqa: T201 - the CLI's result
    return 0


if __name__ == "__main__":
    sys.exit(main())
