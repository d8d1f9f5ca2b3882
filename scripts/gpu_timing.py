"""GPU timing shared by the kernel scripts (scripts/gpu_exl3_check.py, gpu_exl3_sweep.py)."""
from __future__ import annotations

import time
from typing import Callable

import torch


def bench_us(fns: list[Callable[[], object]], device: torch.device, target_s: float = 0.012,
             min_reps: int = 2, max_reps: int = 100) -> float:
    """GPU time of one call, the calls rotating over ``fns`` (one per weight copy), from
    CUDA-graph replays (no launch overhead, as in the engine's decode) timed with CUDA
    events, replayed for about ``target_s``; on the CPU (smoke) one eager pass."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(fns)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns[:2]:
            f()  # compiles (or loads from the cache), cuBLAS workspaces
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    reps = max(min_reps, min(max_reps, int(target_s / max(time.perf_counter() - t0, 1e-6))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1000 / (reps * len(fns))
