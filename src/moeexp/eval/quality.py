"""Quality of a lossy engine run (eMoE's restricted routing) against the unrestricted model.

All comparisons are teacher-forced on the same token sequences, so one early difference
does not cascade: for each sequence both models score every position of the *same* input.

- ``token_agreement``: fraction of positions where both models' argmax next token agree.
- ``kl_mean``: mean over positions of KL(p_ref || p_test) of the next-token distributions
  (nats).
- ``ppl_ref`` / ``ppl_test``: perplexity of each model on the sequences (next-token NLL,
  positions 1..S-1), and ``ppl_ratio = ppl_test / ppl_ref``.

:func:`greedy_agreement` compares two free-running generations position by position (the
fraction of generated tokens that are equal, counting everything after the first
divergence as disagreement only where the tokens differ).

Typical use (the reference must be computed while the model is plain)::

    ref = next_token_logits(model, seqs)
    with offload(model, system="emoe", capacity=0.5, store=store) as om:
        test = next_token_logits(om, seqs)
    quality_report(ref, test, seqs)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F


@torch.no_grad()
def next_token_logits(model: Callable[..., Any], seqs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """float32[S, V] logits of each int64[S] (or [1, S]) sequence, on the CPU."""
    out = []
    inner: Any = getattr(model, "model", model)
    dev = next(iter(inner.parameters())).device
    for s in seqs:
        ids = s.reshape(1, -1)
        res = model(input_ids=ids.to(dev))
        out.append(res.logits[0].float().cpu())
    return out


def kl_divergence(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """float[S]: KL(softmax(ref) || softmax(test)) per position, in nats."""
    lp = F.log_softmax(ref_logits.float(), dim=-1)
    lq = F.log_softmax(test_logits.float(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(dim=-1)


def perplexity(logits: Sequence[torch.Tensor], seqs: Sequence[torch.Tensor]) -> float:
    """exp(mean next-token NLL) over every sequence's positions 1..S-1."""
    nll, n = 0.0, 0
    for lg, s in zip(logits, seqs, strict=True):
        ids = s.reshape(-1).to(lg.device)
        if ids.numel() < 2:
            continue
        nll += float(F.cross_entropy(lg[:-1].float(), ids[1:], reduction="sum"))
        n += ids.numel() - 1
    return float(torch.exp(torch.tensor(nll / n))) if n else float("nan")


def quality_report(ref: Sequence[torch.Tensor], test: Sequence[torch.Tensor],
                   seqs: Sequence[torch.Tensor]) -> dict[str, float]:
    """``token_agreement``, ``kl_mean``, ``ppl_ref``, ``ppl_test``, ``ppl_ratio`` (see module)."""
    agree, kl, n = 0.0, 0.0, 0
    for r, t in zip(ref, test, strict=True):
        agree += float((r.argmax(-1) == t.argmax(-1)).sum())
        kl += float(kl_divergence(r, t).sum())
        n += r.shape[0]
    ppl_ref, ppl_test = perplexity(ref, seqs), perplexity(test, seqs)
    return {
        "token_agreement": agree / n if n else float("nan"),
        "kl_mean": kl / n if n else float("nan"),
        "ppl_ref": ppl_ref,
        "ppl_test": ppl_test,
        "ppl_ratio": ppl_test / ppl_ref if ppl_ref > 0 else float("nan"),
    }


def greedy_agreement(ref_tokens: torch.Tensor, test_tokens: torch.Tensor, prompt_len: int) -> float:
    """Fraction of generated positions (after ``prompt_len``) where two generations agree.

    Both are int64[B, S] outputs of ``generate``; a shorter one counts as disagreeing on the
    missing positions.
    """
    a = ref_tokens.reshape(ref_tokens.shape[0], -1)[:, prompt_len:]
    b = test_tokens.reshape(test_tokens.shape[0], -1)[:, prompt_len:]
    n = max(a.shape[1], b.shape[1])
    if n == 0:
        return float("nan")
    m = min(a.shape[1], b.shape[1])
    same = (a[:, :m] == b[:, :m]).sum().item()
    return same / (n * a.shape[0])
