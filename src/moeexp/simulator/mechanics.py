"""Serving behaviours of the FineMoE artifact, as named options of the replay (all off by
default: the defaults are algorithms.md's paper semantics).

Each option models one thing the authors' code does (``IntelliSys-Lab/FineMoE-EuroSys26``;
algorithms.md §10 lists what was read there), so a study can switch it on and off alone:

* ``demand_load``: ``activated`` (default) loads on demand only the experts the router
  chose. ``all_experts`` touches every expert of every MoE layer, in index order, every
  pass: the artifact's modified model files call every expert module with no skip for
  experts that got no tokens (V1 ``5c584686`` ``finemoe/models/modeling_qwen/
  modeling_qwen2_moe.py``, the loop after ``expert_mask``), and each module's pre-forward
  hook fetches its weights (``finemoe/runtime/model_offload.py``,
  ``_pre_forward_input_hook`` -> ``fetch_tensors``). An expert that got no token costs a
  copy when absent and no compute; it is an access like any other (``hit_rate``,
  ``accesses_total`` and the policy's clock count all J experts of a layer), while the
  ``prediction_*`` metrics still score the router's experts.
* ``flush_per_token``: every expert leaves the device at the end of every forward pass:
  no reuse across tokens. Source: V0 ``6d063946`` ``moe_infinity/memory/expert_tracer.py``,
  ``ExpertTracer.update_entry`` calls ``archer_engine.clear_cache()`` when it records the
  last layer's routing (``layer_idx == num_layers - 1``). Modelled at the pass's end: if
  the artifact's call comes before that layer's experts run, its last layer also loses
  what it held, which this option does not model. Prefetched copies never used count as
  wasted; copies still in flight finish on their link (their bytes count).

Policies that read the whole future (``needs_future``: Belady) are refused with
``all_experts`` (their stream holds the router's experts only), and the ``bound_*`` floor,
which models neither option, is NaN when any is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moeexp.errors import ConfigError

DemandLoad = Literal["activated", "all_experts"]
DEMAND_LOADS: tuple[str, ...] = ("activated", "all_experts")


@dataclass(frozen=True)
class Mechanics:
    """The artifact's behaviours (module docstring); the defaults change nothing.

    Attributes:
        demand_load: ``activated`` or ``all_experts``.
        flush_per_token: empty the device at the end of every forward pass.
    """

    demand_load: DemandLoad = "activated"
    flush_per_token: bool = False

    def __post_init__(self) -> None:
        if self.demand_load not in DEMAND_LOADS:
            raise ConfigError(f"demand_load {self.demand_load!r} is not valid; valid: "
                              f"{', '.join(DEMAND_LOADS)}")
        if not isinstance(self.flush_per_token, bool):
            raise ConfigError(f"flush_per_token must be true or false, got {self.flush_per_token!r}")

    @property
    def default(self) -> bool:
        """True when no option is on (the paper semantics)."""
        return self.demand_load == "activated" and not self.flush_per_token
