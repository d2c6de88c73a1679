"""``+experiment=sim_vs_engine``: calibrate the simulator on the engine, then measure its error.

One job (``backend=sim_vs_engine``, :class:`moeexp.backends.SimVsEngineBackend`) does::

    profile the engine on the store prompts      moeexp.engine.profile (compute + copies)
    fit the cost model                           moeexp.costmodel.fitted.fit_profile
        -> calibration.json, profile_samples.json, conf/hardware/calibrated.yaml
    for every system (same capacity, policies fitted on the store split):
        simulator: replay the test trace with the calibrated cost model
        engine:    serve the test prompts, decoding the trace's tokens (same passes)
    summary.csv / summary.md / requests.csv in the run directory

The error of the simulator per system: MAPE (%) over test requests of TTFT and TPOT
(``|sim - engine| / engine``, request by request), and ``hit_rate_diff = sim - engine``.
The profile is taken on the store split and the comparison on the test split, so the fit
is never evaluated on the requests it was fitted on.

Reuse the fit elsewhere: ``python -m moeexp backend.cost_profile=RUN/calibration.json``
(the full fit), or ``hydra.searchpath=[file://RUN/conf] hardware=calibrated`` (its roofline
approximation).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moeexp.atomic import write_text
from moeexp.cache import build_cache
from moeexp.costmodel.fitted import (
    MEMBER_OUTLIER_MADS,
    PROFILE_FORMAT,
    CalibratedCostModel,
    CalibratedProfile,
    fit_profile,
)
from moeexp.errors import ConfigError
from moeexp.paths import group_options
from moeexp.predictors import build_predictor
from moeexp.registry import typed
from moeexp.simulator import simulate
from moeexp.systems import resolve_system, system_names

log = logging.getLogger(__name__)

DEFAULT_SYSTEMS: tuple[Any, ...] = (
    "no_offload", "deepspeed", "mixtral_offloading", "moe_infinity", "finemoe",
    {"name": "static", "system": "deepspeed", "cache": "static"}, "oracle")
#: The multi-member pass profile (moeexp.engine.profile.profile_passes): member counts (up
#: to a full emoe_serving_check pass), decode passes per count, prompt cuts (KV apart from
#: members), sweeps: the members term of the fit.
PASS_PROFILE: dict[str, Any] = {"batch_sizes": [1, 2, 4, 8, 16, 24], "steps": 8,
                                "prompt_fractions": [0.25, 1.0], "repeats": 3}
SUMMARY_COLUMNS = ["system", "engine_ttft_ms_mean", "sim_ttft_ms_mean", "engine_tpot_ms_mean",
                   "sim_tpot_ms_mean", "engine_hit_rate", "sim_hit_rate"]


@dataclasses.dataclass(frozen=True)
class SystemEntry:
    """One row of the comparison: a label, a system bundle, optional group overrides."""

    name: str
    system: str
    predictor: str | None = None
    cache: str | Mapping[str, Any] | None = None  # a name, or keys over the system's cache
    scheduler: str | None = None
    execution: str | Mapping[str, Any] | None = None  # an option, or {name, keys over it}


# Default copy sizes of the profile, multiples of one expert's bytes: {on CUDA: sizes}.
COPY_FACTORS: dict[bool, tuple[float, ...]] = {
    False: (0.25, 0.5, 1.0, 2.0, 4.0),           # CPU: the emulated link is linear already
    True: (1.0, 4.0, 16.0, 64.0, 256.0, 1024.0),  # CUDA: latency-bound below ~1 MB
}


@dataclasses.dataclass(frozen=True)
class SimVsEngineSettings:
    """The ``sim_vs_engine`` backend group (conf/backend/sim_vs_engine.yaml).

    Attributes:
        systems: names of conf/system bundles, or mappings ``{name, system, predictor?,
            cache?, scheduler?, execution?}`` (e.g. ``static`` = deepspeed with the static
            cache; ``cache`` a conf/cache name or a mapping of keys over the system's
            cache; ``scheduler`` only in serving mode; ``execution`` a conf/execution
            option or a mapping of its ``name`` and keys over it (``{name: balanced,
            late_to_cpu: true}``), priced by the calibrated CPU block:
            :mod:`moeexp.backends.cpu_calibration`).
        capacity: the expert budget of every system (cache.capacity syntax).
        prefetch_distance: ``${model.prefetch_distance}`` for predictor configs.
        device, bandwidth_bps, num_threads, predictor_async, max_inflight, spec_depth,
            warmup: the engine's settings (as in conf/backend/engine.yaml) for the engine
            runs and the profile; ``bandwidth_bps`` is the emulated link on a CPU.
        profile_requests: store requests profiled (prompts truncated to the fractions below).
        length_fractions: prompt lengths profiled, as fractions of each store prompt.
        decode_tokens: tokens generated per profiled request (None: the test output length).
        copy_factors: copy sizes profiled, as multiples of one expert's bytes; None picks
            by device (:data:`COPY_FACTORS`): 0.25-4x through the emulated link of a CPU,
            1-1024x on CUDA, where a small expert's copy is all latency and the slope
            (bandwidth) shows only once copies reach megabytes.
        copy_repeats: timed copies per size.
        predictor_feed: charge each system's predictor-feeding cost (measured on the engine
            with its fitted predictor on the store prompts, every expert resident; see
            :func:`moeexp.engine.profile.profile_feed`) per MoE layer in the simulator.
            False (default): the idealisation of algorithms.md (prediction is free on the
            critical path), which the simulator uses everywhere else. Predictors that need
            the future (oracle) are not measured (0). The engine's predictor is told the
            same cost (``Predictor.set_feed_cost``): ``prefetch_if_pays`` rests its
            predictor where feeding it costs more than it saves (:mod:`moeexp.cache.feed_gate`).
        outlier_mads: None fits mean times (the default: the engine's runs have the same
            slow tail); a number drops samples beyond that many MADs first.
        calibration_dir: None (default) profiles the engine in every job; a directory
            stores each fit as ``<key>.json``, ``key`` the sha256 of everything the profile
            depends on (:func:`calibration_inputs`: model weights and dims, device, torch
            threads and version, host, the engine settings, the profile settings and the
            profiled token ids), and a later job with the same inputs reuses it (a file
            whose recorded inputs differ, or that does not load, is reported and replaced).
        cpu_profile: profile the engine's CPU path and fit the calibrated profile's CPU
            block (:func:`moeexp.backends.cpu_calibration.calibrate_cpu`; offline mode
            only); needed by entries with an ``execution`` that computes on the CPU.
        progress: progress bars.

    Serving mode (``serving`` not None, :mod:`moeexp.backends.serving_point`): every
    ``systems`` entry serves the test requests with continuous batching on both backends
    under its ``scheduler`` (a conf/scheduler option, default fcfs; the run's own
    ``scheduler`` group stays static):

    Attributes:
        serving: the budgets and SLO scales (:class:`ServingSettings` keys).
        arrival_rate: Poisson req/s as the run's ``hardware`` profile would serve it (an
            ``emoe_serving`` point); None = offline (all at 0).
        rescale_rate: serve at ``arrival_rate`` x (mean unloaded end-to-end latency under
            the hardware profile) / (the same under the calibrated model): the same load
            (arrival rate x service time) on the calibrated machine; False serves at
            ``arrival_rate`` as given.
        test_requests: serve only the first N test requests (arrival order); None = all.
        restricted_routing, renormalize: eMoE's lossy mode (the ``emoe`` system sets it).
        batch_decode: the engine runs a pass's decoding requests as one padded forward.
        pass_profile: keys of :data:`PASS_PROFILE` to replace in the multi-member pass
            profile (the fit's members term), e.g. ``{batch_sizes: [1, 2, 4], repeats: 1}``
            for a quick check; None (default) profiles :data:`PASS_PROFILE` as it is.
    """

    systems: tuple[SystemEntry, ...]
    capacity: float | int | str = 0.25
    prefetch_distance: int = 1
    device: str | None = "cpu"
    bandwidth_bps: float | None = None
    num_threads: int | None = None
    predictor_async: bool = True
    max_inflight: int = 2
    spec_depth: int = 4
    warmup: int = 1
    profile_requests: int = 8
    length_fractions: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)
    decode_tokens: int | None = None
    copy_factors: tuple[float, ...] | None = None
    copy_repeats: int = 6
    outlier_mads: float | None = None
    predictor_feed: bool = False
    calibration_dir: str | None = None
    cpu_profile: bool = True
    progress: bool = True
    serving: Mapping[str, Any] | None = None
    arrival_rate: float | None = None
    rescale_rate: bool = True
    test_requests: int | None = None
    restricted_routing: bool = False
    renormalize: bool = False
    batch_decode: bool = False
    pass_profile: Mapping[str, Any] | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SimVsEngineSettings:
        """Validate the group (unknown keys, bad systems and engine keys raise ConfigError)."""
        d = dict(data)
        entries = []
        for item in d.pop("systems", DEFAULT_SYSTEMS):
            if isinstance(item, str):
                item = {"name": item, "system": item}
            if not isinstance(item, Mapping) or "system" not in item:
                raise ConfigError(f"backend=sim_vs_engine: a systems entry must be a system name "
                                  f"or {{name, system, predictor?, cache?}}, got {item!r}")
            entries.append(typed(SystemEntry, {"name": item.get("name", item["system"]), **item},
                                 "backend=sim_vs_engine systems entry"))
        valid = system_names()
        bad = sorted({e.system for e in entries} - set(valid))
        if bad:
            raise ConfigError(f"backend=sim_vs_engine: unknown system(s) {bad}. Valid: "
                              f"{', '.join(valid)}")
        scheds = group_options("scheduler")
        bad = sorted({e.scheduler for e in entries if e.scheduler} - set(scheds))
        if bad or (d.get("serving") is None and any(e.scheduler for e in entries)):
            raise ConfigError(f"backend=sim_vs_engine: a systems entry's scheduler is one of "
                              f"{', '.join(scheds)} and needs backend.serving (got {bad})")
        for k in ("length_fractions", "copy_factors"):
            if d.get(k) is not None:
                d[k] = tuple(float(x) for x in d[k])
        out = typed(cls, {"systems": tuple(entries), **d}, "backend=sim_vs_engine")
        if not out.systems:
            raise ConfigError("backend=sim_vs_engine: systems is empty")
        out.passes  # noqa: B018 (validates pass_profile before any work)
        execs = [e.execution for e in out.systems if e.execution]
        if execs:
            from moeexp.backends.cpu_calibration import check_execution_names

            check_execution_names(execs)
            if out.serving is not None:
                raise ConfigError("backend=sim_vs_engine: a systems entry's execution runs "
                                  "offline only (serving mode copies every miss)")
        if out.serving is not None:
            out.serving_settings()
            if out.arrival_rate is not None and not out.arrival_rate > 0:
                raise ConfigError(f"backend=sim_vs_engine: arrival_rate must be > 0 req/s or "
                                  f"null, got {out.arrival_rate}")
            if out.test_requests is not None and out.test_requests < 1:
                raise ConfigError(f"backend=sim_vs_engine: test_requests must be >= 1 or null, "
                                  f"got {out.test_requests}")
        from moeexp.engine.serve import check_serve_settings  # torch

        check_serve_settings(out.engine)  # device (CUDA present?) checked before any work
        return out

    @property
    def passes(self) -> dict[str, Any]:
        """The multi-member pass profile: :data:`PASS_PROFILE` with ``pass_profile``'s keys
        replaced (ConfigError naming an unknown key or a bad value)."""
        extra = dict(self.pass_profile or {})
        bad = sorted(set(extra) - set(PASS_PROFILE))
        if bad:
            raise ConfigError(f"backend.pass_profile: unknown key(s) {bad}. Valid: "
                              f"{', '.join(PASS_PROFILE)}")
        out = {**PASS_PROFILE, **extra}
        sizes, fracs = list(out["batch_sizes"]), list(out["prompt_fractions"])
        if (len(set(sizes)) < 2 or min(sizes) < 1 or int(out["steps"]) < 1
                or int(out["repeats"]) < 1 or not fracs or not all(0 < f <= 1 for f in fracs)):
            raise ConfigError(f"backend.pass_profile: needs >= 2 distinct batch_sizes >= 1 (the "
                              f"members slope), steps >= 1, repeats >= 1 and prompt_fractions in "
                              f"(0, 1], got {out}")
        return {"batch_sizes": [int(b) for b in sizes], "steps": int(out["steps"]),
                "prompt_fractions": [float(f) for f in fracs], "repeats": int(out["repeats"])}

    @property
    def profiles_cpu(self) -> bool:
        """Whether the calibration profiles the CPU path (``cpu_profile``, offline mode:
        serving mode copies every miss)."""
        return self.cpu_profile and self.serving is None

    @property
    def engine(self) -> dict[str, Any]:
        """The backend=engine settings of the engine runs and the profile."""
        return {k: getattr(self, k) for k in ("device", "bandwidth_bps", "num_threads",
                                              "predictor_async", "max_inflight", "spec_depth",
                                              "warmup")}

    def engine_settings(self) -> Any:
        """:attr:`engine` as the :class:`~moeexp.engine.runtime.EngineSettings` it holds."""
        from moeexp.engine.build import engine_settings  # torch

        return engine_settings(self.engine)

    def serving_settings(self) -> Any:
        """The ``serving`` block as :class:`ServingSettings` (ConfigError naming a bad key)."""
        from moeexp.serving.settings import ServingSettings

        return typed(ServingSettings, dict(self.serving or {}), "backend.serving")

    def decode_tokens_for(self, prompts: Any) -> int:
        """Tokens generated per profiled request (``decode_tokens``, else the test length)."""
        return int(self.decode_tokens or max(int(p.output_len) for p in prompts))


def _store_requests(store: Any, n: int, fractions: tuple[float, ...], new: int
                    ) -> list[tuple[list[int], int]]:
    """Profile requests from the store trace's prompts, truncated to ``fractions``."""
    out = []
    for i, r in enumerate(store.requests[:n]):
        its = store.request_iterations(r.request_id)
        first = its[np.argmin(store.iter_step[its])]
        ids = store.token_ids[int(store.iter_offsets[first]): int(store.iter_offsets[first + 1])]
        keep = max(1, int(round(len(ids) * fractions[i % len(fractions)])))
        out.append(([int(t) for t in ids[:keep]], int(new)))
    return out


def calibration_inputs(ctx: Any, s: SimVsEngineSettings, reqs: list[tuple[list[int], int]]
                       ) -> dict[str, Any]:
    """Everything a profile of the engine depends on (JSON-able), for :func:`_calibrate`'s
    store: the model (weights hash, dims), the machine (device, CUDA name, host, CPU,
    torch version and threads), the engine settings and the profile's settings and
    requests (their token ids, hashed)."""
    import os
    import platform

    import torch

    from moeexp.traces.store import weights_hash

    device = next(ctx.loaded.model.parameters()).device
    d = ctx.trace.dims
    return {
        "version": 2, "model": ctx.loaded.name, "weights": weights_hash(ctx.loaded.model),
        "dims": [d.num_layers, d.num_experts, d.top_k, d.hidden_size, d.intermediate_size,
                 d.expert_bytes],
        "device": str(device), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "engine": {k: v for k, v in s.engine.items()},
        "profile": {"copy_factors": list(s.copy_factors or COPY_FACTORS[device.type == "cuda"]),
                    "copy_repeats": s.copy_repeats, "outlier_mads": s.outlier_mads,
                    "warmup": s.warmup, "passes": s.passes, "batch_decode": s.batch_decode,
                    "cpu_profile": s.profiles_cpu,
                    "fit": {"format": PROFILE_FORMAT, "member_outlier_mads": MEMBER_OUTLIER_MADS}},
        "requests": hashlib.sha256(json.dumps(reqs).encode()).hexdigest(),
    }


def _stored_calibration(path: Path, key: str, inputs: dict[str, Any]) -> Any:
    """The calibration stored at ``path`` if it was fitted from exactly ``inputs``, else
    None (a missing file silently; a corrupt or mismatched one with a warning)."""
    if not path.is_file():
        return None
    try:
        calib = CalibratedProfile.load(path)
    except ConfigError as e:
        log.warning("stored calibration %s does not load (%s): profiling again", path, e)
        return None
    got = calib.meta.get("calibration_inputs")
    if calib.meta.get("calibration_key") != key or got != json.loads(json.dumps(inputs)):
        differ = sorted(k for k in inputs if not isinstance(got, Mapping) or got.get(k) != inputs[k])
        log.warning("stored calibration %s was fitted from other inputs (differ: %s): "
                    "profiling again", path, ", ".join(differ) or "key")
        return None
    return calib


def _calibrate(ctx: Any, s: SimVsEngineSettings, run_dir: Path) -> tuple[Any, bool]:
    """Profile + fit (or reuse a matching stored fit, ``calibration_dir``); writes
    calibration.json, conf/hardware/ and (when profiled) profile_samples.json. Returns
    (the fit, whether it was reused)."""
    import torch

    from moeexp.engine.profile import profile_compute, profile_copy, profile_passes  # torch

    est = s.engine_settings()
    new = s.decode_tokens_for(ctx.prompts)
    reqs = _store_requests(ctx.store, s.profile_requests, s.length_fractions, new)
    # the multi-member passes on whole store prompts: a serving pass's contexts, cut by
    # PASS_PROFILE's prompt fractions
    pass_reqs = _store_requests(ctx.store, s.profile_requests, (1.0,), new)
    store = key = inputs = None
    if s.calibration_dir is not None:
        inputs = calibration_inputs(ctx, s, reqs + pass_reqs)
        key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
        store = Path(s.calibration_dir).expanduser() / f"{key}.json"
        calib = _stored_calibration(store, key, inputs)
        if calib is not None:
            log.info("calibration: reusing %s (same model, machine and profile settings)", store)
            calib.save(run_dir / "calibration.json")
            calib.write_hardware_yaml(run_dir / "conf")
            return calib, True
    samples = profile_compute(ctx.loaded, reqs, settings=est, warmup=s.warmup,
                              progress=s.progress)
    profile_passes(ctx.loaded, pass_reqs, settings=est, batch_decode=s.batch_decode,
                   warmup=s.warmup, samples=samples, **s.passes)  # the member term
    dims = ctx.trace.dims
    device = next(ctx.loaded.model.parameters()).device
    dtype = next(ctx.loaded.model.parameters()).dtype
    profile_copy(device, dims.expert_bytes, bandwidth_bps=est.bandwidth_bps,
                 max_inflight=est.max_inflight, repeats=s.copy_repeats,
                 factors=s.copy_factors or COPY_FACTORS[device.type == "cuda"],
                 dtype=dtype, samples=samples)
    meta = {"device": str(device), "torch_threads": torch.get_num_threads(),
            "emulated_bandwidth_bps": est.bandwidth_bps if device.type == "cpu" else None,
            "profile_requests": len(reqs), "batch_decode": s.batch_decode,
            "decode_tokens": new, "model": ctx.loaded.name,
            "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    raw = {k: list(map(float, v)) for k, v in dataclasses.asdict(samples).items()}
    write_text(run_dir / "profile_samples.json", json.dumps(raw))  # kept if the fit fails
    calib = fit_profile(samples, num_layers=dims.num_layers, hidden_size=dims.hidden_size,
                        intermediate_size=dims.intermediate_size, expert_bytes=dims.expert_bytes,
                        outlier_mads=s.outlier_mads, meta=meta)
    if s.profiles_cpu:
        from moeexp.backends.cpu_calibration import calibrate_cpu

        calib, cpu_raw = calibrate_cpu(ctx.loaded, reqs, calib, settings=est, warmup=s.warmup,
                                       progress=s.progress, outlier_mads=s.outlier_mads)
        write_text(run_dir / "profile_samples.json", json.dumps({**raw, **cpu_raw}))
    if store is not None:
        calib.meta.update({"calibration_key": key, "calibration_inputs": inputs})
        calib.save(store)
    calib.save(run_dir / "calibration.json")
    calib.write_hardware_yaml(run_dir / "conf")
    log.info("calibrated: layer %.0f us + %.2f us/token, expert %.0f us + %.2f us/token, "
             "decode pass %.0f us, prefill pass %.0f us + %.1f us/token, copy %.0f us + %.1f MB/s, "
             "%.0f us per pass member beyond the first (residual ms by members: %s)",
             calib.layer_s * 1e6, calib.dense_token_s * 1e6, calib.expert_s * 1e6,
             calib.expert_token_s * 1e6, calib.decode_pass_s * 1e6, calib.prefill_pass_s * 1e6,
             calib.prefill_token_s * 1e6, calib.copy_latency_s * 1e6, calib.copy_bytes_per_s / 1e6,
             calib.member_s * 1e6, calib.fit.get("member_residuals"))
    return calib, False


def _mape(sim: list[float], eng: list[float]) -> float:
    pairs = [(a, b) for a, b in zip(sim, eng, strict=True)
             if np.isfinite(a) and np.isfinite(b) and b > 0]
    return float(np.mean([abs(a - b) / b for a, b in pairs]) * 100) if pairs else float("nan")


def cache_choice(entry: SystemEntry, capacity: Any) -> dict[str, Any]:
    """The cache overrides of ``entry`` for ``resolve_system``: the run's capacity, and the
    entry's cache name or its keys over the system's cache (e.g. ``{feed_gate: false}``)."""
    out: dict[str, Any] = {"capacity": capacity}
    if isinstance(entry.cache, Mapping):
        out.update(entry.cache)
    elif entry.cache:
        out["name"] = entry.cache
    return out


def _one_system(ctx: Any, s: SimVsEngineSettings, entry: SystemEntry, cost: Any
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Both backends on one system; the summary row and the per-request rows."""
    from moeexp.engine.serve import serve_engine  # torch

    pcfg, ccfg, sys_settings = resolve_system(
        entry.system, entry.predictor, cache_choice(entry, s.capacity),
        model={"prefetch_distance": s.prefetch_distance})
    dims = ctx.trace.dims
    restricted = bool(sys_settings.get("restricted_routing", False))
    renorm = bool(sys_settings.get("renormalize", False))
    objs = []
    for _ in range(2):  # fresh, separately fitted objects for each backend
        pred, pol = build_predictor(pcfg, dims), build_cache(ccfg, dims)
        pred.fit(ctx.store)
        pol.fit(ctx.store)
        objs.append((pred, pol))
    feed_s = 0.0
    if s.predictor_feed and pcfg["name"] != "none" and "future" not in objs[0][0].needs:
        from moeexp.engine.profile import profile_feed  # torch

        feed_reqs = _store_requests(ctx.store, s.profile_requests, (1.0,),
                                    s.decode_tokens_for(ctx.prompts))
        feed_s = profile_feed(ctx.loaded, feed_reqs, objs[0][0], settings=s.engine_settings(),
                              warmup=s.warmup)
        objs[1][0].set_feed_cost(feed_s)  # the engine's policy weighs its own measured feed
    from moeexp.backends.cpu_calibration import cpu_columns, entry_executions

    execs = entry_executions(entry.execution, cost, ctx.store)
    settings = {**s.engine, "restricted_routing": restricted, "renormalize": renorm,
                "replay_tokens": True, "reference": False, "seed": ctx.seed, "progress": False}
    eng = serve_engine(ctx.loaded, ctx.prompts, objs[1][0], objs[1][1], settings, trace=ctx.trace,
                       execution=execs[1], cost=cost)
    sim = simulate(ctx.trace, objs[0][0], objs[0][1], cost, restricted_routing=restricted,
                   seed=ctx.seed, progress=False, predictor_feed_s=feed_s, execution=execs[0])
    sm, em = sim.metrics, eng.metrics
    by_id = {rid: i for i, rid in enumerate(sim.series["request_id"])}
    order = [by_id[rid] for rid in eng.series["request_id"]]
    sim_ttft = [sim.series["ttft_ms"][i] for i in order]
    sim_tpot = [sim.series["tpot_ms"][i] for i in order]
    row = {
        "system": entry.name,
        "engine_ttft_ms_mean": em["ttft_ms_mean"], "sim_ttft_ms_mean": sm["ttft_ms_mean"],
        "engine_tpot_ms_mean": em["tpot_ms_mean"], "sim_tpot_ms_mean": sm["tpot_ms_mean"],
        "engine_hit_rate": em["hit_rate"], "sim_hit_rate": sm["hit_rate"],
        "ttft_mape_pct": _mape(sim_ttft, eng.series["ttft_ms"]),
        "tpot_mape_pct": _mape(sim_tpot, eng.series["tpot_ms"]),
        "hit_rate_diff": sm["hit_rate"] - em["hit_rate"],
        "engine_h2d_bytes_total": em["h2d_bytes_total"], "sim_h2d_bytes_total": sm["h2d_bytes_total"],
        "engine_stall_ms_total": em["stall_ms_total"], "sim_stall_ms_total": sm["stall_ms_total"],
        "engine_prediction_recall": em["prediction_recall"],
        "sim_prediction_recall": sm["prediction_recall"],
        "engine_accesses_total": em["accesses_total"], "sim_accesses_total": sm["accesses_total"],
        "predictor": pcfg["name"], "cache": ccfg["name"],
        "sim_predictor_feed_us": feed_s * 1e6,
        # a policy that weighs its feed: the share of passes its predictor rested (NaN: none)
        "engine_feed_rested_share": float(em.get("predictor_feed_rested_share", np.nan)),
        "sim_feed_rested_share": float(sm.get("predictor_feed_rested_share", np.nan)),
        **cpu_columns(entry.execution, em, sm),
    }
    reqs = [{"system": entry.name, "request_id": rid, "engine_ttft_ms": et, "sim_ttft_ms": st,
             "engine_tpot_ms": ep, "sim_tpot_ms": sp}
            for rid, et, st, ep, sp in zip(eng.series["request_id"], eng.series["ttft_ms"],
                                           sim_ttft, eng.series["tpot_ms"], sim_tpot, strict=True)]
    log.info("%-20s TTFT engine %.2f sim %.2f ms (MAPE %.1f%%)  TPOT engine %.2f sim %.2f ms "
             "(MAPE %.1f%%)  hit engine %.3f sim %.3f  feed %.0f us/layer", entry.name,
             row["engine_ttft_ms_mean"], row["sim_ttft_ms_mean"], row["ttft_mape_pct"],
             row["engine_tpot_ms_mean"], row["sim_tpot_ms_mean"], row["tpot_mape_pct"],
             row["engine_hit_rate"], row["sim_hit_rate"], feed_s * 1e6)
    return row, reqs


def run_sim_vs_engine(ctx: Any, s: SimVsEngineSettings) -> tuple[dict[str, Any], dict[str, list]]:
    """The whole experiment on a pipeline context; returns (metrics, series)."""
    from moeexp.engine.serve import resolve_device, run_on  # torch

    if ctx.store is None or not ctx.store.requests:
        raise ConfigError("backend=sim_vs_engine needs the store split (profile and fits): "
                          "raise dataset.num_prompts or dataset.store_fraction")
    if ctx.run_dir is None:
        raise ValueError("backend=sim_vs_engine writes its files into ctx.run_dir: set it")
    run_dir = Path(ctx.run_dir)
    device = resolve_device(s.engine.get("device"), ctx.loaded.model)
    rows, reqs = [], []
    with run_on(ctx.loaded.model, device, s.engine.get("num_threads")):
        calib, reused = _calibrate(ctx, s, run_dir)
        cost = CalibratedCostModel.from_calibration(calib, ctx.trace.dims,
                                                    dtype_bytes=ctx.cost.dtype_bytes)
        if s.serving is not None:
            from moeexp.backends.serving_point import run_serving_point

            point, cols = run_serving_point(ctx, s, cost, run_dir)
            return {**point, **calibration_metrics(calib, reused, run_dir)}, cols
        for entry in s.systems:
            row, rr = _one_system(ctx, s, entry, cost)
            rows.append(row)
            reqs.extend(rr)
    df = pd.DataFrame(rows)
    df = df[SUMMARY_COLUMNS + [c for c in df.columns if c not in SUMMARY_COLUMNS]]
    write_text(run_dir / "summary.csv", df.to_csv(index=False))
    write_text(run_dir / "requests.csv", pd.DataFrame(reqs).to_csv(index=False))
    show = df[["system", "engine_ttft_ms_mean", "sim_ttft_ms_mean", "ttft_mape_pct",
               "engine_tpot_ms_mean", "sim_tpot_ms_mean", "tpot_mape_pct", "engine_hit_rate",
               "sim_hit_rate", "hit_rate_diff"]]
    write_text(run_dir / "summary.md", show.to_markdown(index=False, floatfmt=".3f") + "\n")
    log.info("sim_vs_engine:\n%s", show.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    metrics: dict[str, Any] = {
        "ttft_mape_pct_mean": float(df["ttft_mape_pct"].mean()),
        "tpot_mape_pct_mean": float(df["tpot_mape_pct"].mean()),
        "hit_rate_abs_diff_mean": float(df["hit_rate_diff"].abs().mean()),
        "systems": ",".join(df["system"]),
    }
    for r in rows:
        for k in ("ttft_mape_pct", "tpot_mape_pct", "hit_rate_diff"):
            metrics[f"{r['system']}_{k}"] = r[k]
    metrics.update(calibration_metrics(calib, reused, run_dir))
    series = {c: df[c].tolist() for c in SUMMARY_COLUMNS[1:]}
    return metrics, series


def calibration_metrics(calib: Any, reused: bool, run_dir: Path) -> dict[str, Any]:
    """The fitted coefficients (us, MB/s), where the fit is, whether it was reused."""
    out: dict[str, Any] = {"calibration_file": str(run_dir / "calibration.json"),
                           "calibration_reused": float(reused),
                           "calibration_key": str(calib.meta.get("calibration_key", ""))}
    for k in ("layer_s", "dense_token_s", "expert_s", "expert_token_s", "decode_pass_s",
              "prefill_pass_s", "copy_latency_s", "member_s"):
        out[f"calib_{k[:-2]}_us"] = getattr(calib, k) * 1e6
    out["calib_copy_mbps"] = calib.copy_bytes_per_s / 1e6
    from moeexp.backends.cpu_calibration import calibration_cpu_metrics

    out.update(calibration_cpu_metrics(calib))
    return out

