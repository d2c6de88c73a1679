"""The KV cache's name in a transformers forward call, across the 5.x releases.

``model.forward`` took ``past_key_values=`` and returned ``output.past_key_values``; from
5.2x it takes ``cache=`` and returns ``output["cache"]`` (the old argument still works
but warns that it goes in 5.40). Every forward loop of moeexp (trace recording, the
engine's batched passes, routing replay, the serving-quality reference, the real-scale
bench) asks here; ``generate`` handles the name itself.
"""

from __future__ import annotations

import inspect
from typing import Any


def kv_argument(model: Any) -> str:
    """The name of ``model.forward``'s KV-cache argument: ``cache`` or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def kv_of(output: Any) -> Any:
    """The KV cache a forward ``output`` returns (``cache``, else ``past_key_values``;
    None if it has neither)."""
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else getattr(output, "past_key_values", None)
