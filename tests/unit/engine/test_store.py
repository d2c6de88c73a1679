"""HostStore with a quantised format: the dense originals leave host memory (spilled to
disk, a one-element placeholder of their shape in the model) and come back bit for bit."""

from __future__ import annotations

import torch
from torch import nn

from moeexp.engine.store import HostStore


class _Experts(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = nn.Parameter(torch.randn(4, 64, 32, generator=g))
        self.down_proj = nn.Parameter(torch.randn(4, 32, 32, generator=g))


def test_quantised_store_drops_the_dense_originals_until_restore() -> None:
    mods = [_Experts(0), _Experts(1)]
    names = ("gate_up_proj", "down_proj")
    before = [{n: getattr(m, n).detach().clone() for n in names} for m in mods]
    store = HostStore(mods, names, pin=False, fmt="int8")
    for m in mods:
        for n in names:
            p = getattr(m, n)
            assert p.shape == before[0][n].shape and p.dtype == torch.float32
            assert p.untyped_storage().nbytes() == p.element_size()  # one element held
    assert store.tensors[0]["down_proj"].dtype == torch.int8
    assert store.expert(1, 2)["gate_up_proj"].shape == (64, 32)
    store.restore()
    store.restore()  # idempotent
    for m, ref in zip(mods, before, strict=True):
        assert all(torch.equal(getattr(m, n), ref[n]) for n in names)


def test_dense_store_aliases_the_parameters() -> None:
    """dense on the CPU: nothing spilled, the store is the model's own tensors."""
    mods = [_Experts(0)]
    store = HostStore(mods, ("gate_up_proj", "down_proj"), pin=False)
    assert store.expert(0, 1)["down_proj"].data_ptr() == mods[0].down_proj[1].data_ptr()
    store.restore()
