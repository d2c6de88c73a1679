"""Job directories sort numerically, so sweeps of more than 10 jobs keep their order."""

from __future__ import annotations

from pathlib import Path

from moeexp.tracking.results import _natural_key


def test_ten_jobs_sort_after_nine() -> None:
    """'10_finemoe' must come after '9_emoe' and '1_deepspeed' (string order puts it second)."""
    dirs = [Path("sweep/10_finemoe"), Path("sweep/1_deepspeed"), Path("sweep/9_emoe"),
            Path("sweep/0_no_offload")]
    assert [p.name for p in sorted(dirs, key=_natural_key)] == [
        "0_no_offload", "1_deepspeed", "9_emoe", "10_finemoe"]
