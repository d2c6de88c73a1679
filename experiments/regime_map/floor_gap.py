"""Why the latency floor sits below the oracles when copies dominate (issue 11).

Two modes::

    python experiments/regime_map/floor_gap.py run OVERRIDES...     # a moeexp (multi)run, instrumented
    python experiments/regime_map/floor_gap.py table SUMMARY.csv    # the README's table

``run`` is ``python -m moeexp OVERRIDES...`` with the simulator watched from outside (no
file under ``src/`` changes; the replay, its decisions and every metric are the plain
run's): every expert copy (its end is ``Device.ready[key]`` when the policy's
``on_insert`` hears of it, its start that minus ``copy_s``: whole-expert copies only),
every forward pass's start and end, and the resident set (in-flight copies included) when
each request's decode phase begins. Each run's ``metrics.json`` then also holds the
``floorgap_*`` terms below, so ``moeexp collect`` gives their mean and 95 % interval over
the seeds like any metric.

**The decomposition.** Per request r, with d_r its decode time (first token to last, what
TPOT divides by its n_r decode steps), c = ``copy_s`` and F_r the floor's decode time
(:mod:`moeexp.simulator.bound`: F_r = max over its layer sets of the compute chain and
q_free * c + min_ce, q_free = MIN's copies for the decode sets minus min(C, D), the
best free start state)::

    d_r = n_copies_r * c + idle_r          (link busy time in the window + link idle time)
    F_r = q_free_r * c + tail_r            (tail_r: the floor's time the link is not busy)
    d_r - F_r =  (q_state_r - q_free_r) * c      start: MIN from the policy's real start
                                                 state needs more copies than from the best one
               + (n_copies_r - q_state_r) * c    extra: copies beyond MIN from that state
               + idle_mid_r                      link idle while a copy of this pass is still to start
               + idle_tail_r                     link idle with no copy of this pass left to start:
                                                 the next pass's copies wait for its start
               - tail_r

``q_state`` is :func:`moeexp.simulator.bound.min_copies` from the resident set at the first
token (a lower bound on the copies any policy needs from that state); ``n_copies`` is the
link busy time inside the window over c (a copy in flight at the first token counts by its
part inside). Every term is reported per output token (each request's term over its n_r,
averaged over the requests as ``tpot_ms_mean`` is), in ms: ``floorgap_<term>_ms``; they add
up to ``tpot_ms_mean - bound_tpot_ms_mean`` (``floorgap_check_ms`` is the residual,
float rounding only). The same split of the prefill window (batch start to first token)
is ``floorgap_ttft_<term>_ms`` (per request, not per token); ``floorgap_<term>_norm`` and
``floorgap_ttft_<term>_norm`` are the same over each request's no_offload latency, averaged
as ``tpot_norm_mean`` / ``ttft_norm_mean`` are (they add up to ``tpot_norm_mean -
bound_tpot_norm_mean``). ``floorgap_{q_free,q_state,copies}_per_token`` are the decode
phase's copy counts per decode step (``floorgap_ttft_*``: per prefill).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import tables as T  # experiments/regime_map/tables.py: run as a script, its directory is on sys.path

#: The decomposition's terms, in the order they add up (tail subtracts).
TERMS = ("start", "extra", "idle_mid", "idle_tail", "tail")


class Watch:
    """What one replay did, recorded from outside: copies, passes, start states."""

    def __init__(self) -> None:
        self.copy_end: list[float] = []  # s, each copy's end, in issue order
        self.pass_span: list[tuple[float, float]] = []  # s, each forward pass (start, end)
        self.state: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (batch, pass 0|1) -> residents
        self.batch = -1
        self.pass_in_batch = 0


def _install(watches: list[Watch]) -> None:
    """Wrap the replay's methods so each replay fills a :class:`Watch` (appended to
    ``watches``) and its metrics gain the ``floorgap_*`` terms."""
    from moeexp.simulator import replay as rp

    init, batch, fwd, build = rp.Replay.__init__, rp.Replay.batch, rp.Replay.forward_pass, \
        rp.build_metrics

    def init_w(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        w = Watch()
        watches.append(w)
        self._watch = w
        dev, insert = self.dev, self.cache.on_insert

        def on_insert(key: Any, now: int, prefetched: bool) -> None:
            w.copy_end.append(dev.ready[key])
            insert(key, now, prefetched)
        self.cache.on_insert = on_insert

    def batch_w(self: Any, b: Any, t: float) -> float:
        self._watch.batch += 1
        self._watch.pass_in_batch = 0
        return batch(self, b, t)

    def fwd_w(self: Any, gd: Any, t: float, req_preds: Any) -> float:
        w = self._watch
        key = (w.batch, w.pass_in_batch)
        if w.pass_in_batch <= 1:  # resident at the batch start and at its first token
            w.state[key] = list(self.dev.ready)
        end = fwd(self, gd, t, req_preds)
        w.pass_span.append((t, end))
        w.pass_in_batch += 1
        return end

    def build_w(**kw: Any) -> Any:
        m, s = build(**kw)
        m.update(decompose(kw["plan"], kw["dev"], kw["cost"], kw["tally"], watches[-1]))
        return m, s

    rp.Replay.__init__, rp.Replay.batch, rp.Replay.forward_pass = init_w, batch_w, fwd_w
    rp.build_metrics = build_w


def _busy(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> float:
    """Link seconds inside [a, b] (copies never overlap: one link)."""
    return float(np.clip(np.minimum(ends, b) - np.maximum(starts, a), 0, None).sum())


def _idle_split(starts: np.ndarray, ends: np.ndarray, spans: np.ndarray, a: float,
                b: float) -> tuple[float, float]:
    """The link's idle seconds in [a, b], split by pass: (mid, tail). A gap's part inside
    pass p is *mid* if the copy that ends the gap starts inside pass p (a copy of the
    pass was still to start), else *tail* (none of the pass's copies left)."""
    i0, i1 = np.searchsorted(ends, a, side="right"), np.searchsorted(starts, b, side="left")
    edges = [a, *[x for pair in zip(starts[i0:i1], ends[i0:i1], strict=True) for x in pair], b]
    mid = tail = 0.0
    for g0, g1 in zip(edges[0::2], edges[1::2], strict=True):
        g0, g1 = max(g0, a), min(g1, b)
        if g1 <= g0:
            continue
        lo = np.searchsorted(spans[:, 1], g0, side="right")
        for p in range(lo, len(spans)):
            p0, p1 = spans[p]
            if p0 >= g1:
                break
            part = min(g1, p1) - max(g0, p0)
            if part <= 0:
                continue
            if g1 < b and g1 < p1 and g1 >= p0:  # the gap ends with a copy inside pass p
                mid += part
            else:
                tail += part
    return mid, tail


def _phase(seq: Any, lay: Any, cap: int, lo: int, hi: int, state: list[Any], J: int,
           c: float, window: tuple[float, float], link: tuple[np.ndarray, ...]) -> dict[str, float]:
    """The terms (s) of one window [a, b] serving layer sets lo..hi-1."""
    from moeexp.simulator.bound import _floor, min_copies

    a, b = window
    starts, ends, spans = link
    q_free = min_copies(seq, cap, lo, hi, free_start=True)
    q_state = min_copies(seq, cap, lo, hi, resident=[k[0] * J + k[1] for k in state])
    floor = _floor(q_free, lay.comp[lo:hi], lay.min_ce[lo:hi], c)[-1]
    busy = _busy(starts, ends, a, b)
    mid, tail_idle = _idle_split(starts, ends, spans, a, b)
    out = {"start": (q_state[-1] - q_free[-1]) * c, "extra": busy - q_state[-1] * c,
           "idle_mid": mid, "idle_tail": tail_idle, "tail": floor - q_free[-1] * c,
           "floor": floor, "time": b - a, "copies": busy / c, "q_free": float(q_free[-1]),
           "q_state": float(q_state[-1])}
    out["check"] = out["time"] - out["floor"] - sum(out[t] for t in TERMS[:-1]) + out["tail"]
    return out


def decompose(plan: Any, dev: Any, cost: Any, tally: Any, w: Watch) -> dict[str, float]:
    """The ``floorgap_*`` metrics of one replay (module docstring)."""
    from moeexp.simulator.bound import _Layout, _no_offload

    if dev.chunk_s:
        return {}  # chunked copies: a copy's start is not its end minus copy_s
    c, J, cap = dev.copy_s, cost.num_experts, dev.capacity
    if len(w.copy_end) * cost.expert_bytes != dev.h2d_bytes:  # every copy seen, or no terms
        raise RuntimeError(f"floor_gap: saw {len(w.copy_end)} copies, the device made "
                           f"{dev.h2d_bytes / cost.expert_bytes:.0f} (the replay's hooks moved?)")
    lay = _Layout(plan, J)
    ends = np.asarray(w.copy_end, dtype=np.float64)
    order = np.argsort(ends, kind="stable")
    ends = ends[order]
    link = (ends - c, ends, np.asarray(w.pass_span, dtype=np.float64))
    ttft0, tpot0 = _no_offload(plan)
    dec: list[tuple[dict[str, float], float]] = []  # (terms, per-token divisor: n_r)
    decn: list[tuple[dict[str, float], float]] = []  # (terms, n_r * no_offload TPOT_r)
    pre: list[tuple[dict[str, float], float]] = []  # (terms, no_offload TTFT_r)
    for bi, b in enumerate(plan.batches):
        lo, group_end = lay.batch_lo[bi], lay.group_end[bi]
        prefill = any(plan.has_prefill(u) for u in b.units)
        first_end = group_end[0] if prefill else lo
        u = b.units[0]
        if len(b.units) != 1:
            raise SystemExit("floor_gap: batch_size 1 only (one request per window)")
        if prefill:
            pre.append((_phase(lay.seq, lay, cap, lo, first_end, w.state[(bi, 0)], J, c,
                               (tally.start[u], tally.first[u]), link), ttft0[u]))
        n = plan.num_decode(u)
        if n > 0:
            d = _phase(lay.seq, lay, cap, first_end, group_end[-1],
                       w.state[(bi, 1 if prefill else 0)], J, c,
                       (tally.first[u], tally.finish[u]), link)
            dec.append((d, n))
            decn.append((d, n * tpot0[u]))
    out: dict[str, float] = {}
    for k in [*TERMS, "floor", "time", "check"]:
        out |= _means(f"floorgap_{k}", k, dec, decn)
        if pre:
            out |= _means(f"floorgap_ttft_{k}", k, [(d, 1.0) for d, _ in pre], pre)
    for k in ("copies", "q_free", "q_state"):
        out[f"floorgap_{k}_per_token"] = float(np.mean([d[k] / n for d, n in dec])) \
            if dec else math.nan
        if pre:
            out[f"floorgap_ttft_{k}"] = float(np.mean([d[k] for d, _ in pre]))
    return out


def _means(name: str, k: str, per_ms: list[tuple[dict[str, float], float]],
           per_norm: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """``name_ms``: mean over requests of term ``k`` over its divisor, in ms (as
    ``tpot_ms_mean``); ``name_norm``: over its no_offload latency (as ``tpot_norm_mean``)."""
    if not per_ms:
        return {f"{name}_ms": math.nan, f"{name}_norm": math.nan}
    return {f"{name}_ms": float(np.mean([d[k] / n for d, n in per_ms])) * 1e3,
            f"{name}_norm": float(np.mean([d[k] / n for d, n in per_norm]))}


# ---------------------------------------------------------------------------- table
def _cell(m: float, h: float, d: int = 2) -> str:
    """``0.39 ± 0.02`` with ``d`` decimals (``-`` for NaN)."""
    if not math.isfinite(m):
        return "-"
    return f"{m:.{d}f}" + (f" ± {h:.{d}f}" if math.isfinite(h) else "")


def table(path: Path, q: str = "tpot") -> str:
    """One row per (budget, ratio, system): the latency and the floor over no_offload's,
    the gap and its terms in the same unit (mean ± 95 % half-width over the seeds)."""
    rows, _ = T._read(path)
    pre = "floorgap_" if q == "tpot" else "floorgap_ttft_"
    head = ["budget", "copy/compute", "system", f"{q.upper()} / no_offload", "floor",
            "gap (% of floor)", "start state", "extra copies", "idle: copy of the pass to start",
            "idle: pass's copies done", "- floor's own idle"]
    head.append("copies per " + ("token" if q == "tpot" else "prefill")
                + ": floor / MIN from state / made")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = rows[pd.to_numeric(rows.get(f"{pre}time_norm"), errors="coerce").notna()]
    for (cap, x), g in rows.sort_values(["_cap", "_x"]).groupby(["_cap", "_x"], sort=False):
        for _, r in g.iterrows():
            m, h = T._f(r, f"{q}_norm_mean")
            fl = T._f(r, f"{pre}floor_norm")[0]
            cells = [f"{cap:.0%}", f"{x:.3g}", str(r["system"]), _cell(m, h), _cell(fl, math.nan),
                     f"{m - fl:.2f} ({100 * (m / fl - 1):+.1f} %)"]
            for k in TERMS:
                v, vh = T._f(r, f"{pre}{k}_norm")
                cells.append(_cell(-v if k == "tail" else v, vh))
            name = "floorgap_{}_per_token" if q == "tpot" else "floorgap_ttft_{}"
            cells.append(" / ".join(f"{T._f(r, name.format(k))[0]:.2f}"
                                    for k in ("q_free", "q_state", "copies")))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "run":
        watches: list[Watch] = []
        _install(watches)
        from moeexp.__main__ import main as app_main

        sys.argv = ["moeexp", *argv[1:]]
        app_main()
        return 0
    if argv and argv[0] == "table":
        path = Path(argv[1])
        print(table(path, "tpot"))
        rows, _ = T._read(path)
        if "floorgap_ttft_time_ms" in rows:
            print(table(path, "ttft"))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
