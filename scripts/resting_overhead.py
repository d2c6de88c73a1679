"""What a resting ``prefetch_if_pays`` costs the engine beyond on-demand LRU (``deepspeed``).

    python scripts/resting_overhead.py                      # toy Mixtral, CPU, 1 GB/s link
    python scripts/resting_overhead.py --rounds 6 --tokens 64 --bandwidth 1e8

Serves the same prompts with ``deepspeed`` and with ``prefetch_if_pays`` told a feed cost no
miss can pay for (10 s a layer: its feed gate never feeds the predictor, so the cache evicts
the least recently used; ``cache.rest_prefetch`` off, so it takes no resting offer),
alternating the two in one process ``--rounds`` times, and prints
each side's TPOT (median of the rounds) and hit counts. The hits, misses and bytes must be
equal (a resting policy is on-demand LRU decision for decision; the script exits 1 if not):
the TPOT difference is then the host time of the resting policy's bookkeeping (the feed
gate's shadow LRU and recency order, ``next_use``'s per-access counts, the pass's
``feeding`` question, the router hook). A developer tool, not a benchmark: this machine's
engine timings move by several per cent between runs, hence the alternation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import types

import torch


def _store(model: torch.nn.Module) -> object:
    """A small store trace of the toy model (4 random 8-token prompts, 4 tokens each)."""
    from moeexp.data.prompts import Prompt
    from moeexp.models.adapters import adapter_for
    from moeexp.traces.recorder import record_trace

    g = torch.Generator().manual_seed(123)
    prompts = [Prompt(request_id=i, text="", prompt_len=8, output_len=4, split="store",
                      input_ids=tuple(torch.randint(3, 250, (8,), generator=g).tolist()),
                      dataset="synthetic") for i in range(4)]
    loaded = types.SimpleNamespace(model=model, tokenizer=None, adapter=adapter_for(model),
                                   name="toy-mixtral")
    return record_trace(loaded, prompts, sampling="greedy", spec_depth=2, record_hidden=True,
                        prompt_embedder=None, progress=False)


def _serve(model, store, system: str, args, prompts) -> dict[str, float]:
    from moeexp.engine import offload

    kw = dict(capacity=args.capacity, hardware="rtx3090_pcie4", bandwidth_bps=args.bandwidth)
    if system == "deepspeed":
        om = offload(model, system="deepspeed", **kw)
    else:
        om = offload(model, system="prefetch_if_pays", store=store, predictor={"spec": "off"},
                     cache={"rest_prefetch": False}, **kw)
    with om:
        if system != "deepspeed":
            om.engine.runner.predictor.set_feed_cost(10.0)  # never pays: it rests throughout
        om.generate(prompts[0][:, :4], max_new_tokens=4, do_sample=False)  # warm-up
        om.reset_metrics()
        for x in prompts:
            om.generate(x, max_new_tokens=args.tokens, do_sample=False)
        return om.metrics()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="alternations of the two systems")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    ap.add_argument("--capacity", type=float, default=0.5, help="fraction of expert bytes")
    ap.add_argument("--bandwidth", type=float, default=1e9, help="emulated link, bytes/s")
    args = ap.parse_args()

    from moeexp.models.toy_configs import toy_model

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = toy_model("mixtral")
    store = _store(model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (1, 7 + i), generator=g) for i in range(args.prompts)]
    tpot: dict[str, list[float]] = {"deepspeed": [], "resting": []}
    counts: dict[str, tuple[float, ...]] = {}
    for r in range(args.rounds):
        for system in ("deepspeed", "resting") if r % 2 == 0 else ("resting", "deepspeed"):
            m = _serve(model, store, system, args, prompts)
            tpot[system].append(m["tpot_ms_mean"])
            counts[system] = (m["hits_total"], m["misses_total"], m["h2d_bytes_total"])
    for system, ts in tpot.items():
        hits, misses, nbytes = counts[system]
        print(f"{system:>9}: TPOT median {statistics.median(ts):.3f} ms "
              f"(rounds {', '.join(f'{t:.3f}' for t in ts)}); hits {hits:.0f}, misses "
              f"{misses:.0f}, {nbytes / 1e6:.2f} MB copied")
    ratio = statistics.median(tpot["resting"]) / statistics.median(tpot["deepspeed"])
    print(f"resting / deepspeed TPOT: {ratio:.3f}")
    if counts["resting"] != counts["deepspeed"]:
        print("the resting policy's hits, misses or bytes differ from LRU's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
