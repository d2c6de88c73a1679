"""Expert-cache capacity: a config value (fraction, bytes, or a size string) -> expert slots.

The mechanism (simulator, engine), not the policy, converts ``cache.capacity`` into slots::

    0.25          a float in (0, 1]: that fraction of all routed-expert bytes (L * J experts)
    1073741824    an int: bytes
    "2GB"         a string: decimal units B, KB, MB, GB, TB (powers of 1000) or binary units
    "512MiB"      KiB, MiB, GiB, TiB (powers of 1024), case-insensitive, spaces allowed
    "0.5" / "25%" a string holding a fraction or a percentage
    "1073741824"  a string holding an integer: bytes

Slots = floor(bytes / expert_bytes), capped at L * J (more than every expert buys nothing).
Fewer slots than ``top_k`` is an error: one token could not have its K experts resident.
"""

from __future__ import annotations

import math
import re

from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims

VALID_FORMS = (
    "a float in (0, 1] (fraction of all expert bytes, e.g. 0.25), an int number of bytes "
    "(e.g. 2147483648), or a string: '2GB', '512MiB', '1.5 GiB', '0.5', '25%' "
    "(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
)

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z%]*)\s*$")


def _fraction_slots(frac: float, total: int, spec: object) -> int:
    if not (0.0 < frac <= 1.0) or math.isnan(frac):
        raise ConfigError(
            f"cache capacity {spec!r}: a fraction must lie in (0, 1]. Valid forms: {VALID_FORMS}"
        )
    # A tiny epsilon keeps 0.3 * 10 == 3 slots despite binary rounding.
    return int(math.floor(frac * total + 1e-9))


def capacity_bytes_to_slots(nbytes: int, dims: TraceDims) -> int:
    """floor(bytes / expert_bytes)."""
    return int(nbytes // dims.expert_bytes)


def _parse_string(spec: str, dims: TraceDims, total: int) -> int:
    m = _SIZE_RE.match(spec)
    if not m:
        raise ConfigError(f"cache capacity {spec!r} is not understood. Valid forms: {VALID_FORMS}")
    number, unit = m.group(1), m.group(2).lower()
    value = float(number)
    if unit == "%":
        return _fraction_slots(value / 100.0, total, spec)
    if unit == "":
        if re.fullmatch(r"[0-9]+", number):
            return capacity_bytes_to_slots(int(number), dims)
        return _fraction_slots(value, total, spec)
    if unit not in _UNITS:
        raise ConfigError(
            f"cache capacity {spec!r}: unknown unit {m.group(2)!r}. Valid units: "
            f"{', '.join(['B', 'KB', 'MB', 'GB', 'TB', 'KiB', 'MiB', 'GiB', 'TiB', '%'])}. "
            f"Valid forms: {VALID_FORMS}"
        )
    return capacity_bytes_to_slots(int(value * _UNITS[unit]), dims)


def capacity_slots(spec: float | int | str, dims: TraceDims) -> int:
    """Expert slots for the capacity ``spec`` (see the module docstring for the forms).

    Raises:
        ConfigError: unparsable spec, fraction outside (0, 1], a non-positive size, or
            fewer slots than ``dims.top_k`` (the message gives the slot size and the
            smallest valid capacity).
    """
    total = dims.num_layers * dims.num_experts
    if dims.expert_bytes <= 0:
        raise ConfigError(f"cannot size the expert cache: expert_bytes={dims.expert_bytes}")
    if isinstance(spec, bool):
        raise ConfigError(f"cache capacity {spec!r} is a boolean. Valid forms: {VALID_FORMS}")
    if isinstance(spec, int):
        if spec <= 0:
            raise ConfigError(f"cache capacity {spec} bytes must be positive. Valid forms: {VALID_FORMS}")
        slots = capacity_bytes_to_slots(spec, dims)
    elif isinstance(spec, float):
        if spec > 1.0 and spec.is_integer():
            slots = capacity_bytes_to_slots(int(spec), dims)  # YAML's 2e9 parses as a float
        else:
            slots = _fraction_slots(spec, total, spec)
    elif isinstance(spec, str):
        slots = _parse_string(spec, dims, total)
    else:
        raise ConfigError(
            f"cache capacity {spec!r} has type {type(spec).__name__}. Valid forms: {VALID_FORMS}"
        )
    slots = min(slots, total)
    if slots < dims.top_k:
        hint = " (an int is bytes: did you mean 1.0, every expert?)" if spec == 1 else ""
        raise ConfigError(
            f"cache capacity {spec!r}{hint} holds {slots} expert slot(s) of {dims.expert_bytes} "
            f"bytes, fewer than top_k={dims.top_k} experts per layer; the smallest valid "
            f"capacity is {dims.top_k * dims.expert_bytes} bytes or a fraction >= "
            f"{dims.top_k / total:.4g}. Valid forms: {VALID_FORMS}"
        )
    return slots
