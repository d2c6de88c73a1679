"""The serving profile (eMoE's fitted c, ΔE and output lengths) on a hand-worked trace."""

from __future__ import annotations

import pytest
from tests.unit.simulator.simhelpers import hand_trace, unit_cost

from moeexp.errors import ConfigError
from moeexp.simulator.serving_profile import fit_serving_profile


def _trace():  # type: ignore[no-untyped-def]
    """One layer, 4 experts, top-1. Request 0: prefill of 2 tokens (experts 0, 1), one
    decode step (0). Request 1: prefill of 1 token (2), one decode step (2)."""
    return hand_trace([[[[[0]], [[1]]], [[[0]]]],
                       [[[[2]]], [[[2]]]]], num_experts=4)


def test_fitted_by_hand() -> None:
    """Unit cost: a layer's dense part 0.1 s, an expert 0.1 s, a copy 1 s.
    Alone: r0 = (0.1 + 0.2) + (0.1 + 0.1) = 0.5 s, r1 = 0.2 + 0.2 = 0.4 s over 3 + 2
    tokens: c = 0.18 s. One batch: prefill (experts 0, 1, 2) 0.4 s + decode (0, 2) 0.3 s:
    c_batched = 0.14 s. r1's first pass brings 1 expert r0's did not: ΔE = 1 copy = 1 s."""
    tr = _trace()
    prof = fit_serving_profile(tr, unit_cost(tr.dims), capacity_slots=2)
    assert prof.token_s == pytest.approx(0.18, rel=1e-6)
    assert prof.token_s_batched == pytest.approx(0.14, rel=1e-6)
    assert prof.expert_load_s == pytest.approx(1.0)
    assert prof.output_len_by_task == {"": 2.0} and prof.output_len("unseen") == 2.0


def test_no_loading_when_every_expert_fits() -> None:
    tr = _trace()
    assert fit_serving_profile(tr, unit_cost(tr.dims), capacity_slots=4).expert_load_s == 0.0


def test_empty_store_is_refused() -> None:
    tr = _trace()
    with pytest.raises(ConfigError, match="non-empty store split"):
        fit_serving_profile(tr.split("store"), unit_cost(tr.dims), capacity_slots=2)
