"""Load a model preset (the Hydra ``model`` group) into a model, tokenizer and adapter.

Where the weights come from, first match wins:

1. ``path`` set: a local directory (``save_pretrained`` layout); it must exist.
2. ``name == "tiny"``: the embedded, project-trained model in the package asset directory
   ``src/moeexp/assets/tiny/`` (``config.json``, ``model.safetensors``, tokenizer files).
3. ``hf_id``: ``from_pretrained`` from the Hugging Face hub (or its local cache; honours
   ``HF_HUB_OFFLINE``). Without access the error names both ways out: ``model.path=`` or
   hub access (``hf auth login`` / ``HF_TOKEN``, license accepted).

The config (``config.json``) is read first, so an unsupported architecture is rejected
before any weight is loaded. The model is returned in eval mode.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeexp.errors import ConfigError, ModelLoadError
from moeexp.models.adapters import adapter_for, supported_model_types
from moeexp.paths import ASSETS_DIR

if TYPE_CHECKING:
    from moeexp.models.base import MoEAdapter

log = logging.getLogger(__name__)

TINY_NAME = "tiny"
DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass(frozen=True)
class LoadedModel:
    """A loaded MoE causal LM with what moeexp needs around it.

    Attributes:
        model: the ``transformers`` ``PreTrainedModel`` (eval mode).
        tokenizer: its tokenizer.
        adapter: the architecture adapter (:func:`moeexp.models.adapters.adapter_for`).
        name: the preset name (``cfg.name``).
        source: where it was loaded from: a local directory path or ``hub:<hf_id>``.
        prefetch_distance: the preset's prefetch distance d (None if the preset has none).
    """

    model: Any
    tokenizer: Any
    adapter: MoEAdapter
    name: str
    source: str
    prefetch_distance: int | None = None


def tiny_asset_dir() -> Path:
    """The package directory holding the embedded tiny model."""
    return ASSETS_DIR / TINY_NAME


def _torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r} is not valid; valid: {', '.join(DTYPES)}")
    return "auto" if dtype == "auto" else getattr(torch, dtype)


def _hub_help(name: str, hf_id: str) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    return (
        f"Either (a) download the checkpoint and pass model.path=/local/dir (a directory "
        f"with config.json, the safetensors weights and tokenizer files), or (b) give "
        f"hub access to {hf_id!r}: "
        + ("unset HF_HUB_OFFLINE (it is set now), " if offline else "")
        + "accept the model's license on huggingface.co if it is gated and run "
        f"`hf auth login` (`huggingface-cli login` with huggingface-hub < 1.0) or set HF_TOKEN. "
        f"Preset: model={name}."
    )


def _resolve_source(cfg: Mapping[str, Any]) -> tuple[str, bool]:
    """(what to pass to from_pretrained, is_local_dir)."""
    name = str(cfg.get("name") or "")
    path = cfg.get("path")
    if path:
        p = Path(str(path)).expanduser()
        if not p.is_dir():
            raise ModelLoadError(
                f"model.path={str(path)!r} does not exist or is not a directory "
                f"(expected a save_pretrained directory with config.json)"
            )
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"model.path={str(path)!r} has no config.json")
        return str(p), True
    if name == TINY_NAME:
        d = tiny_asset_dir()
        if not (d / "config.json").is_file():
            raise ModelLoadError(
                f"the embedded tiny model is missing from {d} (no config.json). Rebuild it "
                f"with `make tiny-model`, or pass model.path=/local/dir"
            )
        return str(d), True
    hf_id = cfg.get("hf_id")
    if not hf_id:
        raise ModelLoadError(
            f"model {name!r} has neither a path nor an hf_id: set model.path=/local/dir or "
            f"model.hf_id=<org/name>"
        )
    return str(hf_id), False


def probe_adapter(cfg: Mapping[str, Any]) -> MoEAdapter | None:
    """The adapter of the model ``cfg`` describes, built from its config alone on the meta
    device (no weights read), so that a run can check dims-dependent settings (a cache
    capacity below K experts, ...) before a long load. None when the config cannot be
    read or built that way (the load itself then reports what is wrong). Memoised per
    process on the source, its config.json's size and mtime, the dtype and
    ``trust_remote_code`` (a sweep's jobs probe the same model once)."""
    try:
        source, local = _resolve_source(cfg)
    except ModelLoadError as err:
        log.debug("model %s: no pre-load probe (%s)", cfg.get("name"), err)
        return None
    stamp = None
    if local:
        st = (Path(source) / "config.json").stat()
        stamp = (st.st_size, st.st_mtime_ns)
    return _probe(source, stamp, bool(cfg.get("trust_remote_code") or False),
                  str(cfg.get("dtype") or "float32"), str(cfg.get("name")))


@functools.lru_cache(maxsize=8)
def _probe(source: str, stamp: tuple[int, int] | None, trust: bool, dtype_name: str,
           name: str) -> MoEAdapter | None:
    """:func:`probe_adapter` for a resolved source (``stamp``: its config.json's size and
    mtime, None for a hub id), the meta-device build."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust)
        if getattr(config, "model_type", None) not in supported_model_types():
            return None
        dtype = _torch_dtype(dtype_name)
        if dtype == "auto":
            dtype = getattr(config, "dtype", None) or torch.float32
        config = copy.deepcopy(config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the load dequantizes (MXFP4): plain tensors
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     trust_remote_code=trust)
        return adapter_for(model)
    except Exception as err:  # noqa: BLE001 - a probe: the real load reports errors
        log.debug("model %s: no pre-load probe (%s: %s)", name, type(err).__name__, err)
        return None


def load_model(cfg: Mapping[str, Any]) -> LoadedModel:
    """Load the model described by ``cfg`` (the ``model`` config group).

    Keys: ``name``, ``hf_id``, ``path``, ``dtype`` (float32|bfloat16|float16|auto,
    default float32), ``device`` (default ``cpu``; anything ``device_map`` accepts, e.g.
    ``cuda:0`` or ``auto``), ``trust_remote_code`` (default false), ``prefetch_distance``.

    Raises:
        ModelLoadError: the path does not exist, the hub cannot be reached (the message
            names ``model.path=`` and hub login, and carries the original error), the
            architecture is unsupported (lists the supported ones), or it has no MoE layer.
        ConfigError: an invalid ``dtype``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name = str(cfg.get("name") or "")
    dtype = _torch_dtype(str(cfg.get("dtype") or "float32"))
    device = str(cfg.get("device") or "cpu")
    trust = bool(cfg.get("trust_remote_code") or False)
    source, local = _resolve_source(cfg)
    where = source if local else f"hub:{source}"
    fail = _failure(name, source, local)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust)
    except Exception as err:  # OSError, ValueError, hub errors: all mean "not loadable"
        raise fail("config", err) from err
    model_type = getattr(config, "model_type", None)
    if model_type not in supported_model_types():
        raise ModelLoadError(
            f"model {name!r} ({where}) has model_type {model_type!r}, which moeexp does not "
            f"support; supported model types: {', '.join(supported_model_types())}"
        )
    log.info("loading model %s from %s (dtype=%s, device=%s)", name, where, dtype, device)
    kwargs = _load_kwargs(config, name, dtype, device, trust)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, config=config, **kwargs)
    except Exception as err:
        raise fail("weights", err) from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust)
    except Exception as err:
        raise fail("tokenizer", err) from err
    model.eval()
    adapter = _checked_adapter(model, name, where)
    pd = cfg.get("prefetch_distance")
    loaded = LoadedModel(model=model, tokenizer=tokenizer, adapter=adapter, name=name,
                         source=where, prefetch_distance=None if pd is None else int(pd))
    log.info("model %s: %s", name, adapter.describe())
    return loaded


def _failure(name: str, source: str, local: bool) -> Any:
    """``fail(what, err)``: the ModelLoadError for a part (config, weights, tokenizer) that
    did not load, naming ``model.path=`` and hub login when it came from the hub."""

    def fail(what: str, err: BaseException) -> ModelLoadError:
        if local:
            return ModelLoadError(f"cannot load the {what} of model {name!r} from {source}: {err}")
        return ModelLoadError(
            f"cannot load the {what} of model {name!r} from the hub id {source!r}. "
            + _hub_help(name, source) + f" Original error: {type(err).__name__}: {err}")

    return fail


def _load_kwargs(config: Any, name: str, dtype: Any, device: str, trust: bool) -> dict[str, Any]:
    """``from_pretrained`` keywords: dtype, device map, and MXFP4 experts dequantised."""
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust}
    if device != "cpu":
        kwargs["device_map"] = device
    qc = getattr(config, "quantization_config", None)
    qmethod = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if str(getattr(qmethod, "value", qmethod)) == "mxfp4":
        # gpt-oss ships MXFP4 experts; the quantized module has no per-expert tensors to
        # offload, so always dequantize to plain fused tensors (the requested dtype).
        from transformers import Mxfp4Config  # type: ignore[attr-defined]

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
        log.info("model %s: dequantizing MXFP4 experts to plain tensors", name)
    return kwargs


def _checked_adapter(model: Any, name: str, where: str) -> MoEAdapter:
    """The model's adapter, once its experts are seen in the fused layout it expects."""
    adapter = adapter_for(model)
    try:
        adapter.expert_tensors(0, 0)
    except (AttributeError, TypeError, IndexError) as err:
        raise ModelLoadError(
            f"model {name!r} ({where}, class {type(model).__module__}.{type(model).__name__}) "
            f"does not have the fused expert layout moeexp's {type(adapter).__name__} expects "
            f"({err}); adapters are verified against transformers' built-in implementations, "
            f"so load it with trust_remote_code: false"
        ) from err
    return adapter
