"""The slot kernel computes what transformers' grouped_mm kernel computes; restricted routing."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward

from moeexp.engine.kernel import _loop_grouped_linear, restrict_routing, slot_rows
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_model

from .conftest import ARCHS


def _slots_for(experts: torch.nn.Module, names: tuple[str, ...], order: list[int]) -> dict:
    """Slot buffers holding experts ``order`` (slot s = expert order[s])."""
    return {n: getattr(experts, n).detach()[order].clone() for n in names}


@pytest.mark.parametrize("model_type", ARCHS)
def test_slot_rows_match_grouped_mm(model_type: str) -> None:
    """Experts placed in shuffled slots give the default kernel's output (max |diff| < 1e-6)."""
    model = toy_model(model_type)
    ad = adapter_for(model)
    experts = ad.moe_layers()[0].experts
    J, K, H = ad.num_experts, ad.top_k, ad.hidden_size
    g = torch.Generator().manual_seed(0)
    T = 7
    hidden = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(J, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    ref = grouped_mm_experts_forward(experts, hidden, idx, w)
    order = torch.randperm(J, generator=g).tolist()  # slot s holds expert order[s]
    buffers = _slots_for(experts, tuple(ad.expert_tensor_names), order)
    slot_of = {e: s for s, e in enumerate(order)}
    flat = idx.reshape(-1)
    slots = torch.tensor([slot_of[int(e)] for e in flat])
    token = torch.arange(T * K) // K
    rows = slot_rows(experts, buffers, hidden, token, slots, w.reshape(-1))
    out = rows.view(T, K, -1).sum(1)
    assert (out - ref).abs().max().item() < 1e-6


@pytest.mark.parametrize("model_type", ARCHS)
def test_batched_slot_rows_are_bitwise_batched_mm(model_type: str) -> None:
    """batched=True (generate's decode path on an accelerator) reproduces transformers'
    batched_mm kernel bit for bit from shuffled slots (a decode step and a 5-token pass),
    and a chunk of rows given by token index to rounding."""
    model = toy_model(model_type)
    ad = adapter_for(model)
    experts = ad.moe_layers()[0].experts
    J, K, H = ad.num_experts, ad.top_k, ad.hidden_size
    g = torch.Generator().manual_seed(3)
    for T in (1, 5):
        hidden = torch.randn(T, H, generator=g)
        idx = torch.stack([torch.randperm(J, generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=g)
        ref = batched_mm_experts_forward(experts, hidden, idx, w)
        order = torch.randperm(J, generator=g).tolist()
        buffers = _slots_for(experts, tuple(ad.expert_tensor_names), order)
        slot_of = {e: s for s, e in enumerate(order)}
        slots = torch.tensor([slot_of[int(e)] for e in idx.reshape(-1)])
        rows = slot_rows(experts, buffers, hidden, K, slots, w.reshape(-1), batched=True)
        assert torch.equal(rows.view(T, K, -1).sum(1).to(hidden.dtype), ref)
        token = torch.arange(T * K) // K
        sub = torch.arange(0, T * K, 2)  # every other row, by token index
        part = slot_rows(experts, buffers, hidden, token[sub], slots[sub], w.reshape(-1)[sub],
                         batched=True)
        torch.testing.assert_close(part, rows[sub], rtol=0, atol=1e-6)  # bmm of fewer rows


def test_cpu_loop_is_bitwise_grouped_mm() -> None:
    """The CPU path (torch.mm per used slot) equals torch's grouped_mm bit for bit: rows
    0:2 in slot 0, rows 2:6 in slot 2, slot 1 empty."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g)
    w = torch.randn(3, 4, 8, generator=g)  # [G, out, in]
    out = _loop_grouped_linear(x, w, [(0, 2), (2, 4)], None, False)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    ref = torch.nn.functional.grouped_mm(x, w.transpose(-2, -1), offs=offs)
    assert torch.equal(out, ref)


def test_restrict_routing_worked_example() -> None:
    """Token 0 chose (0, 1) and expert 1 is not resident: gate order is 1 > 3 > 0 > 2 with
    residents {0, 3}, so 1 -> 3 with weight 0.4 * p3/p1 = 0.4 * 0.3/0.4 = 0.3. Token 1
    chose (2, 3): 2 is not resident and the only resident left unused is 0 (p=0.1), so
    weight 0.5 * 0.1/0.2 = 0.25. With renormalize, each token's weights sum to 1 again."""
    probs = torch.tensor([[0.2, 0.4, 0.1, 0.3], [0.1, 0.3, 0.2, 0.4]])
    idx = torch.tensor([[0, 1], [2, 3]])
    w = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
    resident = torch.tensor([True, False, False, True])
    new_idx, new_w, dropped, n = restrict_routing(idx, w, probs, resident, renormalize=False)
    assert new_idx.tolist() == [[0, 3], [0, 3]]
    assert torch.allclose(new_w, torch.tensor([[0.6, 0.3], [0.25, 0.5]]))
    assert n == 2 and not dropped.any()
    _, rw, _, _ = restrict_routing(idx, w, probs, resident, renormalize=True)
    assert torch.allclose(rw.sum(1), torch.ones(2))


def test_restrict_routing_drops_without_candidates() -> None:
    """Only expert 0 resident: token (0, 1) keeps 0 and drops its second choice (weight 0)."""
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    idx = torch.tensor([[0, 1]])
    w = torch.tensor([[0.7, 0.3]])
    new_idx, new_w, dropped, n = restrict_routing(
        idx, w, probs, torch.tensor([True, False, False]), renormalize=False)
    assert dropped.tolist() == [[False, True]] and n == 0
    assert new_w.tolist() == [[pytest.approx(0.7), 0.0]]
    assert new_idx[0, 0] == 0
