"""``backend=engine``: serve the test prompts through the real engine (for the app pipeline).

::

    check_serve_settings(settings)     # at validation: unknown keys, CUDA asked but absent
    run = serve_engine(loaded, prompts, predictor, cache, settings, trace=test_trace)
    run.metrics, run.series            # the simulator's keys and series layout

``predictor`` and ``cache`` are built and fitted by the pipeline on the store split (the same
objects it would hand to the simulator; ``cache.capacity_slots`` is the budget). Each test
prompt is one request, batch size 1, decoded with ``generate`` for exactly its
``output_len`` tokens (EOS suppressed through ``min_new_tokens``, as the recorder does).

Which tokens are decoded (``settings``, the backend config group, conf/backend/engine.yaml):

* ``replay_tokens: true`` with a ``trace`` (the app's default): every request decodes the very
  tokens the trace recorded for it (a logits processor forces them), so the engine serves the
  same forward passes, hence the same routing, as the simulator replays, whatever
  ``trace.sampling`` was. This is what makes ``backend=engine`` and ``backend=sim`` comparable
  on the same prompts, and what oracle/Belady need (their future is the trace).
* otherwise ``sampling`` (``greedy`` | ``top_k``), ``top_k``, ``temperature``, ``seed``:
  greedy, or HF's top-k sampler seeded with ``torch.manual_seed(seed + request_id)`` (the
  global RNG restored afterwards): not the recorder's sampler, so the tokens differ from a
  top-k trace.

Other keys: the fields of :class:`~moeexp.engine.runtime.EngineSettings`; ``warmup``
(untimed requests served first through a throwaway engine; default 1); ``device`` (None =
where the model is; ``cuda`` moves the model there for the run and back afterwards);
``num_threads`` (torch intra-op threads during the run; None = unchanged: on a loaded CPU
1 thread is far faster and steadier); ``reference`` (also serve the prompts with every
expert resident, for ``ttft_norm_mean``/``tpot_norm_mean``); ``progress``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from moeexp.engine.build import SETTING_KEYS, build_offloaded, engine_settings
from moeexp.engine.report import IterationProbe
from moeexp.engine.runtime import EngineSettings
from moeexp.engine.token_replay import forced_tokens, recorded_tokens
from moeexp.errors import ConfigError
from moeexp.registry import unknown_keys
from moeexp.traces.recorder import trace_dims
from moeexp.traces.schema import RequestMeta, Trace

log = logging.getLogger(__name__)

#: Backend keys beyond EngineSettings' fields (conf/backend/engine.yaml).
DECODE_KEYS: frozenset[str] = frozenset({
    "sampling", "top_k", "temperature", "seed", "warmup", "progress", "device", "num_threads",
    "replay_tokens", "reference",
    # a continuous scheduler's (moeexp.engine.serve_continuous): budgets, Poisson arrivals
    "serving", "arrival_rate", "batch_decode"})


def check_serve_settings(settings: Mapping[str, Any]) -> None:
    """Validate a ``backend=engine`` group before any work: an unknown key, or a device
    that is not there (``device=cuda`` without CUDA), raises ConfigError."""
    unknown = set(settings) - SETTING_KEYS - DECODE_KEYS - {"name"}
    if unknown:
        raise unknown_keys("backend=engine", unknown, SETTING_KEYS | DECODE_KEYS)
    engine_settings(settings)  # the settings' own checks
    if settings.get("device") is not None:
        resolve_device(settings["device"])


@dataclass
class EngineRun:
    """``metrics``: CORE_KEYS + extras; ``series``: per request and per forward pass lists."""

    metrics: dict[str, float]
    series: dict[str, list[Any]] = field(default_factory=dict)


def _generate_kwargs(settings: Mapping[str, Any], output_len: int) -> dict[str, Any]:
    sampling = settings.get("sampling", "greedy")
    kw: dict[str, Any] = {"max_new_tokens": output_len, "min_new_tokens": output_len}
    if sampling == "greedy":
        kw["do_sample"] = False
    elif sampling == "top_k":
        kw.update(do_sample=True, top_k=int(settings.get("top_k", 50)),
                  temperature=float(settings.get("temperature", 1.0)))
    else:
        raise ConfigError(f"backend=engine: sampling must be 'greedy' or 'top_k', got {sampling!r}")
    return kw


def resolve_device(spec: str | None, model: torch.nn.Module | None = None) -> torch.device:
    """The run's device: ``spec`` (``cpu``, ``cuda``, ``cuda:1``) or the model's (None).

    Raises ConfigError for CUDA without a CUDA build or device."""
    if spec is None:
        return next(model.parameters()).device if model is not None else torch.device("cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"backend.device={spec!r} is not a device (valid: cpu, cuda, "
                          "cuda:N, null)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"backend.device={spec}: CUDA is not available on this machine "
                          f"(torch {torch.__version__}, cuda build {torch.version.cuda}); use "
                          "backend.device=cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"backend.device={spec!r}: the engine supports cpu and cuda")
    return dev


@contextlib.contextmanager
def run_on(model: torch.nn.Module, device: torch.device,
           num_threads: int | None) -> Iterator[torch.device]:
    """Move ``model`` to ``device`` and set torch threads for the block; restore both."""
    here = next(model.parameters()).device
    old_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(int(num_threads))
    moved = device != here and not (device.type == here.type == "cuda" and device.index is None)
    try:
        if moved:
            model.to(device)
        yield next(model.parameters()).device
    finally:
        if moved:
            model.to(here)
        torch.set_num_threads(old_threads)


def serve_engine(loaded: Any, prompts: Sequence[Any], predictor: Any, cache: Any,
                 settings: Mapping[str, Any], *, trace: Trace | None = None,
                 execution: Any = None, cost: Any = None,
                 topology: Any = None, mechanics: Any = None) -> EngineRun:
    """Serve ``prompts`` (moeexp.data.prompts.Prompt, test split) through the engine.

    Args:
        loaded: LoadedModel (model, tokenizer, adapter, name).
        prompts: the test prompts (``input_ids``, ``output_len``, ``request_id``, ...).
        predictor / cache: fitted decision objects (the simulator's classes).
        settings: the backend config group (see the module docstring).
        trace: the recorded test trace of these prompts (token replay; oracle's future).
        execution / cost: where missed experts run (a built, fitted
            :class:`~moeexp.execution.ExecutionPolicy`; None = ``copy``) and the cost model
            it prices its decisions with (:func:`moeexp.engine.build.build_offloaded`).
        topology: ``hardware.devices`` and how they share the work
            (:class:`moeexp.simulator.topology.Topology`; several devices: ``cache`` is one
            policy per device, CPU only, :mod:`moeexp.engine.devices`); None = one device.
        mechanics: the FineMoE artifact's behaviours
            (:class:`moeexp.simulator.mechanics.Mechanics`); None = the paper's.
    """
    eng_settings = engine_settings(settings)
    replay = bool(settings.get("replay_tokens", False)) and trace is not None
    forced = recorded_tokens(trace, prompts) if replay and trace is not None else None
    needs_future = "future" in predictor.needs or any(
        c.needs_future for c in (cache if isinstance(cache, list) else [cache]))
    if needs_future and forced is None:
        raise ConfigError(f"backend=engine: {predictor.name}/{cache.name} need the future "
                          "accesses: serve with backend.replay_tokens=true (the recorded "
                          "trace is their future)")
    device = resolve_device(settings.get("device"), loaded.model)
    with run_on(loaded.model, device, settings.get("num_threads")) as dev:
        run = _serve(loaded, prompts, predictor, cache, settings, eng_settings, dev, forced,
                     trace if needs_future else None, execution=execution, cost=cost,
                     topology=topology, mechanics=mechanics)
        if settings.get("reference", False):
            ref = _reference(loaded, prompts, settings, eng_settings, dev, forced)
            _add_norms(run, ref)
    return run


def _serve(loaded: Any, prompts: Sequence[Any], predictor: Any, cache: Any,
           settings: Mapping[str, Any], eng_settings: EngineSettings, device: torch.device,
           forced: dict[int, list[int]] | None, future: Trace | None, *,
           execution: Any = None, cost: Any = None,
           topology: Any = None, mechanics: Any = None) -> EngineRun:
    """One engine over every prompt; metrics and series."""
    model = loaded.model
    embeds = None
    if "prompt_embed" in predictor.needs:
        from moeexp.data.embed import embed_prompts

        embeds = embed_prompts([p.text for p in prompts])
    seed = int(settings.get("seed", 0))
    slots = sum(c.capacity_slots for c in cache) if isinstance(cache, list) else cache.capacity_slots
    _warmup(loaded, prompts, slots, eng_settings, settings)
    om = build_offloaded(model, loaded.adapter, predictor, cache, eng_settings,
                         system="engine", future=future, execution=execution, cost=cost,
                         topology=topology, mechanics=mechanics)
    probe = IterationProbe(om)
    per_req: dict[str, list[float]] = {k: [] for k in
                                       ("request_id", "arrival_ms", "ttft_ms", "tpot_ms", "e2e_ms")}
    try:
        bar = tqdm(prompts, desc="engine", unit="req", disable=not settings.get("progress", True))
        t_start = time.perf_counter()
        for i, p in enumerate(bar):
            ids = torch.tensor([list(p.input_ids)], dtype=torch.long, device=device)
            meta = RequestMeta(request_id=int(p.request_id), prompt=p.text,
                               prompt_len=int(p.prompt_len), output_len=int(p.output_len),
                               split=p.split, dataset=p.dataset, task=getattr(p, "task", ""))
            kw = _generate_kwargs(settings, int(p.output_len))
            if forced is not None:
                kw.update(do_sample=False, logits_processor=forced_tokens(
                    forced[int(p.request_id)], len(p.input_ids)))
                kw.pop("top_k", None), kw.pop("temperature", None)
            emb = None if embeds is None else np.asarray(embeds[i : i + 1])
            n_before = (len(om.timing.ttft), len(om.timing.tpot))
            arrival = time.perf_counter() - t_start
            state = torch.random.get_rng_state()
            try:
                torch.manual_seed(seed + int(p.request_id))
                om.generate(ids, request_meta=[meta], prompt_embed=emb, **kw)
            finally:
                torch.random.set_rng_state(state)
            per_req["request_id"].append(int(p.request_id))
            per_req["arrival_ms"].append(arrival * 1e3)
            per_req["ttft_ms"].append(om.timing.ttft[n_before[0]] * 1e3)
            per_req["e2e_ms"].append(om.timing.e2e[n_before[0]] * 1e3)
            per_req["tpot_ms"].append(om.timing.tpot[n_before[1]] * 1e3
                                      if len(om.timing.tpot) > n_before[1] else float("nan"))
        wall = time.perf_counter() - t_start
        metrics = om.metrics()
    finally:
        probe.remove()
        om.close()
    for k, v in predictor.stats().items():
        metrics.setdefault(f"predictor_{k}", float(v))
    metrics["engine_wall_s"] = wall
    metrics["accesses_per_s"] = metrics["accesses_total"] / wall if wall > 0 else float("nan")
    emulated = eng_settings.bandwidth_bps if device.type == "cpu" else None  # CPU-only
    metrics["emulated_bandwidth_bps"] = float(emulated) if emulated else float("nan")
    series: dict[str, list[Any]] = dict(per_req)
    series["queue_ms"] = [0.0] * len(prompts)
    series["service_ms"] = list(per_req["e2e_ms"])
    series.update(probe.series())
    return EngineRun(metrics, series)


def _reference(loaded: Any, prompts: Sequence[Any], settings: Mapping[str, Any],
               eng_settings: EngineSettings, device: torch.device,
               forced: dict[int, list[int]] | None) -> EngineRun:
    """The same prompts with every expert resident (``no_offload`` through the engine)."""
    from moeexp.cache import CACHES
    from moeexp.predictors import PREDICTORS

    dims = trace_dims(loaded.adapter, eng_settings.spec_depth)
    pred = PREDICTORS.build("none", dims=dims)
    pol = CACHES.build("resident", capacity_slots=dims.num_layers * dims.num_experts,
                       num_layers=dims.num_layers, num_experts=dims.num_experts)
    plain = replace(eng_settings, restricted_routing=False)
    return _serve(loaded, prompts, pred, pol, {**settings, "warmup": 0}, plain, device, forced, None)


def _ratio(a: list[float], b: list[float]) -> float:
    r = [x / y for x, y in zip(a, b, strict=True) if np.isfinite(x) and np.isfinite(y) and y > 0]
    return float(np.mean(r)) if r else float("nan")


def _add_norms(run: EngineRun, ref: EngineRun) -> None:
    """``ttft_norm_mean``/``tpot_norm_mean``: per-request latency over the all-resident one."""
    s, r = run.series, ref.series
    run.metrics["ttft_norm_mean"] = _ratio(s["ttft_ms"], r["ttft_ms"])
    run.metrics["tpot_norm_mean"] = _ratio(s["tpot_ms"], r["tpot_ms"])
    run.metrics["reference_ttft_ms_mean"] = ref.metrics["ttft_ms_mean"]
    run.metrics["reference_tpot_ms_mean"] = ref.metrics["tpot_ms_mean"]


def _warmup(loaded: Any, prompts: Sequence[Any], slots: int, settings: EngineSettings,
            raw: Mapping[str, Any]) -> None:
    """Untimed requests through a throwaway deepspeed-like engine (kernels, allocator)."""
    n = int(raw.get("warmup", 1))
    if n <= 0 or not prompts:
        return
    from moeexp.cache import CACHES
    from moeexp.predictors import PREDICTORS

    dims = trace_dims(loaded.adapter, settings.spec_depth)
    pred = PREDICTORS.build("none", dims=dims)
    pol = CACHES.build("lru", capacity_slots=slots, num_layers=dims.num_layers,
                       num_experts=dims.num_experts)
    device = next(loaded.model.parameters()).device
    plain = replace(settings, restricted_routing=False, predictor_async=False)
    with build_offloaded(loaded.model, loaded.adapter, pred, pol, plain,
                         system="warmup") as om:
        for p in prompts[:n]:
            ids = torch.tensor([list(p.input_ids)], dtype=torch.long, device=device)
            om.generate(ids, max_new_tokens=min(4, int(p.output_len)), do_sample=False)
