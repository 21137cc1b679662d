"""Weight products of one forward pass of the default model, by kernel, at the row counts
the engine runs: F.linear (SGLang's CPU path), oneDNN prepacked fp32 (``--vericache-cpu-linear
packed``), and the draft-only fp16 / int8 copies (``--vericache-draft-weights``).

    python benchmark/bench_cpu_linear.py                 # rows 1,4,17,68; JSON to benchmark/results/cpu_linear.json
    python benchmark/bench_cpu_linear.py --rows 4 --repeats 3 --out /tmp/x.json

Every kernel multiplies the same random weights shaped like SmolLM2-135M's (30 layers of
qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, and the 576->49152 lm_head),
interleaved per repeat (A B C A B C) so machine noise hits all alike; the median of the
repeats is reported with the spread, and each kernel's max abs difference from F.linear.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from sgl_vericache.cpu_linear import PackedLinear, packed_linear_available  # noqa: E402
from sgl_vericache.spec.draft_weights import DraftWeights  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS, QKV = 576, 1536, 49152, 30, 960


def shapes() -> list[tuple[int, int]]:
    return [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]


def kernels() -> dict:
    out = {"f_linear": lambda x, w: F.linear(x, w)}
    if packed_linear_available():
        packed = PackedLinear()
        out["onednn_packed_fp32"] = packed.linear
    fp16 = DraftWeights("fp16")
    out["draft_fp16_copy"] = fp16.linear
    if any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm")):
        out["draft_int8_copy"] = DraftWeights("int8").linear
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,17,68", help="rows per product (batch x tokens), comma list")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "cpu_linear.json"))
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    weights = [torch.randn(o, i) * 0.05 for o, i in shapes()]
    ks = kernels()
    results = []
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
        times = {name: [] for name in ks}
        err = {}
        for name, fn in ks.items():  # warm-up: copies and packing happen here, not timed
            err[name] = max((fn(xs[w.shape[1]], w) - F.linear(xs[w.shape[1]], w)).abs().max().item()
                            for w in weights[:4] + weights[-1:])
        for rep in range(args.repeats):
            for name, fn in ks.items():
                t0 = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["f_linear"])
        for name in ks:
            med = statistics.median(times[name])
            results.append({"rows": m, "kernel": name, "ms_median": med * 1e3, "ms_min": min(times[name]) * 1e3,
                            "ms_max": max(times[name]) * 1e3, "speedup_vs_f_linear": base / med,
                            "max_abs_diff_vs_f_linear": err[name]})
            print(f"rows {m:3d}  {name:20s} {med * 1e3:7.1f} ms  ({base / med:4.2f}x F.linear, "
                  f"max |diff| {err[name]:.1e})", flush=True)
    out = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "threads": torch.get_num_threads(), "torch": torch.__version__},
           "model_shapes": "SmolLM2-135M (121 weight products, 134.5M parameters incl. tied lm_head)",
           "repeats": args.repeats, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
