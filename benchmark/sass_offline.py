"""Compile the draft decode kernel for a GPU on a machine without one, and count its loop.

    .venv/bin/python benchmark/sass_offline.py                       # every variant, sm_90
    .venv/bin/python benchmark/sass_offline.py --only int8_half --dump /tmp/sass

Triton's NVIDIA backend and the ptxas / cuobjdump it ships run on any x86 machine, so the
compiled code of each launch variant (format x half products x inline PTX, at the launch
sizes ops.MEASURED_LAUNCH uses) can be read here: per variant, the instructions of the main
loop (the first backward branch's body: the compressed segment), by opcode. The counts are
from the venv's Triton, not necessarily the GPU machine's (3.6): a guide to what an edit
changes, checked against ``benchmark/profile_kernels.py`` on a lent GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sgl_vericache.kernels import triton_decode as td  # noqa: E402
from sgl_vericache.kernels.packing import FMT_DENSE, FMT_FP8, FMT_INT8, FMT_KIVI  # noqa: E402

# name -> (FMT, BITS, HALF, ASM, BN, warps, stages); ASM as LaunchConfig.asm. Each quantizer
# at its measured launch (ops.MEASURED_LAUNCH at e399a85, fp8 at 4 warps as first profiled):
# fp32 dequantization, half products in Triton code, with inline PTX, and (int8 / fp8) on words
VARIANTS = {"dense": (FMT_DENSE, 16, False, 0, 32, 4, 2)}
for _name, _fmt, _bits, _warps in (("int8", FMT_INT8, 8, 2), ("fp8", FMT_FP8, 8, 4), ("kivi4", FMT_KIVI, 4, 2),
                                   ("kivi2", FMT_KIVI, 2, 2)):
    for _suffix, _half, _asm in (("", False, 0), ("_half", True, 0), ("_half_asm", True, 1), ("_half_words", True, 2)):
        if _fmt != FMT_KIVI or _asm < 2:  # KIVI reads bytes: words are int8 / fp8 only
            VARIANTS[_name + _suffix] = (_fmt, _bits, _half, _asm, 32, _warps, 3)
PTRS = ["q_ptr", "meta_ptr", "k_ptr", "v_ptr", "ks_ptr", "kz_ptr", "vs_ptr", "vz_ptr", "kr_ptr", "vr_ptr",
        "ke_ptr", "ve_ptr", "idx_ptr", "m_ptr", "l_ptr", "acc_ptr"]


def signature(fmt: int) -> dict:
    codes = {FMT_DENSE: "*bf16", FMT_KIVI: "*u8", FMT_INT8: "*i8", FMT_FP8: "*u8"}[fmt]
    types = {"q_ptr": "*bf16", "meta_ptr": "*i32", "k_ptr": codes, "v_ptr": codes,
             "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vs_ptr": "*fp16", "vz_ptr": "*fp16",
             "kr_ptr": "*bf16", "vr_ptr": "*bf16", "ke_ptr": "*bf16", "ve_ptr": "*bf16", "idx_ptr": "*i32",
             "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
             "qk_scale": "fp32", "H": "i32", "HQ": "i32", "E_CAP": "i32", "EXT_ADD": "i32", "NUM_SPLITS": "i32"}
    if fmt == FMT_INT8:
        types["ks_ptr"] = types["vs_ptr"] = "*fp16"
    return types


def compile_variant(name: str, group: int = 4, head_dim: int = 128, arch: int = 90):
    fmt, bits, half, asm, bn, warps, stages = VARIANTS[name]
    constexprs = dict(GROUP=group, GP=16, D=head_dim, BN=bn, FMT=fmt, BITS=bits, QGROUP=32, CGROUP=32,
                      KMODE=1 if bn <= 32 else 2, HEAD_SCALE=False, INDEXED=False, ROUND=2, DOT=2,
                      FOLD=fmt in (FMT_INT8, FMT_FP8), UNPACK=0, HALF=half, Q_BF16=True, ASM=asm,
                      MROUND=1 if half else 2, MDOT=1 if half else 2)
    sig = signature(fmt)
    sig.update({k: "constexpr" for k in constexprs})
    # what a real launch specializes on: 16-byte aligned pointers
    names = td._decode_split_kernel.arg_names
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in PTRS}
    src = ASTSource(td._decode_split_kernel, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps,
                                                                          "num_stages": stages})


def sass_of(kernel) -> tuple[str, int]:
    """(SASS text, registers per thread) of a compiled kernel."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    return sass, int(regs.group(1)) if regs else -1


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode without modifiers or predicate, text) of each SASS instruction."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if m:
            text = m.group(2).strip()
            out.append((int(m.group(1), 16), (text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0],
                        text))
    return out


def opcode_histogram(sass: str) -> dict:
    """Opcode -> count over the whole kernel, most frequent first."""
    return dict(collections.Counter(op for _, op, _ in instructions(sass)).most_common())


def loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of each loop body (a backward branch's target to the branch)."""
    ins = instructions(sass)
    found = []
    for addr, _, text in ins:
        m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            found.append(collections.Counter(op for a, op, _ in ins if start <= a <= addr))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--arch", type=int, default=90, help="SM version (90: H100 / H200)")
    ap.add_argument("--dump", type=Path, help="write each variant's SASS and PTX here")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="vc_sass_"))
    for name in args.only:
        fmt, bits, half, asm, bn, warps, stages = VARIANTS[name]
        try:
            kernel = compile_variant(name, arch=args.arch)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{name}: compile failed: {type(exc).__name__}: {str(exc)[-1500:]}")
            continue
        sass, regs = sass_of(kernel)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{name}.sass").write_text(sass)
            (args.dump / f"{name}.ptx").write_text(kernel.asm["ptx"])
        main_loop = loops(sass)[0] if loops(sass) else collections.Counter()
        per_elem = sum(main_loop.values()) * warps * 32 / (2 * bn * 128)  # thread-instructions per K/V element
        top = ", ".join(f"{k} {v}" for k, v in main_loop.most_common(10))
        print(f"{name:15s} regs {regs:3d} main loop {sum(main_loop.values()):5d} instr "
              f"({per_elem:.2f} per element): {top}", flush=True)


if __name__ == "__main__":
    main()
