"""Quantised expert storage: the engine's host store and slots hold ``model.expert_format``.

The formats are those of :mod:`moeexp.costmodel.formats`, produced by the libraries their
anchors use:

========  ===========================================================================
format    library and call
========  ===========================================================================
int8      torchao ``choose_qparams_affine`` / ``quantize_affine`` /
          ``dequantize_affine`` with what ``Int8WeightOnlyConfig`` uses: symmetric,
          one scale per stored row (``block_size=(1, row)``), int8 values, fp32 eps;
          the scale is held in bf16 (the format's 16 bits per row)
int4      torchao's affine primitives with ``Int4WeightOnlyConfig``'s default grouping:
          asymmetric, groups of 128 along the stored row, values 0..15, bf16 scale and
          zero point per group; two values packed per byte
hqq3      HQQ ``Quantizer.quantize`` with ``BaseQuantizeConfig(nbits=3, group_size=64,
          quant_zero=True, quant_scale=True)``: half-quadratic optimised scales and
          zeros, 10 values per int32 (``3bit_32``); the zeros and scales quantised to
          8 bits as HQQ's meta settings say (zeros: one pair for the matrix; scales:
          groups of 128), their fp16 scale/zero pairs
hqq2      the same with ``nbits=2, group_size=16`` (Mixtral-Offloading's experts), 4 values
          per byte (``2bit_u8``)
========  ===========================================================================

Why these: HQQ is what Mixtral-Offloading ships its 2/3-bit experts with (its pure-PyTorch
quantiser and unpackers run on the CPU); torchao's affine primitives are what its
weight-only int8/int4 configs quantise with, pure PyTorch and CPU-capable, while its
``quantize_`` API needs ``nn.Linear`` modules (MoE experts are fused 3-D parameters) and
its int4 kernels (tinygemm) need CUDA; bitsandbytes' 4-bit formats are NF4/FP4 blocks of 64,
not the table's int4. ``mxfp4`` is refused: the engine does not hold MXFP4 experts
(transformers dequantises gpt-oss's MXFP4 checkpoint on load; the cost model prices it).

Each expert matrix ``name`` (``[J, a, b]``, b = the stored row) becomes packed tensors with
a leading J: ``name`` (the values) and ``name.<part>`` (scales, zeros); vectors (biases)
stay as they are. Dequantisation is per expert and elementwise, so dequantising some slots
gives bit for bit what :func:`fake_quantise` puts into the plain model: the engine holding
a lossy format is exact against the plain model running the *same* quantised weights.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping
from typing import Any

import torch

from moeexp.costmodel.formats import EXPERT_FORMATS, format_spec
from moeexp.errors import ConfigError

#: Formats the engine holds (``dense`` = the model's own tensors); mxfp4 is priced only.
ENGINE_FORMATS: tuple[str, ...] = ("dense", "int8", "int4", "hqq3", "hqq2")
#: HQQ's ``BaseQuantizeConfig`` arguments per format (Mixtral-Offloading's for hqq2).
_HQQ = {"hqq3": {"nbits": 3, "group_size": 64}, "hqq2": {"nbits": 2, "group_size": 16}}
_HQQ_META_GROUP = 128  # HQQ's scale_quant_params group_size


def is_matrix(t: torch.Tensor) -> bool:
    """Expert tensors [J, a, b] are quantised; [J, n] vectors (biases) are not."""
    return t.dim() == 3


def check_engine_format(fmt: str, shapes: Mapping[str, tuple[int, ...]],
                        where: str = "model") -> None:
    """Refuse, before any work, a format the engine cannot hold for experts of ``shapes``
    (per-expert shape by tensor name), naming the formats it can."""
    format_spec(fmt, where)  # an unknown name: ConfigError listing EXPERT_FORMATS
    mats: list[tuple[int, ...]] = [s for s in shapes.values() if len(s) == 2]
    ok = [f for f in ENGINE_FORMATS if not _why_not(f, mats)]
    why = _why_not(fmt, mats)
    if why:
        raise ConfigError(f"{where}: expert_format={fmt}: {why}; formats the engine can hold "
                          f"for these experts (matrices {sorted(set(mats))}): {', '.join(ok)} "
                          f"(all formats: {', '.join(EXPERT_FORMATS)})")
    if fmt != "dense":
        _library(fmt)


def _why_not(fmt: str, mats: list[tuple[int, ...]]) -> str:
    if fmt not in ENGINE_FORMATS:
        return ("the engine does not hold MXFP4 experts (transformers dequantises gpt-oss's "
                "checkpoint on load; the cost model prices mxfp4 on its own)")
    spec = format_spec(fmt)
    bad = [m for m in mats if spec.group_size and any(d % spec.group_size for d in m)]
    if spec.value_bits and bad:
        return f"its groups of {spec.group_size} weights do not divide the expert matrices {bad}"
    if fmt in _HQQ:
        g = _HQQ[fmt]["group_size"]
        bad = [m for m in mats if (m[0] * m[1] // g) % _HQQ_META_GROUP]
        if bad:
            return (f"HQQ quantises the scales of {_HQQ_META_GROUP} groups together, and the "
                    f"group count of {bad} is not a multiple of {_HQQ_META_GROUP}")
    return ""


def _library(fmt: str) -> Any:
    """The quantisation library's module for ``fmt`` (ConfigError when not installed)."""
    try:
        if fmt in _HQQ:
            with contextlib.redirect_stdout(io.StringIO()):  # hqq prints on import/config
                from hqq.core import quantize as hqq_quantize
            return hqq_quantize
        from torchao.quantization import quant_primitives
        return quant_primitives
    except ImportError as e:
        raise ConfigError(f"expert_format={fmt} needs {'hqq' if fmt in _HQQ else 'torchao'} "
                          f"({e}); install moeexp's dependencies (make install)") from None


# ------------------------------------------------------------------------ quantise
def quantise(t: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """Packed parts of expert matrices ``t`` [J, a, b] in ``fmt``: suffix ('' = the
    values, '.scale', ...) -> tensor with leading J."""
    if fmt in _HQQ:
        per = [_hqq_quantise(t[j], fmt) for j in range(t.shape[0])]
        return {k: torch.stack([p[k] for p in per]) for k in per[0]}
    return _affine_quantise(t, fmt)


def _affine_params(fmt: str, row: int) -> dict[str, Any]:
    qp = _library(fmt)
    if fmt == "int8":
        return {"mapping": qp.MappingType.SYMMETRIC, "block": (1, row), "dtype": torch.int8,
                "qmin": -128, "qmax": 127}
    return {"mapping": qp.MappingType.ASYMMETRIC, "block": (1, format_spec(fmt).group_size),
            "dtype": torch.uint8, "qmin": 0, "qmax": 15}


def _affine_quantise(t: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    qp = _library(fmt)
    J, a, b = t.shape
    p = _affine_params(fmt, b)
    w = t.detach().reshape(J * a, b).float()
    scale, zero = qp.choose_qparams_affine(
        w, p["mapping"], p["block"], p["dtype"], p["qmin"], p["qmax"],
        eps=torch.finfo(torch.float32).eps, scale_dtype=torch.bfloat16,
        zero_point_dtype=torch.bfloat16)
    q = qp.quantize_affine(w, p["block"], scale, zero, p["dtype"], p["qmin"], p["qmax"])
    out = {"": q.reshape(J, a, b), ".scale": scale.reshape(J, a, -1)}
    if fmt == "int4":
        q = q.reshape(J, a, b)
        out[""] = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()  # 2 values per byte
        out[".zero"] = zero.reshape(J, a, -1)
    return out


def _hqq_quantise(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    hq = _library(fmt)
    with contextlib.redirect_stdout(io.StringIO()):  # hqq warns (print) about meta settings
        cfg = hq.BaseQuantizeConfig(**_HQQ[fmt], quant_zero=True, quant_scale=True)
    w_q, meta = hq.Quantizer.quantize(w.detach().float(), device="cpu",
                                      compute_dtype=torch.float16, **cfg["weight_quant_params"])
    z_q, mz = hq.Quantizer.quantize(meta["zero"], device="cpu", view_as_float=False,
                                    **cfg["zero_quant_params"])
    s_q, ms = hq.Quantizer.quantize(meta["scale"], device="cpu", view_as_float=False,
                                    **cfg["scale_quant_params"])
    half = torch.float16  # HQQLinear holds its meta in the compute dtype (fp16)
    return {"": w_q, ".zero_q": z_q, ".zero_s": mz["scale"].to(half).reshape(1),
            ".zero_z": mz["zero"].to(half).reshape(1), ".scale_q": s_q,
            ".scale_s": ms["scale"].to(half), ".scale_z": ms["zero"].to(half)}


# ---------------------------------------------------------------------- dequantise
def dequantise(parts: Mapping[str, torch.Tensor], fmt: str, shape: tuple[int, int],
               dtype: torch.dtype) -> torch.Tensor:
    """Expert matrices [U, a, b] (``shape`` = (a, b)) in ``dtype`` from packed ``parts``
    (suffix -> tensor with leading U, as :func:`quantise` returns them)."""
    if fmt in _HQQ:
        return _hqq_dequantise(parts, fmt, shape).to(dtype)
    qp = _library(fmt)
    p = _affine_params(fmt, shape[1])
    q = parts[""]
    U = q.shape[0]
    if fmt == "int4":
        q = torch.stack((q & 0xF, q >> 4), dim=-1).reshape(U, *shape)
    zero = parts[".zero"].reshape(U * shape[0], -1) if ".zero" in parts else None
    w = qp.dequantize_affine(q.reshape(U * shape[0], shape[1]), p["block"],
                             parts[".scale"].reshape(U * shape[0], -1), zero, p["dtype"],
                             p["qmin"], p["qmax"], output_dtype=torch.float32)
    return w.reshape(U, *shape).to(dtype)


def _unpack(fmt: str, w_q: torch.Tensor, packing: str) -> torch.Tensor:
    """HQQ's unpacker ``packing`` applied to each of the U packed matrices ``w_q`` [U, r, c]
    at once (it works along rows, columns independent: the U matrices go side by side),
    in fp16: [U, rows * values per word, c]."""
    U, r, c = w_q.shape
    flat = _library(fmt).Quantizer.unpack[packing](w_q.permute(1, 0, 2).reshape(r, U * c),
                                                   dtype=torch.float16)
    return flat.reshape(-1, U, c).permute(1, 0, 2)


def _hqq_dequantise(parts: Mapping[str, torch.Tensor], fmt: str,
                    shape: tuple[int, int]) -> torch.Tensor:
    """HQQ's ``Quantizer.dequantize`` (``(unpack(W_q) - zero) * scale`` in fp16, after the
    8-bit zeros and scales are dequantised the same way) for U experts at once: bit for bit
    the library's per-matrix result (tests/unit/engine/test_quant.py)."""
    U = parts[""].shape[0]
    nbits, g = _HQQ[fmt]["nbits"], _HQQ[fmt]["group_size"]
    groups = shape[0] * shape[1] // g
    half = torch.float16
    zero = (parts[".zero_q"].to(half) - parts[".zero_z"].view(U, 1, 1)) \
        * parts[".zero_s"].view(U, 1, 1)
    scale = (parts[".scale_q"].to(half) - parts[".scale_z"]) * parts[".scale_s"]
    packing = _library(fmt).Quantizer.bit_to_packing[nbits]
    w = _unpack(fmt, parts[""], packing)[:, :groups]
    return ((w - zero.reshape(U, groups, 1)) * scale.reshape(U, groups, 1)).reshape(U, *shape)


# ---------------------------------------------------------------------- model level
def fake_quantise(experts: list[torch.nn.Module], names: tuple[str, ...], fmt: str) -> None:
    """Replace the fused expert matrices of ``experts`` by their quantised-then-dequantised
    values in place (the plain model running the weights the engine holds in ``fmt``)."""
    with torch.no_grad():
        for module in experts:
            for n in names:
                p = getattr(module, n)
                if is_matrix(p):
                    parts = quantise(p.data, fmt)
                    p.data.copy_(dequantise(parts, fmt, tuple(p.shape[1:]), p.dtype))


def dense_slots(spec: Any, buffers: Mapping[str, torch.Tensor],
                slots: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The dense weights of the slots a computation uses: (name -> float[U, ...] for the
    U distinct slots in ``slots``, ``slots`` remapped to 0..U-1). ``spec``: the pool's
    :class:`moeexp.engine.store.ExpertSpec` (its ``fmt`` and ``dense_shapes``)."""
    used, remap = torch.unique(slots, return_inverse=True)
    out: dict[str, torch.Tensor] = {}
    for n, shape in spec.dense_shapes.items():
        parts = {k[len(n):]: b[used] for k, b in buffers.items()
                 if k == n or k.startswith(n + ".")}
        out[n] = dequantise(parts, spec.fmt, shape, spec.dtype)
    for n, b in buffers.items():
        if n not in out and not any(n.startswith(m + ".") for m in spec.dense_shapes):
            out[n] = b[used]  # vectors (biases): held as they are
    return out, remap
