"""The simulated host CPU: computes the experts an execution policy places on it.

One mechanism object per physical resource (design.md, the execution model): beside the
:class:`~moeexp.simulator.link.Link` (copies) and the
:class:`~moeexp.simulator.device.Device` (slots, GPU compute), :class:`HostCpu` is the
host's compute chain. Its experts run one after another, each using every core
(llama.cpp's and kt-kernel's thread pools split one expert's rows, not the experts); the
weights are read where they live, so no expert crosses the link, only the hidden states
of the tokens routed to them: down before the first CPU expert, the partial outputs up
after the last (:meth:`moeexp.costmodel.roofline.CostModel.hidden_transfer_s`). By
default the hidden-state transfers are not queued behind expert copies on the link (they
are ~H x 2 bytes per token, 8 KB for Mixtral): they are part of this chain's work. With
``execution.hidden_on_link`` the :class:`~moeexp.simulator.exec_device.ExecDevice` books
on the link the ways it names (``up``: the outputs; ``both``: also the way down) and
asks this chain for the rest (``ways``).

Seconds of one expert on n tokens: ``max(B / (eta_f BW_dram), 6 H I n / F_cpu) + t_call``
(:meth:`~moeexp.costmodel.roofline.CostModel.cpu_expert_s`, the profile's ``cpu:``
block); with host-memory sharing the read bandwidth is the share left while the link
copies (:meth:`~moeexp.costmodel.roofline.CostModel.contended_rates`).

Counters (:mod:`moeexp.simulator.report` turns them into metrics): ``calls`` (one per
(layer, expert, pass) computed here: ``cpu_expert_calls``), ``busy_s`` (the chain's
seconds, transfers included: ``cpu_ms_total``), ``tokens`` (tokens over those calls:
``cpu_tokens_total``) and ``hidden_tokens`` (token hidden states sent down, each once
per layer whatever number of CPU experts it uses).
"""

from __future__ import annotations

from collections.abc import Sequence

from moeexp.costmodel.roofline import CostModel


class HostCpu:
    """The host CPU's compute chain and counters (times in seconds).

    Args:
        cost: the run's cost model; its profile must have a ``cpu:`` block that prices
            its ``expert_format`` (checked by the execution policy before any work).
    """

    __slots__ = ("busy_s", "calls", "cost", "free", "hidden_tokens", "tokens")

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.free = 0.0  # when the chain's last work ends
        self.calls = 0
        self.busy_s = 0.0
        self.tokens = 0
        self.hidden_tokens = 0

    def run(self, start: float, tokens: Sequence[int], hidden_tokens: int,
            read_bytes_per_s: float | None = None, ways: int = 2) -> float:
        """Compute experts with ``tokens`` tokens each (one entry per expert, in order) from
        ``start`` (or when the chain is free, if later), after sending ``hidden_tokens``
        hidden states down; returns when the outputs are back on the GPU.

        ``read_bytes_per_s``: the kernel's read bandwidth (None: the profile's own,
        uncontended). ``ways``: hidden-state transfers in this chain's work (2: down and
        up; 1: down only, the caller books the outputs on the link; 0: both booked on the
        link by the caller, ``start`` is when they arrived): the return value is then when
        the last expert ended; the caller counts the booked ways in ``busy_s``."""
        cost = self.cost
        work = cost.hidden_transfer_s(hidden_tokens)
        if ways != 2:
            work *= 0.5 * ways
        for n in tokens:
            work += cost.cpu_expert_s(n, read_bytes_per_s)
        begin = max(start, self.free)
        self.free = begin + work
        self.calls += len(tokens)
        self.busy_s += work
        self.tokens += int(sum(tokens))
        self.hidden_tokens += int(hidden_tokens)
        return self.free
