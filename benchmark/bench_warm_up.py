"""What the draft kernels' start-up warm-up (spec/warm_up.py) costs a GPU server, per head shape.

Three phases of ``warm_up`` for the compressors (default: --vericache-compressor auto's
candidates) with Triton's on-disk cache in a fresh directory:

  cold     a first start on a machine: every variant compiled (what the first requests'
           rounds used to pay, spread over them)
  restart  a new process over the same cache: what every later start pays
  again    the same process once more: the rounds alone, nothing left to compile

and the same three for the verify kernel's warm-up (``warm_verify``: blocks of up to
--draft-len + 1 tokens), which a CUDA server runs beside it (verify_* columns).

    python benchmark/bench_warm_up.py --out $OUT/bench_warm_up.json        # on a GPU (~1 min)
    TRITON_INTERPRET=1 python benchmark/bench_warm_up.py --smoke          # CPU: code paths only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

SHAPES = {"llama3-8b": (32, 8, 128), "llama70b-tp8": (8, 1, 128), "smoke": (6, 2, 64)}  # (H_q, H_kv, D)


def _phase(args) -> dict:
    """One process's warm-ups (cold or restart first, then again): seconds each."""
    import torch

    from sgl_vericache.config import VeriCacheConfig
    from sgl_vericache.spec.plan import Planner
    from sgl_vericache.spec.warm_up import LENGTHS, HeadLayout, warm_up, warm_verify

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hkv, d = SHAPES[args.shape]
    layout = HeadLayout(hq, hkv, d, dtype, dtype)
    vc = VeriCacheConfig(compressor=args.compressor)
    compressors = Planner(vc, None, None, vc.build_compressor()).configured_compressors()
    lengths = (60, 40) if args.smoke else LENGTHS
    out = {"compressors": [c.name for c in compressors], "layout": str(layout)}
    for name in ("first", "again"):
        seconds = warm_up(compressors, layout, device, draft_kernels=True, lengths=lengths)
        out[name] = round(seconds, 3)
        print(f"  {args.shape} {name}: {seconds:.2f} s", flush=True)
    for name in ("first", "again"):
        seconds = warm_verify(layout, args.draft_len + 1, device)
        out[f"verify_{name}"] = round(seconds, 3)
        print(f"  {args.shape} verify {name}: {seconds:.2f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_warm_up.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compressor", default="auto", help="as --vericache-compressor (auto: both candidates)")
    ap.add_argument("--draft-len", type=int, default=16, help="as --vericache-draft-len: the verify blocks warmed")
    ap.add_argument("--shapes", nargs="*", default=["llama3-8b", "llama70b-tp8"], choices=sorted(SHAPES))
    ap.add_argument("--smoke", action="store_true", help="the CPU under TRITON_INTERPRET=1: tiny shape, short requests")
    ap.add_argument("--phase", action="store_true", help=argparse.SUPPRESS)  # one child process
    ap.add_argument("--shape", default="smoke", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.device, args.shapes = "cpu", ["smoke"]
    if args.phase:
        print("PHASE " + json.dumps(_phase(args)), flush=True)
        return
    rows = []
    for shape in args.shapes:
        with tempfile.TemporaryDirectory(prefix="vericache-triton-cache-") as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            row = {"shape": shape}
            for start in ("cold", "restart"):  # each a new process over the same cache directory
                t0 = time.perf_counter()
                cmd = [sys.executable, __file__, "--phase", "--shape", shape, "--device", args.device,
                       "--compressor", args.compressor, "--draft-len", str(args.draft_len)] + (
                           ["--smoke"] if args.smoke else [])
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(f"{start} warm-up of {shape} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
                phase = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("PHASE "))[6:])
                row.update(compressors=phase["compressors"], layout=phase["layout"])
                row[start] = phase["first"]
                row[f"{start}_again"] = phase["again"]
                row[f"verify_{start}"] = phase["verify_first"]
                row[f"verify_{start}_again"] = phase["verify_again"]
                row[f"{start}_process_s"] = round(time.perf_counter() - t0, 1)
            print(f"{shape}: cold {row['cold']:.2f} s, restart {row['restart']:.2f} s, "
                  f"again {row['restart_again']:.3f} s ({', '.join(row['compressors'])}); verify kernel: cold "
                  f"{row['verify_cold']:.2f} s, restart {row['verify_restart']:.2f} s", flush=True)
            rows.append(row)
    import torch
    import triton

    result = {"commit": os.environ.get("VERICACHE_COMMIT", "unknown"), "device": args.device,
              "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "triton": triton.__version__,
              "interpreter": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
