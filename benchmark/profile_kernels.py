"""Where the draft kernels spend their time, on a GPU: compiled code and hardware counters.

    python benchmark/profile_kernels.py --out DIR            # on a CUDA machine, ~1-2 minutes

For a few launches at Llama-3-8B heads, 32k x 8, bf16 (the issue-27 target combination):
times each (CUDA events, median of 20), keeps what Triton compiled for it (TTGIR, PTX and,
where cuobjdump is installed, SASS) with a histogram of the SASS opcodes of the kernel, and,
where Nsight Compute (``ncu``) is installed and allowed to read counters, runs each launch once
under it (speed of light, warp stalls, instruction mix). Everything goes to DIR: the ncu reports
as text, the compiled files in DIR/compiled.tgz, a summary in DIR/profile_kernels.json. First
run on the H200 at 1348b4a: benchmark/results/gpu_h200/ncu_1348b4a/ (the launches were
then those below without the _asm ones). Not part of any test or of scripts/gpu_check.sh:
a tool for a lent GPU session with device time left (~2 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# each launch compiles into a cache of its own, so its files can be told apart
CACHE_ROOT = Path(os.environ.get("VERICACHE_PROFILE_CACHE") or tempfile.mkdtemp(prefix="vc_triton_"))

LAUNCHES = {  # name -> (method, LaunchConfig fields)
    "int8": ("int8", {"block_n": 32, "num_warps": 2, "num_stages": 3, "half": False}),
    "int8_half": ("int8", {"block_n": 32, "num_warps": 2, "num_stages": 3, "half": True, "asm": 0}),
    "int8_half_asm": ("int8", {"block_n": 32, "num_warps": 2, "num_stages": 3, "half": True, "asm": 1}),
    "kivi4": ("kivi4", {"block_n": 32, "num_warps": 2, "num_stages": 3, "half": False}),
    "kivi4_half": ("kivi4", {"block_n": 32, "num_warps": 2, "num_stages": 3, "half": True, "asm": 0}),
    "kivi4_half_asm": ("kivi4", {"block_n": 32, "num_warps": 2, "num_stages": 3, "half": True, "asm": 1}),
    "kivi2_half": ("kivi2", {"block_n": 32, "num_warps": 2, "num_stages": 3, "half": True, "asm": 0}),
    "fp8_half": ("fp8", {"block_n": 32, "num_warps": 4, "num_stages": 3, "half": True, "asm": 0}),
    "droppers": ("droppers", {}),
    # the int64 addressing the default int32 offsets within an entry replaced (not yet timed)
    "int8_half_asm_off64": ("int8", {"block_n": 32, "num_warps": 2, "num_stages": 3, "half": True, "asm": 1,
                                     "int32_offsets": False}),
    "droppers_off64": ("droppers", {"int32_offsets": False}),
    # int8 keys against the query's int8 terms (LaunchConfig.int8_query; not yet timed)
    "int8_half_asm_q8": ("int8", {"block_n": 32, "num_warps": 2, "num_stages": 3, "half": True, "asm": 1,
                                  "int8_query": True}),
    # KIVI int4 codes read as 32-bit words (LaunchConfig.asm=2; not yet timed)
    "kivi4_half_words": ("kivi4", {"block_n": 32, "num_warps": 2, "num_stages": 3, "half": True, "asm": 2}),
}


def _child_env(name: str) -> dict:
    return {**os.environ, "TRITON_CACHE_DIR": str(CACHE_ROOT / name)}


def run_child(name: str, reps: int, timeout: float) -> float:
    """One launch compiled and timed in a process of its own (its own Triton cache)."""
    done = subprocess.run([sys.executable, __file__, "--child", name, "--reps", str(reps)], env=_child_env(name),
                          capture_output=True, text=True, timeout=timeout)
    found = re.search(r"^ms (\S+)$", done.stdout, re.M)
    if done.returncode != 0 or not found:
        raise RuntimeError((done.stdout + done.stderr)[-300:])
    return float(found.group(1))


def run_one(name: str, reps: int = 20) -> float:
    """Compile and time one launch; the median ms."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    import bench_kernels as bk
    from sgl_vericache.kernels import ops
    method, fields = LAUNCHES[name]
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    hq, hkv, d = bk.SHAPES["llama3-8b"]
    packed = bk.synth_entry(method, 8, 32768, hkv, d, device, gen)
    q = bk._rand((8, hq, d), torch.bfloat16, device, gen)
    ke, ve = (bk._rand((8, 32, hkv, d), torch.bfloat16, device, gen) for _ in range(2))
    fn = bk._draft_call(packed, q, ke, ve, ops.LaunchConfig(**fields))
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _sass(cubin: Path) -> str | None:
    tool = shutil.which("cuobjdump") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/cuobjdump")), None)
    if not tool:
        return None
    done = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else None


def collect(name: str, out: Path) -> dict:
    """Copy what Triton compiled for ``name`` into out/name/ and sum up its SASS."""
    got = {}
    dest = out / name
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted((CACHE_ROOT / name).rglob("*")):
        if path.suffix in (".ttgir", ".ptx", ".json") and "decode_split" in path.name:
            shutil.copy(path, dest / path.name)
        if path.suffix == ".cubin" and "decode_split" in path.name:
            sass = _sass(path)
            if sass:
                from sass_offline import loops, opcode_histogram  # the same parsing as offline
                (dest / (path.stem + ".sass")).write_text(sass)
                got["sass_opcodes"] = opcode_histogram(sass)
                got["sass_lines"] = sum(got["sass_opcodes"].values())
                got["main_loop_opcodes"] = dict(loops(sass)[0].most_common()) if loops(sass) else {}
    got["files"] = sorted(p.name for p in dest.iterdir())
    return got


def ncu(names: list[str], out: Path, limit_s: float) -> dict:
    tool = shutil.which("ncu") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/ncu")), None)
    if not tool:
        return {"skipped": "ncu not installed"}
    results = {}
    deadline = time.monotonic() + limit_s
    for name in names:
        left = deadline - time.monotonic()
        if left < 20:
            results[name] = {"skipped": "time"}
            continue
        cmd = [tool, "--kernel-name", "regex:_decode_split_kernel", "--launch-count", "1",
               "--section", "SpeedOfLight", "--section", "WarpStateStats", "--section", "ComputeWorkloadAnalysis",
               "--section", "InstructionStats", "--section", "Occupancy", "--section", "LaunchStats",
               "--section", "MemoryWorkloadAnalysis", sys.executable, __file__, "--child", name, "--reps", "1"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=_child_env(name))
            text, rc = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            text, rc = f"timeout: {exc}", None
        (out / f"ncu_{name}.txt").write_text(text)
        results[name] = {"rc": rc, "chars": len(text), "tail": text[-300:]}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "profile")
    ap.add_argument("--only", nargs="*", default=list(LAUNCHES), choices=list(LAUNCHES))
    ap.add_argument("--ncu-s", type=float, default=120, help="time for the Nsight Compute runs (0: none)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one launch, in its own process
    ap.add_argument("--reps", type=int, default=20, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    if args.child:
        print(f"ms {run_one(args.child, reps=args.reps)}")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"launches": {k: LAUNCHES[k] for k in args.only}, "results": {}}
    for name in args.only:
        try:
            ms = run_child(name, 20, 120)
            summary["results"][name] = {"ms": ms, **collect(name, args.out)}
            print(f"{name}: {ms:.3f} ms, {summary['results'][name].get('sass_lines')} SASS lines", flush=True)
        except Exception as exc:  # noqa: BLE001 - one failing launch does not stop the others
            summary["results"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"{name}: {summary['results'][name]['error']}", flush=True)
    if args.ncu_s > 0:
        summary["ncu"] = ncu(args.only, args.out, args.ncu_s)
    # one archive for the compiled files: the device tool brings back only so many files
    with tarfile.open(args.out / "compiled.tgz", "w:gz") as tar:
        for name in args.only:
            if (args.out / name).is_dir():
                tar.add(args.out / name, arcname=name)
                shutil.rmtree(args.out / name)
    (args.out / "profile_kernels.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'profile_kernels.json'}")


if __name__ == "__main__":
    main()
