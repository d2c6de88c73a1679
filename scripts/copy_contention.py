"""Does a prefetch copy slow the compute thread? A CUDA micro-benchmark (about 1 minute).

Why: on one H200 (experiments/real_scale/README.md, "GPU results") every prefetched
47.5 MiB expert cost the engine's host-bound compute thread 2.6-3.7 ms, about three times
its 0.91 ms copy, while the simulator charges a prefetch nothing beyond its link time.
Each case below isolates one candidate cause. Every time is a median over repeats.

    issue_ms          host time of one ``copy_(pinned expert, non_blocking=True)`` call
                      (should be ~0: an asynchronous copy only enqueues; ~the copy time
                      means the copy is synchronous on this machine)
    layer_ms.*        a layer-like loop on the main thread (``OPS`` tiny kernels, then one
                      ``torch.unique(...).tolist()`` sync, as the engine's per-layer read of
                      the routing), while:
        alone             nothing else runs
        worker_copies     a Python thread issues expert copies back to back on a copy stream
                          and waits on each with ``Event.synchronize`` (the engine's worker)
        worker_polling    the same thread polls ``Event.query()`` instead of waiting
        inline_copies     the main thread itself enqueues one copy per layer (no thread)
        worker_python     a Python thread spins on pure-Python work, no CUDA (GIL only)

Reading: ``worker_copies`` ≫ ``alone`` while ``inline_copies`` ≈ ``alone`` points at the
thread (GIL or the driver's lock); ``worker_python`` ≫ ``alone`` at the GIL alone; a large
``issue_ms`` at synchronous copies. Usage: ``python scripts/copy_contention.py --out DIR``
(writes ``DIR/copy_contention.json``). Needs CUDA; exits with status 2 without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

EXPERT_MIB = 47.48  # one gpt-oss-20b expert in bf16 (real_scale's expert_mib)
OPS = 60  # tiny kernels per "layer": the engine's decode layer launches about this many


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=400, help="layers timed per case")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.stderr.write(f"copy_contention: needs CUDA (torch {torch.__version__} sees none)\n")
        return 2
    dev = torch.device("cuda")
    src = torch.empty(int(EXPERT_MIB * 2**20), dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=dev)
    side = torch.cuda.Stream()
    x = torch.zeros(1024, device=dev)
    idx = torch.randint(0, 32, (1, 4), device=dev)

    def issue_ms() -> float:
        ts = []
        for _ in range(20):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
            ts.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        return statistics.median(ts) * 1e3

    def layers(inline: bool = False) -> float:
        ts = []
        for _ in range(args.layers):
            t = time.perf_counter()
            if inline:
                with torch.cuda.stream(side):
                    dst.copy_(src, non_blocking=True)
            for _ in range(OPS):
                x.add_(1.0)
            torch.unique(idx).tolist()
            ts.append(time.perf_counter() - t)
        side.synchronize()
        return statistics.median(ts) * 1e3

    def with_worker(kind: str) -> float:
        stop = threading.Event()

        def work() -> None:
            while not stop.is_set():
                if kind == "python":
                    sum(i * i for i in range(2000))
                    continue
                with torch.cuda.stream(side):
                    dst.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(side)
                if kind == "poll":
                    while not ev.query():
                        pass
                else:
                    ev.synchronize()

        th = threading.Thread(target=work, daemon=True)
        th.start()
        time.sleep(0.05)
        try:
            return layers()
        finally:
            stop.set()
            th.join()

    layers()  # warm-up
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "expert_mib": EXPERT_MIB, "ops_per_layer": OPS, "issue_ms": issue_ms(),
           "layer_ms": {"alone": layers(), "worker_copies": with_worker("sync"),
                        "worker_polling": with_worker("poll"),
                        "inline_copies": layers(inline=True),
                        "worker_python": with_worker("python")}}
    from moeexp.atomic import write_json  # PYTHONPATH=src, as for the other scripts

    write_json(args.out / "copy_contention.json", res)
    sys.stdout.write(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
