"""moeexp.serving sits below both mechanisms: it imports neither the simulator nor the
engine, and no torch."""

from __future__ import annotations

import subprocess
import sys


def test_serving_imports_no_torch_and_no_mechanism() -> None:
    code = (
        "import sys\n"
        "import moeexp.serving.loop, moeexp.serving.report, moeexp.serving.settings\n"
        "import moeexp.serving.arrivals\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')\n"
        "             or m.startswith(('moeexp.simulator', 'moeexp.engine')))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
