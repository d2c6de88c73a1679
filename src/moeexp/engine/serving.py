"""Helpers of the engine backend: replaying a trace's tokens, per-forward-pass series.

* :func:`recorded_tokens` reads, for every request of a recorded trace, the tokens fed at
  decode steps 1..N-1 (the tokens the recorder generated), checking that the prompt the
  backend serves is the trace's; :func:`forced_tokens` is the ``generate`` logits processor
  that makes the model emit exactly them (every other logit set to -inf, then greedy).
* :class:`IterationProbe` hooks an :class:`~moeexp.engine.offload.OffloadedModel`'s model
  and records, per forward pass, hits, misses, stall and duration: the simulator's
  ``iter_*`` series.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from moeexp.errors import ConfigError
from moeexp.traces.schema import Trace


def recorded_tokens(trace: Trace, prompts: Sequence[Any]) -> dict[int, list[int]]:
    """``{request_id: [token fed at step 1, ..., step N-1]}`` for every prompt.

    Raises:
        ConfigError: a prompt is not in the trace, or its ids or length differ from the
            trace's prefill (the trace was recorded for other prompts).
    """
    out: dict[int, list[int]] = {}
    off = trace.iter_offsets
    for p in prompts:
        rid = int(p.request_id)
        its = trace.request_iterations(rid)
        if len(its) == 0:
            raise ConfigError(f"request {rid} is not in the trace: token replay needs the "
                              "trace recorded for these very prompts")
        its = its[np.argsort(trace.iter_step[its], kind="stable")]
        prefill = trace.token_ids[int(off[its[0]]): int(off[its[0] + 1])].tolist()
        if prefill != list(p.input_ids) or len(its) != int(p.output_len):
            raise ConfigError(f"request {rid}: the trace recorded a {len(prefill)}-token prompt "
                              f"and {len(its)} passes, the backend serves {len(p.input_ids)} "
                              f"tokens and {p.output_len} passes (not the same prompt)")
        out[rid] = [int(trace.token_ids[int(off[i])]) for i in its[1:]]
    return out


def forced_tokens(tokens: Sequence[int], prompt_len: int) -> Any:
    """A ``LogitsProcessorList`` that forces generated token s to ``tokens[s]``.

    Steps past ``len(tokens)`` (the last one: its token is never fed back) are left to the
    decoding rule. Batch size 1.
    """
    from transformers import LogitsProcessor, LogitsProcessorList

    toks = list(tokens)

    class ForceRecorded(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> Any:
            step = input_ids.shape[1] - prompt_len
            if step < len(toks):
                forced = torch.full_like(scores, float("-inf"))
                forced[:, toks[step]] = 0.0
                return forced
            return scores

    return LogitsProcessorList([ForceRecorded()])


class IterationProbe:
    """Per-forward-pass hits, misses, stall (ms) and duration (ms) of an offloaded model.

    Its pre-hook runs before the engine's, its post-hook after (so a CUDA pass has been
    synchronised). ``remove()`` detaches it.
    """

    def __init__(self, om: Any) -> None:
        self.om = om
        self.rows: list[tuple[int, int, float, int, int, float]] = []
        self._start: tuple[int, int, float, int, float] | None = None
        m = om.model
        self._handles = [m.register_forward_pre_hook(self._pre, prepend=True),
                         m.register_forward_hook(self._post)]

    def _snap(self) -> tuple[int, int, float, int]:
        c = self.om.engine.counters
        return c.hits, c.accesses, c.stall_s, len(c.cuda_stalls)

    def _pre(self, module: Any, args: Any) -> None:
        self._start = (*self._snap(), time.perf_counter())

    def _post(self, module: Any, args: Any, output: Any) -> None:
        if self._start is None:
            return
        h0, a0, s0, c0, t0 = self._start
        h1, a1, s1, c1 = self._snap()
        self.rows.append((h1 - h0, (a1 - a0) - (h1 - h0), (s1 - s0) * 1e3, c0, c1,
                          (time.perf_counter() - t0) * 1e3))
        self._start = None

    def series(self) -> dict[str, list[float]]:
        """``iter_hits``, ``iter_misses``, ``iter_stall_ms``, ``iter_ms`` (one per pass)."""
        stalls = self.om.engine.counters.cuda_stalls
        if stalls:
            torch.cuda.synchronize(self.om.engine.device)
        cuda_ms = [sum(a.elapsed_time(b) for a, b in stalls[c0:c1]) if c1 > c0 else 0.0
                   for _, _, _, c0, c1, _ in self.rows]
        return {"iter_hits": [float(r[0]) for r in self.rows],
                "iter_misses": [float(r[1]) for r in self.rows],
                "iter_stall_ms": [r[2] + c for r, c in zip(self.rows, cuda_ms, strict=True)],
                "iter_ms": [r[5] for r in self.rows]}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
