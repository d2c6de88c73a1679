"""``emoe``: eMoE's task-aware, SLO-aware admission (eMoE §3.5, Algorithm 1; algorithms.md §6).

**Eq. 3.** If new requests are admitted now, the expected end-to-end latency of a member i
of the scheduled set S is::

    t_i = k·ΔE + (W + n_i·G_i)·c + r_i

with ΔE the profiled expert-loading latency of one admitted request (k of them are being
admitted; the paper's single admission is k = 1), W the input tokens of the requests being
admitted, G_i i's remaining generation length, n_i the members of S that finish after i
(``G_j >= G_i``, i itself included: its own token is in each of its remaining passes), c
the profiled per-token cost and r_i its runtime so far (now - arrival, queueing included).
ΔE, c and the output lengths come fitted (:class:`~moeexp.schedulers.base.ServingProfile`),
never typed in. Which fitted c (``token_cost``): ``alone`` (a request served by itself) or
``batched`` (the store split served as one batch). Eq. 3 is linear in tokens while a
memory-bound decode pass of n tokens costs about what one token costs, so no single c is
right at every batch size: ``alone`` over-estimates t_i in a large batch (refuses early),
``batched`` is exact near the store's batch size and under-estimates small batches.

**G.** At admission G_i = the task's profiled mean output length; every forward pass i takes
part in decrements it by one; if it reaches 0 before i finishes it is reset to
``restart_fraction`` (paper: ~5 %) of its initial value, at least 1 token.

**Algorithm 1, the reading implemented.** The pseudo-code names the queue and the running
batch R and S but uses them crosswise (it sorts and pops from one while testing latencies
on the other). Read here: R is the **waiting queue** (sorted by SLO stringency: the TTFT
target, tightest first; the end-to-end target where no TTFT is defined; ties by arrival)
and S the **scheduled set** (the running batch plus what this call admitted). Each request
r of R, in that order, is tried greedily (a refused one does not stop the scan): it is
admitted when it fits the token budget T_max (``max_batch_tokens``: the next pass's tokens),
the running-request limit and the KV pool, and no member of S that was on track (t_i <= its
SLO before r's admission) would exceed its end-to-end SLO after it. Why "on track": the
literal test "no scheduled request's latency exceeds its SLO" never admits a request that
already waited past its own SLO, nor anything next to a member that is already late, so
the queue would deadlock under load; a late request gains nothing from waiting longer,
so it is admitted when it harms no member that can still make it. The scheduler runs on
every arrival and every completion (``event_driven``), and whenever nothing runs.
Counters: ``refused_<slo|tokens|memory|running>`` per candidate and call, ``g_resets``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moeexp.errors import ConfigError
from moeexp.schedulers.base import (
    SCHEDULERS,
    Scheduler,
    SchedulerView,
    ServingProfile,
    WaitingRequest,
    fits,
)


def expected_latency(now_s: float, arrival_s: Sequence[float], remaining: Sequence[float],
                     new_tokens: int, num_new: int, load_s: float, token_s: float) -> np.ndarray:
    """Eq. 3 for every member of a scheduled set.

    Args:
        now_s: the clock, s.
        arrival_s: float[M] arrival of each member, s (r_i = now - arrival).
        remaining: float[M] G_i, remaining generation length of each member, tokens.
        new_tokens: W, input tokens of the requests being admitted (0: none).
        num_new: k, requests being admitted (k·ΔE of expert loading).
        load_s: ΔE, s per admitted request; token_s: c, s per token.

    Returns:
        float[M] t_i, s.
    """
    g = np.asarray(remaining, dtype=np.float64)
    n = (g[None, :] >= g[:, None]).sum(axis=1)  # n_i = #{j : G_j >= G_i}, i included
    r = now_s - np.asarray(arrival_s, dtype=np.float64)
    return num_new * load_s + (new_tokens + n * g) * token_s + r


#: The fitted per-token costs Eq. 3 may use (ServingProfile.token_s / token_s_batched).
TOKEN_COSTS: tuple[str, ...] = ("batched", "alone")


def _stringency(w: WaitingRequest) -> tuple[float, float, int]:
    slo = w.slo_ttft_s if np.isfinite(w.slo_ttft_s) else w.slo_e2e_s
    return slo, w.arrival_s, w.unit


@SCHEDULERS.register("emoe")
class EMoEScheduler(Scheduler):
    """eMoE's admission (see the module docstring).

    Args:
        restart_fraction: G is reset to this fraction of its start when it reaches 0 before
            the request finished (paper: ~5 %), in (0, 1].
        token_cost: which fitted c Eq. 3 uses: ``batched`` (default) or ``alone`` (module
            docstring).
        task_aware: G starts at the request's task's profiled mean output length (eMoE);
            False: at the store split's overall mean for every request (the task-agnostic
            ablation of ``+experiment=emoe_serving``).
    """

    event_driven = True

    def __init__(self, restart_fraction: float = 0.05, token_cost: str = "batched",
                 task_aware: bool = True) -> None:
        super().__init__()
        if not 0.0 < restart_fraction <= 1.0:
            raise ConfigError(f"scheduler=emoe: restart_fraction must be in (0, 1], got "
                              f"{restart_fraction!r}")
        if token_cost not in TOKEN_COSTS:
            raise ConfigError(f"scheduler=emoe: token_cost={token_cost!r}; valid: "
                              f"{', '.join(TOKEN_COSTS)}")
        if not isinstance(task_aware, bool):
            raise ConfigError(f"scheduler=emoe: task_aware must be true or false, got "
                              f"{task_aware!r}")
        self.restart_fraction = float(restart_fraction)
        self.token_cost = token_cost
        self.task_aware = task_aware
        self.g: dict[int, float] = {}  # unit -> G_i, remaining generation length (tokens)
        self.g0: dict[int, float] = {}  # unit -> G_i at admission

    def _profile(self) -> ServingProfile:
        if self.profile is None:
            raise RuntimeError("scheduler=emoe: fit(profile) was not called before serving")
        return self.profile

    @property
    def token_s(self) -> float:
        """c, s per token: the fitted cost ``token_cost`` names."""
        p = self._profile()
        c = p.token_s_batched if self.token_cost == "batched" else p.token_s
        if not np.isfinite(c):
            raise RuntimeError(f"scheduler=emoe: the profile has no {self.token_cost} token cost")
        return float(c)

    def _output_len(self, task: str) -> float:
        """G at admission: the task's profiled mean output length (or the overall mean)."""
        prof = self._profile()
        return prof.output_len(task) if self.task_aware else float(prof.output_len_mean)

    def admit(self, view: SchedulerView) -> list[int]:
        """Greedy admission in SLO-stringency order (module docstring)."""
        prof, c = self._profile(), self.token_s
        load = prof.expert_load_s
        arr = [r.arrival_s for r in view.running]
        g = [self.g[r.unit] for r in view.running]
        slo = [r.slo_e2e_s for r in view.running]
        tokens, places, kv = view.tokens_left, view.running_left, view.kv_left_bytes
        w_sum = 0
        out: list[int] = []
        for w in sorted(view.waiting, key=_stringency):
            why = fits(w, tokens, places, kv)
            if why is None and arr:
                g_w = self._output_len(w.task)
                before = expected_latency(view.now_s, arr, g, w_sum, len(out), load, c)
                after = expected_latency(view.now_s, [*arr, w.arrival_s], [*g, g_w],
                                         w_sum + w.first_tokens, len(out) + 1, load, c)[:-1]
                lim = np.asarray(slo)
                if np.any((before <= lim) & (after > lim)):
                    why = "slo"
            if why is not None:
                self.count(f"refused_{why}")
                continue
            out.append(w.unit)
            self._start(w)
            arr.append(w.arrival_s)
            g.append(self.g[w.unit])
            slo.append(w.slo_e2e_s)
            w_sum += w.first_tokens
            tokens -= w.first_tokens
            places -= 1
            kv -= w.kv_bytes
        return out

    def _start(self, w: WaitingRequest) -> None:
        g0 = self._output_len(w.task)
        self.g0[w.unit] = g0
        self.g[w.unit] = g0

    def on_pass(self, units: Sequence[int], finished: Sequence[int]) -> None:
        """Decrement G of every member; reset it to ``restart_fraction`` of its start when
        it reached 0 before the request finished; forget the finished."""
        done = set(finished)
        for u in units:
            if u in done:
                self.g.pop(u, None)
                self.g0.pop(u, None)
                continue
            self.g[u] -= 1.0
            if self.g[u] <= 0.0:
                self.g[u] = max(1.0, self.restart_fraction * self.g0[u])
                self.count("g_resets")
