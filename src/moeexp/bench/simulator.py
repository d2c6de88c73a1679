"""Benchmark: simulator replay speed on FineMoE's offline protocol with Mixtral's shape.

Protocol (algorithms.md §9): 64 prompts of 43 tokens, 122 output tokens each, 70/30
store/test split; the test split (19 requests, ~150k accesses) is replayed at batch size 1
with a 25 % expert cache on the ``rtx3090_pcie4`` profile. The trace is the seeded
synthetic :func:`~moeexp.traces.synthetic.random_trace` with Mixtral's routing shape
(L = 32, J = 8, K = 2); the cost model uses Mixtral-8x7B's real dims (H 4096, I 14336,
352 MB per expert), since the synthetic trace's hidden size only sizes its embeddings.
The three foundation systems (``no_offload``, ``deepspeed``, ``oracle``) are replayed
``repeats`` times each, and so is every other preset in ``conf/system`` (composed with
Hydra, ``model=mixtral_8x7b`` for its prefetch distance, ``cache.capacity`` forced to the
same budget; fitted afresh on the store split before each replay, the fit timed apart).
Each replay is timed by the process CPU clock (``time.process_time``: on a shared machine
other processes inflate the wall clock, not this one) and the wall clock; the best of the
repeats counts (single-threaded Python: the least disturbed run). Target (issue 11): each
replay in at most 2 CPU seconds on one core (``within_target``). :data:`BEFORE` keeps the
figures measured before the speed-up, printed and written beside the new ones.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from heapq import heappop, heappush
from pathlib import Path
from typing import Any

import numpy as np

from moeexp.cache import CACHES
from moeexp.cache.capacity import capacity_slots
from moeexp.costmodel import CostModel, load_profile
from moeexp.predictors import PREDICTORS
from moeexp.simulator import simulate
from moeexp.traces.schema import TraceDims
from moeexp.traces.synthetic import random_trace

log = logging.getLogger(__name__)

#: system -> (predictor, cache); the three systems of the foundation issue.
SYSTEMS: dict[str, tuple[str, str]] = {
    "no_offload": ("none", "resident"),
    "deepspeed": ("none", "lru"),
    "oracle": ("oracle", "belady"),
}
TARGET_S = 2.0
#: system -> (replay CPU s, wall-clock accesses/s of the last ``make bench``) before the
#: speed-up. CPU s: the tree before it (commit 2b2bbb7) on this protocol, best of 2,
#: alternating system by system with the tree after it (``predictor.prefill=paper`` for the
#: expert-map systems, so both trees decide the same) on the shared 2-core machine, load
#: about 4 (2026-12-01 11:45-11:55 UTC): after it, in the same session, no_offload 0.67,
#: deepspeed 0.82, oracle 2.16, finemoe 3.81, finemoe_no_semantic 3.80, moe_infinity 2.60,
#: moe_infinity_oss 3.06, mixtral_offloading 1.88, promoe 1.76, promoe_learned 2.66, emoe
#: 2.29, oracle_aggressive 1.80 (every hit rate, h2d byte count and TPOT identical).
#: accesses/s: ``results/bench/simulator.json`` of 2026-12-01 09:40 (wall clock, loaded).
#: Second step (the device loop, the prefetch queue and ``min_copies`` with fewer calls and
#: locals bound; every metric but the timings identical): commit 78bb051 -> 8f5e4f7, CPU s
#: best of 6 (two passes of 3, alternating, 2026-12-01 12:47-12:57 UTC, load 1-2 plus a
#: CI run): emoe 2.07 -> 1.98, oracle 2.08 -> 2.04, moe_infinity 2.48 -> 2.46, finemoe
#: 3.44 -> 3.52, finemoe_no_semantic 3.22 -> 3.54, moe_infinity_oss 3.01 -> 3.31,
#: promoe_learned 2.57 -> 2.67, promoe 1.83 -> 1.96, mixtral_offloading 1.80 -> 1.84,
#: oracle_aggressive 1.74 -> 1.74, deepspeed 0.81 -> 0.80, no_offload 0.63 -> 0.66: within
#: the noise of the shared machine (the same tree varied by up to 18 % between passes);
#: only emoe's restricted path gained measurably. The latency floor (``bound_metrics``) is
#: ~0.25 s of every replay. Still over 2 s: oracle, finemoe, finemoe_no_semantic,
#: moe_infinity, moe_infinity_oss, promoe_learned (their time is mostly the predictor and
#: the policy, outside the mechanism).
#: Third step (a per-pass ``Predictor.preview_pass`` speed hook: expert_map's trajectory
#: searches, eam paper's matches, learned_mlp's nets and the speculative predictors' top-k
#: batched per pass with the same numpy operations; observations built without the frozen
#: ``__init__``; ``min_copies`` on int heap entries; belady's next use from a table; every
#: metric and per-request series of all 12 systems identical): commit 466ca8c -> e9bc615,
#: ``python -m moeexp.bench simulator`` of both trees side by side (simultaneous processes,
#: OMP_NUM_THREADS=1 as ``make bench``), two pairs, 2026-12-01 15:02-15:12 UTC, load 5-11
#: from other sweeps, CPU s best of 2, pair 1 / pair 2: no_offload 0.73 -> 0.59 / 1.01 ->
#: 0.89, deepspeed 0.94 -> 0.90 / 1.54 -> 1.39, oracle 2.96 -> 2.57 / 3.98 -> 3.54, emoe
#: 2.51 -> 2.31 / 3.65 -> 2.71, finemoe 4.86 -> 4.23 / 5.31 -> 4.91, finemoe_no_semantic
#: 5.05 -> 3.97 / 5.35 -> 4.73, mixtral_offloading 2.31 -> 1.97 / 2.63 -> 2.27,
#: moe_infinity 3.62 -> 2.40 / 4.37 -> 3.37, moe_infinity_oss 5.55 -> 5.10 / 4.12 -> 4.48
#: (no change beyond the noise: its match is a memory-bound matrix-vector product per
#: layer that cannot be batched bit-identically), oracle_aggressive 3.05 -> 2.61 / 2.50 ->
#: 2.32, promoe 2.36 -> 2.15 / 2.30 -> 2.04, promoe_learned 3.04 -> 2.36 / 3.00 -> 2.53.
#: On the lead's idle run of the before tree (13:36 UTC, load 0.7) every system but
#: no_offload and deepspeed took over 2 s; under today's load only no_offload, deepspeed
#: and mixtral_offloading (pair 1) are within 2 CPU s after the step. The reference
#: workload took 0.285 / 0.281 CPU s in the two after runs (:data:`REFERENCE_S`) while
#: pair 2's first replays ran up to 50 % slower than pair 1's (the load rose, then fell):
#: it fits in the caches, so it sees the CPU's speed but not the cache and memory
#: contention of the other processes. Then, with the machine nearly idle (load 4-5, wall
#: = CPU), before / after / before in sequence (15:17-15:23 UTC, 466ca8c vs 8711f4a, best
#: of 2): no_offload 0.71/0.71 -> 0.62, deepspeed 0.89/0.88 -> 0.75, oracle 2.31/2.35 ->
#: 2.13, emoe 2.04/2.07 -> 2.04, finemoe 3.54/3.73 -> 3.33, finemoe_no_semantic 3.36/3.62
#: -> 2.96, mixtral_offloading 1.85/1.89 -> 1.45, moe_infinity 2.44/2.49 -> 1.81,
#: moe_infinity_oss 3.06/2.91 -> 2.71, oracle_aggressive 1.94/1.78 -> 1.58, promoe
#: 1.98/1.91 -> 1.47, promoe_learned 2.74/3.28 -> 1.77 (machine factor 0.94): within 2 CPU
#: s: no_offload, deepspeed, mixtral_offloading, moe_infinity, oracle_aggressive, promoe,
#: promoe_learned; still over: oracle, emoe, finemoe, finemoe_no_semantic, moe_infinity_oss.
#: Fourth step (the cyclic GC paused during a replay, eam oss's unit query once per pass,
#: expert_map's per-pass emits and row-selection tables; every metric and series of all 12
#: systems identical): 36aaedc -> 34433bc, two bench runs each in sequence (16:42-16:50 UTC,
#: load 3-5, machine factor 0.91-0.94), best of both: finemoe 3.57 -> 2.88,
#: finemoe_no_semantic 3.37 -> 2.82, moe_infinity_oss 2.93 -> 2.37, oracle 2.02 -> 2.07,
#: moe_infinity 2.00 -> 2.01, emoe 1.97 -> 1.88, promoe_learned 1.96 -> 1.80, the rest within
#: 1.63 s; still over: finemoe, finemoe_no_semantic, moe_infinity_oss (oracle, moe_infinity at
#: the line).
#: Fifth step (a replay's survivors moved to the oldest GC generation, push's pending check
#: first, the floor's sets from flat experts, expert_map's emits counted per pass, eam oss's
#: contiguous suffixes; every metric and series identical): fd2b797 -> ccb43cd, two bench
#: runs each in sequence (17:09-17:20 UTC, load 3-7, machine factor 0.93-1.03), best of both:
#: finemoe 3.28 -> 3.16, finemoe_no_semantic 3.03 -> 2.63, moe_infinity_oss 2.45 -> 2.29,
#: moe_infinity 1.93 -> 1.78, oracle 2.13 -> 2.24, emoe 1.93 -> 2.18 (the two pairs
#: disagreed: the 3-10 % gain of alternating A/B runs is below this machine's noise); still
#: over: finemoe, finemoe_no_semantic, moe_infinity_oss (oracle, emoe at the line).
#: Sixth step (every one-iteration pass sliced from trace-wide routing tables; a pass's keys
#: and protected sets made once; the floor's MIN walk by index; finemoe's waiting shield as
#: one matrix, float64 visit counts and row views; PredictionSets remembering read-only
#: arrays' sets; belady's heaps built on first search; eam oss's one-pass match; expert_map's
#: whole Predictions memoised and built by a per-pass preview; every metric and series of
#: all 12 systems identical): d43535b -> 87cb9c9, two bench runs each in sequence (ref,
#: new, ref, new; 19:57-20:01 UTC, load ~1, machine factor 0.96 / 0.92 (ref), 0.94 / 1.00
#: (new)), best of both: no_offload 0.49 -> 0.40, deepspeed 0.67 -> 0.55, oracle 1.93 ->
#: 1.53, emoe 1.85 -> 1.78, finemoe 2.65 -> 2.04, finemoe_no_semantic 2.54 -> 1.89,
#: mixtral_offloading 1.57 -> 1.28, moe_infinity 1.81 -> 1.54, moe_infinity_oss 2.31 ->
#: 1.71, oracle_aggressive 1.44 -> 1.33, promoe 1.34 -> 1.25, promoe_learned 1.77 -> 1.58
#: (a second pair minutes later, under host contention, machine factor 1.01-1.35: finemoe
#: 2.72 -> 2.37). Still over: finemoe (2.04-2.07 on the quiet pair); its replay is now many
#: 3-8 % parts each near its numpy-call floor (the trajectory search's gemv over the store,
#: the cache's per-event scalar updates and victim argmin, the floor, the plan).
#: Seventh step (emoe's per-pass preview of the router top-K counts and its memoised
#: first-prompt / reuse Predictions; learned_mlp's one-token top-k in its preview;
#: ``layer_prediction``'s memo by (layer, experts); eam's shared one-request Predictions;
#: every metric and series of all 12 systems identical): 45a20fc -> 98cc5c8, two bench runs
#: each in sequence (ref, new, ref, new; 2026-12-02 00:53-00:59 UTC, load ~1, machine factor
#: 1.21-1.34: a slow host), best of both: emoe 3.25 -> 1.82, promoe_learned 3.08 -> 2.26,
#: promoe 2.12 -> 1.93, moe_infinity 2.57 -> 2.36, moe_infinity_oss 2.94 -> 2.78,
#: mixtral_offloading 2.15 -> 2.04, the rest within 3 % (finemoe 3.84 -> 3.87,
#: finemoe_no_semantic 3.62 -> 3.66, oracle 2.39 -> 2.35). On that host 2b2bbb7's finemoe
#: took 7.88 s (BEFORE: 5.19): the memory-bound replays follow the host more than the reference.
BEFORE: dict[str, tuple[float, float]] = {
    "no_offload": (0.659, 247348.0), "deepspeed": (0.831, 201430.0),
    "oracle": (2.377, 56765.0), "emoe": (2.190, 54480.0),
    "finemoe": (5.193, 16641.0), "finemoe_no_semantic": (5.806, 18108.0),
    "mixtral_offloading": (2.158, 51491.0), "moe_infinity": (5.142, 23319.0),
    "moe_infinity_oss": (5.717, 21001.0), "promoe": (1.919, 56019.0),
    "promoe_learned": (3.546, 39424.0), "oracle_aggressive": (1.765, float("nan")),
}
#: Accesses of the default protocol, which the :data:`BEFORE` figures were measured on.
BEFORE_ACCESSES = 150440.0


#: CPU s of :func:`reference_workload` (best of 3) in the run of the third step's figures
#: (2026-12-01 15:06 UTC, load ~6-11); ``machine_factor`` = the run's reference / this
#: (> 1: the machine runs slower than then).
REFERENCE_S = 0.285


def reference_workload(rounds: int = 3) -> float:
    """Best-of-``rounds`` CPU s of a fixed workload shaped like a replay (tuple keys in
    dicts and sets, a heap, list appends, small numpy calls on an [L, J] matrix), timed
    in the same run as the replays: it moves with the machine's speed, not with the code,
    so the JSON's ``machine_factor`` tells drift of a shared VM from a real change."""
    best = float("inf")
    for _ in range(rounds):
        c0 = time.process_time()
        prio = np.zeros((32, 8))
        ready: dict[tuple[int, int], float] = {}
        heap: list[tuple[float, int, tuple[int, int]]] = []
        out: list[int] = []
        for i in range(300000):
            key = ((i * 7) % 32, (i * 5) % 8)
            ready[key] = i * 1e-3
            heappush(heap, (-float(i % 97), i, key))
            if len(heap) > 64:
                heappop(heap)
            if key in ready and i % 3 == 0:
                prio[key] += 1.0
                out.append(int((prio + 0.5).argmin()))
        best = min(best, time.process_time() - c0)
    return best


def mixtral_dims(dims: TraceDims) -> TraceDims:
    """``dims`` with Mixtral-8x7B's sizes (bf16): 46.7 B parameters, 45.1 B in experts."""
    H, inter = 4096, 14336
    expert = 3 * H * inter * 2
    return dataclasses.replace(dims, hidden_size=H, intermediate_size=inter, expert_bytes=expert,
                               dense_bytes=int(46.7e9 * 2) - 32 * 8 * expert)


def _summary(system: str, m: dict[str, float], wall: float, cpu: float) -> dict[str, Any]:
    """One system's numbers, the figures before the speed-up beside the new ones."""
    n = m["accesses_total"]
    cpu0, rate0 = BEFORE.get(system, (float("nan"), float("nan")))
    return {"cpu_s": cpu, "cpu_s_before": cpu0, "accesses_per_cpu_s": n / cpu,
            "accesses_per_cpu_s_before": BEFORE_ACCESSES / cpu0, "wall_s": wall,
            "accesses_per_s": n / wall, "accesses_per_s_before": rate0,
            "accesses_total": n, "hit_rate": m["hit_rate"],
            "prediction_recall": m["prediction_recall"], "tpot_norm_mean": m["tpot_norm_mean"],
            "ttft_norm_mean": m["ttft_norm_mean"], "within_target": cpu <= TARGET_S}


def _timed(system: str, build: Any, test: Any, cost: CostModel, repeats: int,
           restricted: bool = False) -> dict[str, Any]:
    """Best of ``repeats`` replays (by CPU s) of the (predictor, cache, fit s) ``build()``
    makes; logs the new figures beside the old."""
    best: dict[str, Any] | None = None
    for _ in range(repeats):
        pred, cache, fit = build()
        w0, c0 = time.perf_counter(), time.process_time()
        m = simulate(test, pred, cache, cost, progress=False,
                     restricted_routing=restricted).metrics
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        if best is None or cpu < best["cpu_s"]:
            best = {**_summary(system, m, wall, cpu), "fit_s": fit}
    assert best is not None
    log.info("%s: %.2f CPU s (before %.2f), %.0f accesses/CPU s (before %.0f); wall %.2f s",
             system, best["cpu_s"], best["cpu_s_before"], best["accesses_per_cpu_s"],
             best["accesses_per_cpu_s_before"], best["wall_s"])
    return best


def _presets(capacity: float) -> dict[str, Any]:
    """system name -> composed config (predictor, cache, backend groups) of every preset."""
    from hydra import compose, initialize_config_dir

    from moeexp.paths import CONF_DIR

    out: dict[str, Any] = {}
    names = sorted(p.stem for p in Path(CONF_DIR, "system").glob("*.yaml"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for name in names:
            if name in SYSTEMS:
                continue
            cfg = compose(config_name="config", overrides=[
                f"system={name}", "model=mixtral_8x7b", "logger=none", f"cache.capacity={capacity}"])
            if (cfg.get("execution") or {}).get("name", "copy") != "copy":
                # a CPU system needs its execution policy and a profile with a cpu: block;
                # this benchmark replays predictor + cache on the copy-only profile
                log.info("system %s: execution=%s not replayed here (copy systems only)",
                         name, cfg.execution.name)
                continue
            out[name] = cfg
    return out


def _replay_presets(trace: Any, dims: TraceDims, cost: CostModel, capacity: float,
                    repeats: int) -> dict[str, Any]:
    """Fit and replay every non-foundation preset; a preset that fails is reported, not fatal."""
    from moeexp.cache import build_cache
    from moeexp.predictors import build_predictor

    store, test = trace.split("store"), trace.split("test")
    out: dict[str, Any] = {}
    for name, cfg in _presets(capacity).items():
        def build(cfg: Any = cfg) -> tuple[Any, Any, float]:
            pred = build_predictor(cfg.predictor, trace.dims)
            if hasattr(pred, "progress"):
                pred.progress = False
            cache = build_cache(cfg.cache, dims)
            f0 = time.perf_counter()
            pred.fit(store)
            cache.fit(store)
            return pred, cache, time.perf_counter() - f0

        try:
            out[name] = _timed(name, build, test, cost, repeats,
                               bool(cfg.backend.get("restricted_routing", False)))
        except Exception as e:  # noqa: BLE001 - one broken preset must not hide the others
            log.warning("system %s: %s: %s", name, type(e).__name__, e)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def run(num_prompts: int = 64, prompt_len: int = 43, output_len: int = 122, capacity: float = 0.25,
        hardware: str = "rtx3090_pcie4", repeats: int = 2, presets: bool = True) -> dict[str, Any]:
    """Replay each system; returns CPU and wall seconds, accesses/s (before and after the
    speed-up) and headline metrics per system."""
    ref0 = reference_workload()
    t0 = time.perf_counter()
    trace = random_trace(num_layers=32, num_experts=8, top_k=2, hidden_size=16, spec_depth=4,
                         num_requests=num_prompts, prompt_len=prompt_len, output_len=output_len,
                         num_topics=8, with_hidden=True, seed=0)
    gen_s = time.perf_counter() - t0
    test = trace.split("test")
    dims = mixtral_dims(trace.dims)
    cost = CostModel.from_profile(load_profile(hardware), dims, dtype_bytes=2)
    slots = capacity_slots(capacity, dims)
    systems: dict[str, Any] = {}
    for system, (pname, cname) in SYSTEMS.items():
        def build(pname: str = pname, cname: str = cname) -> tuple[Any, Any, float]:
            return (PREDICTORS.build(pname, dims=trace.dims),
                    CACHES.build(cname, capacity_slots=slots, num_layers=32, num_experts=8), 0.0)

        systems[system] = _timed(system, build, test, cost, repeats)
    presets_out = _replay_presets(trace, dims, cost, capacity, repeats) if presets else {}
    cpus = [s["cpu_s"] for s in (*systems.values(), *presets_out.values()) if "cpu_s" in s]
    ref = min(ref0, reference_workload())  # before and after the replays
    log.info("reference workload: %.3f CPU s (machine factor %.2f)", ref, ref / REFERENCE_S)
    return {
        "machine": {"reference_cpu_s": ref, "reference_cpu_s_then": REFERENCE_S,
                    "machine_factor": ref / REFERENCE_S},
        "protocol": {"prompts": num_prompts, "test_requests": len(test.requests),
                     "prompt_len": prompt_len, "output_len": output_len, "capacity": capacity,
                     "hardware": hardware, "shape": "L=32 J=8 K=2 (Mixtral-8x7B dims)",
                     "trace_gen_s": gen_s, "target_s": TARGET_S, "timing": "process CPU s, "
                     f"best of {repeats}", "before": "CPU s at commit 2b2bbb7; accesses/s: "
                     "the previous make bench (wall clock)"},
        "max_cpu_s": max(cpus) if cpus else float("nan"),
        "all_within_target": bool(cpus) and all(c <= TARGET_S for c in cpus),
        "systems": systems,
        "presets": presets_out,
    }
