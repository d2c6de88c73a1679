"""The copy engine: one background thread moves experts from the host store into slots.

Two sources feed it. **Demand loads** (submitted by the compute thread, slot already
assigned) always go first, in submission order. When none is waiting, the worker asks the
engine for the next **prefetch** (``prefetch_source``): the engine pops its priority queue
and makes the eviction decision at that moment, as the simulator starts a prefetch only
when its copy engine is free. So a queued prefetch never holds a slot, and on-demand loads
pre-empt every prefetch that has not started.

CPU (the device is the CPU too): the worker does the real ``copy_`` into the slot buffers.
An optional **emulated link bandwidth** (bytes/s) makes the worker sleep so that each copy
takes ``bytes / bandwidth`` seconds in total: an emulation of a PCIe link, so that a CPU run
shows prefetch/compute overlap honestly. Without it a CPU copy costs a memcpy.

CUDA: copies are issued on a dedicated copy stream from pinned host memory
(``non_blocking=True``); an event recorded after each copy marks the slot ready. Before
overwriting a slot the copy stream waits on the slot's last-use event (recorded on the
compute stream after the kernel that read it). The compute stream waits on a slot's event
with ``wait_event``: the host never synchronises on a copy on the hot path. The worker keeps
at most ``max_inflight`` copies in flight, synchronising on the oldest *in its own thread*.

Copy granularity (``chunk_bytes``, from ``hardware.copy_chunk_mb``;
:mod:`moeexp.costmodel.copies`): 0 or at least an expert = whole-expert copies (above).
Otherwise an expert is copied as byte ranges of its tensors laid end to end (chunks of
``chunk_bytes``, the rest last), and after each chunk the worker looks at the demand
queue: when a demand load waits and the copy is a prefetch for another layer than the
demand's (a prefetch for the demand's own layer is one of that layer's experts: it
finishes first), the prefetch is set aside and resumes, from its next chunk, once no
demand load waits (before any new prefetch starts). CPU: each chunk is a ``copy_`` of
those slices, paced to ``chunk bytes / bandwidth`` under an emulated link. CUDA: each
chunk is issued on the copy stream and followed by an event; at most ``max_inflight``
chunks are queued on the stream (the worker synchronises on the oldest), so a demand load
waits behind at most that many chunks instead of whole copies.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from moeexp.engine.store import HostStore, Key, SlotPool

log = logging.getLogger(__name__)

JobState = Literal["queued", "copying", "done"]


@dataclass(eq=False)
class CopyJob:
    """Move expert ``key`` into ``slot`` (a demand load or a started prefetch)."""

    key: Key
    slot: int
    demand: bool
    nbytes: int
    state: JobState = "queued"
    issued: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    event: torch.cuda.Event | None = None  # CUDA: recorded after the copy
    t0: float = 0.0
    #: perf_counter when its copy began (CPU: the worker took it; a prefetch: started)
    started_at: float = 0.0
    #: CUDA: a timing event recorded on the copy stream just before its copy
    start_event: torch.cuda.Event | None = None
    #: chunked copies: chunks copied (or issued) so far
    chunks_done: int = 0
    #: a demand load on another link that must land before this one starts (several
    #: emulated devices with one blocking demand thread, :mod:`moeexp.engine.devices`)
    after: CopyJob | None = None


class CopyEngine:
    """The background copy thread.

    Args:
        store: source of expert bytes.
        pool: destination slots.
        prefetch_source: called by the worker when no demand load waits; returns a started
            prefetch job (slot assigned, state ``copying``) or None.
        bandwidth_bps: CPU only: emulated link bandwidth in bytes/s (None = real memcpy).
        max_inflight: CUDA only: copies (chunked: chunks) issued on the stream before the
            worker waits.
        chunk_bytes: copy granularity in bytes: 0 (or >= one expert) = whole-expert copies;
            else chunks of this size after which a demand load may go first (module doc).
    """

    def __init__(self, store: HostStore, pool: SlotPool, *,
                 prefetch_source: Callable[[], CopyJob | None] | None = None,
                 bandwidth_bps: float | None = None, max_inflight: int = 2,
                 chunk_bytes: int = 0) -> None:
        self.store = store
        self.pool = pool
        self.prefetch_source = prefetch_source
        self.cuda = pool.device.type == "cuda"
        self.bandwidth_bps = float(bandwidth_bps) if bandwidth_bps else None
        self.max_inflight = max(1, int(max_inflight)) if self.cuda else 1
        self.stream = torch.cuda.Stream(device=pool.device) if self.cuda else None
        self.last_use: list[torch.cuda.Event | None] = [None] * pool.num_slots
        self._demand: collections.deque[CopyJob] = collections.deque()
        self._cond = threading.Condition()
        self._wakeups = 0
        self._stop = False
        self._outstanding: set[CopyJob] = set()
        self._error: BaseException | None = None
        self.bytes_copied = 0
        self.copy_seconds = 0.0
        self._thread: threading.Thread | None = None  # started by the first submit/wake
        nbytes = pool.spec.nbytes
        if chunk_bytes < 0:
            raise ValueError(f"chunk_bytes must be >= 0 (0 = whole expert), got {chunk_bytes}")
        #: chunk byte ranges [lo, hi) of one expert; empty = whole-expert copies
        self.chunks: list[tuple[int, int]] = (
            [(lo, min(lo + chunk_bytes, nbytes)) for lo in range(0, nbytes, chunk_bytes)]
            if 0 < chunk_bytes < nbytes else [])
        self._held: collections.deque[CopyJob] = collections.deque()  # overtaken prefetches
        self._chunk_events: collections.deque[torch.cuda.Event] = collections.deque()
        self.preemptions = 0  # prefetches a demand load overtook

    def _ensure_thread(self) -> None:
        """Start the worker (called with ``_cond`` held) once the owner is fully built."""
        if self._thread is None and not self._stop:
            self._thread = threading.Thread(target=self._run, name="moeexp-copy", daemon=True)
            self._thread.start()

    # ---- compute-thread API ---------------------------------------------------------
    def submit(self, key: Key, slot: int, after: CopyJob | None = None) -> CopyJob:
        """Queue a demand load of ``key`` into ``slot`` (ahead of every prefetch); with
        ``after`` (CPU), its copy starts only once that job (on another link) landed."""
        if after is not None and self.cuda:
            raise RuntimeError("chained demand loads (several emulated devices) are CPU-only")
        job = CopyJob(key, slot, True, self.pool.spec.nbytes, after=after)
        with self._cond:
            self._raise_if_failed()
            self._demand.append(job)
            self._outstanding.add(job)
            self._wakeups += 1
            self._ensure_thread()
            self._cond.notify()
        return job

    def started_prefetch(self, key: Key, slot: int) -> CopyJob:
        """A prefetch job the engine's ``prefetch_source`` is handing to the worker."""
        job = CopyJob(key, slot, False, self.pool.spec.nbytes, state="copying",
                      started_at=time.perf_counter())
        with self._cond:
            self._outstanding.add(job)
            self.bytes_copied += job.nbytes
        return job

    def reset_counters(self) -> None:
        """Zero ``bytes_copied`` and ``copy_seconds`` (copies in flight count afterwards)."""
        with self._cond:
            self.bytes_copied = 0
            self.copy_seconds = 0.0

    def wake(self) -> None:
        """New prefetches are queued (or prefetching resumed): let the worker look."""
        with self._cond:
            self._wakeups += 1
            self._ensure_thread()
            self._cond.notify()

    def is_ready(self, job: CopyJob) -> bool:
        """The copy has landed (CUDA: its event completed; no synchronisation)."""
        if job.state == "done":
            return True
        if self.cuda and job.issued.is_set() and job.event is not None:
            return bool(job.event.query())
        return False

    def wait(self, job: CopyJob) -> None:
        """Make the compute wait for ``job``.

        CPU: block until the bytes are in the slot. CUDA: block only until the copy is
        *issued*, then make the current (compute) stream wait on its event.
        """
        done = job.issued if self.cuda else job.finished
        while not done.wait(timeout=0.5):
            self._raise_if_failed()
        self._raise_if_failed()
        if self.cuda and job.event is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(job.event)

    def wait_landed(self, job: CopyJob) -> None:
        """Block the calling thread until ``job``'s bytes are in its slot (CUDA: its event
        has completed). Off the hot path: a demand load waiting for a slot to free up."""
        while not job.issued.wait(timeout=0.5):
            self._raise_if_failed()
        self._raise_if_failed()
        if self.cuda and job.event is not None:
            job.event.synchronize()
        else:
            while not job.finished.wait(timeout=0.5):
                self._raise_if_failed()

    def mark_used(self, slots: list[int]) -> None:
        """CUDA: record that the compute stream read ``slots`` (guards their reuse)."""
        if self.cuda and slots:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.pool.device))
            for s in slots:
                self.last_use[s] = ev

    def drain(self) -> None:
        """Block until every started or queued copy has landed (not for the hot path)."""
        while True:
            with self._cond:
                self._raise_if_failed()
                pending = list(self._outstanding)
            if not pending:
                return
            for j in pending:
                while not j.finished.wait(timeout=0.5):
                    self._raise_if_failed()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the expert copy thread failed") from self._error

    # ---- worker thread --------------------------------------------------------------
    def _next(self, inflight: int) -> CopyJob | None:
        """The next job to copy; blocks while there is nothing to do and nothing in flight."""
        while True:
            with self._cond:
                if self._stop:
                    return None
                if self._demand:
                    job = self._demand.popleft()
                    job.state = "copying"
                    job.started_at = time.perf_counter()
                    self.bytes_copied += job.nbytes
                    return job
                if self._held:
                    return self._held.popleft()  # an overtaken prefetch resumes
                seen = self._wakeups
            started = self.prefetch_source() if self.prefetch_source is not None else None
            if started is not None or inflight:
                return started
            with self._cond:
                if self._wakeups == seen and not self._demand and not self._stop:
                    self._cond.wait()

    def _run(self) -> None:
        with torch.no_grad():
            self._loop()

    def _loop(self) -> None:
        inflight: collections.deque[CopyJob] = collections.deque()
        try:
            while True:
                job = self._next(len(inflight))
                if job is None:
                    if inflight:
                        self._finish(inflight.popleft())
                        continue
                    return  # stopped
                if job.after is not None:
                    self._await_after(job)
                if self.chunks:
                    if self._copy_chunks(job) and self.cuda:
                        inflight.append(job)
                        if len(inflight) >= self.max_inflight:
                            self._finish(inflight.popleft())
                elif self.cuda:
                    self._issue_cuda(job)
                    inflight.append(job)
                    if len(inflight) >= self.max_inflight:
                        self._finish(inflight.popleft())
                else:
                    self._copy_cpu(job)
        except BaseException as exc:  # surfaced on the compute thread by wait()/submit()
            log.exception("expert copy thread failed")
            self._error = exc
            with self._cond:
                for j in self._outstanding:
                    j.issued.set()
                    j.finished.set()

    def _await_after(self, job: CopyJob) -> None:
        """Hold ``job`` (and this link) until the demand copy it is chained to landed (one
        blocking demand thread); its copy begins then (``started_at``)."""
        assert job.after is not None
        while not job.after.finished.wait(timeout=0.5):
            if self._stop:
                return
        job.after = None  # no chain of finished jobs kept alive
        job.started_at = time.perf_counter()

    def _done(self, job: CopyJob) -> None:
        with self._cond:
            job.state = "done"
            self._outstanding.discard(job)
        job.issued.set()
        job.finished.set()

    def _copy_cpu(self, job: CopyJob) -> None:
        t0 = time.perf_counter()
        for n, t in self.store.expert(*job.key).items():
            self.pool.buffers[n][job.slot].copy_(t)
        if self.bandwidth_bps:
            remaining = job.nbytes / self.bandwidth_bps - (time.perf_counter() - t0)
            if remaining > 0:
                time.sleep(remaining)  # emulated link (documented above)
        self.copy_seconds += time.perf_counter() - t0
        self._done(job)

    def _issue_cuda(self, job: CopyJob) -> None:
        assert self.stream is not None
        job.t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            prev = self.last_use[job.slot]
            if prev is not None:
                self.stream.wait_event(prev)
            job.start_event = torch.cuda.Event(enable_timing=True)
            job.start_event.record(self.stream)  # when the link begins this copy
            for n, t in self.store.expert(*job.key).items():
                self.pool.buffers[n][job.slot].copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        job.event = ev
        job.issued.set()

    # ---- chunked copies (worker thread) ---------------------------------------------
    def _overtaken(self, job: CopyJob) -> bool:
        """A demand load waits and ``job`` is a prefetch for another layer: set it aside."""
        with self._cond:
            if job.demand or not self._demand or self._demand[0].key[0] == job.key[0]:
                return False
            self._held.append(job)
            self.preemptions += 1
            return True

    def _pieces(self, job: CopyJob) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source bytes, slot bytes) per expert tensor, uint8[nbytes of the tensor] each."""
        out = []
        for n, t in self.store.expert(*job.key).items():
            dst = self.pool.buffers[n][job.slot]
            if not (dst.is_contiguous() and t.is_contiguous()):
                raise RuntimeError(f"chunked copies need contiguous expert tensors ({n})")
            out.append((t.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)))
        return out

    def _copy_range(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], lo: int, hi: int) -> None:
        """Copy bytes [lo, hi) of the expert (its tensors laid end to end)."""
        off = 0
        for src, dst in pieces:
            n = src.numel()
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                dst[a - off:b - off].copy_(src[a - off:b - off], non_blocking=self.cuda)
            off += n

    def _copy_chunks(self, job: CopyJob) -> bool:
        """Copy ``job``'s remaining chunks; stop early (False) when a demand load overtakes
        it. True: every chunk is copied (CPU: landed, job done; CUDA: issued, its event
        recorded, the caller collects it)."""
        pieces = self._pieces(job)
        if self.cuda and job.chunks_done == 0:
            job.t0 = time.perf_counter()
        while job.chunks_done < len(self.chunks):
            lo, hi = self.chunks[job.chunks_done]
            if self.cuda:
                self._issue_chunk(job, pieces, lo, hi)
            else:
                t0 = time.perf_counter()
                self._copy_range(pieces, lo, hi)
                if self.bandwidth_bps:
                    remaining = (hi - lo) / self.bandwidth_bps - (time.perf_counter() - t0)
                    if remaining > 0:
                        time.sleep(remaining)  # emulated link (module docstring)
                self.copy_seconds += time.perf_counter() - t0
            job.chunks_done += 1
            if job.chunks_done < len(self.chunks) and self._overtaken(job):
                return False
        if self.cuda:
            ev = torch.cuda.Event()
            assert self.stream is not None
            ev.record(self.stream)
            job.event = ev
            job.issued.set()
        else:
            self._done(job)
        return True

    def _issue_chunk(self, job: CopyJob, pieces: list[tuple[torch.Tensor, torch.Tensor]],
                     lo: int, hi: int) -> None:
        """CUDA: issue one chunk on the copy stream; keep at most ``max_inflight`` chunks
        queued there (synchronise on the oldest), so a demand load is never far behind."""
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            if job.chunks_done == 0:
                prev = self.last_use[job.slot]
                if prev is not None:
                    self.stream.wait_event(prev)
                job.start_event = torch.cuda.Event(enable_timing=True)
                job.start_event.record(self.stream)
            self._copy_range(pieces, lo, hi)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._chunk_events.append(ev)
        while len(self._chunk_events) > self.max_inflight:
            self._chunk_events.popleft().synchronize()  # worker thread only

    def _finish(self, job: CopyJob) -> None:
        assert job.event is not None
        job.event.synchronize()  # worker thread only: never the compute thread
        self.copy_seconds += time.perf_counter() - job.t0
        self._done(job)
