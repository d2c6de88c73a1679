"""Record routing traces by running a real model: prefill + decode with a KV cache.

Per request (batch size 1), with ``P = prompt_len`` and ``O = output_len``:

- iteration 0 (prefill): one forward pass over the ``P`` prompt tokens; its last logits give
  output token 1;
- iterations 1..O-1 (decode): one forward pass of one token each (the previously generated
  token, with the KV cache); iteration s gives output token s+1.

So a request has ``O`` iterations and ``P + O - 1`` token rows, and ``O`` generated tokens
(``meta["output_token_ids"]``). The EOS token is suppressed (its logit set to -inf, like
``generate(min_new_tokens=O)``) so every request generates exactly ``O`` tokens, as the fixed
lengths of FineMoE require.

Sampling: ``top_k`` (default; a tiny model loops under greedy decoding, which would fake
temporal locality): logits / temperature, keep the ``top_k`` largest, softmax, draw with a
``torch.Generator`` seeded with ``seed + request_id`` (so a request's tokens do not depend on
which other requests are recorded, or in which order). ``greedy``: argmax.

What is recorded per token row (see :mod:`moeexp.traces.schema`) comes from
:class:`~moeexp.models.capture.RoutingCapture` hooks on the routers (logits, the experts and
weights *the model chose*, the router input hidden state) and a hook on the embedding layer.
``spec_probs[t, l, d-1] = router_probs(apply_router(l + d, h_l))`` is computed after each
forward pass, batched: one router call per target layer ``m`` over the stacked inputs
``h_{m-1} .. h_{m-D}``. Recorded tensors stay on the device until the request ends, then
move to the host in one copy per array.

This module imports torch (it runs the model); the rest of :mod:`moeexp.traces` does not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from tqdm import tqdm

from moeexp.errors import ConfigError
from moeexp.models.kv import kv_argument, kv_of
from moeexp.traces.schema import RequestMeta, Trace, TraceDims

if TYPE_CHECKING:
    import torch

    from moeexp.data.prompts import Prompt
    from moeexp.models.base import MoEAdapter

log = logging.getLogger(__name__)

#: Bump when what the recorder writes changes meaning (part of the trace cache's hash).
RECORDER_VERSION = 1
SAMPLINGS = ("top_k", "greedy")
EMBEDDERS = ("minilm", None)


class LoadedLike(Protocol):
    """What the recorder needs of :class:`moeexp.models.loading.LoadedModel`."""

    model: Any
    tokenizer: Any
    adapter: MoEAdapter
    name: str


def check_settings(sampling: str, top_k: int, temperature: float, spec_depth: int,
                   prompt_embedder: str | None) -> None:
    """Raise ConfigError on invalid recording settings (naming the valid values)."""
    bad = []
    if sampling not in SAMPLINGS:
        bad.append(f"sampling={sampling!r} (valid: {', '.join(SAMPLINGS)})")
    if sampling == "top_k" and (int(top_k) < 1 or float(temperature) <= 0):
        bad.append(f"top_k={top_k} must be >= 1 and temperature={temperature} > 0")
    if int(spec_depth) < 0:
        bad.append(f"spec_depth={spec_depth} must be >= 0")
    if prompt_embedder not in EMBEDDERS:
        bad.append(f"prompt_embedder={prompt_embedder!r} (valid: minilm, null)")
    if bad:
        raise ConfigError("trace: " + "; ".join(bad))


class _Step:
    """Per-iteration recording state: the hooks' tensors -> stacked [T, L, ...] tensors."""

    def __init__(self, adapter: MoEAdapter, spec_depth: int, record_hidden: bool) -> None:
        self.adapter = adapter
        self.L, self.J, self.D = adapter.num_layers, adapter.num_experts, spec_depth
        self.record_hidden = record_hidden
        self.embeds: list[torch.Tensor] = []
        # per target layer m: source layers l = m - d and depth slots d - 1, d = 1..min(D, m)
        self.spec_plan = [(m, [m - d for d in range(1, min(spec_depth, m) + 1)],
                           list(range(min(spec_depth, m)))) for m in range(1, self.L)]

    def embed_hook(self, module: Any, args: Any, output: Any) -> None:
        self.embeds.append(output.detach())

    def collect(self, cap: Any) -> dict[str, torch.Tensor]:
        """Tensors of the iteration just run ([T, ...] rows, on the model's device); clears
        the capture."""
        import torch

        lcs = [cap.layers[i] for i in range(self.L)]
        if any(lc.num_calls != 1 for lc in lcs) or len(self.embeds) != 1:
            raise RuntimeError("expected exactly one router call per MoE layer and one "
                               "embedding call per forward pass")
        recs = [lc.records[0] for lc in lcs]
        dev = recs[0].logits.device  # layers may sit on several devices (device_map=auto)

        def stack(ts: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([t.to(dev) for t in ts], dim=1)

        logits = stack([r.logits for r in recs])  # [T, L, J]
        T = logits.shape[0]
        out: dict[str, torch.Tensor] = {
            "probs": self.adapter.router_probs(logits.reshape(T * self.L, self.J))
            .reshape(T, self.L, self.J).half(),
            "topk_idx": stack([r.indices for r in recs]).to(torch.int16),
            "topk_weight": stack([r.weights for r in recs]).half(),
            "embed": self.embeds[0].reshape(T, -1).half(),
        }
        if self.D > 0 or self.record_hidden:
            hidden = stack([r.hidden for r in recs])  # [T, L, H]
            if self.record_hidden:
                out["hidden"] = hidden.half()
            if self.D > 0:
                spec = torch.zeros(T, self.L, self.D, self.J, dtype=torch.float16, device=dev)
                for m, src, slot in self.spec_plan:
                    h = hidden[:, src].reshape(T * len(src), -1)
                    p = self.adapter.router_probs(self.adapter.apply_router(m, h).logits)
                    spec[:, src, slot] = p.reshape(T, len(src), self.J).to(dev, torch.float16)
                out["spec_probs"] = spec
        cap.clear()
        self.embeds.clear()
        return out


def _next_token(logits: torch.Tensor, sampling: str, top_k: int, temperature: float,
                gen: torch.Generator, eos_ids: Sequence[int]) -> int:
    """Choose the next token from logits [V]; the ``eos_ids`` are never chosen.

    The top-k candidates are drawn on the CPU with the request's CPU generator, so the
    sampled tokens do not depend on the model's device(s).
    """
    import torch

    logits = logits.float()
    if eos_ids:
        logits = logits.clone()
        logits[list(eos_ids)] = -float("inf")
    if sampling == "greedy":
        return int(torch.argmax(logits))
    k = min(int(top_k), logits.shape[-1])
    vals, idx = torch.topk(logits / temperature, k)
    probs = torch.softmax(vals.cpu(), dim=-1)
    return int(idx[int(torch.multinomial(probs, 1, generator=gen))])


def trace_dims(adapter: MoEAdapter, spec_depth: int) -> TraceDims:
    """TraceDims of the model behind ``adapter`` (bytes in the model's dtype)."""
    return TraceDims(
        num_layers=adapter.num_layers, num_experts=adapter.num_experts, top_k=adapter.top_k,
        hidden_size=adapter.hidden_size, spec_depth=int(spec_depth),
        expert_bytes=adapter.expert_bytes(), num_shared_experts=adapter.num_shared_experts,
        dense_bytes=adapter.dense_bytes(), intermediate_size=adapter.expert_intermediate_size)


def record_trace(
    loaded: LoadedLike,
    prompts: Sequence[Prompt],
    *,
    sampling: str = "top_k",
    top_k: int = 50,
    temperature: float = 1.0,
    spec_depth: int = 4,
    record_hidden: bool = False,
    seed: int = 0,
    prompt_embedder: str | None = "minilm",
    progress: bool = True,
) -> Trace:
    """Run every prompt through the model and record its routing (module docstring).

    Args:
        loaded: model, tokenizer, adapter, name (a ``LoadedModel``).
        prompts: the requests; ``input_ids`` are fed as is, ``output_len`` tokens generated.
        sampling: ``top_k`` (seeded) or ``greedy``.
        top_k, temperature: top-k sampling parameters (ignored for greedy).
        spec_depth: D, speculative gate distances recorded (0: no ``spec_probs``).
        record_hidden: also store the hidden state entering each MoE block.
        seed: request r samples with ``torch.Generator().manual_seed(seed + r)``.
        prompt_embedder: ``minilm`` (384-d sentence embeddings) or None.
        progress: show a tqdm bar over requests.

    Returns:
        A validated :class:`Trace`; ``meta`` holds provenance and the generated token ids.
    """
    import torch

    from moeexp.models.capture import RoutingCapture

    check_settings(sampling, top_k, temperature, spec_depth, prompt_embedder)
    if not prompts:
        raise ValueError("record_trace needs at least one prompt")
    model, adapter = loaded.model, loaded.adapter
    device = next(model.parameters()).device
    eos_cfg = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_cfg = eos_cfg if eos_cfg is not None else getattr(model.config, "eos_token_id", None)
    eos_list = eos_cfg if isinstance(eos_cfg, (list, tuple)) else [eos_cfg]
    eos_ids = [int(e) for e in eos_list if e is not None]
    step = _Step(adapter, int(spec_depth), bool(record_hidden))
    parts: dict[str, list[np.ndarray]] = {}
    it_req: list[int] = []
    it_step: list[int] = []
    lens: list[int] = []
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    handle = adapter.embedding().register_forward_hook(step.embed_hook)
    keep_hidden = spec_depth > 0 or record_hidden
    kv = kv_argument(model)  # the KV cache's argument name (transformers 5.x renamed it)
    try:
        with RoutingCapture(adapter, keep_hidden=keep_hidden) as cap, torch.inference_mode():
            for p in tqdm(prompts, desc="recording trace", unit="req", disable=not progress):
                if p.output_len < 1 or p.prompt_len < 1:
                    raise ValueError(f"request {p.request_id}: prompt_len and output_len must "
                                     f"be >= 1 (got {p.prompt_len}, {p.output_len})")
                gen = torch.Generator().manual_seed(int(seed) + p.request_id)
                ids = torch.tensor([list(p.input_ids)], dtype=torch.long, device=device)
                past = None
                out_ids: list[int] = []
                req_parts: dict[str, list[torch.Tensor]] = {}
                for s in range(p.output_len):
                    res = model(input_ids=ids, use_cache=True, logits_to_keep=1,
                                **{kv: past})
                    past = kv_of(res)
                    tensors = step.collect(cap)
                    tensors["token_ids"] = ids[0].to(torch.int32)
                    for k, v in tensors.items():
                        req_parts.setdefault(k, []).append(v)
                    it_req.append(p.request_id)
                    it_step.append(s)
                    lens.append(ids.shape[1])
                    tok = _next_token(res.logits[0, -1], sampling, top_k, temperature, gen,
                                      eos_ids)
                    out_ids.append(tok)
                    ids = torch.tensor([[tok]], dtype=torch.long, device=device)
                outputs.append(out_ids)
                for k, vs in req_parts.items():  # one device->host copy per array and request
                    parts.setdefault(k, []).append(torch.cat(vs).cpu().numpy())
    finally:
        handle.remove()
    elapsed = time.perf_counter() - t0

    def cat(name: str) -> np.ndarray:
        return np.concatenate(parts[name], axis=0)

    prompt_embed = None
    if prompt_embedder == "minilm":
        from moeexp.data.embed import embed_prompts

        prompt_embed = embed_prompts([p.text for p in prompts])
    n_tok = int(sum(lens))
    trace = Trace(
        dims=trace_dims(adapter, spec_depth),
        requests=[RequestMeta(request_id=p.request_id, prompt=p.text, prompt_len=p.prompt_len,
                              output_len=p.output_len, split=p.split, dataset=p.dataset,
                              task=p.task) for p in prompts],
        iter_request=np.asarray(it_req, dtype=np.int32),
        iter_step=np.asarray(it_step, dtype=np.int32),
        iter_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        probs=cat("probs"),
        topk_idx=cat("topk_idx"),
        topk_weight=cat("topk_weight"),
        embed=cat("embed"),
        token_ids=cat("token_ids"),
        spec_probs=cat("spec_probs") if spec_depth > 0 else None,
        hidden=cat("hidden") if record_hidden else None,
        prompt_embed=prompt_embed,
        meta={
            "model": loaded.name,
            "model_type": str(getattr(model.config, "model_type", "")),
            "dataset": ",".join(sorted({p.dataset for p in prompts})),
            "sampling": {"sampling": sampling, "top_k": int(top_k),
                         "temperature": float(temperature), "eos": "suppressed"},
            "seed": int(seed),
            "spec_depth": int(spec_depth),
            "prompt_embedder": prompt_embedder,
            "recorder_version": RECORDER_VERSION,
            "record_seconds": round(elapsed, 3),
            "output_token_ids": outputs,
        },
    )
    trace.validate()
    log.info("recorded %d requests, %d iterations, %d token rows in %.1f s (%.1f tok/s)",
             len(prompts), len(it_req), n_tok, elapsed, n_tok / max(elapsed, 1e-9))
    return trace
