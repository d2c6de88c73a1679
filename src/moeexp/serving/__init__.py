"""Serving with continuous (iteration-level) batching: what the simulator and the engine
share, below both mechanisms (they import it; it imports neither).

::

    settings.py   ServingSettings (backend.serving: T_max, max_running, device memory, SLO
                  scales, mix_prefill), the KV reservation, the checks before serving,
                  not_applicable_reason (policies needing the whole future stream)
    arrivals.py   poisson_arrivals (one seeded arrival process for every replay)
    loop.py       BatchingLoop: the waiting queue, the running batch, the scheduler's view
                  and its admission checked against the budgets, over a PassRunner (the
                  mechanism: how one pass runs, how time advances)
    report.py     ServedRun (what the loop records), SLO attainment, goodput, throughput,
                  queueing, per-request series

The decisions (which request joins when) are :mod:`moeexp.schedulers`'; the simulator's
runner is :mod:`moeexp.simulator.continuous`, the engine's :mod:`moeexp.engine.continuous`.
"""
