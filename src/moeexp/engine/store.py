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

With a lossy ``expert_format`` (:mod:`moeexp.engine.quant`) the store holds the quantised
experts instead, under the packed names (``gate_up_proj``, ``gate_up_proj.scale``, ...),
and the slots are packed the same way: a copy moves the quantised bytes
(:attr:`ExpertSpec.nbytes`), and the kernel dequantises the slots it computes with. The
model's own (dense) fused tensors do not stay in host memory beside them (that doubled the
host footprint at real size): once quantised they are written to a temporary directory on
disk and each parameter holds a placeholder of its shape and dtype backed by one element
(``torch.zeros(()).expand(shape)``: shapes and byte counts read from the model stay true,
nothing computes with it); :meth:`HostStore.restore` reads them back, bit for bit, and
removes the directory.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

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
        dtype: parameter dtype (of the dense experts the kernel computes with).
        nbytes: bytes of one expert (all tensors, as held: packed when quantised).
        dtypes: name -> dtype of the tensors that are not ``dtype`` (packed parts).
        fmt: ``model.expert_format`` the store and slots hold (``dense``: as loaded).
        dense_shapes: quantised formats: name of a matrix -> its dense per-expert shape.
    """

    names: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype
    nbytes: int
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    fmt: str = "dense"
    dense_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype slot buffer ``name`` holds."""
        return self.dtypes.get(name, self.dtype)


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

    def __init__(self, experts: list[nn.Module], names: tuple[str, ...], *, pin: bool,
                 fmt: str = "dense") -> None:
        self.names = names
        self.fmt = fmt
        self.tensors: list[dict[str, torch.Tensor]] = []
        self._moved: list[tuple[nn.Parameter, torch.device]] = []
        #: quantised stores: the dense originals spilled to disk (param, its file)
        self._spilled: list[tuple[nn.Parameter, Path]] = []
        self._spill_dir: tempfile.TemporaryDirectory[str] | None = None
        with torch.inference_mode(False), torch.no_grad():
            self._take(experts, names, pin and fmt == "dense")
            if fmt != "dense":
                self.tensors = [self._quantised(layer, pin) for layer in self.tensors]
                self._spill(experts, names)

    def _spill(self, experts: list[nn.Module], names: tuple[str, ...]) -> None:
        """Write each dense fused parameter to disk and leave a one-element placeholder of
        its shape in the model (the quantised store is all the run reads)."""
        self._spill_dir = tempfile.TemporaryDirectory(prefix="moeexp-dense-experts-")
        for i, module in enumerate(experts):
            for n in names:
                p = getattr(module, n)
                path = Path(self._spill_dir.name) / f"{i}.{n}.pt"
                torch.save(p.data, path)
                self._spilled.append((p, path))
                p.data = torch.zeros((), dtype=p.dtype).expand(p.shape)

    def _quantised(self, layer: dict[str, torch.Tensor], pin: bool) -> dict[str, torch.Tensor]:
        """One layer's tensors held in ``self.fmt`` (vectors as they are)."""
        from moeexp.engine.quant import is_matrix, quantise  # the libraries: lazily

        out: dict[str, torch.Tensor] = {}
        for n, t in layer.items():
            parts = quantise(t, self.fmt) if is_matrix(t) else {"": t}
            for suffix, p in parts.items():
                p = p.contiguous()
                out[n + suffix] = p.pin_memory() if pin else p
        return out

    def packed_spec(self, dense: ExpertSpec) -> ExpertSpec:
        """The :class:`ExpertSpec` of what this store holds (``dense``: the model's)."""
        if self.fmt == "dense":
            return dense
        layer = self.tensors[0]
        shapes = {n: tuple(t.shape[1:]) for n, t in layer.items()}
        nbytes = sum(t[0].numel() * t.element_size() for t in layer.values())
        mats: dict[str, tuple[int, ...]] = {n: s for n, s in dense.shapes.items() if len(s) == 2}
        return replace(dense, names=tuple(layer), shapes=shapes, nbytes=int(nbytes),
                       dtypes={n: t.dtype for n, t in layer.items()}, fmt=self.fmt,
                       dense_shapes=mats)

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
        """Move the fused parameters back to where they were before, dense originals read
        back from disk for a quantised store (idempotent)."""
        with torch.inference_mode(False), torch.no_grad():
            for p, path in self._spilled:
                p.data = torch.load(path, map_location="cpu", weights_only=True)
            self._spilled.clear()
            if self._spill_dir is not None:
                self._spill_dir.cleanup()
                self._spill_dir = None
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
            self.buffers = {n: torch.empty((slots, *spec.shapes[n]), dtype=spec.dtype_of(n),
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
