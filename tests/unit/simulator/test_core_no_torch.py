"""The core packages (traces, predictors, cache, costmodel, simulator) and the rules the
simulator shares with the engine (moeexp.prefetching, moeexp.metrics) import no torch."""

from __future__ import annotations

import subprocess
import sys


def test_core_imports_do_not_pull_torch() -> None:
    """In a fresh interpreter, importing the core (every predictor and cache policy
    included) leaves ``torch`` out of ``sys.modules``."""
    code = (
        "import sys\n"
        "import moeexp.traces, moeexp.traces.schema, moeexp.traces.io, moeexp.traces.synthetic\n"
        "import moeexp.predictors, moeexp.cache, moeexp.cache.capacity\n"
        "import moeexp.costmodel, moeexp.simulator, moeexp.prefetching, moeexp.metrics\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(len(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", "torch was imported by the core packages"
