"""The engine's experts computation over slot buffers, and eMoE's restricted routing.

:func:`slot_rows` computes, for a set of (token, k) routing rows, exactly what
transformers' default ``grouped_mm`` experts kernel computes for them, but reading expert
weights from the slot pool instead of the module's fused parameters: routing indices are
remapped to slot indices, rows are grouped by slot, and the same grouped linear, the
module's own gate (``module._apply_gate``: SiLU-GLU, GPT-OSS's clamped interleaved GLU),
activation, optional post-expert norm and routing weights are applied. The caller sums the
rows over top-k exactly as the default kernel does (``view(T, K, H).sum(1)``), so the
result matches the plain model to floating-point rounding (0.0 difference on the tested
CPU builds).

The grouped matmul: on CUDA (and other accelerators) transformers' own ``_grouped_linear``
when the installed version has it, so the engine and the plain model share one numerical
path and one launch per projection. On the CPU a ``torch.mm`` per *used* slot: the CPU
``grouped_mm`` computes each group exactly as ``torch.mm`` does (bitwise equal, checked in
the tests) but pays for every group of the weight tensor, and a slot pool holding every
expert of the model has L*J groups where the default kernel has J.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_hf_grouped_linear: Callable[..., torch.Tensor] | None
try:  # transformers >= 5.x: the helper its grouped_mm kernel uses
    from transformers.integrations.moe import _grouped_linear as _hf_grouped_linear
except ImportError:  # pragma: no cover - depends on the installed transformers
    _hf_grouped_linear = None
_hf_batched_linear: Callable[..., torch.Tensor] | None
try:  # ... and the one of its batched_mm kernel
    from transformers.integrations.moe import _batched_linear as _hf_batched_linear
except ImportError:  # pragma: no cover - depends on the installed transformers
    _hf_batched_linear = None


def batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   is_transposed: bool) -> torch.Tensor:
    """Row r of ``x`` [R, in] times its own weight ``weight[r]`` ([R, out, in], or
    [R, in, out] when transposed), plus ``bias`` [R, out]: transformers' batched_mm."""
    if _hf_batched_linear is not None:
        return _hf_batched_linear(x, weight, bias=bias, is_transposed=is_transposed)
    out = (torch.bmm(x.unsqueeze(1), weight).squeeze(1) if is_transposed  # pragma: no cover
           else torch.bmm(weight, x.unsqueeze(-1)).squeeze(-1))
    return out if bias is None else out + bias  # pragma: no cover


def _loop_grouped_linear(x: torch.Tensor, weight: torch.Tensor,
                         groups: list[tuple[int, int]], bias: torch.Tensor | None,
                         is_transposed: bool) -> torch.Tensor:
    """x[S, in] rows in consecutive ``groups`` (slot, row count) times weight[slot]."""
    w0 = weight[0] if is_transposed else weight[0].transpose(-2, -1)
    out = torch.empty(x.size(0), w0.size(-1), dtype=weight.dtype, device=x.device)
    start = 0
    for s, n in groups:
        w = weight[s] if is_transposed else weight[s].transpose(-2, -1)
        torch.mm(x[start:start + n].to(w.dtype), w, out=out[start:start + n])
        start += n
    if bias is not None:
        out.add_(bias)
    return out


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, slot_g: torch.Tensor,
                   groups: list[tuple[int, int]] | None, bias: torch.Tensor | None,
                   is_transposed: bool) -> torch.Tensor:
    """Grouped linear: ``x`` [S, in] sorted by slot (``slot_g`` int64[S]), ``weight``
    [G, out, in] (or [G, in, out] when transposed), ``bias`` [S, out] or None. ``groups``:
    the (slot, rows) runs of ``slot_g`` (CPU path), None to use the grouped kernel."""
    if groups is not None or _hf_grouped_linear is None:
        if groups is None:
            uniq, cnt = torch.unique_consecutive(slot_g, return_counts=True)
            groups = list(zip(uniq.tolist(), cnt.tolist(), strict=True))
        return _loop_grouped_linear(x, weight, groups, bias, is_transposed)
    n_slots = weight.shape[0]
    hist_in = slot_g.float() if slot_g.device.type in ("cpu", "mps") else slot_g.int()
    counts = torch.histc(hist_in, bins=n_slots, min=0, max=n_slots - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    return _hf_grouped_linear(x, weight, offs, bias=bias, is_transposed=is_transposed)


def slot_rows(module: Any, buffers: dict[str, torch.Tensor], hidden: torch.Tensor,
              token: torch.Tensor | int, slot: torch.Tensor, weight: torch.Tensor, *,
              batched: bool = False, finish: bool = True) -> torch.Tensor:
    """Weighted expert outputs of routing rows, reading weights from slots.

    ``batched=True`` computes like transformers' ``batched_mm`` kernel instead (each row's
    slot weights gathered, one ``bmm`` per projection): what ``generate`` switches a
    ``grouped_mm`` model to for its decode steps on an accelerator, so the engine follows
    the plain model's numerical path there too; it is also far faster than a grouped
    matmul for a few rows (fp32 ``grouped_mm`` took ~0.8 ms per call on an H200). Like
    transformers' kernel it briefly holds one copy of the selected experts' weights per
    row (decode: K experts per token), outside the slot budget.

    Args:
        module: the experts module (its flags, gate, activation and norm are used).
        buffers: slot buffers, name -> float[S_slots, ...] (same names as the module's
            fused parameters).
        hidden: float[T, H] the experts' input.
        token: int64[R] token row of each routing row, or an int K when the rows are all
            T*K routing choices in order (row r belongs to token r // K).
        slot: int64[R] slot holding the routing row's expert (all valid).
        weight: float[R] routing weight of each row.
        finish: apply the post-expert norm and the routing weights here; False returns
            the raw expert outputs (``weight`` unused) for :func:`finish_rows` to finish
            elsewhere (the CPU path computes on the host, finishes on the device).

    Returns:
        float[R, H]: ``weight * expert(hidden[token])`` per row, in the input row order.
    """
    transposed = bool(getattr(module, "is_transposed", False))
    has_bias = bool(getattr(module, "has_bias", False))
    has_gate = bool(getattr(module, "has_gate", True))
    up = "gate_up_proj" if has_gate else "up_proj"
    if batched:
        x = hidden.repeat_interleave(token, dim=0) if isinstance(token, int) else hidden[token]
        bias = buffers[f"{up}_bias"][slot] if has_bias else None
        out = batched_linear(x, buffers[up][slot], bias, transposed)
        out = module._apply_gate(out) if has_gate else module.act_fn(out)
        bias = buffers["down_proj_bias"][slot] if has_bias else None
        out = batched_linear(out, buffers["down_proj"][slot], bias, transposed)
        return finish_rows(module, out, weight) if finish else out
    slot_g, perm = torch.sort(slot)
    x_g = hidden[perm // token] if isinstance(token, int) else hidden[token[perm]]
    w_g = weight[perm]
    groups = None
    if slot_g.device.type == "cpu":
        uniq, cnt = torch.unique_consecutive(slot_g, return_counts=True)
        groups = list(zip(uniq.tolist(), cnt.tolist(), strict=True))
    bias = buffers[f"{up}_bias"][slot_g] if has_bias else None
    out = grouped_linear(x_g, buffers[up], slot_g, groups, bias, transposed)
    out = module._apply_gate(out) if has_gate else module.act_fn(out)
    bias = buffers["down_proj_bias"][slot_g] if has_bias else None
    out = grouped_linear(out, buffers["down_proj"], slot_g, groups, bias, transposed)
    if finish:
        out = finish_rows(module, out, w_g)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[inv]


def finish_rows(module: Any, out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float[R, H]: raw expert outputs ``out`` through the module's optional post-expert
    norm, times the routing weights ``weight`` (float[R]): the last step of :func:`slot_rows`."""
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    return out * weight.unsqueeze(-1)


def restrict_routing(
    idx: torch.Tensor, weights: torch.Tensor, probs: torch.Tensor, resident: torch.Tensor,
    *, renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """eMoE's restricted routing: non-resident choices go to the next-ranked resident expert.

    A token's selected expert that is not resident is replaced by the expert with the
    highest router probability that is resident and not already used by that token; the
    token's choices are visited in their routing order (the simulator's rule). The
    substitute's weight is the original weight scaled by p(substitute) / p(original), i.e.
    the router's own weighting applied to the substitute; with ``renormalize`` the token's
    weights are then rescaled to their original sum. A choice with no resident candidate
    left is dropped (weight 0).

    Args:
        idx: int64[T, K] selected experts. weights: float[T, K] their routing weights.
        probs: float[T, J] router probabilities (the gate order). resident: bool[J].

    Returns:
        (new idx int64[T, K], new weights float[T, K], dropped bool[T, K], substituted
        choices count).
    """
    ok = resident[idx]
    if bool(ok.all()):
        return idx, weights, torch.zeros_like(ok), 0
    T, K = idx.shape
    p = probs.float()
    order = torch.argsort(p, dim=1, descending=True, stable=True)  # [T, J] gate order
    used = torch.zeros_like(p, dtype=torch.bool)
    used.scatter_(1, idx, ok)  # resident choices stay and are taken
    new_idx, new_w = idx.clone(), weights.clone()
    dropped = torch.zeros_like(ok)
    rows = torch.arange(T, device=idx.device)
    for j in range(K):
        k = torch.full((T,), j, dtype=torch.long, device=idx.device)
        need = ~ok[rows, k]
        if not bool(need.any()):
            continue
        cand = (resident.unsqueeze(0) & ~used).gather(1, order)  # [T, J] in gate order
        has = cand.any(dim=1)
        first = order[rows, cand.int().argmax(dim=1)]
        take = need & has
        orig = idx[rows, k]
        scale = p[rows, first] / p[rows, orig].clamp_min(1e-30)
        new_idx[rows[take], k[take]] = first[take]
        new_w[rows[take], k[take]] = (weights[rows, k] * scale.to(weights.dtype))[take]
        used[rows[take], first[take]] = True
        drop = need & ~has
        dropped[rows[drop], k[drop]] = True
        new_w[rows[drop], k[drop]] = 0
    if renormalize:
        before = weights.sum(dim=1, keepdim=True)
        after = new_w.sum(dim=1, keepdim=True)
        new_w = torch.where(after > 0, new_w * (before / after.clamp_min(1e-30)), new_w)
    substituted = int((~ok).sum()) - int(dropped.sum())
    return new_idx, new_w, dropped, substituted
