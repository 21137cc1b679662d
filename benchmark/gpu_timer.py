"""GPU timing for the kernel benchmarks (bench_kernels.py): a call captured in a CUDA graph,
L2 flushed before each timed replay."""

from __future__ import annotations

import time

import torch

# Datasheet HBM peaks in TB/s, matched in order against torch.cuda.get_device_name (the lent
# machines are an H200 and an H100 SXM; "GH200" before "H200", "H100 NVL" / "PCIe" before "H100").
HBM_PEAK_TBPS = (("GH200", 4.0), ("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35),
                 ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935), ("A100", 1.555))


def clock_peak(props) -> float | None:
    """Bytes/s from the device's memory clock and bus (two transfers a clock), or None when
    this torch does not report them."""
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def hbm_peak(device: torch.device, tbps: float | None = None) -> tuple[float, str]:
    """The HBM peak in bytes/s the benchmarks divide by, and where it came from: ``tbps`` when
    given (--hbm-tbps), else the datasheet figure for the device's name, else its memory clock
    x bus width. Off CUDA (the smoke run) the H200's, so the shares stay comparable."""
    if tbps is not None:
        if not tbps > 0:
            raise ValueError(f"--hbm-tbps must be a positive TB/s figure; got {tbps}")
        return tbps * 1e12, "--hbm-tbps"
    if device.type != "cuda":
        return 4.8e12, "cpu smoke run: the H200's figure"
    name = torch.cuda.get_device_name(device)
    for key, peak in HBM_PEAK_TBPS:
        if key in name:
            return peak * 1e12, f"datasheet: {key} {peak} TB/s"
    clocks = clock_peak(torch.cuda.get_device_properties(device))
    if clocks is None:
        raise RuntimeError(f"no HBM peak known for {name!r} and this torch reports no memory clock: "
                           "pass --hbm-tbps")
    return clocks, f"memory clock x bus width of {name!r}"


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
