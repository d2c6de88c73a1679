"""The budgets and SLO targets of continuous batching, and what both batching loops refuse.

The simulator's loop (:mod:`moeexp.simulator.continuous`) and the engine's
(:mod:`moeexp.engine.continuous`) take the same :class:`ServingSettings`
(``backend.serving``), reserve the same KV bytes per request
(:func:`kv_reservation_bytes`), refuse the same impossible runs before any pass
(:func:`check_budgets`) and the same policies (:func:`not_applicable_reason`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from moeexp.cache.base import CachePolicy
from moeexp.errors import ConfigError
from moeexp.schedulers.base import ServingProfile

_SLO_KEYS = frozenset({"ttft", "e2e"})


@dataclass(frozen=True)
class ServingSettings:
    """The batching loop's budgets and SLO targets (``backend.serving``).

    Attributes:
        max_batch_tokens: T_max, tokens one forward pass may process (>= 1).
        max_running: requests the running batch may hold (>= 1; vLLM's max_num_seqs).
        device_memory_gb: device memory, GB (1e9 bytes), shared by the weights, the
            expert cache and the KV pool; None = the hardware profile's ``memory_gb``.
        slo_ttft_scale: TTFT target = this x the request's unloaded TTFT (> 0).
        slo_e2e_scale: end-to-end target = this x its unloaded end-to-end latency (> 0).
        slo_task_scales: task -> {"ttft": x, "e2e": y}, per-task scales replacing the two
            above for that task's requests (each task must exist in the trace).
        mix_prefill: True: joining prompts share a pass with the decoding requests
            (Orca / FastGen-style mixed passes; T_max covers both). False: requests admitted
            at a boundary run their prefill in a pass of their own first, the decoding
            requests wait for it (vLLM's default without chunked prefill); every pass is
            then one phase, prefill or decode.
    """

    max_batch_tokens: int = 2048
    max_running: int = 256
    device_memory_gb: float | None = None
    slo_ttft_scale: float = 5.0
    slo_e2e_scale: float = 5.0
    slo_task_scales: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    mix_prefill: bool = True

    def __post_init__(self) -> None:
        bad = []
        if not isinstance(self.max_batch_tokens, int) or self.max_batch_tokens < 1:
            bad.append(f"max_batch_tokens={self.max_batch_tokens!r} (an integer >= 1)")
        if not isinstance(self.max_running, int) or self.max_running < 1:
            bad.append(f"max_running={self.max_running!r} (an integer >= 1)")
        if self.device_memory_gb is not None and not self.device_memory_gb > 0:
            bad.append(f"device_memory_gb={self.device_memory_gb!r} (> 0, or null)")
        for name in ("slo_ttft_scale", "slo_e2e_scale"):
            if not getattr(self, name) > 0:
                bad.append(f"{name}={getattr(self, name)!r} (an SLO must be > 0)")
        for task, scales in dict(self.slo_task_scales).items():
            unknown = set(scales) - _SLO_KEYS
            if unknown or not all(float(v) > 0 for v in scales.values()):
                bad.append(f"slo_task_scales[{task!r}]={dict(scales)!r} (keys ttft, e2e; "
                           "values > 0)")
        if bad:
            raise ConfigError("backend.serving: " + "; ".join(bad))

    def scales(self, task: str) -> tuple[float, float]:
        """(TTFT scale, end-to-end scale) of ``task``."""
        own = self.slo_task_scales.get(task, {})
        return (float(own.get("ttft", self.slo_ttft_scale)),
                float(own.get("e2e", self.slo_e2e_scale)))


def kv_reservation_bytes(kv_per_token: int, prompt_tokens: int, task: str,
                         profile: ServingProfile) -> int:
    """KV bytes a request reserves when admitted: ``kv_per_token`` x (its prompt + its
    task's profiled mean output length, rounded to a token count)."""
    return kv_per_token * int(round(prompt_tokens + profile.output_len(task)))


def check_budgets(first_tokens: Sequence[int], kv_bytes: Sequence[int],
                  settings: ServingSettings, pool: int, pool_detail: str = "",
                  remedy: str = "") -> None:
    """Every request's first pass fits T_max (no chunked prefill: a prefill is its whole
    prompt) and its reservation fits the KV pool alone.

    Args:
        first_tokens: int[n] tokens of each request's first forward pass.
        kv_bytes: int[n] each request's KV reservation, bytes.
        settings: the budgets (``max_batch_tokens``).
        pool: the KV pool, bytes.
        pool_detail: appended to the pool's size in the message (where it comes from).
        remedy: appended to the pool message after "; " (what to raise), if any.

    Raises:
        ConfigError: naming the numbers and the bound to raise.
    """
    longest = max(first_tokens)
    if longest > settings.max_batch_tokens:
        raise ConfigError(f"backend.serving: max_batch_tokens={settings.max_batch_tokens} is "
                          f"below one prompt ({longest} tokens); T_max must be >= {longest} "
                          "(no chunked prefill)")
    biggest = max(kv_bytes)
    if biggest > pool:
        raise ConfigError(f"backend.serving: one request's KV cache ({biggest} bytes) "
                          f"exceeds the KV pool ({pool} bytes{pool_detail})"
                          + (f"; {remedy}" if remedy else ""))


def not_applicable_reason(cache: CachePolicy) -> str | None:
    """Why continuous batching cannot serve this system honestly, or None."""
    if cache.needs_future:
        return (f"not applicable: cache={cache.name} needs the whole future access stream, "
                "which under continuous batching depends on the schedule the replay itself "
                "makes (use scheduler=static for a Belady bound)")
    return None
