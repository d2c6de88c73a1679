"""The trace schema: the contract between recording (models, engine) and replay (simulator).

A trace holds, for a set of requests, per iteration, per token and per MoE layer, what
``algorithms.md`` §0 lists. Iterations of all requests are concatenated; tokens of all
iterations are concatenated ("token rows")::

    iteration i  : request ``iter_request[i]``, step ``iter_step[i]`` (0 = prefill,
                   s >= 1 = the s-th decode step), token rows
                   ``iter_offsets[i] : iter_offsets[i + 1]``
    token row t  : ``probs[t, l]``      float16[L, J] full router probabilities (softmax of
                                        the logits, before top-k and renormalisation);
                                        optional (imported traces may hold top-k only)
                   ``topk_idx[t, l]``   int16[K]  experts the model really selected
                   ``topk_weight[t, l]``float16[K] their routing weights
                   ``embed[t]``         float16[H] output of the embedding layer (semantic key;
                                        optional)
                   ``spec_probs[t, l, d-1]`` float16[J] softmax(gate_{l+d}(h_l)), d = 1..D;
                                        zeros where l + d >= L
                   ``hidden[t, l]``     float16[H] hidden state entering layer l's MoE block
                                        (optional)
                   ``token_ids[t]``     int32 the token fed in this row (optional)

Dense layers (DeepSeek's first layers) are not counted: layer index l = 0..L-1 counts MoE
layers only. On disk a trace is ``NAME.npz`` (numpy arrays, no pickle) plus ``NAME.json``
(the sidecar: schema version, dims, requests, provenance, what the trace holds, and the
digests binding the two files). Only :mod:`moeexp.traces.io` reads or writes them.

**What a trace holds** (:attr:`Trace.capabilities`, also in the sidecar): a trace recorded
by this project's recorder holds everything above. A trace imported from elsewhere
(:mod:`moeexp.traces.external`) may be *routing only*: top-k ids and weights of decode
steps, no full router probabilities (``router_probs``), no embedding-layer outputs
(``embed``), no token ids (``token_ids``), no prefill routing (``prefill``), no
speculative gates or hidden states. ``meta["source"]`` says where it came from (model,
repository, commit, licence). A predictor names what it needs (``Predictor.needs``); one
needing something the trace lacks is *not applicable* to it (:func:`missing_for`), never
run on zeros.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np

from moeexp.errors import TraceError

#: 2: probs/embed/token_ids optional, capabilities and digests in the sidecar (1: none).
SCHEMA_VERSION = 2

#: What a trace may hold, with the words a "not applicable" message uses for each.
CAPABILITIES: dict[str, str] = {
    "router_probs": "full router probabilities",
    "embed": "embedding-layer outputs",
    "token_ids": "token ids",
    "prefill": "prefill routing",
    "spec_probs": "speculative gate outputs",
    "hidden": "hidden states",
    "prompt_embed": "prompt embeddings",
    "prompt_text": "prompt texts",
}

Split = Literal["store", "test"]


@dataclass(frozen=True)
class TraceDims:
    """Shape of the model a trace was recorded from.

    Attributes:
        num_layers: L, MoE layers only.
        num_experts: J, routed experts per layer.
        top_k: K, experts selected per token.
        hidden_size: H.
        spec_depth: D, number of speculative gate distances recorded (0 = none).
        expert_bytes: bytes of one routed expert's weights as the model stores them.
        num_shared_experts: always-resident shared experts per layer (not offloaded).
        dense_bytes: bytes of all non-routed-expert weights (always resident).
        intermediate_size: I of one routed expert (for the roofline cost model).
    """

    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    spec_depth: int
    expert_bytes: int
    num_shared_experts: int = 0
    dense_bytes: int = 0
    intermediate_size: int = 0


@dataclass(frozen=True)
class RequestMeta:
    """One request (prompt) of a trace."""

    request_id: int
    prompt: str
    prompt_len: int
    output_len: int
    split: Split
    dataset: str
    task: str = ""


@dataclass
class Trace:
    """A routing trace. See the module docstring for the array layout.

    ``meta`` holds provenance (model name, dataset, seed, content hash, git sha, ...).
    ``prompt_embed`` (optional, float32[R, E]) is a sentence embedding per request, used by
    the ``semantic_knn`` predictor. ``probs``, ``embed`` and ``token_ids`` are None in a
    routing-only trace (see the module docstring).
    """

    dims: TraceDims
    requests: list[RequestMeta]
    iter_request: np.ndarray  # int32[N_iter]
    iter_step: np.ndarray  # int32[N_iter]
    iter_offsets: np.ndarray  # int64[N_iter + 1]
    probs: np.ndarray | None  # float16[N_tok, L, J]
    topk_idx: np.ndarray  # int16[N_tok, L, K]
    topk_weight: np.ndarray  # float16[N_tok, L, K]
    embed: np.ndarray | None  # float16[N_tok, H]
    token_ids: np.ndarray | None  # int32[N_tok]
    spec_probs: np.ndarray | None = None  # float16[N_tok, L, D, J]
    hidden: np.ndarray | None = None  # float16[N_tok, L, H]
    prompt_embed: np.ndarray | None = None  # float32[R, E]
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise TraceError if arrays disagree with each other or with ``dims``."""
        d = self.dims
        n_iter = len(self.iter_request)
        n_tok = int(self.iter_offsets[-1]) if len(self.iter_offsets) else 0
        checks: list[tuple[bool, str]] = [
            (self.iter_step.shape == (n_iter,), "iter_step length != iterations"),
            (self.iter_offsets.shape == (n_iter + 1,), "iter_offsets must have N_iter + 1 entries"),
            (n_iter == 0 or bool(np.all(np.diff(self.iter_offsets) > 0)), "empty iteration"),
            (self.topk_idx.shape == (n_tok, d.num_layers, d.top_k), "topk_idx shape"),
            (self.topk_weight.shape == (n_tok, d.num_layers, d.top_k), "topk_weight shape"),
        ]
        if self.probs is not None:
            want_probs = (n_tok, d.num_layers, d.num_experts)
            checks.append((self.probs.shape == want_probs, "probs shape"))
        if self.embed is not None:
            checks.append((self.embed.shape == (n_tok, d.hidden_size), "embed shape"))
        if self.token_ids is not None:
            checks.append((self.token_ids.shape == (n_tok,), "token_ids shape"))
        if self.spec_probs is not None:
            want_spec = (n_tok, d.num_layers, d.spec_depth, d.num_experts)
            checks.append((self.spec_probs.shape == want_spec, "spec_probs shape"))
        if self.hidden is not None:
            want_hidden = (n_tok, d.num_layers, d.hidden_size)
            checks.append((self.hidden.shape == want_hidden, "hidden shape"))
        if self.prompt_embed is not None:
            checks.append((self.prompt_embed.shape[0] == len(self.requests), "prompt_embed rows"))
        if n_tok:
            lo, hi = int(self.topk_idx.min()), int(self.topk_idx.max())
            checks.append((lo >= 0 and hi < d.num_experts, "topk_idx out of range"))
        if n_iter:
            ids = {r.request_id for r in self.requests}
            checks.append((set(np.unique(self.iter_request).tolist()) <= ids, "unknown request"))
        bad = [msg for ok, msg in checks if not ok]
        if bad:
            raise TraceError(f"invalid trace: {'; '.join(bad)}")

    # ------------------------------------------------------------------ capabilities
    @property
    def capabilities(self) -> frozenset[str]:
        """What this trace holds, among :data:`CAPABILITIES`."""
        have = {name for name, arr in (("router_probs", self.probs), ("embed", self.embed),
                                       ("token_ids", self.token_ids),
                                       ("spec_probs", self.spec_probs),
                                       ("hidden", self.hidden),
                                       ("prompt_embed", self.prompt_embed))
                if arr is not None}
        if bool(np.any(self.iter_step == 0)):
            have.add("prefill")
        if self.requests and all(r.prompt for r in self.requests):
            have.add("prompt_text")
        return frozenset(have)

    def router_probs(self, rows: slice | np.ndarray = slice(None),
                     layer: int | None = None) -> np.ndarray:
        """float16[T, J] (one ``layer``) or float16[T, L, J] (``layer=None``): the router
        probabilities of token ``rows``; in a routing-only trace, the top-k weights
        scattered into J (zero elsewhere), which is what predictors that accept it see."""
        if self.probs is not None:
            return self.probs[rows] if layer is None else self.probs[rows, layer]
        idx = self.topk_idx[rows] if layer is None else self.topk_idx[rows, layer]
        w = self.topk_weight[rows] if layer is None else self.topk_weight[rows, layer]
        out = np.zeros((*idx.shape[:-1], self.dims.num_experts), dtype=np.float16)
        np.put_along_axis(out, idx.astype(np.int64), w, axis=-1)
        return out

    # ------------------------------------------------------------------ views
    @property
    def num_iterations(self) -> int:
        return len(self.iter_request)

    @property
    def num_tokens(self) -> int:
        return int(self.iter_offsets[-1])

    def token_slice(self, it: int) -> slice:
        """Token rows of iteration ``it``."""
        return slice(int(self.iter_offsets[it]), int(self.iter_offsets[it + 1]))

    def iteration_counts(self, it: int) -> np.ndarray:
        """int64[L, J]: tokens routed to each expert in iteration ``it``."""
        idx = self.topk_idx[self.token_slice(it)].astype(np.int64)  # [T, L, K]
        L, J = self.dims.num_layers, self.dims.num_experts
        flat = (np.arange(L)[None, :, None] * J + idx).reshape(-1)
        return np.bincount(flat, minlength=L * J).reshape(L, J)

    def request_iterations(self, request_id: int) -> np.ndarray:
        """int64[n]: iteration indices of one request, in order."""
        return np.flatnonzero(self.iter_request == request_id)

    def request(self, request_id: int) -> RequestMeta:
        for r in self.requests:
            if r.request_id == request_id:
                return r
        raise KeyError(request_id)

    def split(self, split: Split) -> Trace:
        """The sub-trace holding only the requests of ``split`` (arrays copied)."""
        keep = [r for r in self.requests if r.split == split]
        return self.select([r.request_id for r in keep])

    def select(self, request_ids: list[int]) -> Trace:
        """The sub-trace of the given requests, in trace order."""
        wanted = set(request_ids)
        iters = np.flatnonzero(np.isin(self.iter_request, list(wanted)))
        rows = (
            np.concatenate([np.arange(self.iter_offsets[i], self.iter_offsets[i + 1]) for i in iters])
            if len(iters)
            else np.zeros(0, dtype=np.int64)
        )
        lens = np.diff(self.iter_offsets)[iters]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        req_pos = [i for i, r in enumerate(self.requests) if r.request_id in wanted]

        def take(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[rows]

        return replace(
            self,
            requests=[self.requests[i] for i in req_pos],
            iter_request=self.iter_request[iters],
            iter_step=self.iter_step[iters],
            iter_offsets=offsets,
            probs=take(self.probs),
            topk_idx=self.topk_idx[rows],
            topk_weight=self.topk_weight[rows],
            embed=take(self.embed),
            token_ids=take(self.token_ids),
            spec_probs=take(self.spec_probs),
            hidden=take(self.hidden),
            prompt_embed=None if self.prompt_embed is None else self.prompt_embed[req_pos],
            meta=dict(self.meta),
        )

    def sidecar(self) -> dict[str, Any]:
        """The JSON sidecar content (without arrays)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "dims": asdict(self.dims),
            "requests": [asdict(r) for r in self.requests],
            "meta": self.meta,
            "capabilities": sorted(self.capabilities),
        }


def missing_for(needs: frozenset[str], capabilities: frozenset[str]) -> list[str]:
    """The words for what ``needs`` asks of a trace that ``capabilities`` lacks ([] = none).

    Only trace contents count (:data:`CAPABILITIES`); other needs (``future``) are the
    mechanism's business."""
    return [CAPABILITIES[n] + f" ({n})" for n in sorted(needs) if n in CAPABILITIES
            and n not in capabilities]
