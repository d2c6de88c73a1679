"""Real expert offloading: a host store, a fixed budget of device slots, a copy thread.

Public API::

    from moeexp.engine import offload
    with offload(model, system="deepspeed", capacity=0.5) as om:
        om.generate(input_ids, max_new_tokens=16)
        om.metrics()

See :mod:`moeexp.engine.offload` (wrapping), :mod:`moeexp.engine.runtime` (the Engine and its
state), :mod:`moeexp.engine.layer` (one layer's steps),
:mod:`moeexp.engine.transfer` (copies), :mod:`moeexp.eval.quality` (lossy-mode quality)
and :mod:`moeexp.engine.serve` (``backend=engine`` of the app).
"""

from moeexp.engine.build import build_offloaded, engine_settings, offload
from moeexp.engine.offload import OffloadedModel
from moeexp.engine.runtime import EngineSettings
from moeexp.systems import resolve_system, system_names

__all__ = ["EngineSettings", "build_offloaded", "OffloadedModel", "engine_settings", "offload",
           "resolve_system", "system_names"]
