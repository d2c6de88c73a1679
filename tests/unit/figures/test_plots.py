"""plots.is_lossy: restricted routing and lossy expert formats both mark a row lossy."""

from __future__ import annotations

import pandas as pd

from moeexp.figures.plots import is_lossy


def test_lossy_formats_marked_like_emoe() -> None:
    """A quantised-expert row (expert_format_lossy True, "True" from a CSV, or a seed mean
    of 1.0) is lossy like eMoE's restricted routing; dense rows and rows without the column
    are not."""
    df = pd.DataFrame({"system": ["deepspeed", "deepspeed", "deepspeed", "emoe", "deepspeed"],
                       "expert_format_lossy": [True, "True", 1.0, False, False]})
    assert is_lossy(df, "system").tolist() == [True, True, True, True, False]
    assert not is_lossy(pd.DataFrame({"system": ["deepspeed"]}), "system").any()
