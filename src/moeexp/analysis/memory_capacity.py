"""The memory eMoE frees: at a fixed device memory, the longest prompt and the largest batch
each system can serve (eMoE's table; algorithms.md §6, "Memory freed").

``python -m moeexp.analysis.memory_capacity --device-gb 80 [--models ...] [--systems ...]
[--prompt-len 512] [--output-len 0] [--activations prefill|none] [--reserve-gb 0] [--out DIR]``
writes ``memory_capacity.md`` and ``memory_capacity.csv`` (atomically) and prints the table.

The model, for one system on one model (all sizes in bytes; GB = 10^9 bytes)::

    memory(B, P, O) = reserve + dense + resident * expert
                      + B * kv(P + O) + [activations] B * (P * act + vocab * 4)

- ``resident`` experts: ``no_offload`` every routed expert (L * J); an offloading system the
  slots of its ``cache.capacity`` (:func:`moeexp.cache.capacity.capacity_slots`, the rule the
  simulator and the engine use); ``emoe`` its predictor's ``experts_per_layer`` * L (the set
  it keeps loaded; nothing is loaded on demand). Read from ``conf/system`` through
  :func:`moeexp.systems.resolve_system`, with optional overrides.
- ``expert``, ``dense``: bytes of one routed expert and of every other weight (attention,
  embeddings, norms, routers, shared experts), from the model's real tensor shapes: the
  preset's ``arch:`` block built on the meta device (:func:`moeexp.models.arch.arch_dims`; the
  tiny model: its shipped ``config.json``). Dtype and ``expert_format`` as in the preset.
- ``kv(T)`` = (one token's K and V in one layer) * (full-attention layers * T +
  sliding-window layers * min(T, window)). The per-token, per-layer bytes are
  :func:`moeexp.costmodel.roofline.kv_bytes_per_token` (the serving simulator's rule: 2 * kv
  heads * head dim * dtype bytes, or MLA's latent) over the layer count; the window split
  is added here from the config's ``layer_types`` / ``sliding_window`` (gpt-oss-20b: 12 of
  its 24 layers keep a 128-token window; the simulator's rule keeps every position).
- ``act`` (``activations="prefill"``, the default): the live tensors of one layer while the
  whole prompt is prefilled at once, per token: dtype bytes * (4 H [residual, normed input,
  attention output, its projection] + 2 * kv heads * head dim [K, V: kv_layer / dtype] +
  3 * K * I [each
  routed copy's gate, up and their product]) + 4 * J (float32 router logits); plus the last
  position's float32 logits per sequence. Attention is assumed fused (SDPA/flash: no
  T x T score matrix); a chunked prefill (vLLM) would bound this term, ``activations="none"``
  drops it. An estimate, not a measurement.
- ``reserve``: what the framework holds besides (CUDA context, allocator slack), default 0.

The longest prompt is the largest P with memory(1, P, O) <= device; the largest batch the
largest B with memory(B, P, O) <= device (both 0 when the weights alone do not fit). Neither
is capped at the model's context length: they are memory bounds. An offloading system's
bound says what fits beside its cache, not how fast it serves (every miss crosses the bus).

Check against eMoE's Mixtral row (96 -> 59 GB at 512 tokens with 60 % of the experts
loaded; 40x longer prompts; batch 4 -> 18, 4.5x). Here (bf16, 512 prompt tokens, prefill
activations, no reserve; ``tests/unit/analysis/test_memory_capacity.py``):

- Footprint: no_offload 93.58 GB (weights 93.41: experts 90.19 + the rest 3.21), eMoE with
  ``experts_per_layer=0.6`` (round(0.6 * 8) = 5 of 8 per layer, 62.5 %) 59.76 GB. The
  paper's 96 and 59 GB are both matched by exactly 60 % of the experts (57.50 GB) plus a
  constant ~2.5 GB the framework holds (``--reserve-gb``): the saving (~36 GB, 38 %) is
  the same shape; the absolute 96 includes overheads this model does not count.
- Ratios: in this model memory is affine in tokens and in sequences, so both ratios equal
  (device - eMoE's fixed bytes) / (device - no_offload's fixed bytes): they depend only on
  the headroom the device leaves above the full model. At 94.5 GB (just above no_offload's
  need) eMoE serves a 32x longer prompt and a 33x larger batch; at 104 GB both are 4.2x.
  The paper's pair (40x prompts, 4.5x batches) cannot come from one device memory under an
  affine model: 40x needs ~94.4 GB, 4.5x ~103 GB. Its batch experiment implies ~2.6 GB per
  sequence ((96 - 59) GB / (18 - 4)), far more than 512 tokens of Mixtral KV (67 MB) and
  activations (107 MB): longer sequences or per-request framework memory (padding, eager
  attention, full-sequence logits) the paper does not give. Read the ratios here as what
  the freed bytes buy under lean serving, not as a reproduction of the paper's numbers.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from moeexp.atomic import write_text
from moeexp.errors import ConfigError

log = logging.getLogger(__name__)

Activations = Literal["prefill", "none"]
ACTIVATIONS: tuple[str, ...] = ("prefill", "none")
GB = 10**9
#: Models tabulated by default (``conf/model`` presets; ``tiny`` reads its shipped config).
DEFAULT_MODELS: tuple[str, ...] = ("mixtral_8x7b", "gpt_oss_20b", "phi3_5_moe",
                                   "qwen1_5_moe_a2_7b", "tiny")
#: Systems tabulated by default.
DEFAULT_SYSTEMS: tuple[str, ...] = ("no_offload", "deepspeed", "moe_infinity", "finemoe", "emoe")
_SEARCH_MAX = 1 << 40  # upper bound of the binary searches (tokens or sequences)


@dataclass(frozen=True)
class ModelMemory:
    """The byte counts of one model that the memory model needs.

    Attributes:
        name: the model preset.
        num_layers: L, MoE layers; num_experts: J routed experts per layer; top_k: K.
        expert_bytes: one routed expert; dense_bytes: every other weight.
        hidden_size: H; moe_intermediate: I of one routed expert; vocab_size: V.
        kv_layer_bytes: K and V of one token in one attention layer (bytes).
        dtype_bytes: of the activations and the KV cache.
        full_layers, window_layers: attention layers with full / sliding-window context.
        window: the sliding window in tokens (0 when no layer slides).
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    dense_bytes: int
    hidden_size: int
    moe_intermediate: int
    vocab_size: int
    kv_layer_bytes: int
    dtype_bytes: int
    full_layers: int
    window_layers: int = 0
    window: int = 0

    def kv_bytes(self, tokens: int) -> int:
        """KV-cache bytes of one sequence of ``tokens`` positions."""
        return self.kv_layer_bytes * (
            self.full_layers * tokens + self.window_layers * min(tokens, self.window))

    @property
    def act_bytes_per_token(self) -> int:
        """Prefill activation bytes per prompt token (module docstring)."""
        width = 4 * self.hidden_size + 3 * self.top_k * self.moe_intermediate
        return self.dtype_bytes * width + self.kv_layer_bytes + 4 * self.num_experts

    @property
    def all_experts(self) -> int:
        """L * J routed experts."""
        return self.num_layers * self.num_experts


@dataclass(frozen=True)
class Residency:
    """How many experts a system keeps on the device, and why."""

    system: str
    resident_experts: int
    source: str  # e.g. "all experts", "cache.capacity=0.25", "experts_per_layer=5"


def footprint_bytes(m: ModelMemory, resident: int, *, batch: int, prompt_len: int,
                    output_len: int = 0, activations: Activations = "prefill",
                    reserve_bytes: int = 0) -> int:
    """Device bytes to serve ``batch`` sequences of ``prompt_len`` + ``output_len`` tokens
    with ``resident`` experts on the device (module docstring's formula)."""
    fixed = reserve_bytes + m.dense_bytes + resident * m.expert_bytes
    per_seq = m.kv_bytes(prompt_len + output_len)
    if activations == "prefill":
        per_seq += prompt_len * m.act_bytes_per_token + 4 * m.vocab_size
    return fixed + batch * per_seq


def _largest(fits: Any, lo: int = 0) -> int:
    """Largest n in [lo, _SEARCH_MAX] with fits(n) (fits monotone, fits(lo) true)."""
    hi = _SEARCH_MAX
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_prompt_tokens(m: ModelMemory, resident: int, device_bytes: int, *,
                      output_len: int = 0, activations: Activations = "prefill",
                      reserve_bytes: int = 0) -> int:
    """Longest prompt (tokens) one sequence can have within ``device_bytes`` (0: none fits)."""
    def fits(p: int) -> bool:
        return footprint_bytes(m, resident, batch=1, prompt_len=p, output_len=output_len,
                               activations=activations, reserve_bytes=reserve_bytes) <= device_bytes

    return _largest(fits) if fits(1) else 0


def max_batch(m: ModelMemory, resident: int, device_bytes: int, *, prompt_len: int,
              output_len: int = 0, activations: Activations = "prefill",
              reserve_bytes: int = 0) -> int:
    """Most sequences of ``prompt_len`` + ``output_len`` tokens within ``device_bytes``."""
    def fits(b: int) -> bool:
        return footprint_bytes(m, resident, batch=b, prompt_len=prompt_len,
                               output_len=output_len, activations=activations,
                               reserve_bytes=reserve_bytes) <= device_bytes

    return _largest(fits) if fits(1) else 0


# ---------------------------------------------------------------------------- model dims
def _arch_of(name: str) -> tuple[dict[str, Any], str, str]:
    """(arch mapping, dtype, expert_format) of model preset ``name`` (tiny: its config.json)."""
    from moeexp.paths import group_options, load_group_yaml

    if name not in group_options("model"):
        raise ConfigError(f"unknown model {name!r}; valid: {', '.join(group_options('model'))}")
    preset = load_group_yaml("model", name)
    arch = preset.get("arch")
    if not arch and name == "tiny":
        from moeexp.assets import __file__ as assets_init

        cfg = json.loads((Path(assets_init).parent / "tiny" / "config.json").read_text())
        arch = {k: v for k, v in cfg.items()
                if k not in ("architectures", "dtype", "transformers_version")}
    if not arch:
        raise ConfigError(f"model={name} has no arch: block, so its dims are unknown without "
                          "its checkpoint; valid: a preset with arch: or tiny")
    return dict(arch), str(preset.get("dtype") or "bfloat16"), \
        str(preset.get("expert_format") or "dense")


def model_memory(name: str) -> ModelMemory:
    """The :class:`ModelMemory` of model preset ``name``, from its real dims (meta device)."""
    # torch and transformers, on the meta device only: the rest of this module is torch-free
    from transformers import AutoConfig

    from moeexp.costmodel.roofline import kv_bytes_per_token
    from moeexp.models.arch import arch_dims

    arch, dtype, fmt = _arch_of(name)
    dims = arch_dims(arch, dtype=dtype, expert_format=fmt, where=f"model={name}")
    spec = dict(arch)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    n_layers = int(config.num_hidden_layers)
    window = int(getattr(config, "sliding_window", None) or 0)
    types = list(getattr(config, "layer_types", None) or [])
    if types:
        sliding = sum(t == "sliding_attention" for t in types) if window else 0
    else:
        sliding = n_layers if window and getattr(config, "use_sliding_window", True) else 0
    dtype_bytes = {"float32": 4, "float64": 8}.get(dtype, 2)
    return ModelMemory(
        name=name, num_layers=dims.num_layers, num_experts=dims.num_experts,
        top_k=dims.top_k, expert_bytes=dims.expert_bytes, dense_bytes=dims.dense_bytes,
        hidden_size=dims.hidden_size, moe_intermediate=dims.intermediate_size,
        vocab_size=int(config.vocab_size),
        kv_layer_bytes=kv_bytes_per_token(arch, dtype_bytes) // n_layers,
        dtype_bytes=dtype_bytes, full_layers=n_layers - sliding,
        window_layers=sliding, window=window if sliding else 0)


def _dims(m: ModelMemory) -> Any:
    from moeexp.traces.schema import TraceDims

    return TraceDims(num_layers=m.num_layers, num_experts=m.num_experts, top_k=m.top_k,
                     hidden_size=m.hidden_size, spec_depth=0, expert_bytes=m.expert_bytes,
                     dense_bytes=m.dense_bytes, intermediate_size=m.moe_intermediate)


def residency(system: str, m: ModelMemory, *, capacity: float | int | str | None = None,
              experts_per_layer: float | int | None = None) -> Residency:
    """Experts ``system`` keeps resident on model ``m`` (module docstring), from
    ``conf/system/<system>.yaml``; ``capacity`` overrides ``cache.capacity`` and
    ``experts_per_layer`` eMoE's predictor setting.

    Raises:
        ConfigError: an unknown system (the valid ones listed) or an invalid override.
    """
    from moeexp.cache.capacity import capacity_slots
    from moeexp.systems import resolve_system, system_names

    if system not in system_names():
        raise ConfigError(f"unknown system {system!r}; valid: {', '.join(system_names())}")
    pred, cache, _ = resolve_system(system, cache=None if capacity is None else {"capacity": capacity})
    if pred["name"] == "emoe":
        from moeexp.predictors import build_predictor

        if experts_per_layer is not None:
            pred = {**pred, "experts_per_layer": experts_per_layer}
        epl = int(build_predictor(pred, _dims(m)).experts_per_layer)  # type: ignore[attr-defined]
        return Residency(system, epl * m.num_layers, f"experts_per_layer={epl}")
    slots = capacity_slots(cache["capacity"], _dims(m))
    source = "all experts" if slots == m.all_experts else f"cache.capacity={cache['capacity']}"
    return Residency(system, slots, source)


# ---------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Setting:
    """What the table is computed for: the device and the request shape.

    Attributes:
        device_gb: device memory, GB (10^9 bytes; an "80 GB" A100 holds 85.9 GB = 80 GiB).
        prompt_len: prompt tokens of each sequence of the batch column (and of the
            footprint column); output_len: tokens generated (their KV counted).
        activations: ``prefill`` or ``none`` (module docstring).
        reserve_gb: memory held besides weights, KV and activations, GB.
    """

    device_gb: float
    prompt_len: int = 512
    output_len: int = 0
    activations: Activations = "prefill"
    reserve_gb: float = 0.0

    def check(self) -> None:
        """ConfigError naming each bad value and its valid range."""
        bad = [msg for ok, msg in [
            (self.device_gb > 0, f"device_gb={self.device_gb} must be > 0"),
            (self.prompt_len >= 1, f"prompt_len={self.prompt_len} must be >= 1"),
            (self.output_len >= 0, f"output_len={self.output_len} must be >= 0"),
            (self.activations in ACTIVATIONS,
             f"activations={self.activations!r}; valid: {', '.join(ACTIVATIONS)}"),
            (self.reserve_gb >= 0, f"reserve_gb={self.reserve_gb} must be >= 0"),
        ] if not ok]
        if bad:
            raise ConfigError("memory capacity: " + "; ".join(bad))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`footprint_bytes` besides batch and prompt_len."""
        return {"output_len": self.output_len, "activations": self.activations,
                "reserve_bytes": int(round(self.reserve_gb * GB))}


def capacity_row(m: ModelMemory, r: Residency, s: Setting) -> dict[str, Any]:
    """One table row: the system's residency, its footprint at (1, prompt_len, output_len),
    its longest prompt and largest batch on ``s.device_gb``."""
    device = int(round(s.device_gb * GB))
    kw = s.kwargs
    foot = footprint_bytes(m, r.resident_experts, batch=1, prompt_len=s.prompt_len, **kw)
    return {
        "model": m.name, "system": r.system, "resident_experts": r.resident_experts,
        "resident_share": round(r.resident_experts / m.all_experts, 4),
        "residency": r.source,
        "weights_gb": round((m.dense_bytes + r.resident_experts * m.expert_bytes) / GB, 3),
        "footprint_gb": round(foot / GB, 3),
        "max_prompt_tokens": max_prompt_tokens(m, r.resident_experts, device, **kw),
        "max_batch": max_batch(m, r.resident_experts, device, prompt_len=s.prompt_len, **kw),
    }


def _ratio(a: int, b: int) -> float:
    return float("inf") if b == 0 and a > 0 else (float("nan") if b == 0 else round(a / b, 2))


def capacity_table(models: Sequence[str], systems: Sequence[str], s: Setting, *,
                   capacity: float | int | str | None = None,
                   experts_per_layer: float | int | None = None) -> list[dict[str, Any]]:
    """Rows for every (model, system), with ``prompt_x`` / ``batch_x``: the longest prompt
    and the largest batch over those of ``no_offload`` on the same model (inf when
    no_offload does not fit at all, nan when neither does)."""
    s.check()
    rows: list[dict[str, Any]] = []
    for name in models:
        m = model_memory(name)
        base = capacity_row(m, residency("no_offload", m), s)
        for system in systems:
            r = residency(system, m, capacity=capacity, experts_per_layer=experts_per_layer)
            row = capacity_row(m, r, s)
            row["prompt_x"] = _ratio(row["max_prompt_tokens"], base["max_prompt_tokens"])
            row["batch_x"] = _ratio(row["max_batch"], base["max_batch"])
            rows.append(row)
    return rows


COLUMNS: tuple[str, ...] = ("model", "system", "resident_experts", "resident_share", "residency",
                            "weights_gb", "footprint_gb", "max_prompt_tokens", "prompt_x",
                            "max_batch", "batch_x")


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as CSV text with a header of :data:`COLUMNS`."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS), lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: row[k] for k in COLUMNS})
    return buf.getvalue()


def to_markdown(rows: Sequence[Mapping[str, Any]], s: Setting) -> str:
    """The rows as a markdown table, headed by the setting it was computed for."""
    head = (f"Device {s.device_gb:g} GB, prompt {s.prompt_len} + output {s.output_len} tokens "
            f"per sequence, activations {s.activations}, reserve {s.reserve_gb:g} GB "
            "(moeexp.analysis.memory_capacity).\n\n")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [f"{row[k]:,}" if isinstance(row[k], int) else str(row[k]) for k in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def write_tables(rows: Sequence[Mapping[str, Any]], s: Setting, out: str | Path) -> list[Path]:
    """``memory_capacity.md`` and ``.csv`` in ``out`` (created), written atomically."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / "memory_capacity.md", d / "memory_capacity.csv"]
    write_text(paths[0], to_markdown(rows, s))
    write_text(paths[1], to_csv(rows))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: compute the table, print it as markdown, write it to ``--out`` when given."""
    p = argparse.ArgumentParser(prog="python -m moeexp.analysis.memory_capacity",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--device-gb", type=float, required=True, help="device memory, GB (1e9 B)")
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=0)
    p.add_argument("--activations", choices=ACTIVATIONS, default="prefill")
    p.add_argument("--reserve-gb", type=float, default=0.0)
    p.add_argument("--capacity", default=None,
                   help="override every system's cache.capacity (e.g. 0.6, '40GB')")
    p.add_argument("--experts-per-layer", default=None,
                   help="override eMoE's experts_per_layer (int count or fraction of J)")
    p.add_argument("--out", default=None, help="directory for memory_capacity.md/.csv")
    a = p.parse_args(argv)
    s = Setting(a.device_gb, a.prompt_len, a.output_len, a.activations, a.reserve_gb)
    epl = _number(a.experts_per_layer)
    if isinstance(epl, str):
        p.error(f"--experts-per-layer {epl!r}: an int count or a fraction of J in (0, 1]")
    try:
        rows = capacity_table(a.models, a.systems, s, capacity=_number(a.capacity),
                              experts_per_layer=epl)
    except ConfigError as exc:
        p.error(str(exc))
    sys.stdout.write(to_markdown(rows, s))
    if a.out:
        for path in write_tables(rows, s, a.out):
            log.info("wrote %s", path)
    return 0


def _number(text: str | None) -> float | int | str | None:
    """A CLI value as an int, a float, or the string itself (a size like '40GB')."""
    if text is None:
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
