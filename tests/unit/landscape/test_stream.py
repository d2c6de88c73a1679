"""The landscape's access stream is the simulator's, cut into (pass, layer) runs."""

from __future__ import annotations

import numpy as np

from moeexp.costmodel import CostModel, load_profile
from moeexp.landscape.stream import NEVER, AccessStream, access_stream
from moeexp.simulator.plan import Plan
from moeexp.traces.synthetic import random_trace


def _cost(trace):
    return CostModel.from_profile(load_profile("rtx3090_pcie4"), trace.dims)


def test_stream_is_the_plans_access_stream_in_runs() -> None:
    """Same keys in the same order as Plan.access_stream (Belady's future in the replay);
    each run is one layer's sorted experts, and the runs cycle through the layers."""
    tr = random_trace(num_layers=5, num_experts=8, top_k=2, num_requests=6, prompt_len=4,
                      output_len=5, seed=2).split("test")
    cost = _cost(tr)
    s = access_stream(tr, cost)
    plan = Plan(tr, cost, batch_size=1, arrival_rate=None, num_requests=None, seed=0)
    assert s.pairs() == plan.access_stream()
    runs = list(s.runs())
    assert sum(map(len, runs)) == s.num_accesses and s.num_runs == len(runs)
    layers = [r[0] // 8 for r in runs]
    assert layers == [i % 5 for i in range(len(runs))]  # every layer has >= 1 expert
    for r in runs:
        assert r == sorted(r) and len({k // 8 for k in r}) == 1


def test_next_use() -> None:
    """A B A C B -> next uses 2, 4, never, never, never."""
    s = AccessStream(num_layers=1, num_experts=4, keys=np.array([0, 1, 0, 2, 1]),
                     run_offsets=np.array([0, 5]))
    assert s.next_use().tolist() == [2, 4, NEVER, NEVER, NEVER]
    empty = AccessStream(1, 4, np.zeros(0, np.int64), np.zeros(1, np.int64))
    assert empty.next_use().size == 0 and list(empty.runs()) == []


def test_landscape_imports_neither_torch_nor_libcachesim() -> None:
    """In a fresh interpreter, importing the landscape (backend included) leaves torch and
    libcachesim out of sys.modules: libCacheSim loads when a policy runs, torch only for an
    imported source's dims."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import moeexp.landscape.stream, moeexp.landscape.cachesim\n"
            "import moeexp.landscape.study, moeexp.landscape.sources, moeexp.landscape.backend\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'libcachesim')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
