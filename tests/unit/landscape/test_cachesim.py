"""libCacheSim as moeexp runs it: the two semantics, the guards, the optional import."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.landscape.cachesim import (
    EXCLUDED,
    INSTALL_HINT,
    POLICIES,
    CacheSimMissing,
    check_policies,
    require_libcachesim,
    run_policy,
)
from moeexp.landscape.stream import AccessStream

INSTALL = "libcachesim is optional: pip install -e '.[cachesim]'"


def _stream(runs: list[list[int]], num_layers: int, num_experts: int) -> AccessStream:
    keys = np.asarray([k for r in runs for k in r], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in runs])]).astype(np.int64)
    return AccessStream(num_layers, num_experts, keys, offsets)


def test_missing_libcachesim_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the extra, asking for it raises a ConfigError that says how to install it."""
    monkeypatch.setitem(sys.modules, "libcachesim", None)  # import now raises ImportError
    with pytest.raises(CacheSimMissing, match=r"pip install -e '\.\[cachesim\]'"):
        require_libcachesim()
    with pytest.raises(ConfigError, match="cachesim"):
        run_policy(_stream([[0]], 1, 2), POLICIES["LRU"], 1, "native")
    assert "libcachesim==0.3.5" in INSTALL_HINT


def test_policy_names_are_checked() -> None:
    """A misspelled name suggests the right one; an excluded one says why."""
    with pytest.raises(ConfigError, match="Did you mean 'LIRS'"):
        check_policies(["LIRs"])
    with pytest.raises(ConfigError, match="size 1"):
        check_policies(["BeladySize"])
    assert not set(EXCLUDED) & set(POLICIES)
    assert [p.name for p in check_policies(["ARC", "Belady"])] == ["ARC", "Belady"]


def test_native_lru_evicts_what_the_running_layer_needs() -> None:
    """Layer 0 uses experts 0 and 1, layer 1 uses expert 2, two slots, passes repeat.
    Native LRU: when 0 misses, the least recent object is 1, which layer 0 needs next, so
    nothing ever hits. Protected: 1 is used (a hit) before 0 loads, so the victim is 2:
    one hit per pass after the first."""
    pytest.importorskip("libcachesim", reason=INSTALL)
    passes = 10
    s = _stream([[0, 1], [2]] * passes, num_layers=2, num_experts=2)
    native = run_policy(s, POLICIES["LRU"], 2, "native")
    protected = run_policy(s, POLICIES["LRU"], 2, "protected")
    assert native.hit_rate == 0.0
    assert protected.hit_rate * s.num_accesses == pytest.approx(passes - 1)
    assert protected.peak_objects == 2 and protected.repeats == 1


def test_find_has_no_side_effect_so_one_key_runs_agree() -> None:
    """With one access per run there is nothing to reorder: the protected pass (which
    also calls find(update_cache=False) before every request) must equal the native one,
    for every deterministic policy."""
    pytest.importorskip("libcachesim", reason=INSTALL)
    rng = np.random.default_rng(0)
    s = _stream([[int(k)] for k in rng.zipf(1.3, 3000) % 64], num_layers=1, num_experts=64)
    for p in POLICIES.values():
        if p.randomized or p.offline:
            continue
        a, b = run_policy(s, p, 16, "native"), run_policy(s, p, 16, "protected")
        assert a.hit_rate == b.hit_rate, p.name


def test_randomized_policies_report_repeats_and_spread() -> None:
    pytest.importorskip("libcachesim", reason=INSTALL)
    rng = np.random.default_rng(1)
    s = _stream([[int(k)] for k in rng.integers(0, 40, 2000)], 1, 40)
    r = run_policy(s, POLICIES["Random"], 10, "native", repeats=4)
    assert r.repeats == 4 and r.hit_rate_std >= 0.0 and 0.0 < r.hit_rate < 1.0


def test_guards_skip_sizes_libcachesim_aborts_at() -> None:
    """Below a policy's ``min_slots`` the cell is NaN with a note, and libCacheSim is not
    asked (S3FIFO aborts the whole process below 10 objects): every policy at every size
    from 1 to 24 objects, both semantics, in a fresh interpreter that must exit cleanly."""
    pytest.importorskip("libcachesim", reason=INSTALL)
    code = (
        "import numpy as np\n"
        "from moeexp.landscape.cachesim import POLICIES, run_policy\n"
        "from moeexp.landscape.stream import AccessStream\n"
        "rng = np.random.default_rng(0)\n"
        "runs = [sorted(set((l * 8 + rng.integers(0, 8, 3)).tolist())) for _ in range(40)"
        " for l in range(4)]\n"
        "keys = np.asarray([k for r in runs for k in r])\n"
        "off = np.concatenate([[0], np.cumsum([len(r) for r in runs])])\n"
        "s = AccessStream(4, 8, keys, off)\n"
        "for p in POLICIES.values():\n"
        "    for c in range(1, 25):\n"
        "        for sem in ('native', 'protected'):\n"
        "            r = run_policy(s, p, c, sem, repeats=1)\n"
        "            assert (c < p.min_slots) == bool(r.note and 'aborts' in r.note)\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_belady_runs_native_only() -> None:
    """Belady is fed each request's next use, so it has no protected variant here."""
    pytest.importorskip("libcachesim", reason=INSTALL)
    s = _stream([[0, 1], [2]] * 5, 2, 2)
    r = run_policy(s, POLICIES["Belady"], 2, "protected")
    assert math.isnan(r.hit_rate) and "offline" in r.note
    assert run_policy(s, POLICIES["Belady"], 2, "native").hit_rate > 0
