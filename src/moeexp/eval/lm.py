"""moeexp as an lm-eval model: ``--model moeexp --model_args model=tiny,system=emoe,capacity=0.5``.

:class:`MoeexpLM` loads a model through :func:`moeexp.models.loading.load_model` (the same
presets as the Hydra ``model`` group), optionally offloads its experts with
:func:`moeexp.engine.offload` (any ``system``; lossy systems such as ``emoe`` change the
routing, which is what their accuracy checks measure) and hands the resulting model to
lm-eval's own :class:`HFLM`, so scoring code is lm-eval's, not ours.

The stock ``lm_eval`` command has no plugin discovery for models, so use
``python -m moeexp.eval.cli ...`` (same arguments as ``lm_eval``; it registers ``moeexp``
first), or call :func:`evaluate` from Python.
"""

from __future__ import annotations

import logging
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

log = logging.getLogger(__name__)

#: Systems that keep every expert resident: no engine needed, the plain model is evaluated.
PLAIN_SYSTEMS = ("plain", "no_offload", "none")


def _model_cfg(model: str, model_path: str | None, dtype: str) -> dict[str, Any]:
    from moeexp.paths import load_group_yaml

    cfg = load_group_yaml("model", model)
    if model_path:
        cfg["path"] = model_path
    if dtype:
        cfg["dtype"] = dtype
    return cfg


@register_model("moeexp")
class MoeexpLM(HFLM):
    """lm-eval model over a moeexp model, plain or offloaded by the engine.

    Args:
        model: a ``conf/model`` preset name (``tiny``, ``mixtral_8x7b``, ...).
        model_path: local checkpoint directory (overrides the preset's hub id).
        system: a ``conf/system`` name; ``plain``/``no_offload`` evaluates the plain model.
        capacity: expert-cache budget for the engine (fraction, bytes, or "2GB").
        store: a trace path that fits systems needing a store (FineMoE maps, ...).
        dtype: model dtype (default: the preset's).
        batch_size, max_length, device: passed to HFLM.
    """

    def __init__(
        self,
        model: str = "tiny",
        model_path: str | None = None,
        system: str = "plain",
        capacity: float | int | str = 0.5,
        store: str | None = None,
        dtype: str = "",
        batch_size: int | str = 1,
        max_length: int | None = None,
        device: str = "cpu",
        **overrides: Any,
    ) -> None:
        from moeexp.models.loading import load_model

        cfg = _model_cfg(model, model_path, dtype)
        cfg["device"] = device
        loaded = load_model(cfg)
        self.loaded = loaded
        self.system = system
        self.offloaded = None
        if system not in PLAIN_SYSTEMS:
            from moeexp.engine import offload

            self.offloaded = offload(loaded.model, system=system, capacity=_num(capacity),
                                     store=store, **overrides)
        super().__init__(pretrained=loaded.model, tokenizer=loaded.tokenizer,
                         backend="causal", batch_size=int(batch_size), max_length=max_length)

    def engine_metrics(self) -> dict[str, float]:
        """The engine's metrics (hit rate, substitution rate, ...) or {} for a plain model."""
        return {} if self.offloaded is None else dict(self.offloaded.metrics())

    def close(self) -> None:
        if self.offloaded is not None:
            self.offloaded.close()
            self.offloaded = None


def _num(v: float | int | str) -> float | int | str:
    """lm-eval passes model_args as strings; turn numeric strings into numbers."""
    if isinstance(v, str):
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
    return v
