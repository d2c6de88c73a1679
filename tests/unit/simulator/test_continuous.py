"""Continuous batching (``moeexp.simulator.continuous``): static == simulate, FCFS, budgets,
conservation, metric identities, not-applicable policies and configuration errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moeexp.cache import CACHES
from moeexp.cache.capacity import capacity_slots
from moeexp.costmodel import CostModel, load_profile
from moeexp.errors import ConfigError
from moeexp.metrics import CORE_KEYS
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import IterationStart, Prediction, Predictor
from moeexp.schedulers import build_scheduler
from moeexp.serving.settings import ServingSettings, not_applicable_reason
from moeexp.simulator import simulate
from moeexp.simulator.continuous import serve
from moeexp.simulator.serving_profile import fit_serving_profile
from moeexp.traces.synthetic import random_trace

WALL = ("sim_wall_s", "accesses_per_s", "predictor_query_us_mean")
PROMPT, OUTPUT = 6, 8


def _trace(seed: int = 0, **kw):  # type: ignore[no-untyped-def]
    args = dict(num_layers=4, num_experts=8, num_requests=12, prompt_len=PROMPT,
                output_len=OUTPUT, seed=seed)
    args.update(kw)
    return random_trace(**args)


def _parts(trace, predictor: str = "none", cache: str = "lru", capacity=0.25):  # type: ignore[no-untyped-def]
    d = trace.dims
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), d)
    pred = PREDICTORS.build(predictor, dims=d)
    pol = CACHES.build(cache, capacity_slots=capacity_slots(capacity, d), num_layers=d.num_layers,
                       num_experts=d.num_experts)
    return pred, pol, cost


def _serve(trace, scheduler: str, *, predictor: str = "none", cache: str = "lru",  # type: ignore[no-untyped-def]
           batch_size: int = 1, settings: ServingSettings | None = None, **kw):
    pred, pol, cost = _parts(trace, predictor, cache)
    prof = fit_serving_profile(trace.split("store"), cost, pol.capacity_slots)
    sched = build_scheduler({"name": scheduler, **kw.pop("sched_kw", {})}, batch_size=batch_size)
    return serve(trace.split("test"), pred, pol, cost, sched, prof, settings=settings,
                 progress=False, **kw)


def _same(a: dict, b: dict, keys) -> list[str]:  # type: ignore[no-untyped-def]
    return [k for k in keys if not (a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])))]


@pytest.mark.parametrize(("predictor", "cache", "restricted"), [
    ("none", "lru", False), ("speculative_gate", "lfu", False), ("oracle", "lru", False),
    ("none", "lru", True)])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("arrival_rate", [None, 50.0])
def test_static_reproduces_simulate_exactly(predictor, cache, restricted, batch_size,
                                            arrival_rate) -> None:
    """scheduler=static through the batching loop gives every metric of ``simulate``
    bit for bit (``bound_*`` aside: its model is simulate's), offline and online."""
    tr = _trace()
    kw = dict(arrival_rate=arrival_rate, num_requests=None if arrival_rate is None else 10,
              restricted_routing=restricted)
    pred, pol, cost = _parts(tr, predictor, cache)
    old = simulate(tr.split("test"), pred, pol, cost, batch_size=batch_size, progress=False,
                   **kw).metrics
    new = _serve(tr, "static", predictor=predictor, cache=cache, batch_size=batch_size,
                 **kw).metrics
    keys = [k for k in old if not k.startswith("bound_") and k not in WALL]
    assert not _same(old, new, keys)


def test_fcfs_with_arrivals_far_apart_is_batch_size_one() -> None:
    """Each request finishes before the next arrives: FCFS serves them one at a time,
    exactly as static batches of one with the same arrivals."""
    tr = _trace(1)
    kw = dict(arrival_rate=0.01, num_requests=8)
    fcfs = _serve(tr, "fcfs", **kw).metrics
    static = _serve(tr, "static", **kw).metrics
    assert fcfs["batch_requests_peak"] == 1.0
    assert not _same(static, fcfs, [k for k in CORE_KEYS if k not in WALL])
    assert fcfs["queue_ms_mean"] == 0.0


def test_fcfs_batches_when_requests_overlap() -> None:
    """Offline (all at t = 0) FCFS runs everything together: one prefill pass of every
    prompt, then decode steps; fewer passes than requests x steps."""
    tr = _trace(2)
    res = _serve(tr, "fcfs")
    n = int(res.metrics["requests_total"])
    assert res.metrics["batch_requests_peak"] == n
    assert res.series["iter_tokens"][0] == n * PROMPT
    assert len(res.series["iter_ms"]) == OUTPUT


class _Log(Predictor):
    """Records the request ids and the embedding rows of every pass."""

    def __init__(self, *, dims) -> None:  # type: ignore[no-untyped-def]
        super().__init__(dims=dims)
        self.passes: list[list[int]] = []
        self.embeds: list[np.ndarray] = []

    def start_iteration(self, ctx: IterationStart) -> Prediction:
        self.passes.append(ctx.request_ids.tolist())
        self.embeds.append(np.asarray(ctx.embed))
        return Prediction()


def _logged(scheduler: str = "fcfs", **kw):  # type: ignore[no-untyped-def]
    tr = _trace(3, num_requests=16)
    test = tr.split("test")
    pred = _Log(dims=tr.dims)
    _, pol, cost = _parts(tr)
    prof = fit_serving_profile(tr.split("store"), cost, pol.capacity_slots)
    settings = kw.pop("settings", None)
    res = serve(test, pred, pol, cost, build_scheduler({"name": scheduler}), prof,
                arrival_rate=400.0, progress=False, settings=settings, **kw)
    return test, pred, res


def _steps(passes: list[list[int]]) -> list[list[int]]:
    """The step of each member of each pass, counting a request's appearances."""
    seen: dict[int, int] = {}
    out = []
    for p in passes:
        out.append([seen.get(r, 0) for r in p])
        for r in p:
            seen[r] = seen.get(r, 0) + 1
    return out


def test_every_request_and_token_is_served_once() -> None:
    """Under Poisson arrivals each request takes part in exactly as many passes as it has
    iterations, the passes' tokens add up to the trace's, and latencies are ordered."""
    test, pred, res = _logged()
    counts: dict[int, int] = {}
    for p in pred.passes:
        assert len(set(p)) == len(p)
        for r in p:
            counts[r] = counts.get(r, 0) + 1
    want = {int(r): int(np.sum(test.iter_request == r)) for r in np.unique(test.iter_request)}
    assert counts == want
    assert sum(res.series["iter_tokens"]) == int(test.iter_offsets[-1])
    assert max(res.series["iter_requests"]) > 1
    # in order: the k-th pass of request r carries the token rows of r's step k
    for ids, steps, emb in zip(pred.passes, _steps(pred.passes), pred.embeds, strict=True):
        rows = [np.arange(test.iter_offsets[i], test.iter_offsets[i + 1])
                for r, k in zip(ids, steps, strict=True)
                for i in np.flatnonzero((test.iter_request == r) & (test.iter_step == k))]
        assert np.array_equal(emb, test.embed[np.concatenate(rows)].astype(np.float32))
    s = res.series
    for q, t, e in zip(s["queue_ms"], s["ttft_ms"], s["e2e_ms"], strict=True):
        assert q >= 0.0 and t >= q and e >= t


def test_mix_prefill_false_keeps_each_pass_one_phase() -> None:
    """Under Poisson arrivals mixed passes occur by default (a joining prompt beside decode
    steps); with mix_prefill=false every pass is all prefill or all decode, and the same
    requests and tokens are served."""
    _, mixed, a = _logged()
    assert any(0 in st and max(st) > 0 for st in _steps(mixed.passes))
    _, split, b = _logged(settings=ServingSettings(mix_prefill=False))
    assert all(max(st) == 0 or min(st) > 0 for st in _steps(split.passes))
    assert sum(a.series["iter_tokens"]) == sum(b.series["iter_tokens"])


def test_token_budget_is_honoured() -> None:
    """T_max = one prompt: a decoding request leaves no room for a prefill, so FCFS serves
    one request at a time; T_max = prompt + 1 lets one prefill join one decode."""
    tr = _trace(4)
    one = _serve(tr, "fcfs", settings=ServingSettings(max_batch_tokens=PROMPT))
    assert one.metrics["batch_requests_peak"] == 1.0
    assert one.metrics["scheduler_blocked_tokens"] > 0
    two = _serve(tr, "fcfs", settings=ServingSettings(max_batch_tokens=PROMPT + 1))
    assert max(two.series["iter_tokens"]) <= PROMPT + 1
    assert two.metrics["batch_requests_peak"] > 1.0


def test_memory_budget_is_honoured() -> None:
    """A KV pool of 2.5 reservations holds two running requests, never three."""
    tr = _trace(5)
    _, pol, cost = _parts(tr)
    kv_tok = 1000
    reservation = kv_tok * (PROMPT + OUTPUT)
    mem = (cost.gpu_mem_bytes(pol.capacity_slots) + 2.5 * reservation) / 1e9
    res = _serve(tr, "fcfs", settings=ServingSettings(device_memory_gb=mem),
                 kv_bytes_per_token=kv_tok)
    m = res.metrics
    assert m["batch_requests_peak"] == 2.0 and m["scheduler_blocked_memory"] > 0
    assert m["kv_reserved_peak_bytes"] == 2 * reservation <= m["kv_pool_bytes"]
    assert m["kv_used_peak_bytes"] <= m["kv_reserved_peak_bytes"]


def test_max_running_is_honoured() -> None:
    res = _serve(_trace(6), "fcfs", settings=ServingSettings(max_running=2))
    assert res.metrics["batch_requests_peak"] == 2.0


@pytest.mark.parametrize("scheduler", ["fcfs", "emoe"])
def test_serving_metric_identities(scheduler: str) -> None:
    """Attainment in [0, 1], goodput <= throughput, the per-request SLO flags agree with
    the attainment, queueing >= 0, and the core keys are all there."""
    m, s = (lambda r: (r.metrics, r.series))(_serve(_trace(7), scheduler, arrival_rate=300.0,
                                                     num_requests=20))
    assert set(CORE_KEYS) <= set(m)
    for k in ("slo_attainment", "slo_ttft_attainment", "slo_e2e_attainment"):
        assert 0.0 <= m[k] <= 1.0
    assert m["slo_attainment"] <= min(m["slo_ttft_attainment"], m["slo_e2e_attainment"])
    assert m["goodput_rps"] <= m["throughput_rps"]
    assert m["goodput_rps"] == pytest.approx(m["slo_attainment"] * m["throughput_rps"])
    assert np.mean(s["slo_met"]) == pytest.approx(m["slo_attainment"])
    assert m["queue_ms_p50"] >= 0.0 and m["requests_total"] == 20.0
    assert m["throughput_tokens_per_s"] == pytest.approx(m["output_tokens_total"] / m["span_s"])
    assert m["scheduler"] == scheduler


def test_slo_scale_moves_attainment() -> None:
    """Every expert resident, one request at a time: each request takes exactly its
    unloaded latency, so a scale of 1 (+ float rounding of the clock) is met by all and a
    scale of 0.5 by none."""
    tr = _trace(8)
    kw = dict(cache="resident", arrival_rate=0.01, num_requests=6)
    one = 1.0 + 1e-9
    ok = _serve(tr, "fcfs", settings=ServingSettings(slo_ttft_scale=one, slo_e2e_scale=one), **kw)
    assert ok.metrics["slo_attainment"] == 1.0
    bad = _serve(tr, "fcfs", settings=ServingSettings(slo_ttft_scale=0.5, slo_e2e_scale=0.5), **kw)
    assert bad.metrics["slo_attainment"] == 0.0


def test_per_task_slo_scales_apply_to_their_task() -> None:
    tr = _trace(8)
    tasks = sorted({r.task for r in tr.requests})
    settings = ServingSettings(slo_ttft_scale=1.0 + 1e-9, slo_e2e_scale=1.0 + 1e-9,
                               slo_task_scales={tasks[0]: {"e2e": 0.5}})
    m = _serve(tr, "fcfs", cache="resident", arrival_rate=0.01, num_requests=12,
               settings=settings).metrics
    assert m[f"slo_attainment_task_{tasks[0]}"] == 0.0
    assert m[f"slo_attainment_task_{tasks[1]}"] == 1.0


def test_belady_is_not_applicable() -> None:
    tr = _trace()
    _, pol, _ = _parts(tr, cache="belady")
    assert "not applicable" in str(not_applicable_reason(pol))
    with pytest.raises(ConfigError, match="future access stream"):
        _serve(tr, "fcfs", cache="belady")


def test_budget_errors_before_serving() -> None:
    """T_max below one prompt, no memory for a KV cache, one request larger than the
    pool, an unknown task in the SLO map: ConfigError before any pass."""
    tr = _trace()
    _, pol, cost = _parts(tr)
    weights = cost.gpu_mem_bytes(pol.capacity_slots)
    with pytest.raises(ConfigError, match="below one prompt"):
        _serve(tr, "fcfs", settings=ServingSettings(max_batch_tokens=PROMPT - 1))
    with pytest.raises(ConfigError, match="no room for a KV"):
        _serve(tr, "fcfs", settings=ServingSettings(device_memory_gb=weights / 1e9))
    with pytest.raises(ConfigError, match="exceeds the KV pool"):
        _serve(tr, "emoe", settings=ServingSettings(device_memory_gb=(weights + 10) / 1e9),
               kv_bytes_per_token=1000)
    with pytest.raises(ConfigError, match="unknown task"):
        _serve(tr, "fcfs", settings=ServingSettings(slo_task_scales={"nope": {"e2e": 2.0}}))
    with pytest.raises(ConfigError, match="arrival_rate"):
        _serve(tr, "fcfs", arrival_rate=0.0)


def test_same_seed_same_metrics() -> None:
    tr = _trace(9)
    a = _serve(tr, "emoe", arrival_rate=200.0, num_requests=15).metrics
    b = _serve(tr, "emoe", arrival_rate=200.0, num_requests=15).metrics
    assert not _same(a, b, [k for k in a if isinstance(a[k], float) and k not in WALL])


def test_record_usable_logs_each_pass_and_layer_and_changes_nothing() -> None:
    """``record_usable``: per pass (one row per ``iter_ms``), per layer, the sorted ready
    experts the restricted layer saw; recording leaves every metric as it was. With no
    predictor nothing ever loads under restricted routing, so every set is empty; the log
    is refused without restricted routing."""
    tr = _trace(3)
    kw = dict(arrival_rate=50.0, num_requests=10, restricted_routing=True)
    plain = _serve(tr, "fcfs", predictor="speculative_gate", cache="lfu", **kw)
    rec = _serve(tr, "fcfs", predictor="speculative_gate", cache="lfu", record_usable=True, **kw)
    log = rec.series["restricted_usable"]
    assert len(log) == len(rec.series["iter_ms"]) and all(len(p) == 4 for p in log)
    assert all(list(s) == sorted(set(s)) and set(s) <= set(range(8)) for p in log for s in p)
    assert any(s for p in log for s in p)
    assert "restricted_usable" not in plain.series
    assert not _same(plain.metrics, rec.metrics, [k for k in plain.metrics if k not in WALL])
    empty = _serve(tr, "fcfs", record_usable=True, **kw).series["restricted_usable"]
    assert all(s == [] for p in empty for s in p)
    with pytest.raises(ConfigError, match="record_usable needs restricted_routing"):
        _serve(tr, "fcfs", record_usable=True, arrival_rate=50.0, num_requests=10)


def test_static_prefetch_if_pays_reproduces_simulate_with_the_cost_model_bound() -> None:
    """``serve`` binds the cost model as ``simulate`` does: prefetch_if_pays (reuse_prob +
    next_use, whose gate reads it) gives simulate's metrics under scheduler=static."""
    tr = _trace()
    store = tr.split("store")

    def fitted():  # type: ignore[no-untyped-def]
        pred, pol, cost = _parts(tr, "reuse_prob", "next_use")
        pred.fit(store)
        pol.fit(store)
        return pred, pol, cost

    pred, pol, cost = fitted()
    old = simulate(tr.split("test"), pred, pol, cost, progress=False).metrics
    pred, pol, cost = fitted()
    prof = fit_serving_profile(store, cost, pol.capacity_slots)
    new = serve(tr.split("test"), pred, pol, cost, build_scheduler({"name": "static"}),
                prof, progress=False).metrics
    assert pol.copy_s == cost.copy_s and old["prefetches_issued"] > 0
    keys = [k for k in old if not k.startswith("bound_") and k not in WALL]
    assert not _same(old, new, keys)
