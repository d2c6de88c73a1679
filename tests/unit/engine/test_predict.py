"""engine/predict.py: the predictor runner's threads and the order of hooks."""

from __future__ import annotations

import threading

import numpy as np

from moeexp.engine.predict import PredictorRunner
from moeexp.predictors.base import Prediction, Predictor, Prefetch, RequestStart, RestLayer
from moeexp.traces.schema import RequestMeta, TraceDims


class _Recorder(Predictor):
    """Rests every pass; records which thread ran each hook, in order. ``start_request``
    blocks until :attr:`release` is set."""

    def __init__(self) -> None:
        super().__init__(dims=TraceDims(num_layers=2, num_experts=4, top_k=1, hidden_size=2,
                                        spec_depth=0, expert_bytes=1))
        self.calls: list[tuple[str, str]] = []
        self.release = threading.Event()

    def feeding(self, tokens: int = 1) -> bool:
        return False

    def start_request(self, ctx: RequestStart) -> Prediction:
        self.release.wait(10)
        self.calls.append(("start_request", threading.current_thread().name))
        return Prediction()

    def rest_layer(self, obs: RestLayer) -> Prediction:
        self.calls.append(("rest_layer", threading.current_thread().name))
        return Prediction(prefetch=[Prefetch(1.0, obs.layer + 1, 0)])


def _rest(layer: int) -> RestLayer:
    return RestLayer(layer, 1, np.array([0], dtype=np.int64))


def test_a_rest_hook_runs_on_the_callers_thread_while_the_worker_is_idle() -> None:
    pred = _Recorder()
    runner = PredictorRunner(pred, asynchronous=True)
    try:
        runner.begin_pass()
        assert runner.resting
        runner.submit("rest_layer", _rest(0), tag=0)
        # ran at once, on this thread, and its prediction waits for the engine's next look
        assert pred.calls == [("rest_layer", threading.current_thread().name)]
        (hook, tag, got), = runner.drain()
        assert (hook, tag) == ("rest_layer", 0) and got.prefetch[0].layer == 1
    finally:
        runner.close()


def test_a_rest_hook_queues_behind_a_running_hook_so_the_order_is_kept() -> None:
    pred = _Recorder()
    runner = PredictorRunner(pred, asynchronous=True)
    try:
        meta = RequestMeta(request_id=0, prompt="p", prompt_len=1, output_len=1, split="test",
                           dataset="d")
        runner.submit("start_request", RequestStart(meta))
        runner.begin_pass()
        runner.submit("rest_layer", _rest(0), tag=0)  # the worker is busy: queued
        pred.release.set()
        runner.flush()
        assert [c[0] for c in pred.calls] == ["start_request", "rest_layer"]
        assert all(name == "moeexp-predictor" for _, name in pred.calls)
    finally:
        runner.close()
