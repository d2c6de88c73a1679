"""Where expert bytes live: the host store (all routed experts) and the device slot pool.

::

    host store   layer l, tensor name n: float[J, ...]   (pinned when the device is CUDA)
        │  copy one expert (all of its tensors) ── transfer.CopyEngine
        ▼
    slot pool    tensor name n: float[S, ...] on the device; slot s holds key (l, e) or none

The host store *is* the model's fused expert parameters, moved to host memory when the
device is CUDA (``param.data`` becomes a pinned host tensor, so the device never holds the
full fused tensors) and left untouched on a CPU-only run. :meth:`HostStore.restore` moves
them back. The slot pool is the only place the engine's experts kernel reads weights from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from moeexp.errors import ConfigError

log = logging.getLogger(__name__)

Key = tuple[int, int]


@dataclass(frozen=True)
class ExpertSpec:
    """Shape of one routed expert: tensor name -> per-expert shape, one dtype for all.

    Attributes:
        names: fused parameter names of the experts module, each of shape (J, ...).
        shapes: name -> shape of one expert's slice.
        dtype: parameter dtype.
        nbytes: bytes of one expert (all tensors).
    """

    names: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype
    nbytes: int


def expert_spec(experts: nn.Module, names: tuple[str, ...], num_experts: int) -> ExpertSpec:
    """The :class:`ExpertSpec` of a fused experts module (ConfigError if not fused)."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes = set()
    nbytes = 0
    for n in names:
        p = getattr(experts, n, None)
        if not isinstance(p, torch.Tensor) or p.dim() < 2 or p.shape[0] != num_experts:
            raise ConfigError(
                f"the engine needs fused expert tensors of shape (J={num_experts}, ...); "
                f"{type(experts).__name__}.{n} is {None if p is None else tuple(p.shape)}")
        shapes[n] = tuple(p.shape[1:])
        dtypes.add(p.dtype)
        nbytes += p.numel() // num_experts * p.element_size()
    if len(dtypes) != 1:
        raise ConfigError(f"expert tensors of mixed dtypes {sorted(map(str, dtypes))} are not supported")
    return ExpertSpec(names, shapes, dtypes.pop(), int(nbytes))


class HostStore:
    """All routed experts in host memory, indexed by (layer, expert).

    Args:
        experts: the experts module of each MoE layer, in MoE-layer order.
        names: the fused parameter names (adapter.expert_tensor_names).
        pin: pin host memory (CUDA devices: enables asynchronous copies).
    """

    def __init__(self, experts: list[nn.Module], names: tuple[str, ...], *, pin: bool) -> None:
        self.names = names
        self.tensors: list[dict[str, torch.Tensor]] = []
        self._moved: list[tuple[nn.Parameter, torch.device]] = []
        with torch.inference_mode(False), torch.no_grad():
            self._take(experts, names, pin)

    def _take(self, experts: list[nn.Module], names: tuple[str, ...], pin: bool) -> None:
        for module in experts:
            layer: dict[str, torch.Tensor] = {}
            for n in names:
                p = getattr(module, n)
                host = p.data
                if host.device.type != "cpu" or (pin and not host.is_pinned()):
                    self._moved.append((p, host.device))
                    host = host.to("cpu")
                    if pin:
                        host = host.pin_memory()
                    p.data = host  # the fused tensor leaves the device (instance data only)
                layer[n] = host
            self.tensors.append(layer)

    def expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Views of one expert's host tensors (name -> tensor)."""
        return {n: t[expert] for n, t in self.tensors[layer].items()}

    def restore(self) -> None:
        """Move the fused parameters back to where they were before (idempotent)."""
        with torch.inference_mode(False), torch.no_grad():
            for p, device in self._moved:
                p.data = p.data.to(device)
        self._moved.clear()


class SlotPool:
    """A fixed number of expert-sized slot buffers on the device.

    ``buffers[name]`` is float[S, ...]; ``lut`` is int64[L, J] on the device mapping
    (layer, expert) to its slot (-1 when not resident), so the kernel can remap routing
    indices to slot indices without a host round trip.
    """

    def __init__(self, spec: ExpertSpec, slots: int, num_layers: int, num_experts: int,
                 device: torch.device) -> None:
        self.spec = spec
        self.num_slots = slots
        self.device = device
        # normal tensors even under inference_mode: the copy thread writes them outside it
        with torch.inference_mode(False), torch.no_grad():
            self.buffers = {n: torch.empty((slots, *spec.shapes[n]), dtype=spec.dtype,
                                           device=device) for n in spec.names}
            self.lut = torch.full((num_layers, num_experts), -1, dtype=torch.long, device=device)
        self.key_of: list[Key | None] = [None] * slots
        self.slot_of: dict[Key, int] = {}
        self._free = list(range(slots - 1, -1, -1))

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the slot buffers (the whole device-side expert footprint)."""
        return self.num_slots * self.spec.nbytes

    @property
    def occupied(self) -> int:
        return len(self.slot_of)

    def has_free(self) -> bool:
        return bool(self._free)

    def assign(self, key: Key) -> int:
        """Give ``key`` a free slot (its contents are undefined until the copy lands)."""
        if key in self.slot_of:
            raise RuntimeError(f"{key} already holds slot {self.slot_of[key]}")
        if not self._free:
            raise RuntimeError("no free slot: evict first")
        s = self._free.pop()
        self.key_of[s] = key
        self.slot_of[key] = s
        self.lut[key[0], key[1]] = s
        return s

    def release(self, key: Key) -> int:
        """Free ``key``'s slot; returns the slot index."""
        s = self.slot_of.pop(key)
        self.key_of[s] = None
        self.lut[key[0], key[1]] = -1
        self._free.append(s)
        return s
