"""Expert storage formats: bits per weight, scale overhead, GPU dequantisation, lossiness.

``model.expert_format`` says how the offloaded experts are held (in host memory, on the
link and in the GPU cache). Each format's bytes follow its bits plus the overhead of its
scales and zero points, from the library the format's anchor uses:

========  =====================================================  ===================  =====
format    layout (source)                                        bits per weight      lossy
========  =====================================================  ===================  =====
dense     the model's dtype (bf16/fp16: 16, float32: 32)         dtype bits           no
int8      one bf16 scale per stored row (per-channel weight-     8 + 16 / row         yes
          only int8: torchao ``Int8WeightOnlyConfig``,
          bitsandbytes LLM.int8 ``Int8Params``)
int4      groups of 128, bf16 scale + bf16 zero point per        4 + 32 / 128 = 4.25  yes
          group (torchao ``Int4WeightOnlyConfig`` default
          ``group_size=128``)
mxfp4     OCP MX: blocks of 32 E2M1 values share one 8-bit E8M0  4 + 8 / 32 = 4.25    yes*
          scale (gpt-oss's hub checkpoint)
hqq3      HQQ 3-bit, ``group_size=64`` (HQQ's                    3.2 + 16 / 64 +      yes
          ``BaseQuantizeConfig`` default), 10 values packed per  64 / (128 * 64)
          int32 (HQQ ``3bit_32``: 3.2 bits stored); scale and    = 3.458
          zero quantised to 8 bits (``quant_scale``/
          ``quant_zero``), their own fp16 scale + zero per 128
          groups (HQQ's meta ``group_size=128``)
hqq2      HQQ 2-bit as Mixtral-Offloading ships its experts:     2 + 16 / 16 +        yes
          ``BaseQuantizeConfig(nbits=2, group_size=16,           64 / (128 * 16)
          quant_zero=True, quant_scale=True)`` (its demo         = 3.031
          notebook; the 4-bit ``group_size=64`` config there is
          the attention's), 4 values per byte
========  =====================================================  ===================  =====

``*`` MXFP4 is lossless for gpt-oss, whose released checkpoint stores its experts that way
(:func:`is_lossy` with ``model_type="gpt_oss"``); for any other model it is a quantisation.
Vectors (biases) stay in the model's dtype in every format. A format's group must divide
both trailing dimensions of every expert matrix (the reduction axis is one of them,
depending on the architecture's layout): e.g. gpt-oss-20b's 2880-wide matrices take
``group_size`` 16, 32 and 64 but not 128, so ``int4`` is refused for it
(:func:`check_format_fits`).

**GPU dequantisation** (:attr:`FormatSpec.gpu_dequant_bytes_per_weight`): fused
weight-only kernels (torchao's int8 and tinygemm int4, gpt-oss's MXFP4 Triton kernels)
read the packed bytes, already priced by the roofline's ``expert_bytes``, and add nothing;
HQQ's PyTorch backend (what Mixtral-Offloading runs) dequantises a whole matrix to bf16
before the matmul, writing and re-reading 2 + 2 bytes per weight in device memory. These
are estimates, to be calibrated against the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from moeexp.errors import ConfigError


@dataclass(frozen=True)
class FormatSpec:
    """One expert storage format.

    Attributes:
        name: the ``model.expert_format`` value.
        value_bits: stored bits per weight value (0 = the model's dtype: ``dense``).
        group_size: weights sharing one scale (and zero point); 0 = one per stored row
            (per-channel); ignored for ``dense``.
        group_overhead_bits: bits of scale + zero point per group.
        meta_group: groups whose (quantised) scales and zeros share one fp16 scale + zero
            pair each (HQQ's ``quant_scale``/``quant_zero``); 0 = scales not quantised.
        lossy: the format changes the weights of a model stored in bf16 (see
            :func:`is_lossy` for models that ship the format).
        gpu_dequant_bytes_per_weight: extra device-memory bytes per weight the GPU kernel
            moves to dequantise (0: fused kernel).
        source: where the layout comes from.
    """

    name: str
    value_bits: float
    group_size: int
    group_overhead_bits: float
    meta_group: int
    lossy: bool
    gpu_dequant_bytes_per_weight: float
    source: str

    def bits_per_weight(self, dense_bits: float, row: int = 0) -> float:
        """Bits one matrix weight occupies, scales included (``row``: the stored row length,
        used by per-channel formats; ``dense_bits``: the model dtype's bits)."""
        if self.value_bits == 0:
            return float(dense_bits)
        group = self.group_size or row
        if group <= 0:
            raise ConfigError(f"expert_format={self.name}: per-channel scales need the row length")
        meta = (2 * 32) / (self.meta_group * group) if self.meta_group else 0.0
        return self.value_bits + self.group_overhead_bits / group + meta


#: The formats, by ``model.expert_format`` name.
FORMATS: dict[str, FormatSpec] = {f.name: f for f in (
    FormatSpec("dense", 0, 0, 0.0, 0, False, 0.0, "the model's dtype"),
    FormatSpec("int8", 8, 0, 16.0, 0, True, 0.0,
               "per-channel int8 weight-only, one bf16 scale per row (torchao "
               "Int8WeightOnlyConfig, bitsandbytes LLM.int8)"),
    FormatSpec("int4", 4, 128, 32.0, 0, True, 0.0,
               "int4 weight-only, group 128, bf16 scale + zero (torchao Int4WeightOnlyConfig "
               "default group_size=128)"),
    FormatSpec("mxfp4", 4, 32, 8.0, 0, True, 0.0,
               "OCP MXFP4: 32 E2M1 values share one E8M0 scale (gpt-oss checkpoints)"),
    FormatSpec("hqq3", 3.2, 64, 16.0, 128, True, 4.0,
               "HQQ 3-bit, group 64 (BaseQuantizeConfig default), 10 values per int32, 8-bit "
               "scale + zero quantised per 128 groups; PyTorch backend dequantises to bf16"),
    FormatSpec("hqq2", 2, 16, 16.0, 128, True, 4.0,
               "HQQ 2-bit as Mixtral-Offloading's experts: BaseQuantizeConfig(nbits=2, "
               "group_size=16, quant_zero=True, quant_scale=True); dequantised to bf16"),
)}

#: Valid ``model.expert_format`` values, in the order of the table above.
EXPERT_FORMATS: tuple[str, ...] = tuple(FORMATS)

#: Formats a model's released checkpoint stores its experts in (``model_type`` -> format):
#: holding the experts that way loses nothing.
NATIVE_FORMATS: Mapping[str, str] = {"gpt_oss": "mxfp4"}


def format_spec(name: str, where: str = "model") -> FormatSpec:
    """The :class:`FormatSpec` of ``name``; an unknown one raises ConfigError naming the valid."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"{where}: expert_format={name!r}; valid: "
                          f"{', '.join(EXPERT_FORMATS)}") from None


def is_lossy(name: str, model_type: str | None = None) -> bool:
    """True when holding a model's experts in format ``name`` changes its weights (``dense``
    never does; a model's native format, e.g. gpt-oss's MXFP4, neither)."""
    spec = format_spec(name)
    if model_type is not None and NATIVE_FORMATS.get(model_type) == name:
        return False
    return spec.lossy


def matrix_bytes(name: str, shape: tuple[int, ...], dense_bits: float) -> float:
    """Bytes of one expert's matrix of ``shape`` (its trailing dims; the last is the stored
    row) held in format ``name``."""
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel * format_spec(name).bits_per_weight(dense_bits, row=int(shape[-1])) / 8


def check_format_fits(name: str, shapes: Iterable[tuple[int, ...]], where: str = "model") -> None:
    """Raise ConfigError when format ``name``'s group does not divide both trailing dims of
    every expert matrix ``shapes`` (the model cannot take the format), naming what it can."""
    spec = format_spec(name, where)
    mats = [tuple(int(d) for d in s[-2:]) for s in shapes if len(s) >= 2]
    bad = _misfits(spec, mats)
    if bad:
        ok = [f for f, s in FORMATS.items() if not _misfits(s, mats)]
        raise ConfigError(f"{where}: expert_format={name} needs groups of {spec.group_size} "
                          f"weights, which do not divide the expert matrices {bad}; formats "
                          f"this model can take: {', '.join(ok)}")


def _misfits(spec: FormatSpec, mats: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    if spec.value_bits == 0 or spec.group_size == 0:
        return []
    return [m for m in mats if any(d % spec.group_size for d in m)]
