"""GPU timing for the kernel benchmarks (bench_kernels.py): a call captured in a CUDA graph,
L2 flushed before each timed replay."""

from __future__ import annotations

import time

import torch


class Timer:
    """Median GPU milliseconds of fn: captured once in a CUDA graph, L2 flushed before each
    replay (so a 4 MB layer is read from HBM, as in a real step), events around the replay.
    Off CUDA (the --smoke run): wall time of eager calls."""

    def __init__(self, device: torch.device, reps: int, hbm_bytes_per_s: float):
        self.device, self.reps, self.hbm = device, reps, hbm_bytes_per_s
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def __call__(self, fn) -> tuple[float, str]:
        fn()
        if self.flush is None:
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0), "eager, cpu"
        torch.cuda.synchronize()
        run, mode = fn, "eager"
        if getattr(fn, "host_syncs", False):  # reads device values on the host: no graph can hold it
            return self._replays(run), "eager (it syncs with the host)"
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run, mode = graph.replay, "cuda graph"
        except Exception as exc:  # noqa: BLE001 - time it eagerly instead, and say so
            mode = f"eager ({type(exc).__name__}: {exc})"[:200]
        return self._replays(run), mode

    def _replays(self, run) -> float:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in events)
        return times[len(times) // 2]
