"""``backend=eviction_landscape``: the grid of :mod:`moeexp.landscape.study` as one job.

``python -m moeexp +experiment=eviction_landscape`` records (or reuses) the run's trace as
every experiment does, then this backend replays the on-demand access stream of each
routing source (``sources``) with every policy at every capacity and writes, into the
run directory:

* ``summary.csv``: one row per cell (:data:`moeexp.landscape.study.COLUMNS`), read by
  ``make figures`` (:mod:`moeexp.figures.eviction_landscape`);
* ``summary.md``: per source, hit rate by policy and capacity, and where libCacheSim's
  native semantics and the protected ones differ;
* ``metrics.json`` (by the pipeline): per source, LRU's and Belady's mean hit rates, the
  best online policy, the agreement checks (``*_agreement_max_abs``: moeexp's ``lru``
  against libCacheSim's LRU under the protection rule, moeexp's ``belady`` against
  libCacheSim's Belady) and the protection gain of libCacheSim's LRU.

Registration: :class:`moeexp.backends.EvictionLandscapeBackend` wraps
:class:`LandscapeBackend` lazily (pandas and the optional libcachesim load only when the
backend is chosen); its settings are ``conf/backend/eviction_landscape.yaml``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from moeexp.atomic import write_text
from moeexp.backends.base import BackendContext, BackendResult
from moeexp.errors import ConfigError
from moeexp.landscape.cachesim import (
    EXCLUDED,
    POLICIES,
    SEMANTICS,
    LibPolicy,
    Semantics,
    check_policies,
    require_libcachesim,
)
from moeexp.landscape.sources import ImportedSourceSpec, SourceSpec, build_source, source_spec
from moeexp.landscape.study import Grid, MoeexpPolicy, run_grid

log = logging.getLogger(__name__)

#: Policies that see the future: never "the best online policy".
OFFLINE = ("belady", "lcs.Belady")


@dataclass(frozen=True)
class LandscapeSettings:
    """The ``backend`` group of conf/backend/eviction_landscape.yaml."""

    capacities: tuple[float, ...]
    sources: tuple[SourceSpec, ...]
    moeexp_policies: tuple[MoeexpPolicy, ...]
    libcachesim_policies: tuple[LibPolicy, ...]
    semantics: tuple[Semantics, ...]
    repeats: int
    jobs: int
    progress: bool

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> LandscapeSettings:
        """Typed settings; a bad key, value or name raises ConfigError."""
        keys = {"capacities", "sources", "moeexp_policies", "libcachesim_policies",
                "semantics", "repeats", "jobs", "progress"}
        unknown = sorted(set(data) - keys)
        if unknown:
            from moeexp.registry import unknown_keys

            raise unknown_keys("backend=eviction_landscape", unknown, keys)
        caps = tuple(float(c) for c in data.get("capacities", (0.05, 0.1, 0.25, 0.5, 0.75)))
        if not caps or any(not 0.0 < c <= 1.0 for c in caps):
            raise ConfigError(f"backend=eviction_landscape: capacities {list(caps)} must be "
                              "fractions of all experts in (0, 1]")
        sem = tuple(data.get("semantics", SEMANTICS))
        bad = [s for s in sem if s not in SEMANTICS]
        if bad or not sem:
            raise ConfigError(f"backend=eviction_landscape: semantics {list(sem)}; valid: "
                              f"{', '.join(SEMANTICS)}")
        libs = data.get("libcachesim_policies")
        sources = tuple(source_spec(s) for s in data.get("sources", ()))
        if not sources:
            raise ConfigError("backend=eviction_landscape: no sources")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"backend=eviction_landscape: source names repeat: {names}")
        out = cls(
            capacities=caps, sources=sources,
            moeexp_policies=tuple(MoeexpPolicy.from_entry(e)
                                  for e in data.get("moeexp_policies", ())),
            libcachesim_policies=tuple(check_policies(list(POLICIES) if libs is None
                                                      else [str(n) for n in libs])),
            semantics=sem,  # type: ignore[arg-type]
            repeats=int(data.get("repeats", 3)), jobs=int(data.get("jobs", 1)),
            progress=bool(data.get("progress", True)))
        if out.repeats < 1 or out.jobs < 1:
            raise ConfigError("backend=eviction_landscape: repeats and jobs must be >= 1")
        return out


class LandscapeBackend:
    """Every policy x capacity x routing source, on demand; see the module docstring.

    Raises ConfigError at construction (so before any model load) for a bad setting, an
    imported source that does not exist, or libcachesim missing while libCacheSim
    policies are asked for (the message names ``pip install -e '.[cachesim]'``).
    """

    def __init__(self, **settings: Any) -> None:
        self.settings = LandscapeSettings.from_mapping(settings)
        if self.settings.libcachesim_policies:
            require_libcachesim()
        for spec in self.settings.sources:
            if isinstance(spec, ImportedSourceSpec):
                from moeexp.traces.importers import resolve_source

                resolve_source(spec.source)

    def run(self, ctx: BackendContext) -> BackendResult:
        s = self.settings
        if ctx.run_dir is None:
            raise ValueError("backend=eviction_landscape writes into ctx.run_dir: set it")
        sources = [build_source(spec, ctx.trace, ctx.store) for spec in s.sources]
        for src in sources:
            log.info("source %s: %s, %d test requests", src.name, src.description,
                     len(src.test.requests))
        grid = Grid(capacities=s.capacities, moeexp=s.moeexp_policies,
                    libcachesim=s.libcachesim_policies, semantics=s.semantics,
                    repeats=s.repeats, progress=s.progress)
        df = pd.DataFrame(run_grid(sources, grid, ctx.cost.profile, jobs=s.jobs))
        run_dir = Path(ctx.run_dir)
        write_text(run_dir / "summary.csv", df.to_csv(index=False))
        write_text(run_dir / "summary.md", summary_markdown(df, sources_text(sources)))
        log.info("eviction landscape: %d cells -> %s", len(df), run_dir / "summary.csv")
        return BackendResult(landscape_metrics(df), {})


def sources_text(sources: Sequence[Any]) -> dict[str, str]:
    """Source name -> its description and test-split size (for the markdown)."""
    return {s.name: f"{s.description}; {len(s.test.requests)} test requests"
            for s in sources}


def _mean_by_policy(sub: pd.DataFrame) -> pd.Series:
    return sub.groupby("policy", sort=False)["hit_rate"].mean()


def landscape_metrics(df: pd.DataFrame) -> dict[str, Any]:
    """Flat per-source scalars (see the module docstring); NaN where a policy is absent."""
    m: dict[str, Any] = {"sources": ",".join(dict.fromkeys(df["source"])),
                         "cells_total": len(df),
                         "policies_total": int(df["policy"].nunique())}
    for src, sub in df.groupby("source", sort=False):
        prot = sub[sub["semantics"] == "protected"]
        nat = sub[sub["semantics"] == "native"]
        means = _mean_by_policy(prot)
        m[f"{src}_lru_hit_rate_mean"] = float(means.get("lru", math.nan))
        m[f"{src}_belady_hit_rate_mean"] = float(means.get("belady", math.nan))
        # rank only policies with every capacity run at full occupancy
        ok = prot.groupby("policy", sort=False)["full"].all()
        online = means[[p not in OFFLINE and bool(ok.get(p, False)) for p in means.index]]
        if len(online):
            best = str(online.idxmax())
            m[f"{src}_best_online_policy"] = best
            m[f"{src}_best_online_hit_rate_mean"] = float(online.max())
        m[f"{src}_lru_agreement_max_abs"] = _max_gap(prot, "lru", prot, "lcs.LRU")
        m[f"{src}_belady_agreement_max_abs"] = _max_gap(prot, "belady", nat, "lcs.Belady")
        m[f"{src}_lcs_lru_protection_gain_mean"] = float(
            means.get("lcs.LRU", math.nan)
            - _mean_by_policy(nat).get("lcs.LRU", math.nan))
    return m


def _max_gap(a: pd.DataFrame, pa: str, b: pd.DataFrame, pb: str) -> float:
    x = a[a["policy"] == pa].set_index("capacity")["hit_rate"]
    y = b[b["policy"] == pb].set_index("capacity")["hit_rate"]
    common = x.index.intersection(y.index)
    if not len(common):
        return math.nan
    return float((x[common] - y[common]).abs().max())


def summary_markdown(df: pd.DataFrame, described: Mapping[str, str] | None = None) -> str:
    """Per source: hit rate by policy (rows) and capacity (columns), then the cells where
    libCacheSim's two semantics differ by more than 0.001."""
    out = ["# Eviction landscape: on-demand hit rate (hits / accesses), no cost model\n",
           "Rows: moeexp policies (the simulator, running layer protected) and libCacheSim "
           "policies in both semantics (`native`: its own rule on every request; "
           "`protected`: the running layer's resident experts are used before its misses "
           "load). `*`: the policy held fewer objects than its capacity (not comparable).\n"]
    for src, sub in df.groupby("source", sort=False):
        out.append(f"\n## {src}\n")
        if described and src in described:
            out.append(f"{described[src]}; {int(sub['accesses'].iloc[0])} accesses.\n\n")
        cell = sub.assign(
            label=sub["policy"] + " (" + sub["semantics"] + ")",
            text=[("-" if math.isnan(h) else f"{h:.3f}") + ("" if f else "*")
                  for h, f in zip(sub["hit_rate"], sub["full"], strict=True)])
        table = cell.pivot_table(index="label", columns="capacity", values="text",
                                 aggfunc="first", sort=False)
        table.columns = [f"{c:g}" for c in table.columns]
        out.append(table.to_markdown() + "\n")
        lib = sub[sub["family"] == "libcachesim"]
        wide = lib.pivot_table(index="policy", columns=["semantics", "capacity"],
                               values="hit_rate", sort=False)
        if {"native", "protected"} <= set(lib["semantics"]):
            gap = (wide["protected"] - wide["native"]).dropna(how="all")
            gap = gap[(gap.abs() > 0.001).any(axis=1)]
            if len(gap):
                gap.columns = [f"{c:g}" for c in gap.columns]
                out.append("\nlibCacheSim, protected minus native, where they differ:\n\n"
                           + gap.round(4).to_markdown() + "\n")
    out.append("\nExcluded libCacheSim policies: "
               + "; ".join(f"{k} ({v})" for k, v in EXCLUDED.items()) + ".\n")
    return "".join(out)
