"""Real scale (issue 15): a random-weight gpt-oss-20b in the engine, driven by the real
trace's routing, and the simulator held to it.

``python -m moeexp.bench.real_scale [--out DIR] [--dry-run]`` (``make bench-real-scale``)::

    model     gpt-oss-20b's arch (conf/model/gpt_oss_20b.yaml), random weights
              (moeexp.models.random_init): experts in pinned host memory, the rest on the GPU
    trace     the shipped gpt-oss-20b routing (trace.source=gpt_oss_20b, routing only,
              decode steps only), split store/test (70/30, seed 0); test requests truncated
              to their first --passes decode steps, store requests to --store-passes
    h2d       achieved bandwidth of the engine's copies of real-size experts (every slot
              loaded back to back) against one plain pinned copy of as many bytes
    calibrate the simulator's cost model fitted on the engine (moeexp.engine.profile:
              compute with every expert resident, copies of 0.25-4 experts)
    overhead  plain forward passes with every expert on the GPU (routing forced the same
              way) against the engine's no_offload on the same passes
    systems   at 12.5 / 25 / 50 % of expert memory (no_offload: all of it, where it fits):
              the engine in routing-replay mode (moeexp.engine.routing_replay) and the
              simulator with the calibrated cost model on the same test passes: TPOT, hit
              rate, bytes, the stall decomposition (moeexp.metrics.traffic_metrics), and
              the simulator's TPOT error per request; a system whose predictor needs what
              the trace lacks (mixtral_offloading: speculative gates) is not applicable

Everything lands in one folder (atomic writes): ``results.json`` (all numbers, the
environment, the settings), ``systems.csv`` (one row per system and capacity) and
``summary.md``. Results say ``routing_source: replay``, ``exact: false``: the model's
weights are random, its routing the trace's.

``--profile SYSTEM:CAPACITY``: after the systems, that system's engine run again under
torch.profiler (the first test request's first 4 passes): ``profile_<system>_<cap>.txt``
(operators by self CPU and device time) and ``.json`` (a Chrome trace of every thread).

``--feed``: also each predictor's feeding cost on the engine (every expert resident, the
predictor against none, per MoE layer) and the simulator charged with it
(``simulate(predictor_feed_s=...)``): columns ``feed_us_per_layer``,
``sim_feed_tpot_ms_mean``, ``tpot_error_feed_pct``.

``--dry-run``: the same code path on the CPU at a reduced size (gpt-oss's 24 layers, 32
experts and top-4, hidden size 64, vocabulary 512), a few short requests: a check that the
script runs, not a result.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moeexp.atomic import atomic_path, write_json, write_text
from moeexp.errors import ConfigError

log = logging.getLogger(__name__)

MODEL = "gpt_oss_20b"
SYSTEMS: tuple[str, ...] = ("no_offload", "deepspeed", "mixtral_offloading", "moe_infinity",
                            "finemoe", "prefetch_if_pays", "oracle")
CAPACITIES: tuple[float, ...] = (0.125, 0.25, 0.5)
#: The dry run's arch: gpt-oss-20b's L, J, K (the trace's) with everything else shrunk.
DRY_ARCH = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
COPY_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
ROW_KEYS = ("tpot_ms_mean", "hit_rate", "h2d_bytes_total", "stall_ms_total",
            "stall_demand_ms_total", "stall_late_prefetch_ms_total", "stall_link_ms_total",
            "h2d_demand_bytes_per_token", "prefetch_used_bytes_per_token",
            "prefetch_waste_bytes_per_token", "prefetches_issued", "demand_loads_total",
            "prediction_recall", "accesses_total", "predictor_query_us_mean")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run does (the CLI's flags; :meth:`dry` the dry run's values)."""

    out: Path
    device: str = "cuda"
    dry_run: bool = False
    systems: tuple[str, ...] = SYSTEMS
    capacities: tuple[float, ...] = CAPACITIES
    test_requests: int = 4
    passes: int = 32
    store_requests: int = 64
    store_passes: int | None = 128
    profile_requests: int = 4
    profile_prompt: int = 32
    profile_new: int = 16
    copy_repeats: int = 4
    seed: int = 0
    max_wall_s: float = 480.0  # no new system run starts after this (the lease is 10 min)
    #: a calibration.json of an earlier run of this model (its out folder) used instead of
    #: profiling the engine in this process; None = profile (and save calibration.json)
    calibration: Path | None = None
    #: (system, capacity) whose engine run is profiled again with torch.profiler (the
    #: first request's first ``profile_passes`` passes), after the systems; None = none
    profile: tuple[str, float] | None = None
    profile_passes: int = 4
    #: the engine's predictor on a worker thread (EngineSettings.predictor_async, the
    #: default) or inline on the compute thread (``--predictor-inline``)
    predictor_async: bool = True
    #: also measure each predictor's feeding cost on the engine (every expert resident,
    #: with the predictor against without) and simulate with it (``--feed``)
    feed: bool = False
    #: CPU only: the engine's emulated host-to-device link (bytes/s), also in the profile;
    #: a CPU memcpy of a small expert is all noise, its fitted bandwidth undefined
    emulated_bps: float | None = None

    @classmethod
    def dry(cls, out: Path) -> Settings:
        return cls(out=out, device="cpu", dry_run=True, test_requests=2, passes=3,
                   store_requests=4, store_passes=8, profile_requests=2, profile_prompt=6,
                   profile_new=3, copy_repeats=4, emulated_bps=2e7)


def truncate(trace: Any, requests: int, passes: int | None) -> Any:
    """The first ``requests`` requests of ``trace``, each cut to its first ``passes``
    iterations (by step; None keeps all)."""
    from moeexp.engine.routing_replay import ordered

    tr = ordered(trace.select([r.request_id for r in trace.requests[:requests]]))
    keep = []
    for r in tr.requests:
        its = tr.request_iterations(r.request_id)
        keep.extend(its[:passes].tolist() if passes is not None else its.tolist())
    rows = np.concatenate([np.arange(tr.iter_offsets[i], tr.iter_offsets[i + 1]) for i in keep])
    lens = np.diff(tr.iter_offsets)[keep]

    def take(a: Any) -> Any:
        return None if a is None else a[rows]

    reqs = [dataclasses.replace(r, output_len=int(np.sum(tr.iter_request[keep] == r.request_id)))
            for r in tr.requests]
    return dataclasses.replace(
        tr, requests=reqs, iter_request=tr.iter_request[keep], iter_step=tr.iter_step[keep],
        iter_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        probs=take(tr.probs), topk_idx=tr.topk_idx[rows], topk_weight=tr.topk_weight[rows],
        embed=take(tr.embed), token_ids=take(tr.token_ids), spec_probs=take(tr.spec_probs),
        hidden=take(tr.hidden), meta=dict(tr.meta))


def _model_and_traces(s: Settings) -> tuple[Any, Any, Any, Any]:
    """(model, adapter, store trace, test trace) on the model's own dims."""
    import torch

    from moeexp.models.adapters import adapter_for
    from moeexp.models.random_init import random_model
    from moeexp.paths import load_group_yaml
    from moeexp.traces.importers import load_imported
    from moeexp.traces.recorder import trace_dims

    arch = dict(load_group_yaml("model", MODEL)["arch"])
    model = random_model(arch, device=s.device, dtype=torch.bfloat16,
                         overrides=DRY_ARCH if s.dry_run else None, seed=s.seed, where=MODEL)
    adapter = adapter_for(model)
    trace = load_imported(MODEL, arch, model=MODEL, seed=s.seed)
    trace = dataclasses.replace(trace, dims=trace_dims(adapter, 0))  # this model's bytes
    store = truncate(trace.split("store"), s.store_requests, s.store_passes)
    test = truncate(trace.split("test"), s.test_requests, s.passes)
    return model, adapter, store, test


def _h2d_bandwidth(model: Any, adapter: Any, s: Settings) -> dict[str, Any]:
    """Engine copies (every slot of a 12.5 % budget loaded back to back) against one plain
    pinned copy of as many bytes (CPU: the emulated link against a plain memcpy)."""
    import torch

    from moeexp.engine import offload

    repeats = s.copy_repeats
    cuda = next(model.parameters()).device.type == "cuda"
    with offload(model, system="deepspeed", capacity=0.125, bandwidth_bps=s.emulated_bps) as om:
        eng = om.engine
        keys = [(layer, e) for layer in range(eng.L) for e in range(eng.J)][:eng.pool.num_slots]
        nbytes = len(keys) * eng.spec.nbytes
        engine_s = []
        for _ in range(repeats + 1):  # the first round warms the copy path up
            with eng.lock:
                for k in list(eng.pool.slot_of):
                    eng._evict(k)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.preload(keys)
            if cuda:
                torch.cuda.synchronize()
            engine_s.append(time.perf_counter() - t0)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    plain_s = []
    for _ in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        plain_s.append(time.perf_counter() - t0)
    e_bw, p_bw = nbytes / min(engine_s[1:]), nbytes / min(plain_s[1:])
    return {"h2d_engine_gbps": e_bw / 1e9, "h2d_plain_gbps": p_bw / 1e9,
            "h2d_ratio": e_bw / p_bw, "h2d_bytes": nbytes, "h2d_experts": len(keys),
            "expert_mib": eng.spec.nbytes / 2**20}


def _calibrate(model: Any, adapter: Any, s: Settings) -> tuple[Any, dict[str, float]]:
    """The simulator's cost model fitted on this engine (compute + copies)."""
    import types

    import torch

    from moeexp.costmodel.fitted import CalibratedCostModel, fit_profile
    from moeexp.engine.profile import profile_compute, profile_copy
    from moeexp.engine.runtime import EngineSettings
    from moeexp.traces.recorder import trace_dims

    loaded = types.SimpleNamespace(model=model, adapter=adapter, tokenizer=None, name=MODEL)
    g = torch.Generator().manual_seed(s.seed)
    vocab = int(model.config.vocab_size)
    reqs = [(torch.randint(3, vocab, (s.profile_prompt * (1 + i % 2),), generator=g).tolist(),
             s.profile_new) for i in range(s.profile_requests)]
    samples = profile_compute(loaded, reqs, settings=EngineSettings(bandwidth_bps=s.emulated_bps),
                              warmup=1)
    dims = trace_dims(adapter, 0)
    device = next(model.parameters()).device
    profile_copy(device, dims.expert_bytes, bandwidth_bps=s.emulated_bps, repeats=s.copy_repeats,
                 factors=COPY_FACTORS, dtype=torch.bfloat16, samples=samples)
    calib = fit_profile(samples, num_layers=dims.num_layers, hidden_size=dims.hidden_size,
                        intermediate_size=dims.intermediate_size, expert_bytes=dims.expert_bytes,
                        meta={"device": str(device), "model": MODEL})
    calib.save(s.out / "calibration.json")  # reusable: --calibration
    return CalibratedCostModel.from_calibration(calib, dims, dtype_bytes=2), _fit_summary(calib)


def _fit_summary(calib: Any) -> dict[str, float]:
    """The fitted coefficients results.json and summary.md report (µs, GB/s)."""
    fit = {f"calib_{k[:-2]}_us": getattr(calib, k) * 1e6
           for k in ("layer_s", "dense_token_s", "expert_s", "expert_token_s", "decode_pass_s",
                     "copy_latency_s")}
    fit["calib_copy_gbps"] = calib.copy_bytes_per_s / 1e9
    return fit


def _load_calibration(path: Path, adapter: Any) -> tuple[Any, dict[str, Any]]:
    """A saved calibration (an earlier run's ``calibration.json``) as the cost model, checked
    against this model's dimensions (ConfigError naming the mismatch)."""
    from moeexp.costmodel.fitted import CalibratedCostModel, CalibratedProfile
    from moeexp.traces.recorder import trace_dims

    calib = CalibratedProfile.load(path)
    dims = trace_dims(adapter, 0)
    want = {"num_layers": dims.num_layers, "hidden_size": dims.hidden_size,
            "intermediate_size": dims.intermediate_size, "expert_bytes": dims.expert_bytes}
    bad = {k: (getattr(calib, k), v) for k, v in want.items() if getattr(calib, k) != v}
    if bad:
        raise ConfigError(f"--calibration {path}: fitted on another model ("
                          + ", ".join(f"{k} {a} there, {b} here" for k, (a, b) in bad.items())
                          + "); use a calibration.json of a run with the same settings")
    cost = CalibratedCostModel.from_calibration(calib, dims, dtype_bytes=2)
    return cost, {**_fit_summary(calib), "calib_file": str(path)}


def _plain_tpot_ms(model: Any, adapter: Any, test: Any) -> float:
    """Mean TPOT (ms) of plain forward passes, every expert on the device, the routers
    forced to the trace (the same passes as the engine's): the overhead's reference."""
    import torch

    from moeexp.engine.routing_replay import RoutingReplay, request_cache, request_latencies
    from moeexp.models.kv import kv_argument
    from moeexp.models.random_init import experts_resident

    device = next(model.parameters()).device
    replay = RoutingReplay(test, adapter)
    kv = kv_argument(model)
    handles = replay.install()
    tpots = []
    impl = model.config._experts_implementation
    if device.type == "cuda":  # what generate switches a grouped_mm model to for decoding
        model.set_experts_implementation("batched_mm")
    try:
        with experts_resident(model, device), torch.no_grad():
            for req in replay.trace.requests:
                its = replay.trace.request_iterations(req.request_id)
                prefill = bool(replay.trace.iter_step[its[0]] == 0)
                cache, ends = request_cache(model, 0 if prefill else req.prompt_len), []
                start = time.perf_counter()
                for it in its:
                    replay.begin(int(it))
                    model(input_ids=replay.token_ids(int(it)), use_cache=True, **{kv: cache})
                    replay.end()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    ends.append(time.perf_counter())
                tpots.append(request_latencies(start, ends, prefill)[1])
    finally:
        for h in handles:
            h.remove()
        model.set_experts_implementation(impl)
    return float(np.mean(tpots)) * 1e3


def _free_device() -> None:
    """Free a closed engine's slot buffers now (engine and predictor runner refer to each
    other, so only the cycle collector frees them) and give cached blocks back. On a CPU
    (the dry run) nothing waits for device memory: the collector runs when it runs."""
    import gc

    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def _fits_on_device(model: Any, adapter: Any) -> tuple[bool, str]:
    """Whether every expert fits on the device next to what is there (no_offload)."""
    import torch

    device = next(model.parameters()).device
    if device.type != "cuda":
        return True, ""
    _free_device()
    free = torch.cuda.mem_get_info(device)[0]
    need = adapter.total_expert_bytes() + (2 << 30)
    if need > free:
        return False, (f"not applicable: every expert needs {need / 2**30:.1f} GiB of device "
                       f"memory, {free / 2**30:.1f} GiB is free")
    return True, ""


def _fitted(system: str, capacity: float, store: Any, dims: Any, fits: dict[str, Any]
            ) -> tuple[Any, Any, Any, dict[str, Any], list[str]]:
    """(predictor, cache for the engine, cache for the simulator, engine settings, what
    the trace lacks); each system's predictor is fitted on the store once (``fits``)."""
    from moeexp.cache import build_cache
    from moeexp.predictors import build_predictor
    from moeexp.systems import resolve_system
    from moeexp.traces.schema import missing_for

    pcfg, ccfg, settings = resolve_system(system, cache={"capacity": capacity},
                                          model={"prefetch_distance": 3})
    if system not in fits:
        pred = build_predictor(pcfg, dims)
        lacks = missing_for(frozenset(pred.needs), store.capabilities)
        if not lacks:
            pred.fit(store)
        fits[system] = (pred, lacks)
    pred, lacks = fits[system]
    caches = []
    for _ in range(2):
        c = build_cache(ccfg, dims)
        c.fit(store)
        caches.append(c)
    return pred, caches[0], caches[1], settings, lacks


def _tpot_error_pct(sim: Sequence[float], eng: Sequence[float]) -> float:
    """Mean over requests of |sim - engine| / engine TPOT, in % (finite pairs only)."""
    pairs = [(a, b) for a, b in zip(sim, eng, strict=True)
             if np.isfinite(a) and np.isfinite(b) and b > 0]
    return float(np.mean([abs(a - b) / b for a, b in pairs]) * 100) if pairs else float("nan")


def _runnable(system: str, trace: Any) -> str:
    """The system as run on ``trace``: ``finemoe`` without its semantic search where the
    trace has no embedding outputs (its semantic search keys on them)."""
    return "finemoe_no_semantic" if system == "finemoe" and "embed" not in trace.capabilities \
        else system


def _engine_run(model: Any, adapter: Any, trace: Any, pred: Any, pol: Any,
                settings: Mapping[str, Any], cost: Any, s: Settings, system: str,
                around: Any = None) -> tuple[Any, dict[str, Any]]:
    """The engine serving ``trace`` under routing replay with ``pred`` and ``pol`` (the run's
    emulated link and predictor thread; the cost model handed over as the simulator hands
    it), inside ``around`` (a context manager, e.g. a profiler) if given: (the per-request
    series, the engine's metrics). Frees the device after."""
    from moeexp.engine.build import build_offloaded, engine_settings
    from moeexp.engine.routing_replay import RoutingReplay, replay_requests

    replay = RoutingReplay(trace, adapter)
    est = engine_settings(settings, bandwidth_bps=s.emulated_bps,
                          predictor_async=s.predictor_async)
    inside = around if around is not None else contextlib.nullcontext()
    with build_offloaded(model, adapter, pred, pol, est, system=system, routing=replay,
                         cost=cost) as om, inside:
        series = replay_requests(om, replay, prompt_kv=True)
        metrics = om.metrics()
    del om
    _free_device()
    return series, metrics


def _one_system(model: Any, adapter: Any, store: Any, test: Any, cost: Any, system: str,
                capacity: float, fits: dict[str, Any], s: Settings) -> dict[str, Any]:
    """The engine (routing replay) and the simulator on one system and capacity."""
    from moeexp.simulator import simulate

    row: dict[str, Any] = {"system": system, "capacity": capacity}
    if _runnable(system, test) != system:
        system = _runnable(system, test)
        row.update(system=system, requested="finemoe")
    pred, pol_e, pol_s, settings, lacks = _fitted(system, capacity, store, test.dims, fits)
    if lacks:
        return {**row, "status": "not_applicable",
                "reason": f"not applicable: the trace lacks {', and '.join(lacks)}"}
    if system == "no_offload":
        ok, why = _fits_on_device(model, adapter)
        if not ok:
            return {**row, "status": "not_applicable", "reason": why}
    t0 = time.perf_counter()
    series, em = _engine_run(model, adapter, test, copy.deepcopy(pred), pol_e, settings, cost, s,
                             system)
    wall = time.perf_counter() - t0
    nan = float("nan")
    sm: dict[str, Any] = {k: nan for k in ROW_KEYS}
    sim_tpot = [nan] * len(series.request_id)
    pol_feed = copy.deepcopy(pol_s) if s.feed else None  # unused by a replay yet
    if cost is not None:  # None: the calibration failed (results.json says why)
        sim = simulate(test, copy.deepcopy(pred), pol_s, cost, progress=False)
        sm = sim.metrics
        by_id = dict(zip(sim.series["request_id"], sim.series["tpot_ms"], strict=True))
        sim_tpot = [by_id[r] for r in series.request_id]
    row.update(status="ok", reason="", slots=int(pol_e.capacity_slots), engine_wall_s=wall,
               tpot_error_pct=_tpot_error_pct(sim_tpot, series.tpot_ms))
    for k in ROW_KEYS:
        row[f"engine_{k}"], row[f"sim_{k}"] = float(em[k]), float(sm[k])
    row["hit_rate_diff"] = row["sim_hit_rate"] - row["engine_hit_rate"]
    if pol_feed is not None and cost is not None and system != "no_offload":
        row.update(_feed_columns(model, adapter, store, test, cost, pred, pol_feed, s, series,
                                 settings))
    log.info("%-20s %5.1f%%  TPOT engine %.2f sim %.2f ms (err %.1f%%)  hit engine %.3f sim "
             "%.3f  h2d %.2f GB", system, capacity * 100, row["engine_tpot_ms_mean"],
             row["sim_tpot_ms_mean"], row["tpot_error_pct"], row["engine_hit_rate"],
             row["sim_hit_rate"], row["engine_h2d_bytes_total"] / 1e9)
    return row


def _feed_columns(model: Any, adapter: Any, store: Any, test: Any, cost: Any, pred: Any,
                  pol: Any, s: Settings, series: Any, settings: Mapping[str, Any]
                  ) -> dict[str, float]:
    """``--feed``: what feeding ``pred`` costs the engine per MoE layer, measured on the test
    passes with every expert resident (no copy, no stall): TPOT with the predictor minus
    TPOT with none, over the layers, clipped at 0 (``engine.profile.profile_feed``'s
    measure, under routing replay); then the simulator with that cost charged on every
    layer's critical path (``simulate(predictor_feed_s=...)``). Keys ``feed_us_per_layer``,
    ``sim_feed_tpot_ms_mean``, ``tpot_error_feed_pct``; NaN for a system without a
    predictor, or where the experts do not fit on the device. A policy that weighs its feed
    (``next_use`` with ``feed_gate``, :mod:`moeexp.cache.feed_gate`) is served again told
    that cost, as the simulator is: ``engine_gated_tpot_ms_mean``, ``engine_gated_hit_rate``,
    ``engine_gated_rested_share``, and the simulator's error is against that run."""
    from moeexp.simulator import simulate

    nan = float("nan")
    out = {"feed_us_per_layer": nan, "sim_feed_tpot_ms_mean": nan, "tpot_error_feed_pct": nan}
    if pred.name == "none" or not _fits_on_device(model, adapter)[0]:
        return out
    tpot = {}
    for label in ("without", "with", "without_again"):
        none, resident, _, plain, _ = _fitted("no_offload", 1.0, store, test.dims, {})
        use = copy.deepcopy(pred) if label == "with" else none
        run, _ = _engine_run(model, adapter, test, use, resident, plain, cost, s, "feed")
        tpot[label] = float(np.mean(run.tpot_ms))
    base = (tpot["without"] + tpot["without_again"]) / 2  # one on each side of "with"
    feed_s = max(0.0, (tpot["with"] - base) / 1e3 / test.dims.num_layers)
    if getattr(pol, "use_feed_gate", False) and feed_s > 0:  # a policy that weighs the feed:
        gated = copy.deepcopy(pred)  # the engine again, told what it measured
        gated.set_feed_cost(feed_s)
        series, em = _engine_run(model, adapter, test, gated, copy.deepcopy(pol), settings,
                                 cost, s, "feed_gate")
        out.update(engine_gated_tpot_ms_mean=float(em["tpot_ms_mean"]),
                   engine_gated_hit_rate=float(em["hit_rate"]),
                   engine_gated_rested_share=float(gated.stats()["feed_rested_share"]))
    sim = simulate(test, copy.deepcopy(pred), pol, cost, progress=False,
                   predictor_feed_s=feed_s)
    by_id = dict(zip(sim.series["request_id"], sim.series["tpot_ms"], strict=True))
    out.update(feed_us_per_layer=feed_s * 1e6,
               sim_feed_tpot_ms_mean=float(sim.metrics["tpot_ms_mean"]),
               tpot_error_feed_pct=_tpot_error_pct([by_id[r] for r in series.request_id],
                                                   series.tpot_ms))
    return out


def _systems(model: Any, adapter: Any, store: Any, test: Any, cost: Any,
             s: Settings, t0: float) -> list[dict[str, Any]]:
    """Every system at every capacity (no_offload once, at all of expert memory); runs
    that would start after ``s.max_wall_s`` seconds since ``t0`` are skipped (said so)."""
    fits: dict[str, Any] = {}
    rows = []
    for system in s.systems:
        for cap in ((1.0,) if system == "no_offload" else s.capacities):
            if time.perf_counter() - t0 > s.max_wall_s:
                rows.append({"system": system, "capacity": cap, "status": "skipped",
                             "reason": f"skipped: past the time budget of {s.max_wall_s:.0f} s"})
                continue
            try:
                rows.append(_one_system(model, adapter, store, test, cost, system, cap, fits, s))
            except ConfigError as exc:  # e.g. a capacity below top-k experts
                rows.append({"system": system, "capacity": cap, "status": "not_applicable",
                             "reason": str(exc)})
    return rows


def _profile_system(model: Any, adapter: Any, store: Any, test: Any, cost: Any,
                    s: Settings) -> dict[str, Any]:
    """torch.profiler over the engine serving ``s.profile``'s system at its capacity on the
    first test request's first ``s.profile_passes`` passes: ``profile_<system>_<cap>.txt``
    (the operators by self CPU time, then by self device time where there is a device) and
    ``profile_<system>_<cap>.json`` (a Chrome trace: the compute, copy and worker threads
    side by side). Returns where they are and the passes' TPOT."""
    from torch.profiler import ProfilerActivity, profile

    assert s.profile is not None
    one = truncate(test, 1, s.profile_passes)
    system, cap = _runnable(s.profile[0], one), s.profile[1]
    pred, pol, _, settings, lacks = _fitted(system, cap, store, one.dims, {})
    if lacks:
        return {"system": system, "capacity": cap,
                "reason": f"not applicable: the trace lacks {', and '.join(lacks)}"}
    cuda = next(model.parameters()).device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=acts)
    series, _ = _engine_run(model, adapter, one, copy.deepcopy(pred), pol, settings, cost, s,
                            system, around=prof)
    stem = f"profile_{system}_{cap:g}"
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    if cuda:
        table += "\n\n" + prof.key_averages().table(sort_by="self_device_time_total",
                                                    row_limit=25)
    write_text(s.out / f"{stem}.txt", table + "\n")
    with atomic_path(s.out / f"{stem}.json", suffix=".json") as tmp:
        prof.export_chrome_trace(str(tmp))
    return {"system": system, "capacity": cap, "passes": s.profile_passes,
            "tpot_ms": float(np.mean(series.tpot_ms)), "table": f"{stem}.txt",
            "trace": f"{stem}.json"}


def _environment(device: str) -> dict[str, Any]:
    import platform

    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "python": platform.python_version(), "device": device,
                           "torch_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_mem_gib=p.total_memory / 2**30)
    from moeexp.models.random_init import host_available_bytes

    env["host_available_gib"] = host_available_bytes() / 2**30
    return env


def _summary_md(res: dict[str, Any]) -> str:
    """A short markdown summary: the measurements, then one line per system."""
    head = ("CPU dry run at reduced size (not a result)" if res["settings"]["dry_run"]
            else f"GPU run: {res['environment'].get('gpu', res['environment']['device'])}")
    lines = [f"# real_scale: {head}", "", f"routing_source: replay, exact: false; "
             f"{res['test_requests']} test requests x {res['passes']} decode passes", ""]
    for k in ("h2d", "calibration", "overhead"):
        lines.append(f"- {k}: " + ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}"
                                            for a, b in res[k].items()))
    lines += ["", "| system | capacity | engine TPOT ms | sim TPOT ms | TPOT err % | engine hit | "
              "sim hit | engine H2D GB | stall demand/late/link ms | predictor µs/call | status |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["systems"]:
        if r["status"] != "ok":
            lines.append(f"| {r['system']} | {r['capacity']:.3f} | | | | | | | | | {r['reason']} |")
            continue
        lines.append(
            f"| {r['system']} | {r['capacity']:.3f} | {r['engine_tpot_ms_mean']:.2f} | "
            f"{r['sim_tpot_ms_mean']:.2f} | {r['tpot_error_pct']:.1f} | "
            f"{r['engine_hit_rate']:.3f} | {r['sim_hit_rate']:.3f} | "
            f"{r['engine_h2d_bytes_total'] / 1e9:.3f} | {r['engine_stall_demand_ms_total']:.1f}/"
            f"{r['engine_stall_late_prefetch_ms_total']:.1f}/{r['engine_stall_link_ms_total']:.1f}"
            f" | {r['engine_predictor_query_us_mean']:.0f} | ok |")
    lines += ["", f"simulator TPOT error, mean over systems: {res['tpot_error_pct_mean']:.1f} %",
              ""]
    fed = [r for r in res["systems"] if np.isfinite(r.get("feed_us_per_layer", np.nan))]
    if fed:
        lines += ["--feed: each predictor's feeding cost on the engine (every expert resident), "
                  "and the simulator charged with it:", "",
                  "| system | capacity | feed µs/layer | engine TPOT ms | engine told the feed: "
                  "TPOT ms / rested share | sim+feed TPOT ms | TPOT err % (without / with feed) |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['system']} | {r['capacity']:.3f} | {r['feed_us_per_layer']:.0f} | "
                  f"{r['engine_tpot_ms_mean']:.2f} | {_gated(r)} | "
                  f"{r['sim_feed_tpot_ms_mean']:.2f} | "
                  f"{r['tpot_error_pct']:.1f} / {r['tpot_error_feed_pct']:.1f} |" for r in fed]
        lines.append("")
    if "profile" in res:
        pr = res["profile"]
        lines += [f"profile: {pr['system']} at {pr['capacity']:g}: "
                  + (f"{pr['passes']} passes, TPOT {pr['tpot_ms']:.2f} ms under the profiler; "
                     f"{pr['table']}, {pr['trace']}" if "table" in pr else pr["reason"]), ""]
    return "\n".join(lines)


def _gated(row: Mapping[str, Any]) -> str:
    """The summary's cell for a policy served again told its feed cost ("–": not one)."""
    if "engine_gated_tpot_ms_mean" not in row:
        return "–"
    return f"{row['engine_gated_tpot_ms_mean']:.2f} / {row['engine_gated_rested_share']:.2f}"


def run_real_scale(s: Settings) -> dict[str, Any]:
    """Everything of the module docstring; writes ``s.out`` and returns results.json's dict."""
    import torch

    from moeexp.engine.routing_replay import replay_labels

    if s.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"real_scale: device={s.device} but CUDA is not available (torch "
                          f"{torch.__version__}); use --dry-run for the CPU check")
    t0 = time.perf_counter()
    model, adapter, store, test = _model_and_traces(s)
    built = time.perf_counter() - t0
    res: dict[str, Any] = {**replay_labels(test, prompt_kv=True), "settings": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(s).items()},
        "environment": _environment(s.device), "model_build_s": built,
        "model": adapter.describe(), "test_requests": len(test.requests), "passes": s.passes,
        "store_requests": len(store.requests)}
    loaded = _load_calibration(s.calibration, adapter) if s.calibration is not None else None
    res["h2d"] = _h2d_bandwidth(model, adapter, s)
    _free_device()
    cost: Any = None
    fits, why = _fits_on_device(model, adapter)  # the profile holds every expert resident
    try:
        if loaded is not None:
            cost, res["calibration"] = loaded
        elif not fits:
            raise ConfigError(f"the calibration profiles every expert resident: {why}")
        else:
            cost, res["calibration"] = _calibrate(model, adapter, s)
    except (ConfigError, torch.cuda.OutOfMemoryError) as exc:  # keep the engine's numbers
        log.error("calibration failed, the simulator is skipped: %s", exc)
        res["calibration"] = {"error": str(exc)}
    _free_device()
    rows = _systems(model, adapter, store, test, cost, s, t0)
    plain = _plain_tpot_ms(model, adapter, test) if _fits_on_device(model, adapter)[0] \
        else float("nan")
    ref = next((r for r in rows if r["system"] == "no_offload" and r["status"] == "ok"), None)
    eng = ref["engine_tpot_ms_mean"] if ref else float("nan")
    res["overhead"] = {"plain_tpot_ms": plain, "engine_no_offload_tpot_ms": eng,
                       "engine_over_plain": eng / plain if plain > 0 else float("nan")}
    res["systems"] = rows
    if s.profile is not None:
        res["profile"] = _profile_system(model, adapter, store, test, cost, s)
    ok = [r["tpot_error_pct"] for r in rows if r["status"] == "ok"
          and np.isfinite(r["tpot_error_pct"])]
    res["tpot_error_pct_mean"] = float(np.mean(ok)) if ok else float("nan")
    res["wall_s"] = time.perf_counter() - t0
    _write(res, s.out)
    return res


def _write(res: dict[str, Any], out: Path) -> None:
    import pandas as pd

    write_json(out / "results.json", res)
    write_text(out / "systems.csv", pd.DataFrame(res["systems"]).to_csv(index=False))
    write_text(out / "summary.md", _summary_md(res))


def run() -> dict[str, Any]:
    """``make bench`` (every bench module's ``run``) does not run this one: it is the GPU
    script of issue 15, ~10 minutes on an H200."""
    from moeexp.bench import BenchSkipped

    raise BenchSkipped("real_scale is a GPU script: make bench-real-scale (or python -m "
                       "moeexp.bench.real_scale --dry-run for its CPU check)")


def _systems_arg(text: str) -> tuple[str, ...]:
    """``--systems``: each name a ``conf/system`` YAML (ConfigError naming the valid ones)."""
    from moeexp.paths import group_options

    valid = group_options("system")
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in valid]
    if not names or bad:
        raise ConfigError(f"--systems: unknown system(s) {bad or [text]}; valid: "
                          f"{', '.join(sorted(valid))}")
    return names


def _profile_arg(text: str) -> tuple[str, float]:
    """``--profile SYSTEM:CAPACITY`` (ConfigError naming what is valid)."""
    name, sep, cap = text.partition(":")
    if not sep:
        raise ConfigError(f"--profile: {text!r} is not SYSTEM:CAPACITY, e.g. oracle:0.5")
    return _systems_arg(name)[0], _capacities_arg(cap)[0]


def _capacities_arg(text: str) -> tuple[float, ...]:
    """``--capacities``: fractions of expert memory in (0, 1] (ConfigError otherwise)."""
    try:
        caps = tuple(float(c) for c in text.split(",") if c.strip())
    except ValueError:
        caps = ()
    if not caps or any(not 0 < c <= 1 for c in caps):
        raise ConfigError(f"--capacities: {text!r} is not a comma-separated list of fractions "
                          "of expert memory in (0, 1], e.g. 0.25,0.5")
    return caps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moeexp.bench.real_scale",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: results/real_scale/<time>)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, reduced size, a few requests: the same code path")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--test-requests", type=int, default=None)
    ap.add_argument("--passes", type=int, default=None)
    ap.add_argument("--systems", default=None,
                    help=f"comma-separated systems (default: {','.join(SYSTEMS)})")
    ap.add_argument("--capacities", default=None,
                    help="comma-separated fractions of expert memory, each in (0, 1] "
                         f"(default: {','.join(str(c) for c in CAPACITIES)})")
    ap.add_argument("--calibration", type=Path, default=None,
                    help="an earlier run's calibration.json, used instead of profiling the "
                         "engine in this process")
    ap.add_argument("--profile", default=None, metavar="SYSTEM:CAPACITY",
                    help="after the systems, profile this system's engine run with "
                         "torch.profiler (the first request's first 4 passes), e.g. oracle:0.5")
    ap.add_argument("--predictor-inline", action="store_true",
                    help="run the engine's predictor inline on the compute thread instead "
                         "of on its worker thread (EngineSettings.predictor_async=False)")
    ap.add_argument("--feed", action="store_true",
                    help="also measure each predictor's feeding cost on the engine (every "
                         "expert resident, with against without it) and simulate with it")
    ap.add_argument("--max-wall-s", type=float, default=None,
                    help="no new system run starts after this many seconds (default 480)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = args.out or Path("results/real_scale") / time.strftime("%Y-%m-%d_%H-%M-%S")
    s = Settings.dry(out) if args.dry_run else Settings(out=out, device=args.device)
    over: dict[str, Any] = {k: v for k, v in (("test_requests", args.test_requests),
                                               ("passes", args.passes),
                                               ("max_wall_s", args.max_wall_s),
                                               ("calibration", args.calibration))
                           if v is not None}
    if args.systems is not None:
        over["systems"] = _systems_arg(args.systems)
    if args.capacities is not None:
        over["capacities"] = _capacities_arg(args.capacities)
    if args.profile is not None:
        over["profile"] = _profile_arg(args.profile)
    if args.predictor_inline:
        over["predictor_async"] = False
    if args.feed:
        over["feed"] = True
    s = dataclasses.replace(s, **over)
    res = run_real_scale(s)
    sys.stdout.write(_summary_md(res) + f"\noutputs in {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
