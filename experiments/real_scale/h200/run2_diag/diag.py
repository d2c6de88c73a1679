"""Device diagnosis: why prefetching costs the real-scale engine ~1 ms per layer."""
import cProfile, io, json, os, pstats, sys, time
from pathlib import Path
import torch
OUT = Path(os.environ["OUT"])
res = {}
dev = torch.device("cuda")
# --- micro 1: a small D2H sync (the engine's per-layer torch.unique(idx).tolist()) while an
# H2D copy of one real-size expert (47.5 MiB, pinned) is in flight on a side stream
src = torch.empty(int(47.48 * 2**20), dtype=torch.uint8).pin_memory()
dst = torch.empty_like(src, device=dev)
idx = torch.randint(0, 32, (1, 4), device=dev)
side = torch.cuda.Stream()
def sync_us(n=200, busy=False, pinned_d2h=False):
    buf = torch.empty(4, dtype=torch.int64).pin_memory()
    ts = []
    for _ in range(n):
        if busy:
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
            time.sleep(0.0002)
        torch.cuda.synchronize() if not busy else None
        t = time.perf_counter()
        if pinned_d2h:
            u = torch.unique(idx)
            buf[:u.numel()].copy_(u, non_blocking=True)
            torch.cuda.current_stream().synchronize()
        else:
            torch.unique(idx).tolist()
        ts.append(time.perf_counter() - t)
        side.synchronize()
    ts.sort()
    return {"median_us": ts[n // 2] * 1e6, "p90_us": ts[int(n * 0.9)] * 1e6}
for _ in range(3):
    sync_us(20)
res["d2h_idle"] = sync_us()
res["d2h_during_h2d"] = sync_us(busy=True)
res["d2h_pinned_during_h2d"] = sync_us(busy=True, pinned_d2h=True)
t = time.perf_counter(); dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
res["h2d_one_expert_ms"] = (time.perf_counter() - t) * 1e3
print(json.dumps(res, indent=1), flush=True)
# --- engine under cProfile: where the compute thread's time goes
sys.path.insert(0, "src")
from moeexp.bench import real_scale as rs
s = rs.Settings(out=OUT / "x", device="cuda")
model, adapter, store, test = rs._model_and_traces(s)
fits = {}
for system, cap in (("deepspeed", 0.5), ("oracle", 0.5), ("deepspeed", 0.5), ("oracle", 0.5),
                    ("finemoe", 0.5)):
    prof = cProfile.Profile()
    prof.enable()
    row = rs._one_system(model, adapter, store, test, None, system, cap, fits, None)
    prof.disable()
    sio = io.StringIO()
    st = pstats.Stats(prof, stream=sio).sort_stats("tottime")
    st.print_stats(25)
    (OUT / f"prof_{system}_{len(res)}.txt").write_text(sio.getvalue())
    res[f"{system}_{len(res)}"] = {k: row.get(k) for k in ("engine_tpot_ms_mean", "engine_stall_ms_total",
                                   "engine_prefetches_issued", "engine_demand_loads_total", "engine_wall_s")}
    print(system, res[f"{system}_{len(res) - 1}"], flush=True)
(OUT / "diag.json").write_text(json.dumps(res, indent=1))
