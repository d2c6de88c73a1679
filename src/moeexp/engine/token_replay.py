"""Replaying a recorded trace's tokens through the engine (``backend.replay_tokens``).

* :func:`recorded_tokens` reads, for every request of a recorded trace, the tokens fed at
  decode steps 1..N-1 (the tokens the recorder generated), checking that the prompt the
  backend serves is the trace's; :func:`forced_tokens` is the ``generate`` logits processor
  that makes the model emit exactly them (every other logit set to -inf, then greedy).
"""

from __future__ import annotations

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
    if trace.token_ids is None:
        raise ConfigError("token replay needs the trace's token ids; this trace has none (an "
                          "imported, routing-only trace): serve it with backend=sim")
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
