"""Calibration: the fits recover known parameters, and the fitted cost model times as fitted."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.costmodel.fitted import (
    PROFILE_FORMAT,
    CalibratedCostModel,
    CalibratedProfile,
    ProfileSamples,
    fit_linear,
    fit_profile,
    load_cost_model,
)
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims

L, H, INTER, EB = 8, 64, 128, 3 * 64 * 128 * 4
DIMS = TraceDims(num_layers=L, num_experts=16, top_k=2, hidden_size=H, spec_depth=0,
                 expert_bytes=EB, dense_bytes=10_000, intermediate_size=INTER)
#: The "true" machine of the synthetic profiles (seconds, bytes/s).
TRUE = {"layer_s": 300e-6, "dense_token_s": 4e-6, "dense_ctx_s": 2e-8, "expert_s": 40e-6,
        "expert_token_s": 1.5e-6, "prefill_pass_s": 2e-3, "prefill_token_s": 10e-6,
        "decode_pass_s": 1.2e-3, "copy_latency_s": 80e-6, "copy_bytes_per_s": 50e6,
        "member_s": 0.7e-3, "member_kv_s": 2e-6}
#: The continuous engine's one-member offset from the single-request passes (not applied).
OFFSET_S = -0.4e-3


def _synthetic(noise: float, outliers: int, seed: int = 0) -> ProfileSamples:
    """Samples drawn from TRUE with multiplicative noise and a few preempted samples (+5 ms)."""
    rng = np.random.default_rng(seed)
    s = ProfileSamples()
    k0 = 100e-6  # per-layer constant inside the experts call (belongs to layer_s)
    for _ in range(400):
        prefill = rng.random() < 0.3
        T = int(rng.integers(2, 64)) if prefill else 1
        ctx = T * (T + 1) // 2 if prefill else int(rng.integers(5, 120))
        rows = 2 * T
        active = min(16, int(rng.integers(2, 2 + rows)))
        ex = k0 + TRUE["expert_s"] * active + TRUE["expert_token_s"] * rows
        dense = (TRUE["layer_s"] - k0) + TRUE["dense_token_s"] * T + TRUE["dense_ctx_s"] * ctx
        e = 1 + noise * rng.standard_normal(2)
        s.layer_tokens.append(T)
        s.layer_ctx.append(ctx)
        s.layer_active.append(active)
        s.layer_rows.append(rows)
        s.experts_s.append(ex * e[0])
        s.layer_s.append(ex * e[0] + dense * e[1])
    for i in range(120):
        prefill = i % 4 == 0
        T = int(rng.integers(2, 64)) if prefill else 1
        t = (TRUE["prefill_pass_s"] + TRUE["prefill_token_s"] * T) if prefill else TRUE["decode_pass_s"]
        s.pass_prefill.append(prefill)
        s.pass_tokens.append(T)
        s.pass_s.append(t * (1 + noise * rng.standard_normal()))
    for nbytes in (EB // 4, EB // 2, EB, 2 * EB, 4 * EB):
        for _ in range(6):
            t = TRUE["copy_latency_s"] + nbytes / TRUE["copy_bytes_per_s"]
            s.copy_bytes.append(nbytes)
            s.copy_s.append(t * (1 + noise * rng.standard_normal()))
    _synthetic_passes(s, noise, rng, k0)
    for j in range(outliers):  # preemption: a few layer and pass samples 5 ms late
        s.layer_s[7 * j] += 5e-3
        s.pass_s[3 * j + 1] += 5e-3
        s.batch_s[5 * j + 2] += 5e-3
    return s


def _synthetic_passes(s: ProfileSamples, noise: float, rng: np.random.Generator, k0: float) -> None:
    """Multi-member passes of B = 1, 2, 4, 8 on short and 4x longer prompts (one
    all-prefill, eight decode, one mixed per B and length): outside the experts calls the
    single-request model + OFFSET_S + (B > 1) (member_s (B - 1) + member_kv_s kv)."""
    for B, scale in ((b, k) for b in (1, 2, 4, 8) for k in (1, 4)):
        prompts = rng.integers(4, 60, B) * scale
        for step in range(10):
            pre = np.zeros(B, bool) if 0 < step < 9 else (np.ones(B, bool) if step == 0
                                                           else np.arange(B) == B - 1)
            T = int(np.where(pre, prompts, 1).sum())
            ctx = int(np.where(pre, prompts * (prompts + 1) // 2, prompts + step).sum())
            kv = int(np.where(pre, prompts, prompts + step).sum())
            per_pass = (TRUE["prefill_pass_s"] + TRUE["prefill_token_s"] * T if kv <= T
                        else TRUE["decode_pass_s"])
            outside = (L * (TRUE["layer_s"] - k0 + TRUE["dense_token_s"] * T
                            + TRUE["dense_ctx_s"] * ctx) + per_pass
                       + OFFSET_S + (B > 1) * (TRUE["member_s"] * (B - 1)
                                           + TRUE["member_kv_s"] * kv))
            experts = L * (k0 + 2 * TRUE["expert_s"] + TRUE["expert_token_s"] * 2 * T)
            e = 1 + noise * rng.standard_normal(2)
            s.batch_members.append(B)
            s.batch_prefills.append(int(pre.sum()))
            s.batch_tokens.append(T)
            s.batch_ctx.append(ctx)
            s.batch_kv.append(kv)
            s.batch_experts_s.append(experts * e[0])
            s.batch_s.append(experts * e[0] + outside * e[1])


def _fit(s: ProfileSamples, outlier_mads: float | None = None) -> CalibratedProfile:
    return fit_profile(s, num_layers=L, hidden_size=H, intermediate_size=INTER, expert_bytes=EB,
                       outlier_mads=outlier_mads)


def test_fit_linear_recovers_exact_line_and_clamps_negative() -> None:
    """y = 2 + 3x exactly: coef (2, 3), rms 0, r2 1; with nonneg, y = 5 - x on x >= 0 has no
    non-negative solution with slope: the slope is clamped to 0 and the intercept is the mean."""
    x = np.arange(10.0)
    f = fit_linear(np.c_[np.ones(10), x], 2 + 3 * x)
    assert f.coef == pytest.approx((2.0, 3.0)) and f.rms == pytest.approx(0, abs=1e-12)
    assert f.r2 == pytest.approx(1.0)
    g = fit_linear(np.c_[np.ones(10), x], 5 - x, outlier_mads=None)
    assert g.coef[1] == 0.0 and g.coef[0] == pytest.approx(np.mean(5 - x))


def test_fit_linear_drops_outliers() -> None:
    """One sample 100x off a clean line is dropped (kept = n - 1) and the line is exact."""
    x = np.linspace(0, 1, 20)
    y = 1 + 2 * x
    y[5] += 100
    f = fit_linear(np.c_[np.ones(20), x], y)
    assert f.kept == 19 and f.coef == pytest.approx((1.0, 2.0))


@pytest.mark.parametrize(("noise", "outliers", "rel"), [(0.0, 0, 1e-6), (0.02, 5, 0.08)])
def test_fit_profile_recovers_known_parameters(noise: float, outliers: int, rel: float) -> None:
    """Noise-free samples give TRUE exactly; 2% noise plus five 5 ms outliers per part still
    give every coefficient within 8%, except the two that noise on much larger terms hides:
    the attention slope (100x smaller than the others) within 50% and the copy latency
    (80 us under copies of up to 8 ms) within 30 us."""
    p = _fit(_synthetic(noise, outliers), outlier_mads=4.0)
    for k, v in TRUE.items():
        if noise and k == "copy_latency_s":
            assert getattr(p, k) == pytest.approx(v, abs=30e-6), k
            continue
        tol = 0.5 if (k == "dense_ctx_s" and noise) else rel
        assert getattr(p, k) == pytest.approx(v, rel=tol), k
    assert p.fit["copy"]["n"] == 30
    assert p.fit["member"]["offset_ms"] == pytest.approx(OFFSET_S * 1e3, abs=0.15 if noise else 1e-6)
    assert set(p.fit["member_residuals"]) == {"1", "2", "4", "8"}
    if not noise:
        assert all(abs(v - OFFSET_S * 1e3) < 1e-6 for v in p.fit["member_residuals"].values())


def test_one_preempted_pass_does_not_move_the_member_term() -> None:
    """Even in the default (mean) fit, one multi-member pass 600 ms late (a preemption on a
    shared CPU) is dropped from the member fit: member_s stays within 2% of the truth."""
    s = _synthetic(0.01, 0)
    s.batch_s[-5] += 0.6
    p = _fit(s)
    assert p.member_s == pytest.approx(TRUE["member_s"], rel=0.02)
    assert p.fit["member"]["kept"] < p.fit["member"]["n"]


def test_member_term_is_refused_without_two_member_counts() -> None:
    """Multi-member passes of one member count cannot give a per-member slope."""
    s = _synthetic(0.0, 0)
    keep = [i for i, b in enumerate(s.batch_members) if b == 4]
    for k in ("batch_members", "batch_prefills", "batch_tokens", "batch_ctx", "batch_kv",
              "batch_s", "batch_experts_s"):
        setattr(s, k, [getattr(s, k)[i] for i in keep])
    with pytest.raises(ConfigError, match="member count"):
        _fit(s)


def test_a_fit_without_multi_member_passes_prices_one_member_passes_only() -> None:
    """No multi-member samples (a single-request profile, e.g. bench/real_scale): member_s
    is NaN, a one-member pass is priced as before, a pass of two requests is refused."""
    s = _synthetic(0.0, 0)
    for k in ("batch_members", "batch_prefills", "batch_tokens", "batch_ctx", "batch_kv",
              "batch_s", "batch_experts_s"):
        setattr(s, k, [])
    p = _fit(s)
    assert np.isnan(p.member_s) and np.isnan(p.member_kv_s) and p.fit["member"] == {"n": 0}
    cm = CalibratedCostModel.from_calibration(p, DIMS)
    assert cm.dense_s(1, 50, 50) == pytest.approx((300 + 4 + 1 + 150) * 1e-6)
    with pytest.raises(ConfigError, match="without multi-member passes"):
        cm.dense_s(2, 100, 100, 2)


def test_a_pass_of_members_adds_member_s_per_extra_member() -> None:
    """dense_s of a B-member pass = the one-member layer + (member_s (B - 1) + member_kv_s
    kv) / L; a one-member pass (the default) is the single-request fit to the bit."""
    p = CalibratedProfile(num_layers=L, hidden_size=H, intermediate_size=INTER,
                          expert_bytes=EB, **TRUE)
    cm = CalibratedCostModel.from_calibration(p, DIMS)
    c = TRUE
    one = c["layer_s"] + c["dense_token_s"] * 4 + c["dense_ctx_s"] * 200 + c["decode_pass_s"] / L
    assert cm.dense_s(4, 200, 200) == cm.dense_s(4, 200, 200, 1) == one
    assert cm.dense_s(4, 200, 200, 4) == pytest.approx(
        one + (3 * c["member_s"] + 200 * c["member_kv_s"]) / L, rel=1e-12)
    pre = c["layer_s"] + c["dense_token_s"] * 8 + c["dense_ctx_s"] * 36 + (
        c["prefill_pass_s"] + c["prefill_token_s"] * 8 + c["member_s"] + 8 * c["member_kv_s"]) / L
    assert cm.dense_s(8, 36, 8, 2) == pytest.approx(pre, rel=1e-12)


def test_a_profile_without_the_member_term_is_refused(tmp_path) -> None:
    """A stored fit of format 1 (before member_s) does not load: the message names the
    format, the missing term and how to refit; a profile of format 2 missing member_s is a
    missing key."""
    import json

    p = CalibratedProfile(num_layers=L, hidden_size=H, intermediate_size=INTER,
                          expert_bytes=EB, **TRUE)
    data = p.to_dict()
    assert data["format_version"] == PROFILE_FORMAT == 2
    old = {k: v for k, v in data.items() if k not in ("member_s", "member_kv_s", "format_version")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ConfigError, match="format 1.*member_s.*refit"):
        CalibratedProfile.load(tmp_path / "old.json")
    with pytest.raises(ConfigError, match="format 1"):
        load_cost_model(tmp_path / "old.json", DIMS)
    with pytest.raises(ConfigError, match=r"missing key\(s\) \['member_s'\]"):
        CalibratedProfile.from_mapping({k: v for k, v in data.items() if k != "member_s"})


def test_default_fit_is_of_the_mean_time() -> None:
    """Without outlier rejection the fit keeps the slow tail: of 120 passes, 90 are decode
    passes (i % 4 != 0) and passes 1, 4, 7, 10, 13 are 5 ms late, 4 of them decode passes:
    decode_pass_s is 1.2 ms plus 4 * 5 / 90 ms (the mean); with outlier rejection it is
    1.2 ms (0.1% noise: a MAD of zero would disable the rejection)."""
    s = _synthetic(0.001, 5)
    assert _fit(s).decode_pass_s == pytest.approx(1.2e-3 + 20e-3 / 90, rel=1e-3)
    assert _fit(s, outlier_mads=4.0).decode_pass_s == pytest.approx(1.2e-3, rel=1e-3)


def test_cost_model_times_follow_the_fit(tmp_path) -> None:
    """The cost model built from a saved profile: copy = 80 us + EB / 50 MB/s; expert_s(3) =
    40 + 3 * 1.5 us; a decode layer (T=1, ctx=50, kv=50) = 300 + 4 + 1 + 1200/8 us; a prefill
    layer (T=kv=10, ctx=55) = 300 + 40 + 1.1 + (2000 + 100)/8 us."""
    p = CalibratedProfile(num_layers=L, hidden_size=H, intermediate_size=INTER,
                          expert_bytes=EB, **TRUE)
    for name in ("c.json", "c.yaml"):
        p.save(tmp_path / name)
        assert CalibratedProfile.load(tmp_path / name) == p
    cm = load_cost_model(tmp_path / "c.json", DIMS)
    assert isinstance(cm, CalibratedCostModel)
    assert cm.copy_s == pytest.approx(80e-6 + EB / 50e6)
    assert cm.expert_s(0) == 0.0 and cm.expert_s(3) == pytest.approx(44.5e-6)
    assert cm.dense_s(1, 50, 50) == pytest.approx((300 + 4 + 1 + 150) * 1e-6)
    assert cm.dense_s(10, 55, 10) == pytest.approx((300 + 40 + 1.1 + 262.5) * 1e-6)
    hp = p.hardware_profile()
    assert hp.copy_latency_us == pytest.approx(80) and hp.h2d_bytes_per_s == pytest.approx(50e6)
    path = p.write_hardware_yaml(tmp_path / "conf")
    from moeexp.costmodel.hardware import load_profile

    assert load_profile("calibrated", conf_dir=path.parent) == hp


def test_calibrated_model_drives_the_simulator() -> None:
    """A synthetic trace replays under the calibrated model; with every expert resident the
    TPOT is exactly L * (decode dense + 2 experts of 1 token) (no copies, no stalls)."""
    from moeexp.cache import CACHES
    from moeexp.predictors import PREDICTORS
    from moeexp.simulator import simulate
    from moeexp.traces.synthetic import random_trace

    tr = random_trace(num_requests=2, num_layers=L, num_experts=16, top_k=2, hidden_size=H,
                      prompt_len=6, output_len=4, seed=0)
    dims = tr.dims
    p = CalibratedProfile(num_layers=dims.num_layers, hidden_size=dims.hidden_size,
                          intermediate_size=INTER, expert_bytes=dims.expert_bytes, **TRUE)
    cm = CalibratedCostModel.from_calibration(p, dims)
    pol = CACHES.build("resident", capacity_slots=L * 16, num_layers=L, num_experts=16)
    m = simulate(tr, PREDICTORS.build("none", dims=dims), pol, cm, progress=False).metrics
    assert m["hit_rate"] == 1.0 and m["h2d_bytes_total"] == 0.0
    assert m["tpot_norm_mean"] == pytest.approx(1.0)
    assert m["tpot_ms_mean"] > L * (TRUE["layer_s"] + TRUE["decode_pass_s"] / L) * 1e3


def test_bad_input_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        CalibratedProfile.load(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="distinct sizes"):
        s = _synthetic(0.0, 0)
        s.copy_bytes = [EB] * len(s.copy_bytes)
        _fit(s)
    with pytest.raises(ConfigError, match="invalid value"):
        CalibratedProfile(num_layers=L, hidden_size=H, intermediate_size=INTER, expert_bytes=EB,
                          **{**TRUE, "expert_s": -1.0})
