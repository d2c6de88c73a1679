"""Where the engine's host time goes: cProfile of plain ``generate`` and of the engine.

    python scripts/profile_engine.py                       # tiny model, CPU, no_offload
    python scripts/profile_engine.py --device cuda --system deepspeed --capacity 0.5

Prints time per output token of both sides and the top functions by own time (tottime)
for each, so a per-layer overhead of the engine (e.g. on CUDA, where the tiny model's
kernels take microseconds and host work dominates) can be attributed. A developer tool,
not a benchmark: cProfile itself slows Python code down, so compare the two sides only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def _generate(fn, prompts: list[torch.Tensor], new: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for x in prompts:
        fn(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new,
           min_new_tokens=new)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _profiled(fn, prompts, new, device, top: int, title: str) -> None:
    _generate(fn, prompts[:1], 4, device)  # warm-up
    wall = _generate(fn, prompts, new, device)
    prof = cProfile.Profile()
    prof.enable()
    _generate(fn, prompts, new, device)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    n = len(prompts) * new
    print(f"===== {title}: {wall / n * 1e3:.3f} ms per output token (unprofiled, {n} tokens)")
    print("\n".join(buf.getvalue().splitlines()[:top + 12]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--system", default="no_offload")
    ap.add_argument("--capacity", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()

    from moeexp.bench.engine import _prompts
    from moeexp.bench.record import _load
    from moeexp.engine import offload

    torch.set_num_threads(1)
    loaded, which = _load()
    device = torch.device(args.device)
    model = loaded.model.to(device)
    prompts = [torch.tensor([p], device=device)
               for p in _prompts(int(model.config.vocab_size), args.prompts, 43, seed=0)]
    print(f"model {which} on {device}, torch {torch.__version__}")
    with torch.inference_mode():
        _profiled(model.generate, prompts, args.tokens, device, args.top, "plain generate")
        with offload(model, system=args.system, capacity=args.capacity) as om:
            _profiled(om.generate, prompts, args.tokens, device, args.top,
                      f"engine {args.system} capacity {args.capacity}")


if __name__ == "__main__":
    main()
