"""Full-size random-weight MoE models without a download or a CPU-heavy init.

The model of an ``arch:`` block (conf/model/*.yaml, e.g. gpt-oss-20b or Mixtral-8x7B) is
built on the **meta device** (no memory), then every parameter is materialised where it
will live and filled cheaply::

    routed experts (the fused tensors)  -> host memory, pinned when the device is CUDA
                                           (what the engine's host store copies from)
    everything else                     -> the device (embeddings, attention, routers, norms)

Filling: one seeded block of ``FILL_BLOCK`` normal(0, ``std``) values is drawn once (on the
device when it is CUDA) and tiled into every tensor, each from its own offset, so a 40 GB
model fills at copy speed instead of at the CPU's random-number speed; 1-D ``weight``
parameters (norm gains) are ones. The values are meaningless and so are the model's
outputs: use it with routing replay (:mod:`moeexp.engine.routing_replay`).

Before anything is allocated the memory is checked (:func:`check_memory`): the host must
hold the experts (MemAvailable of /proc/meminfo, else psutil) and a CUDA device the rest
(``torch.cuda.mem_get_info``), each with a margin; a model that does not fit is refused
with the numbers. Reduced sizes for tests: ``overrides`` changes arch keys (fewer layers,
a smaller hidden size) and the very same code path runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moeexp.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

#: Values of the seeded block tiled into every tensor.
FILL_BLOCK = 1 << 20
#: Memory kept free beyond what the tensors need (bytes), on the host and on the device.
MARGIN_BYTES = 2 << 30


@dataclass(frozen=True)
class MemoryNeeds:
    """Bytes a random model needs where (``*_bytes``) against what is free (``*_free``);
    ``device_free`` is None for a CPU device (everything is on the host then)."""

    host_bytes: int
    device_bytes: int
    host_free: int
    device_free: int | None

    def as_dict(self) -> dict[str, float]:
        return {"host_need_gib": self.host_bytes / 2**30, "device_need_gib": self.device_bytes / 2**30,
                "host_free_gib": self.host_free / 2**30,
                "device_free_gib": float("nan") if self.device_free is None
                else self.device_free / 2**30}


def host_available_bytes(meminfo: str | Path = "/proc/meminfo") -> int:
    """Bytes of host memory available to a new allocation: ``MemAvailable`` of
    /proc/meminfo, else ``psutil.virtual_memory().available``."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError as exc:
        raise ConfigError(f"cannot read the available host memory: no MemAvailable in "
                          f"{meminfo} and psutil is not installed") from exc
    return int(psutil.virtual_memory().available)


def meta_model(arch: Mapping[str, Any], *, dtype: torch.dtype = torch.bfloat16,
               overrides: Mapping[str, Any] | None = None, where: str = "model"
               ) -> PreTrainedModel:
    """The model ``arch`` (``model_type`` + config keys, ``overrides`` applied) on the meta
    device, in eval mode: shapes only, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moeexp.models.adapters import supported_model_types

    spec = {**dict(arch), **dict(overrides or {})}
    model_type = spec.pop("model_type", None)
    if model_type not in supported_model_types():
        raise ConfigError(f"{where}: arch.model_type={model_type!r}; supported: "
                          f"{', '.join(supported_model_types())}")
    try:
        config = AutoConfig.for_model(model_type, **spec)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: arch does not build a {model_type} model: {exc}") from exc
    return model.eval()


def _expert_param_ids(model: nn.Module) -> set[int]:
    from moeexp.models.adapters import adapter_for

    ad = adapter_for(model)
    return {id(getattr(m.experts, n)) for m in ad.moe_layers() for n in ad.expert_tensor_names}


def memory_needs(model: nn.Module, device: torch.device) -> MemoryNeeds:
    """What materialising the meta ``model`` for ``device`` needs, and what is free."""
    experts = _expert_param_ids(model)
    seen: set[int] = set()
    host = dev = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel() * p.element_size()
        if id(p) in experts or device.type == "cpu":
            host += n
        else:
            dev += n
    dev_free = None
    if device.type == "cuda":
        dev_free = int(torch.cuda.mem_get_info(device)[0])
    return MemoryNeeds(host, dev, host_available_bytes(), dev_free)


def check_memory(needs: MemoryNeeds, *, margin: int = MARGIN_BYTES, what: str = "model") -> None:
    """Refuse (ConfigError, with the numbers) a model that does not fit with ``margin``."""
    gib = 2**30
    if needs.host_bytes + margin > needs.host_free:
        raise ConfigError(
            f"random {what}: needs {needs.host_bytes / gib:.1f} GiB of host memory "
            f"(+{margin / gib:.1f} GiB margin) for its offloaded experts, "
            f"{needs.host_free / gib:.1f} GiB is available (MemAvailable): use a machine with "
            "more memory or a smaller arch (fewer layers)")
    if needs.device_free is not None and needs.device_bytes + margin > needs.device_free:
        raise ConfigError(
            f"random {what}: needs {needs.device_bytes / gib:.1f} GiB of device memory "
            f"(+{margin / gib:.1f} GiB margin) for its dense weights, "
            f"{needs.device_free / gib:.1f} GiB is free on the device")


class _Filler:
    """Tiles one seeded normal block into tensors (each from its own offset)."""

    def __init__(self, std: float, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        gen_dev = device if device.type == "cuda" else torch.device("cpu")
        g = torch.Generator(device=gen_dev).manual_seed(seed)
        block = torch.randn(FILL_BLOCK, generator=g, device=gen_dev) * std
        self.block = torch.cat([block, block]).to(dtype)  # any window of FILL_BLOCK values
        self.count = 0

    def fill(self, t: torch.Tensor, name: str) -> None:
        """Fill ``t`` in place: ones for a 1-D ``weight`` (norm gains), else the block."""
        if t.dim() == 1 and name == "weight":
            t.fill_(1.0)
            return
        flat = t.view(-1)
        off = (self.count * 7919) % FILL_BLOCK
        self.count += 1
        for i in range(0, flat.numel(), FILL_BLOCK):
            n = min(FILL_BLOCK, flat.numel() - i)
            flat[i:i + n].copy_(self.block[off:off + n], non_blocking=True)


def _materialise_params(model: nn.Module, device: torch.device, pin: bool,
                        filler: _Filler) -> None:
    """Every meta parameter becomes a filled tensor where it lives (tied ones once)."""
    experts = _expert_param_ids(model)
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            new = done.get(id(p))
            if new is None:
                on_host = id(p) in experts or device.type == "cpu"
                t = (torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) if on_host
                     else torch.empty(p.shape, dtype=p.dtype, device=device))
                filler.fill(t, name)
                new = nn.Parameter(t, requires_grad=False)
                done[id(p)] = new
            module.register_parameter(name, new)


def _materialise_buffers(model: nn.Module, device: torch.device) -> None:
    """Meta buffers (RoPE tables) are recomputed: the owning module is built again on
    ``device`` from the model's config and its buffers taken."""
    for module in model.modules():
        meta = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if not meta:
            continue
        try:
            with torch.device(device):
                fresh = type(module)(config=model.config)
        except TypeError as exc:
            raise ConfigError(f"random model: cannot recompute the buffers {meta} of "
                              f"{type(module).__name__} (built from config and device): {exc}"
                              ) from exc
        new = dict(fresh.named_buffers(recurse=False))
        for n in meta:
            persistent = n not in module._non_persistent_buffers_set  # no public accessor
            module.register_buffer(n, new[n], persistent=persistent)


def random_model(arch: Mapping[str, Any], *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.bfloat16, overrides: Mapping[str, Any] | None = None,
                 seed: int = 0, std: float = 0.02, margin: int = MARGIN_BYTES,
                 where: str = "model") -> PreTrainedModel:
    """A random-weight model of ``arch`` ready for the engine (see the module docstring).

    Args:
        arch: ``model_type`` plus HF config keys (a preset's ``arch:`` block).
        device: where compute runs; CUDA: experts in pinned host memory, the rest there.
        dtype: parameter dtype. overrides: arch keys replaced (reduced sizes for tests).
        seed / std: the fill's seed and standard deviation.
        margin: bytes left free on the host and on the device.

    Raises:
        ConfigError: an arch transformers refuses, or a model that does not fit (numbers).
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    model = meta_model(arch, dtype=dtype, overrides=overrides, where=where)
    needs = memory_needs(model, dev)
    model_type = str(model.config.model_type)
    check_memory(needs, margin=margin, what=f"{model_type} model")
    filler = _Filler(std, seed, dev, dtype)
    with torch.no_grad():
        _materialise_params(model, dev, dev.type == "cuda", filler)
        _materialise_buffers(model, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    log.info("random %s: %.1f GiB of experts on the host%s, %.1f GiB on %s, in %.1f s",
             model_type, needs.host_bytes / 2**30,
             " (pinned)" if dev.type == "cuda" else "", needs.device_bytes / 2**30, dev,
             time.perf_counter() - t0)
    return model


@contextmanager
def experts_resident(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Every routed expert on ``device`` for the block (plain ``generate`` with every expert
    resident: the reference of the engine's overhead); back in host memory afterwards."""
    from moeexp.models.adapters import adapter_for

    ad = adapter_for(model)
    moved: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for m in ad.moe_layers():
                for n in ad.expert_tensor_names:
                    p = getattr(m.experts, n)
                    if p.device != device:
                        moved.append((p, p.data))
                        p.data = p.data.to(device)
        yield
    finally:
        with torch.no_grad():
            for p, host in moved:
                p.data = host
        if device.type == "cuda":
            torch.cuda.empty_cache()
