"""``fcfs``: first-come-first-served continuous batching (vLLM, DeepSpeed-FastGen).

At every iteration boundary the head of the waiting queue joins the running batch while it
fits the budgets left (the next pass's tokens under ``max_batch_tokens``, a free place
under ``max_running``, its KV reservation in the pool); the first request that does not fit
stops admission (no overtaking: strict arrival order, as vLLM's FCFS policy). Counters:
``blocked_<reason>``, the boundaries at which the head waited for that budget.
"""

from __future__ import annotations

from moeexp.schedulers.base import SCHEDULERS, Scheduler, SchedulerView, fits


@SCHEDULERS.register("fcfs")
class FCFSScheduler(Scheduler):
    """Strict-arrival-order admission at every iteration boundary."""

    def admit(self, view: SchedulerView) -> list[int]:
        """The longest prefix of the waiting queue that fits the budgets."""
        out: list[int] = []
        tokens, places, kv = view.tokens_left, view.running_left, view.kv_left_bytes
        for w in view.waiting:
            why = fits(w, tokens, places, kv)
            if why is not None:
                self.count(f"blocked_{why}")
                break
            out.append(w.unit)
            tokens -= w.first_tokens
            places -= 1
            kv -= w.kv_bytes
        return out
