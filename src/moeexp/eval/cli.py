"""``python -m moeexp.eval.cli`` = lm-eval's own CLI with the ``moeexp`` model registered.

lm-eval 0.4 discovers models only from its own package, so the stock ``lm_eval`` command
cannot see plug-ins. This wrapper imports :mod:`moeexp.eval.lm` (registering ``moeexp``)
and then runs lm-eval's CLI with the same arguments, e.g.::

    python -m moeexp.eval.cli --model moeexp \\
        --model_args model=tiny,system=emoe,capacity=0.5 \\
        --tasks moeexp_sharegpt_ppl --include_path results/eval_tasks

The same command is ``moeexp lm-eval ...`` (the console script). Build the local tasks
first with ``python -m moeexp.eval.prepare`` (writes ``results/eval_tasks``).

A moeexp error (an unknown system, a bad model argument, ...) is one clear line and exit
status 2, raised before the model loads (``HYDRA_FULL_ERROR=1`` shows the traceback).
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    import moeexp.eval.lm  # noqa: F401  (registers the moeexp model)
    from moeexp.errors import MoeexpError

    try:
        cli_evaluate()
    except MoeexpError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        sys.stderr.write(f"moeexp: {type(err).__name__}: {err}\n")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
