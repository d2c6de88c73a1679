"""The replay plan: batches, forward passes, arrivals, the access stream."""

from __future__ import annotations

import numpy as np
from tests.unit.simulator.simhelpers import hand_trace, unit_cost

from moeexp.simulator.plan import Plan

# request 0: prefill (2 tokens) + 1 decode; request 1: prefill (1 token) + 2 decodes;
# request 2: prefill only. One layer, K=1.
TRACE = hand_trace([
    [[[[0]], [[1]]], [[[2]]]],
    [[[[3]]], [[[0]]], [[[1]]]],
    [[[[2]]]],
], 4)


def _plan(**kw) -> Plan:  # type: ignore[no-untyped-def]
    args = dict(batch_size=1, arrival_rate=None, num_requests=None, seed=0)
    args.update(kw)
    return Plan(TRACE, unit_cost(TRACE.dims), **args)  # type: ignore[arg-type]


def test_batches_align_steps_and_drop_finished_requests() -> None:
    """batch_size=2: batch 0 = requests 0 and 1 (steps 0, 1 together; step 2 only request
    1); request 0 finishes at its step 1, request 1 at step 2; batch 1 = request 2."""
    p = _plan(batch_size=2)
    b0, b1 = p.batches
    assert b0.units == [0, 1] and b1.units == [2]
    assert [len(g) for g in b0.groups] == [2, 2, 1]
    assert b0.finishing == [[], [0], [1]]
    g0 = p.group(b0.groups[0])
    assert g0.experts == [[0, 1, 3]] and g0.counts[0].tolist() == [1, 1, 0, 1]
    assert g0.token_request.tolist() == [0, 0, 1] and g0.step == 0


def test_access_stream_and_no_offload_times() -> None:
    """Stream in replay order: r0 {0,1} {2}; r1 {3} {0} {1}; r2 {2}. With every expert
    resident a pass costs dense 0.1 s + 0.1 s per expert: r0 = 0.3 + 0.2."""
    p = _plan()
    assert p.access_stream() == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 0), (0, 1), (0, 2)]
    start, first, finish = p.no_offload_times()
    assert np.isclose(first[0] - start[0], 0.3) and np.isclose(finish[0] - start[0], 0.5)
    assert np.isclose(start[1], finish[0])  # offline: back to back
    assert p.num_decode(1) == 2 and p.num_decode(2) == 0


def test_online_arrivals_seeded_and_cycled() -> None:
    """num_requests=7 cycles the 3 requests; arrivals are increasing, seeded."""
    p = _plan(arrival_rate=10.0, num_requests=7, seed=3)
    assert [m.request_id for m in p.unit_request] == [0, 1, 2, 0, 1, 2, 0]
    assert p.arrivals is not None and np.all(np.diff(p.arrivals) > 0)
    q = _plan(arrival_rate=10.0, num_requests=7, seed=3)
    assert np.array_equal(p.arrivals, q.arrivals)
    assert p.group(p.batches[0].groups[0]) is p.group(p.batches[3].groups[0])  # memoised


def test_groups_from_the_trace_wide_tables_equal_a_direct_count() -> None:
    """A one-iteration pass is sliced from the trace-wide tables (``_IterationTables``), a
    batched one counted per pass: both equal ``Trace.iteration_counts`` + ``np.nonzero``
    (experts, per-expert seconds, keys, arrays) on a random trace with K = 2."""
    from moeexp.traces.synthetic import random_trace

    tr = random_trace(num_layers=3, num_experts=5, top_k=2, hidden_size=4, num_requests=4,
                      prompt_len=3, output_len=4, seed=1)
    cost = unit_cost(tr.dims)
    for bs in (1, 2):
        p = Plan(tr, cost, batch_size=bs, arrival_rate=None, num_requests=None, seed=0)
        for b in p.batches:
            for iters in b.groups:
                g = p.group(iters)
                counts = sum(tr.iteration_counts(i) for i in iters)
                assert np.array_equal(g.counts, counts)
                for layer in range(3):
                    want = np.flatnonzero(counts[layer]).tolist()
                    assert g.experts[layer] == want
                    assert g.ce[layer] == [cost.expert_s(int(n)) for n in counts[layer][want]]
                    assert g.expert_arrays()[layer].tolist() == want
                    keys, sets = g.layer_keys()
                    assert keys[layer] == [(layer, e) for e in want] and sets[layer] == set(keys[layer])
                flat, sizes = g.flat_experts()
                assert flat.tolist() == [e for es in g.experts for e in es]
                assert sizes.tolist() == [len(es) for es in g.experts]
