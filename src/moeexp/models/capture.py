"""Capture what every MoE router of a model sees and decides, through forward hooks.

Usage (the trace recorder's entry point)::

    adapter = adapter_for(model)
    with RoutingCapture(adapter, keep_hidden=True) as cap:
        model(input_ids)                 # any number of forward passes (prefill, decode...)
    lc = cap.layers[l]                   # MoE layer l (dense layers not counted)
    lc.indices   # int64[T, K]   experts the model really selected
    lc.weights   # float[T, K]   their routing weights (as the model applied them)
    lc.logits    # float[T, J]   raw router logits
    lc.probs     # float32[T, J] adapter.router_probs(logits) (softmax; DeepSeek-V3: see adapter)
    lc.hidden    # float[T, H]   the hidden state entering the MoE block (= the router input)
    lc.records   # one RoutingRecord per forward pass (per-call tensors, same fields)

T counts token rows of all captured forward passes, concatenated in call order; within a
call the rows are the block's ``[batch, seq]`` positions flattened row-major (batch-major),
exactly as the router sees them (padded positions of a padded batch included: drop them
with the attention mask). Dtypes follow the family: DeepSeek's logits and weights are fp32
whatever the model dtype, Mixtral's weights are fp32, the rest use the model dtype; indices
are int64. ``cap.clear()`` drops what was captured so far (e.g. after
each decode step) while keeping the hooks installed.

One forward hook per router is installed (with its inputs), so the captured hidden state is
the router's input, which is the MoE block's input (every family only flattens it to
``[T, H]`` before calling the router; Mixtral/PhiMoE's input jitter applies in training
only). The hooks are removed on exit, also when the body raises. Tensors are detached and
kept on the model's device unless ``to_cpu=True``. Calls made through
:meth:`MoEAdapter.apply_router` bypass the hooks and are never captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

    from moeexp.models.base import MoEAdapter


@dataclass(frozen=True)
class RoutingRecord:
    """One router call: logits float[T, J], weights float[T, K], indices int64[T, K],
    hidden float[T, H] or None (when ``keep_hidden`` was off)."""

    logits: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    hidden: torch.Tensor | None


@dataclass
class LayerCapture:
    """Everything captured for one MoE layer (see the module docstring for shapes)."""

    index: int
    decoder_index: int
    adapter: MoEAdapter = field(repr=False)
    records: list[RoutingRecord] = field(default_factory=list)

    @property
    def num_calls(self) -> int:
        """Router calls (forward passes) captured so far."""
        return len(self.records)

    def _cat(self, name: str) -> torch.Tensor:
        import torch

        if not self.records:
            raise ValueError(f"MoE layer {self.index}: nothing captured yet (no forward pass)")
        parts = [getattr(r, name) for r in self.records]
        if any(p is None for p in parts):
            raise ValueError(
                f"MoE layer {self.index}: {name} was not kept; use RoutingCapture(..., "
                f"keep_hidden=True)"
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    @property
    def logits(self) -> torch.Tensor:
        """float[T, J] raw router logits of all captured calls."""
        return self._cat("logits")

    @property
    def probs(self) -> torch.Tensor:
        """float32[T, J] the router's probability vector (``adapter.router_probs``)."""
        return self.adapter.router_probs(self.logits)

    @property
    def weights(self) -> torch.Tensor:
        """float[T, K] routing weights of the selected experts."""
        return self._cat("weights")

    @property
    def indices(self) -> torch.Tensor:
        """int64[T, K] experts the model selected."""
        return self._cat("indices")

    @property
    def hidden(self) -> torch.Tensor:
        """float[T, H] hidden state entering the MoE block (needs ``keep_hidden=True``)."""
        return self._cat("hidden")


class RoutingCapture:
    """Context manager recording every MoE router call of ``adapter.model``.

    Args:
        adapter: the model's adapter.
        keep_hidden: also keep the router input (the MoE block's input hidden state).
        to_cpu: move captured tensors to the CPU as they arrive (costs a device sync each).
        layers: MoE layer indices to hook (default: all). ``cap.layers`` is then still
            indexed by MoE layer index but only holds the chosen ones.
    """

    def __init__(
        self,
        adapter: MoEAdapter,
        *,
        keep_hidden: bool = False,
        to_cpu: bool = False,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.adapter = adapter
        self.keep_hidden = keep_hidden
        self.to_cpu = to_cpu
        moe = adapter.moe_layers()
        chosen = list(range(len(moe))) if layers is None else sorted(set(layers))
        bad = [i for i in chosen if not 0 <= i < len(moe)]
        if bad:
            raise IndexError(f"MoE layers {bad} out of range 0..{len(moe) - 1}")
        self.layers: dict[int, LayerCapture] = {
            i: LayerCapture(i, moe[i].decoder_index, adapter) for i in chosen
        }
        self._handles: list[RemovableHandle] = []

    # --- hooks -----------------------------------------------------------------------
    def _make_hook(self, lc: LayerCapture) -> Any:
        hidden_size = self.adapter.hidden_size

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            logits, weights, indices = output[0], output[1], output[2]
            hidden = None
            if self.keep_hidden:
                x = args[0] if args else kwargs["hidden_states"]
                hidden = x.detach().reshape(-1, hidden_size)
            rec = [logits.detach(), weights.detach(), indices.detach(), hidden]
            if self.to_cpu:
                rec = [t.cpu() if t is not None else None for t in rec]
            lc.records.append(RoutingRecord(*rec))

        return hook

    @property
    def active(self) -> bool:
        """Whether the hooks are currently installed."""
        return bool(self._handles)

    def install(self) -> RoutingCapture:
        """Install the hooks (``__enter__`` does this); idempotent."""
        if self._handles:
            return self
        moe = self.adapter.moe_layers()
        try:
            for i, lc in self.layers.items():
                h = moe[i].router.register_forward_hook(self._make_hook(lc), with_kwargs=True)
                self._handles.append(h)
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Remove every hook this capture installed (``__exit__`` does this)."""
        while self._handles:
            self._handles.pop().remove()

    def clear(self) -> None:
        """Forget what was captured so far (hooks stay installed)."""
        for lc in self.layers.values():
            lc.records.clear()

    @property
    def num_calls(self) -> int:
        """Forward passes captured (router calls of the first hooked layer)."""
        return next(iter(self.layers.values())).num_calls if self.layers else 0

    def __enter__(self) -> RoutingCapture:
        return self.install()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


def capture_routing(adapter: MoEAdapter, **kwargs: Any) -> RoutingCapture:
    """``RoutingCapture(adapter, **kwargs)``: use as ``with capture_routing(a) as cap:``."""
    return RoutingCapture(adapter, **kwargs)
