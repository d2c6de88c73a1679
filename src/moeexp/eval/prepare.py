"""``python -m moeexp.eval.prepare [OUT_DIR]``: build the local lm-eval tasks.

Uses the default dataset config (``conf/dataset/sharegpt.yaml``) and the tiny model's
tokenizer, exactly as ``python -m moeexp`` samples prompts, so the tasks hold the test
split of the default experiments.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> Path:
    from moeexp.eval.tasks import prepare_tasks
    from moeexp.models.loading import load_model
    from moeexp.paths import load_group_yaml, results_dir

    logging.basicConfig(level=logging.INFO)
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else results_dir() / "eval_tasks"
    loaded = load_model(load_group_yaml("model", "tiny"))
    path = prepare_tasks(out, load_group_yaml("dataset", "sharegpt"), loaded.tokenizer)
    logging.getLogger(__name__).info("local lm-eval tasks written to %s", path)
    return path


if __name__ == "__main__":
    main()
