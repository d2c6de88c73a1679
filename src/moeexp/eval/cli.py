"""``python -m moeexp.eval.cli`` = lm-eval's own CLI with the ``moeexp`` model registered.

lm-eval 0.4 discovers models only from its own package, so the stock ``lm_eval`` command
cannot see plug-ins. This wrapper imports :mod:`moeexp.eval.lm` (registering ``moeexp``)
and then runs lm-eval's CLI with the same arguments, e.g.::

    python -m moeexp.eval.cli --model moeexp \\
        --model_args model=tiny,system=emoe,capacity=0.5 \\
        --tasks moeexp_sharegpt_ppl --include_path results/eval_tasks

Build the local tasks first with ``python -m moeexp.eval.prepare`` (writes
``results/eval_tasks``).
"""

from __future__ import annotations


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    import moeexp.eval.lm  # noqa: F401  (registers the moeexp model)

    cli_evaluate()


if __name__ == "__main__":
    main()
