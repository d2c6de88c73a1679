"""Running a predictor off the critical path: a background worker with an ordered queue.

The engine hands each predictor hook (``start_request``, ``start_iteration``,
``observe_layer``, ``end_iteration``, ``end_request``) to :class:`PredictorRunner` and never
waits for it on the hot path: hooks run in submission order on one worker thread (so a
predictor sees exactly the sequence the simulator feeds it), and their
:class:`~moeexp.predictors.base.Prediction` results apply when ready, as FineMoE's
publisher/subscriber design requires: the worker calls ``on_result`` (the engine takes the
new predictions at once and queues their prefetches) as soon as a hook returns one, and the
engine also collects whatever is pending when it next looks (``drain``). A resting
predictor's ``rest_layer`` (a lookup) runs inline on the engine's thread while the worker is
idle (:meth:`PredictorRunner.submit`). ``asynchronous=False`` runs every hook inline
instead (deterministic: used by tests that compare the engine with the simulator decision
for decision).

An exception raised by the predictor is re-raised on the engine's thread at the next
``submit``/``drain``/``flush``; it is never swallowed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from moeexp.predictors.base import Prediction, Predictor, overrides

log = logging.getLogger(__name__)

_HOOKS = ("start_request", "start_iteration", "observe_layer", "end_iteration", "end_request",
          "rest_layer")
#: the hooks of one pass, not called while the predictor rests (``Predictor.feeding``)
PASS_HOOKS = frozenset({"start_iteration", "observe_layer", "end_iteration"})
#: the hooks called only while the predictor rests (``Predictor.rest_layer``); they run on
#: the engine's thread when the worker is idle (:meth:`PredictorRunner.submit`)
REST_HOOKS = frozenset({"rest_layer"})


class PredictorRunner:
    """Feeds a predictor its hooks, in order, on a background thread (or inline).

    Attributes:
        query_seconds: wall time spent inside hooks that return predictions (s).
        queries: number of such hook calls.
    """

    def __init__(self, predictor: Predictor, *, asynchronous: bool = True) -> None:
        self.predictor = predictor
        self.asynchronous = asynchronous
        self.active = {h: overrides(predictor, h) for h in _HOOKS}
        self.any_active = any(self.active.values())
        self.query_seconds = 0.0
        self.queries = 0
        self._out: list[tuple[str, Any, Prediction]] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._q: queue.Queue[tuple[str, Any, Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        #: called by the worker (no lock held) after a hook returned a Prediction
        self.on_result: Callable[[], None] | None = None
        #: the running pass is not handed to the predictor (:meth:`begin_pass`)
        self.resting = False
        self.rested_passes = 0
        if asynchronous and any(self.active.values()):
            self._thread = threading.Thread(target=self._run, name="moeexp-predictor", daemon=True)
            self._thread.start()

    def begin_pass(self, tokens: int = 1) -> None:
        """Ask the predictor whether the pass that begins, of ``tokens`` token rows, is
        handed to it (``Predictor.feeding``, on the engine's thread); while it rests, the
        pass's hooks (:data:`PASS_HOOKS`) are neither built nor submitted."""
        self.resting = self.any_active and not self.predictor.feeding(tokens)
        self.rested_passes += self.resting

    def wants(self, hook: str) -> bool:
        """False when the hook is the base-class no-op, a pass hook while the predictor
        rests, or a rest hook while it is fed (the engine then skips its inputs)."""
        if hook in REST_HOOKS:
            return self.active[hook] and self.resting
        return self.active[hook] and not (self.resting and hook in PASS_HOOKS)

    def submit(self, hook: str, arg: Any = None, tag: Any = None) -> None:
        """Run ``predictor.<hook>(arg)``; its Prediction (if any) is kept with ``tag``.

        A rest hook (:data:`REST_HOOKS`: a lookup, no model) runs at once on the calling
        thread when the worker has nothing queued or running, so the order of hooks is kept
        and the predictor is never entered from two threads; its Prediction is taken at the
        engine's next look (``begin_layer``, on the same layer). Handing it to the worker
        instead costs a thread wake-up and GIL hand-offs per layer, more host time than
        the hook itself (issue 27's eighteenth stage)."""
        self._raise_if_failed()
        if not self.wants(hook):
            return
        if self._thread is None or (hook in REST_HOOKS and not self._q.unfinished_tasks):
            self._call(hook, arg, tag)
        else:
            self._q.put((hook, arg, tag))

    def drain(self) -> list[tuple[str, Any, Prediction]]:
        """Predictions finished since the last drain: (hook, tag, prediction), in order."""
        self._raise_if_failed()
        with self._lock:
            out, self._out = self._out, []
        return out

    def flush(self) -> None:
        """Wait until every submitted hook has run (end of a request; never per layer)."""
        if self._thread is not None:
            self._q.join()
        self._raise_if_failed()

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    # ---- internals ------------------------------------------------------------------
    def _call(self, hook: str, arg: Any, tag: Any) -> bool:
        """Run one hook; True when it returned a Prediction worth applying."""
        fn: Callable[..., Any] = getattr(self.predictor, hook)
        t0 = time.perf_counter()
        result = fn() if arg is None else fn(arg)
        dt = time.perf_counter() - t0
        if not isinstance(result, Prediction):
            return False
        useful = bool(result.prefetch or result.scores or result.predicted)
        with self._lock:
            self.query_seconds += dt
            self.queries += 1
            if useful:
                self._out.append((hook, tag, result))
        return useful

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if self._error is None and self._call(*item) and self.on_result is not None:
                    self.on_result()
            except BaseException as exc:  # re-raised on the engine thread
                log.exception("predictor %s failed in its worker thread", self.predictor.name)
                self._error = exc
            finally:
                self._q.task_done()

    def _raise_if_failed(self) -> None:
        """Re-raise the worker's exception (its own type, e.g. ConfigError) on this thread."""
        if self._error is not None:
            raise self._error
