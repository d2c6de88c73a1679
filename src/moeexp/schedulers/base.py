"""The scheduler interface: which waiting requests join the running batch, and when.

A scheduler *decides*; the batching loop (:mod:`moeexp.serving.loop`) is the
mechanism that runs forward passes, keeps the clock and the budgets, and checks every
decision against them. At every iteration boundary (an *event-driven* scheduler: only at
boundaries after an arrival or a completion, or with nothing running) the loop calls::

    admit(SchedulerView) -> list[int]        units to start now, in order
      ... one forward pass of the running batch ...
    on_pass(units, finished)                 who took part, who finished

The view holds plain numbers only (seconds, tokens, bytes): the waiting requests with their
SLO targets and the token / memory / batch budgets left. A scheduler never sees a trace,
a device or a cost model; what it needs to know of them comes fitted, once, as a
:class:`ServingProfile` (output lengths per task, the per-token cost c and the expected
expert-loading latency ΔE of eMoE's Eq. 3; :mod:`moeexp.simulator.serving_profile` fits it
from the store split and the cost model).

A scheduler may return only units of ``view.waiting``; the loop raises if an admission
breaks a budget (``max_batch_tokens``, ``max_running``, the KV pool), so budget accounting
is written once, in the mechanism, and schedulers only choose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from moeexp.registry import Registry


@dataclass(frozen=True)
class ServingProfile:
    """What the scheduler may know of the system, fitted on the store split.

    Attributes:
        output_len_by_task: task label -> mean output length in tokens (store requests).
        output_len_mean: mean output length over every store request (tasks not seen).
        token_s: c, seconds per token (prompt or generated) of a request served alone with
            every expert resident: sum of the store requests' unloaded latencies over the
            sum of the tokens their passes processed.
        token_s_batched: c with the store split served as one batch (every request
            together, every expert resident): that batch's duration over the same tokens.
            Smaller where passes are memory bound (a decode pass of n tokens costs about
            what one token costs).
        expert_load_s: ΔE, expected seconds of expert loading one admitted request causes
            (``copy_s`` x mean experts its first pass needs beyond the previous request's).
    """

    output_len_by_task: Mapping[str, float]
    output_len_mean: float
    token_s: float
    expert_load_s: float
    token_s_batched: float = float("nan")

    def output_len(self, task: str) -> float:
        """The profiled mean output length (tokens) of ``task`` (overall mean if unseen)."""
        return float(self.output_len_by_task.get(task, self.output_len_mean))


@dataclass(frozen=True)
class WaitingRequest:
    """A request in the waiting queue.

    Attributes:
        unit: the loop's index of the served request.
        task: its task label ("" = untyped).
        arrival_s: arrival time, s.
        first_tokens: tokens of its first forward pass (the prompt, W, with a prefill).
        kv_bytes: KV-cache bytes it reserves when admitted (prompt + expected output).
        slo_ttft_s: its time-to-first-token target, s (NaN: no prefill, not defined).
        slo_e2e_s: its end-to-end target, s.
    """

    unit: int
    task: str
    arrival_s: float
    first_tokens: int
    kv_bytes: int
    slo_ttft_s: float
    slo_e2e_s: float


@dataclass(frozen=True)
class RunningRequest:
    """A request of the running batch (admitted, not finished).

    Attributes:
        unit, task, arrival_s, slo_ttft_s, slo_e2e_s: as in :class:`WaitingRequest`.
        start_s: when it was admitted, s.
        passes_done: forward passes it took part in so far.
        next_tokens: tokens it adds to the next forward pass (1 per decode step).
    """

    unit: int
    task: str
    arrival_s: float
    slo_ttft_s: float
    slo_e2e_s: float
    start_s: float
    passes_done: int
    next_tokens: int


@dataclass(frozen=True)
class SchedulerView:
    """The state at one iteration boundary.

    Attributes:
        now_s: the clock, s.
        waiting: arrived, not admitted requests, in arrival order.
        running: the running batch, in admission order.
        remaining: requests not admitted yet, arrived or not (``len(waiting)`` or more).
        tokens_left: tokens the next forward pass may still take (T_max minus the
            running requests' ``next_tokens``).
        running_left: requests that may still join (``max_running`` minus running).
        kv_left_bytes: KV-pool bytes not reserved by running requests.
    """

    now_s: float
    waiting: Sequence[WaitingRequest]
    running: Sequence[RunningRequest]
    remaining: int
    tokens_left: int
    running_left: int
    kv_left_bytes: int


class Scheduler:
    """Base class: admit nothing. Subclasses override :meth:`admit`."""

    name: ClassVar[str] = "base"
    #: True: called only at boundaries after an arrival or a completion (or when nothing
    #: runs); False: at every iteration boundary.
    event_driven: ClassVar[bool] = False
    #: False: the loop does not hold it to the token / memory budgets (static batching,
    #: today's simulator, has none).
    budgeted: ClassVar[bool] = True

    def __init__(self) -> None:
        self.profile: ServingProfile | None = None
        self.counts: dict[str, int] = {}

    def fit(self, profile: ServingProfile) -> None:
        """Take the fitted profile (called once, before serving)."""
        self.profile = profile

    def admit(self, view: SchedulerView) -> list[int]:
        """Units of ``view.waiting`` to admit now, in the order they join."""
        return []

    def on_pass(self, units: Sequence[int], finished: Sequence[int]) -> None:
        """``units`` took part in a forward pass; ``finished`` of them are done."""

    def count(self, what: str) -> None:
        """Count one decision outcome (``stats`` reports it as ``scheduler_<what>``)."""
        self.counts[what] = self.counts.get(what, 0) + 1

    def stats(self) -> dict[str, float]:
        """Counters of the decisions (refusals by reason ...)."""
        return {k: float(v) for k, v in sorted(self.counts.items())}


def fits(req: WaitingRequest, tokens_left: int, running_left: int, kv_left: int) -> str | None:
    """Why ``req`` does not fit the budgets left (``tokens``, ``running``, ``memory``), or
    None when it fits. One rule for every budgeted scheduler."""
    if running_left < 1:
        return "running"
    if req.first_tokens > tokens_left:
        return "tokens"
    if req.kv_bytes > kv_left:
        return "memory"
    return None


def check_admission(view: SchedulerView, chosen: Sequence[int], scheduler: Scheduler) -> None:
    """What a batching loop (the simulator's, the engine's) holds every admission to: only
    units of ``view.waiting``, once each, and, for a budgeted scheduler, within the tokens,
    places and KV bytes left. RuntimeError naming the broken rule otherwise (a scheduler bug)."""
    waiting = {w.unit: w for w in view.waiting}
    if len(set(chosen)) != len(chosen) or any(c not in waiting for c in chosen):
        raise RuntimeError(f"scheduler={scheduler.name} admitted {list(chosen)}, not distinct "
                           f"waiting requests {sorted(waiting)}")
    if not scheduler.budgeted:
        return
    picked = [waiting[c] for c in chosen]
    over = [name for name, used, left in (
        ("max_batch_tokens", sum(w.first_tokens for w in picked), view.tokens_left),
        ("max_running", len(picked), view.running_left),
        ("the KV pool", sum(w.kv_bytes for w in picked), view.kv_left_bytes)) if used > left]
    if over:
        raise RuntimeError(f"scheduler={scheduler.name} broke {', '.join(over)} admitting "
                           f"{list(chosen)}")


SCHEDULERS: Registry[Scheduler] = Registry("scheduler")
