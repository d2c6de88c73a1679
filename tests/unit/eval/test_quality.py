"""Quality helpers of lossy runs: agreement, KL, perplexity."""

from __future__ import annotations

import math

import pytest
import torch
from tests.unit.conftest import prompt_ids

from moeexp.engine import offload
from moeexp.eval.quality import (
    greedy_agreement,
    kl_divergence,
    next_token_logits,
    perplexity,
    quality_report,
)


def test_kl_and_perplexity_worked_examples() -> None:
    """KL(p||p) = 0; KL([.5,.5] || [.9,.1]) = .5 ln(.5/.9) + .5 ln(.5/.1) = 0.5108 nats.
    A model putting probability 1/4 on every next token has perplexity 4."""
    p = torch.log(torch.tensor([[0.5, 0.5]]))
    q = torch.log(torch.tensor([[0.9, 0.1]]))
    assert kl_divergence(p, p).item() == pytest.approx(0.0, abs=1e-7)
    assert kl_divergence(p, q).item() == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5), abs=1e-5)
    uniform = torch.zeros(5, 4)
    assert perplexity([uniform], [torch.tensor([0, 1, 2, 3, 0])]) == pytest.approx(4.0)


def test_greedy_agreement() -> None:
    """Prompt of 2, generated (5, 6, 7) vs (5, 9, 7): 2 of 3 positions agree."""
    a = torch.tensor([[1, 2, 5, 6, 7]])
    b = torch.tensor([[1, 2, 5, 9, 7]])
    assert greedy_agreement(a, b, 2) == pytest.approx(2 / 3)
    assert greedy_agreement(a, a[:, :4], 2) == pytest.approx(2 / 3)  # missing position


def test_report_of_an_exact_run_is_perfect(mixtral) -> None:
    """An exact engine run scores agreement 1, KL ~0 and the same perplexity."""
    seqs = [prompt_ids(9, seed=s)[0] for s in (0, 1)]
    ref = next_token_logits(mixtral, seqs)
    with offload(mixtral, capacity=0.5) as om:
        test = next_token_logits(om, seqs)
    q = quality_report(ref, test, seqs)
    assert q["token_agreement"] == 1.0 and q["kl_mean"] < 1e-9
    assert q["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)


def test_report_of_a_lossy_run(mixtral, store_of) -> None:
    """Restricted routing with a quarter of the experts pinned changes the distributions:
    KL > 0 and agreement below 1 (on these seeds), all numbers finite."""
    seqs = [prompt_ids(12, seed=s)[0] for s in (3, 4)]
    ref = next_token_logits(mixtral, seqs)
    with offload(mixtral, cache={"name": "static", "scratch_slots": 1}, capacity=0.25,
                 store=store_of("mixtral"), restricted_routing=True, renormalize=True) as om:
        test = next_token_logits(om, seqs)
        sub = om.metrics()["substitution_rate"]
    q = quality_report(ref, test, seqs)
    assert 0 < sub < 1
    assert q["kl_mean"] > 0 and 0 <= q["token_agreement"] < 1
    assert all(math.isfinite(v) for v in q.values())
