"""The serving comparison's per-pass line (moeexp.backends.serving_check.pass_line)."""

from __future__ import annotations

import math

import pytest

from moeexp.backends.serving_check import pass_line


def test_pass_line_is_the_least_squares_line_of_pass_time_on_requests() -> None:
    """Passes of 1, 2, 4 requests at 10 + 3 ms per request (one NaN pass skipped) give
    (10, 3); one request count alone has no line (NaN)."""
    got = pass_line([1, 2, 4, 3], [13.0, 16.0, 22.0, float("nan")])
    assert got["pass_ms_intercept"] == pytest.approx(10.0)
    assert got["pass_ms_per_request"] == pytest.approx(3.0)
    assert all(math.isnan(v) for v in pass_line([2, 2], [1.0, 3.0]).values())
