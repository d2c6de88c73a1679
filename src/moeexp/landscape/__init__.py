"""The eviction landscape (issue 16): classic cache policies on expert access streams.

Every libCacheSim policy that applies (size-1 objects, no TTL) against capacity on each
routing source, beside moeexp's own cache policies, on the very on-demand access stream
the simulator replays. A hit-rate-only study: no cost model enters a hit rate.

    stream.py     the simulator's on-demand access stream of a test trace, by layer runs
    cachesim.py   libCacheSim (optional extra ``moeexp[cachesim]``) in two semantics
    sources.py    routing sources: the run's trace, synthetic, imported (gpt-oss-20b)
    study.py      the grid: sources x capacities x policies -> table rows
    backend.py    ``backend=eviction_landscape`` (``+experiment=eviction_landscape``)

Only :mod:`moeexp.landscape.cachesim` imports libcachesim, and only when a policy runs.
"""
