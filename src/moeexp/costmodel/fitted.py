"""Calibrating the simulator's cost model against the engine: fit, store, load (numpy only).

The engine is profiled by :mod:`moeexp.engine.profile` (torch); this module turns the
samples into a :class:`CalibratedProfile` and a :class:`CalibratedCostModel`, a drop-in
:class:`~moeexp.costmodel.roofline.CostModel` for :func:`moeexp.simulator.simulate`. The
fitted model is linear in the quantities the simulator already hands its cost model::

    expert_s(n)            = expert_s + expert_token_s * n              (n > 0 tokens)
    dense_s(T, ctx, kv, B) = layer_s + dense_token_s * T + dense_ctx_s * ctx
                             + (pass overhead + members term) / L
        members term       = member_s * (B - 1) + member_kv_s * kv     (B > 1; 0 for B = 1)
        pass overhead      = prefill_pass_s + prefill_token_s * T      (prefill: kv == T)
                           | decode_pass_s                              (decode:  kv >  T)
    copy_s                 = copy_latency_s + expert_bytes / copy_bytes_per_s

``layer_s`` holds everything per MoE layer and pass that does not scale with the experts
(attention, norms, router, the engine's bookkeeping); the pass overhead is what a forward
pass of ``generate`` costs outside its MoE layers (embedding, LM head, sampling, the decode
loop, ``generate``'s set-up for the prefill), spread evenly over the L layers because the
simulator advances time layer by layer. A prefill is recognised by ``kv == tokens`` (every
KV entry is new), which holds for every group the simulator builds.

``member_s`` is what each member of a pass beyond the first costs the continuous engine
outside the experts calls (``PassModel.run_pass``: a member's own forward call on its own
thread, or its row of the padded decode forward with ``batch_decode``, its KV cache
stacked and unstacked, its next token), per pass, spread over the L layers like the pass
overhead; ``member_kv_s`` what each KV entry of such a pass costs beyond the single
request's attention (the padded decode attends B x the longest context and copies every
member's cache in and out; a lone request runs unpadded). The layer and pass parts above
are fitted on single requests (``generate``); the members term on multi-member passes
(:func:`moeexp.engine.profile.profile_passes`, short and long prompts, so that KV and
members vary apart): the residual of each pass's time outside its experts calls after the
single-request model, against ``B - 1`` and ``kv [B > 1]`` with an intercept (slopes
non-negative; grossly preempted passes dropped:
:data:`MEMBER_OUTLIER_MADS`; the continuous path's one-member offset from
``generate``, reported in ``fit["member"]["offset_ms"]``, not applied: a one-member pass
costs what it cost before, so every single-request time stays as it was). A stored
profile written before this term (``format_version`` < :data:`PROFILE_FORMAT`) is refused
with a message saying to refit it.

Fits are least squares with non-negative coefficients, i.e. of the *mean* time, which is
what the simulator's latencies are compared on: on a shared machine a few samples are
preempted by milliseconds, and the engine's own runs suffer the same tail, so by default
nothing is dropped. ``outlier_mads`` (a robust pass: samples whose residual exceeds that
many median absolute deviations are dropped and the fit redone) suits a quiet machine
where such samples are measurement artefacts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from moeexp.atomic import write_text
from moeexp.costmodel.cpu import CpuProfile
from moeexp.costmodel.hardware import HardwareProfile
from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims

log = logging.getLogger(__name__)

#: The stored profile's format: 2 added ``member_s`` and ``member_kv_s`` (the members
#: term of a continuous-batching pass); a profile of another format is refused on load.
PROFILE_FORMAT = 2
#: Outlier rejection of the member fit when ``outlier_mads`` is None: it rests on ~150
#: passes, a few per member count, where one preempted pass (hundreds of ms on a shared
#: CPU) moves the slope by milliseconds per member; 6 MADs drops only such passes.
MEMBER_OUTLIER_MADS = 6.0


# ----------------------------------------------------------------------------- fitting
@dataclass(frozen=True)
class LinearFit:
    """``y ~ X @ coef`` (coef >= 0 when fitted non-negative).

    Attributes:
        coef: one coefficient per column of X.
        rms: root mean square residual over the kept samples (units of y).
        r2: coefficient of determination over the kept samples (NaN if y is constant).
        n: samples given; kept: samples left after dropping outliers.
    """

    coef: tuple[float, ...]
    rms: float
    r2: float
    n: int
    kept: int


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coef >= 0 (active set: drop the most negative column, refit)."""
    free = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(X[:, free], y, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            return coef
        free.pop(int(np.argmin(sol)))
    return coef


def fit_linear(X: np.ndarray | Sequence[Sequence[float]], y: np.ndarray | Sequence[float], *,
               nonneg: bool = True, outlier_mads: float | None = 4.0) -> LinearFit:
    """Fit ``y ~ X @ coef``.

    Args:
        X: float[n, p] features (include a column of ones for an intercept).
        y: float[n] targets.
        nonneg: constrain every coefficient to be >= 0 (times cannot be negative).
        outlier_mads: drop samples whose residual is beyond this many median absolute
            deviations (scaled to sigma) and refit once; None keeps every sample.

    Raises:
        ConfigError: fewer samples than features, or non-finite input.
    """
    Xa = np.asarray(X, dtype=np.float64)
    ya = np.asarray(y, dtype=np.float64)
    if Xa.ndim != 2 or ya.shape != (Xa.shape[0],):
        raise ConfigError(f"fit_linear: X must be [n, p] and y [n]; got {Xa.shape} and {ya.shape}")
    if Xa.shape[0] < Xa.shape[1]:
        raise ConfigError(f"fit_linear: {Xa.shape[0]} samples for {Xa.shape[1]} coefficients")
    if not (np.isfinite(Xa).all() and np.isfinite(ya).all()):
        raise ConfigError("fit_linear: non-finite samples")
    solve = _nnls if nonneg else (lambda a, b: np.linalg.lstsq(a, b, rcond=None)[0])
    keep = np.ones(len(ya), dtype=bool)
    coef = solve(Xa, ya)
    if outlier_mads is not None and len(ya) > 2 * Xa.shape[1]:
        res = ya - Xa @ coef
        mad = 1.4826 * float(np.median(np.abs(res - np.median(res))))
        if mad > 0:
            keep = np.abs(res - np.median(res)) <= outlier_mads * mad
            if keep.sum() >= Xa.shape[1]:
                coef = solve(Xa[keep], ya[keep])
            else:
                keep[:] = True
    res = ya[keep] - Xa[keep] @ coef
    ss = float(((ya[keep] - ya[keep].mean()) ** 2).sum())
    r2 = 1.0 - float((res**2).sum()) / ss if ss > 0 else float("nan")
    return LinearFit(tuple(float(c) for c in coef), float(np.sqrt((res**2).mean())), r2,
                     int(len(ya)), int(keep.sum()))


@dataclass
class ProfileSamples:
    """What a profile of the engine measured (all times in seconds).

    Per MoE layer call (arrays of one length): ``layer_tokens`` T, ``layer_ctx`` (sum over
    the T tokens of the keys each attends to), ``layer_active`` (distinct experts used),
    ``layer_rows`` (routing rows T*K), ``layer_s`` (the whole decoder layer) and
    ``experts_s`` (its routed-experts call, the engine's kernel included).
    Per forward pass: ``pass_prefill`` (bool), ``pass_tokens`` T, ``pass_s`` (time of the
    pass outside its MoE layers, plus the gap since the previous pass ended or, for a
    prefill, since ``generate`` was called).
    Per copy: ``copy_bytes`` and ``copy_s`` (submit to data ready, one copy at a time).
    Per multi-member pass of the continuous engine (:func:`moeexp.engine.profile.profile_passes`):
    ``batch_members`` B, ``batch_prefills`` (members at their prefill), ``batch_tokens``,
    ``batch_ctx`` and ``batch_kv`` (summed over the members as the simulator's
    ``Plan.group`` sums them), ``batch_s`` (the whole pass: members built, forward calls,
    next tokens) and ``batch_experts_s`` (its served experts calls, every MoE layer).
    """

    layer_tokens: list[float] = field(default_factory=list)
    layer_ctx: list[float] = field(default_factory=list)
    layer_active: list[float] = field(default_factory=list)
    layer_rows: list[float] = field(default_factory=list)
    layer_s: list[float] = field(default_factory=list)
    experts_s: list[float] = field(default_factory=list)
    pass_prefill: list[bool] = field(default_factory=list)
    pass_tokens: list[float] = field(default_factory=list)
    pass_s: list[float] = field(default_factory=list)
    copy_bytes: list[float] = field(default_factory=list)
    copy_s: list[float] = field(default_factory=list)
    batch_members: list[float] = field(default_factory=list)
    batch_prefills: list[float] = field(default_factory=list)
    batch_tokens: list[float] = field(default_factory=list)
    batch_ctx: list[float] = field(default_factory=list)
    batch_kv: list[float] = field(default_factory=list)
    batch_s: list[float] = field(default_factory=list)
    batch_experts_s: list[float] = field(default_factory=list)

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: np.asarray(getattr(self, f.name), dtype=np.float64) for f in fields(self)}


@dataclass(frozen=True)
class CalibratedProfile:
    """Fitted per-part times of one machine + model (see the module docstring; seconds).

    Attributes:
        name: profile name (``calibrated``).
        num_layers / hidden_size / intermediate_size / expert_bytes: the model profiled.
        layer_s ... decode_pass_s: compute coefficients.
        copy_latency_s, copy_bytes_per_s: the copy path (bytes/s achieved).
        member_s: seconds per pass and member beyond the first (continuous engine); NaN
            when the profile had no multi-member passes (then only one-member passes are
            priced: :meth:`CalibratedCostModel.dense_s` refuses more).
        member_kv_s: seconds per pass and KV entry of a multi-member pass (NaN with member_s).
        cpu: this machine's CPU expert kernel as a ``cpu:`` block mapping
            (:mod:`moeexp.costmodel.cpu_fit`, fitted on the engine's CPU path), or None
            (not profiled: the calibrated profile has no CPU). Optional in a stored profile.
        format_version: :data:`PROFILE_FORMAT` (what :meth:`from_mapping` accepts).
        fit: per part ``{rms_ms, r2, n, kept}`` (``member``, of the members term, also
            ``offset_ms``;
            ``member_residuals``: median residual ms per member count, after the fit).
        meta: provenance (device, threads, emulated bandwidth, sample counts...).
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    expert_bytes: int
    layer_s: float
    dense_token_s: float
    dense_ctx_s: float
    expert_s: float
    expert_token_s: float
    prefill_pass_s: float
    prefill_token_s: float
    decode_pass_s: float
    copy_latency_s: float
    copy_bytes_per_s: float
    member_s: float
    member_kv_s: float
    cpu: dict[str, Any] | None = None
    name: str = "calibrated"
    format_version: int = PROFILE_FORMAT
    fit: dict[str, dict[str, float]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [f.name for f in fields(self) if f.type == "float"
               and not (np.isfinite(getattr(self, f.name)) and getattr(self, f.name) >= 0)
               and not (f.name in ("member_s", "member_kv_s") and np.isnan(getattr(self, f.name)))]
        if not self.copy_bytes_per_s > 0:
            bad.append("copy_bytes_per_s")
        if bad:
            raise ConfigError(f"calibrated profile: invalid value(s) for {', '.join(sorted(set(bad)))}"
                              " (times must be finite and >= 0, the bandwidth > 0)")

    # ---- persistence ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        """Write JSON (``.json``) or YAML (``.yaml``/``.yml``) atomically."""
        p = Path(path)
        data = self.to_dict()
        text = (yaml.safe_dump(data, sort_keys=False) if p.suffix in (".yaml", ".yml")
                else json.dumps(data, indent=2) + "\n")
        p.parent.mkdir(parents=True, exist_ok=True)
        write_text(p, text)
        return p

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> CalibratedProfile:
        """A profile from :meth:`to_dict`'s mapping (ConfigError: another format, unknown or
        missing keys)."""
        version = data.get("format_version", 1)
        if version != PROFILE_FORMAT:
            raise ConfigError(
                f"calibrated profile of format {version}, this code reads format "
                f"{PROFILE_FORMAT} (format 2 added member_s and member_kv_s, the members cost of a "
                "continuous-batching pass; an older fit lacks it and would under-price full "
                "passes): refit with `python -m moeexp +experiment=sim_vs_engine` (a "
                "backend.calibration_dir store is refitted on its own)")
        names = {f.name for f in fields(cls)}
        optional = ("name", "fit", "meta", "format_version", "cpu")
        unknown, missing = sorted(set(data) - names), sorted(
            f.name for f in fields(cls) if f.name not in data and f.name not in optional)
        if unknown or missing:
            raise ConfigError(f"calibrated profile: unknown key(s) {unknown}, missing key(s) "
                              f"{missing}. Keys: {', '.join(sorted(names))}")
        return cls(**dict(data))

    @classmethod
    def load(cls, path: str | Path) -> CalibratedProfile:
        """Read a profile written by :meth:`save` (ConfigError if absent or malformed)."""
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"calibrated profile {str(p)!r} does not exist (write one with "
                              "`python -m moeexp +experiment=sim_vs_engine`)")
        try:
            data = (yaml.safe_load(p.read_text()) if p.suffix in (".yaml", ".yml")
                    else json.loads(p.read_text()))
        except (ValueError, yaml.YAMLError) as e:
            raise ConfigError(f"calibrated profile {p}: not valid JSON/YAML ({e})") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"calibrated profile {p}: expected a mapping")
        return cls.from_mapping(data)

    # ---- views --------------------------------------------------------------------------
    def hardware_profile(self) -> HardwareProfile:
        """A roofline :class:`HardwareProfile` approximating this fit (for ``hardware=``).

        Expert GEMM throughput from ``expert_token_s`` (6 H I FLOPs per token), device
        memory fast enough never to bind, the copy path as measured; the launch overheads
        take the per-layer constant and the decode pass overhead. Prefill overhead, the
        per-member term and the dense part's slopes have no roofline counterpart: use
        :class:`CalibratedCostModel`
        (``backend.cost_profile=``) for the full fit.
        """
        flops = 6.0 * self.hidden_size * self.intermediate_size / max(self.expert_token_s, 1e-15)
        return HardwareProfile(
            name=self.name, h2d_gbps=self.copy_bytes_per_s / 1e9, h2d_efficiency=1.0,
            copy_latency_us=self.copy_latency_s * 1e6, peak_tflops=flops / 1e12,
            compute_efficiency=1.0, hbm_gbps=1e6, memory_efficiency=1.0, memory_gb=0.0,
            dense_overhead_us=(self.layer_s + self.decode_pass_s / self.num_layers) * 1e6,
            expert_overhead_us=self.expert_s * 1e6,
            cpu=None if self.cpu is None else CpuProfile.from_mapping(self.cpu, "calibrated cpu"))

    def write_hardware_yaml(self, conf_root: str | Path) -> Path:
        """``conf_root/hardware/<name>.yaml`` (use ``hydra.searchpath=[file://conf_root]``)."""
        hw = self.hardware_profile()
        hp = asdict(hw)
        hp.pop("cpu")  # written below as its YAML block, when profiled
        flat = {k: (float(v) if k != "name" else v) for k, v in hp.items()}
        if hw.cpu is not None:
            flat["cpu"] = hw.cpu.to_mapping()
        text = ("# Roofline approximation of a calibrated profile "
                "(moeexp.costmodel.fitted); written, not edited.\n"
                + yaml.safe_dump(flat, sort_keys=False))
        path = Path(conf_root) / "hardware" / f"{self.name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, text)
        return path


def fit_profile(samples: ProfileSamples, *, num_layers: int, hidden_size: int,
                intermediate_size: int, expert_bytes: int, outlier_mads: float | None = None,
                meta: Mapping[str, Any] | None = None) -> CalibratedProfile:
    """Fit every part of :class:`CalibratedProfile` from ``samples`` (module docstring).

    ``outlier_mads``: None fits the mean times (default); a number drops samples beyond
    that many MADs first (see :func:`fit_linear`).

    Raises:
        ConfigError: a part has too few samples (say which).
    """
    a = samples.arrays()
    n_layer = len(a["layer_s"])
    if n_layer < 4:
        raise ConfigError(f"fit_profile: {n_layer} layer samples (need >= 4)")
    ones = np.ones(n_layer)

    def fit(X: Any, y: Any) -> LinearFit:
        return fit_linear(X, y, outlier_mads=outlier_mads)

    ex = fit(np.c_[ones, a["layer_active"], a["layer_rows"]], a["experts_s"])
    dense = fit(np.c_[ones, a["layer_tokens"], a["layer_ctx"]], a["layer_s"] - a["experts_s"])
    pre = a["pass_prefill"].astype(bool)
    if pre.sum() < 2 or (~pre).sum() < 1:
        raise ConfigError(f"fit_profile: {int(pre.sum())} prefill and {int((~pre).sum())} decode "
                          "pass samples (need >= 2 and >= 1)")
    pf = fit(np.c_[np.ones(int(pre.sum())), a["pass_tokens"][pre]], a["pass_s"][pre])
    dec = fit(np.ones((int((~pre).sum()), 1)), a["pass_s"][~pre])
    if len(a["copy_s"]) < 2 or len(np.unique(a["copy_bytes"])) < 2:
        raise ConfigError("fit_profile: copy samples need >= 2 distinct sizes")
    cp = fit(np.c_[np.ones(len(a["copy_s"])), a["copy_bytes"]], a["copy_s"])
    if cp.coef[1] <= 0:
        raise ConfigError("fit_profile: copy time does not grow with bytes (bandwidth undefined)")
    member, member_kv, member_q, by_size = _fit_members(
        a, num_layers=int(num_layers), dense=dense.coef, prefill=pf.coef, decode_pass_s=dec.coef[0],
        outlier_mads=outlier_mads)

    def q(f: LinearFit) -> dict[str, float]:
        return {"rms_ms": f.rms * 1e3, "r2": f.r2, "n": f.n, "kept": f.kept}

    return CalibratedProfile(
        num_layers=int(num_layers), hidden_size=int(hidden_size),
        intermediate_size=int(intermediate_size), expert_bytes=int(expert_bytes),
        layer_s=dense.coef[0] + ex.coef[0], dense_token_s=dense.coef[1],
        dense_ctx_s=dense.coef[2], expert_s=ex.coef[1], expert_token_s=ex.coef[2],
        prefill_pass_s=pf.coef[0], prefill_token_s=pf.coef[1], decode_pass_s=dec.coef[0],
        copy_latency_s=cp.coef[0], copy_bytes_per_s=1.0 / cp.coef[1], member_s=member,
        member_kv_s=member_kv,
        fit={"experts": q(ex), "dense": q(dense), "prefill_pass": q(pf), "decode_pass": q(dec),
             "copy": q(cp), "member": member_q, "member_residuals": by_size},
        meta=dict(meta or {}))


def member_residuals(a: Mapping[str, np.ndarray], *, num_layers: int, dense: Sequence[float],
                     prefill: Sequence[float], decode_pass_s: float) -> np.ndarray:
    """float[n]: each multi-member pass sample's seconds outside its experts calls minus
    what the single-request model gives for it (L x (dense intercept + dense_token_s T +
    dense_ctx_s ctx) + the pass overhead: prefill's when every member prefills, kv == T).

    ``dense``: the dense part's (intercept, per token, per context token) per layer;
    ``prefill``: the prefill pass's (intercept, per token).
    """
    T, ctx, kv = a["batch_tokens"], a["batch_ctx"], a["batch_kv"]
    per_pass = np.where(kv <= T, prefill[0] + prefill[1] * T, decode_pass_s)
    model = num_layers * (dense[0] + dense[1] * T + dense[2] * ctx) + per_pass
    return np.asarray(a["batch_s"] - a["batch_experts_s"] - model, dtype=np.float64)


def _fit_members(a: Mapping[str, np.ndarray], *, num_layers: int, dense: Sequence[float],
                 prefill: Sequence[float], decode_pass_s: float, outlier_mads: float | None
                 ) -> tuple[float, float, dict[str, float], dict[str, float]]:
    """(member_s, member_kv_s, the fit's quality, median residual ms per member count after
    the applied terms): the residuals of :func:`member_residuals` ~ offset + member_s x
    (B - 1) + member_kv_s x kv [B > 1] (module docstring), a slope that comes out negative
    dropped (0) and the rest refitted, samples beyond ``outlier_mads`` (None:
    :data:`MEMBER_OUTLIER_MADS`) MADs dropped; the per-count residuals are medians over
    every sample.

    No multi-member samples at all: (NaN, NaN, ``{"n": 0}``, {}): the term is not fitted.

    Raises:
        ConfigError: fewer than two member counts among the multi-member pass samples.
    """
    B = a["batch_members"]
    if len(B) == 0:
        log.info("calibration: no multi-member pass samples; the members term is not "
                 "fitted (member_s NaN: passes of one request only)")
        return float("nan"), float("nan"), {"n": 0}, {}
    if len(np.unique(B)) < 2:
        raise ConfigError(f"fit_profile: multi-member pass samples of {len(np.unique(B))} "
                          "member count(s) (need >= 2: moeexp.engine.profile.profile_passes)")
    r = member_residuals(a, num_layers=num_layers, dense=dense, prefill=prefill,
                         decode_pass_s=decode_pass_s)
    feats = np.c_[B - 1, np.where(B > 1, a["batch_kv"], 0.0)]
    slopes, free = np.zeros(2), [0, 1]
    mads = MEMBER_OUTLIER_MADS if outlier_mads is None else outlier_mads
    while True:
        f = fit_linear(np.c_[np.ones(len(B)), feats[:, free]], r, nonneg=False, outlier_mads=mads)
        sol = np.asarray(f.coef[1:])
        if (sol >= 0).all():
            break
        log.warning("calibration: a negative members slope (%s) dropped and the rest refitted",
                    ("per member", "per KV entry")[free[int(np.argmin(sol))]])
        free.pop(int(np.argmin(sol)))
    slopes[free] = sol
    left = r - feats @ slopes
    by_size = {str(int(b)): float(np.median(left[B == b]) * 1e3) for b in np.unique(B)}
    quality = {"rms_ms": f.rms * 1e3, "r2": f.r2, "n": f.n, "kept": f.kept,
               "offset_ms": f.coef[0] * 1e3}
    return float(slopes[0]), float(slopes[1]), quality, by_size


# ----------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class CalibratedCostModel(CostModel):
    """:class:`CostModel` whose times come from a :class:`CalibratedProfile` fit.

    Build it with :meth:`from_calibration`; ``profile`` holds the roofline approximation
    (used only for naming and describe()).
    """

    calib: CalibratedProfile | None = None

    @classmethod
    def from_calibration(cls, calib: CalibratedProfile, dims: TraceDims,
                         dtype_bytes: int = 4) -> CalibratedCostModel:
        """The calibrated cost model for a trace's ``dims`` (warns if the model differs)."""
        base = CostModel.from_profile(calib.hardware_profile(), dims, dtype_bytes=dtype_bytes)
        if (dims.num_layers, dims.hidden_size, dims.expert_bytes) != (
                calib.num_layers, calib.hidden_size, calib.expert_bytes):
            log.warning("calibrated profile measured on L=%d H=%d expert_bytes=%d, used for "
                        "L=%d H=%d expert_bytes=%d: its times do not transfer between models",
                        calib.num_layers, calib.hidden_size, calib.expert_bytes,
                        dims.num_layers, dims.hidden_size, dims.expert_bytes)
        kw = {f.name: getattr(base, f.name) for f in fields(CostModel)
              if not f.name.startswith("_")}
        return cls(**kw, calib=calib)

    @property
    def _c(self) -> CalibratedProfile:
        assert self.calib is not None, "use CalibratedCostModel.from_calibration"
        return self.calib

    @property
    def copy_s(self) -> float:
        c = self._c
        return c.copy_latency_s + self.expert_bytes / c.copy_bytes_per_s

    def expert_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self._c.expert_s + self._c.expert_token_s * tokens

    def dense_s(self, tokens: int, ctx_tokens: int, kv_tokens: int, members: int = 1) -> float:
        """One layer's dense part (module docstring); ``members`` > 1 adds
        ``(member_s x (members - 1) + member_kv_s x kv_tokens) / L`` (a one-member pass is
        the single-request fit)."""
        c = self._c
        if kv_tokens <= tokens:  # prefill: every KV entry is new
            per_pass = c.prefill_pass_s + c.prefill_token_s * tokens
        else:
            per_pass = c.decode_pass_s
        if members > 1:
            if np.isnan(c.member_s) or np.isnan(c.member_kv_s):
                raise ConfigError(
                    f"calibrated profile {c.name!r} was fitted without multi-member passes "
                    f"(member_s unknown) and cannot price a pass of {members} requests: refit "
                    "it with moeexp.engine.profile.profile_passes samples "
                    "(`python -m moeexp +experiment=sim_vs_engine` does)")
            per_pass = per_pass + c.member_s * (members - 1) + c.member_kv_s * kv_tokens
        return (c.layer_s + c.dense_token_s * tokens + c.dense_ctx_s * ctx_tokens
                + per_pass / self.num_layers)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["hardware"] = f"{self._c.name} (fitted)"
        return out


def load_cost_model(path: str | Path, dims: TraceDims, dtype_bytes: int = 4) -> CalibratedCostModel:
    """:meth:`CalibratedProfile.load` + :meth:`CalibratedCostModel.from_calibration`."""
    return CalibratedCostModel.from_calibration(CalibratedProfile.load(path), dims, dtype_bytes)
