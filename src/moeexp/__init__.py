"""moeexp: a research framework for MoE expert offloading.

The core (``traces``, ``predictors``, ``cache``, ``costmodel``, ``simulator``) is pure
numpy and imports no torch; torch-backed pieces (``models``, ``engine``, ``eval``) load
lazily. See README.md and ``docs/design.md`` for the architecture.
"""

__version__ = "0.1.0"
