"""Compile the draft kernels for a GPU on a machine without one, and count their loops.

    .venv/bin/python benchmark/sass_offline.py                       # every variant, sm_90
    .venv/bin/python benchmark/sass_offline.py --only int8_half --dump /tmp/sass
    .venv/bin/python benchmark/sass_offline.py --only quest_kv quest_query page_scores_kv
    .venv/bin/python benchmark/sass_offline.py --only int8_half_asm int8_half_asm_off64 int8_half_asm_q8
    .venv/bin/python benchmark/sass_offline.py --triton 3.6.0 --defaults   # the lent GPU machine's Triton

Triton's NVIDIA backend and the ptxas / cuobjdump it ships run on any x86 machine, so the
compiled code of each launch variant (format x half products x inline PTX, at the launch
sizes ops.MEASURED_LAUNCH uses, offsets within an entry in int32 as the drafter launches them;
``*_off64``: the int64 addressing that replaced) can be read here: per variant, the instructions of the main
loop (the first backward branch's body: the compressed segment), by opcode. The counts are
from the venv's Triton, not necessarily the GPU machine's (3.6): a guide to what an edit
changes, checked against ``benchmark/profile_kernels.py`` on a lent GPU. Quest's kernels
(``quest_*``, ``page_scores_*``) are compiled the same way; a variant that fails to compile
is reported and the exit status is 1 (test_kernels.py runs the drafter's default ones, so a
kernel the interpreter accepts but the compiler refuses fails CI, not a GPU session).
``--triton VERSION`` compiles with that Triton release instead of the venv's (the lent GPU
machine has 3.6, the venv 3.8; their code differs, e.g. int8 read as words is shorter than the
default under 3.8 and longer under 3.6, as the H200 timed it): the wheel comes from the package
index once, unpacked under ~/.cache/sgl_vericache/triton/VERSION, and this script runs again
with it first on the path.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

TRITON_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sgl_vericache" / "triton"


def triton_release(version: str) -> Path:
    """A directory holding Triton ``version`` (its package, ptxas and cuobjdump), for this
    Python and platform: fetched with pip (no dependencies) and unpacked once."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise SystemExit(f"--triton {version!r}: expected a release number such as 3.6.0")
    home = TRITON_CACHE / version
    if not (home / "triton" / "__init__.py").exists():
        import zipfile

        with tempfile.TemporaryDirectory() as tmp:
            print(f"fetching triton=={version} into {home}", file=sys.stderr, flush=True)
            got = subprocess.run([sys.executable, "-m", "pip", "download", f"triton=={version}", "--no-deps",
                                  "--only-binary=:all:", "--disable-pip-version-check", "-q", "-d", tmp],
                                 capture_output=True, text=True)
            wheels = list(Path(tmp).glob("triton-*.whl"))
            if got.returncode != 0 or not wheels:
                raise SystemExit(f"--triton {version}: pip could not fetch it: {(got.stderr or got.stdout)[-600:]}")
            part = home.with_name(home.name + ".part")
            shutil.rmtree(part, ignore_errors=True)  # what an interrupted run left
            with zipfile.ZipFile(wheels[0]) as wheel:
                wheel.extractall(part)
            for tool in (part / "triton" / "backends" / "nvidia" / "bin").glob("*"):
                tool.chmod(0o755)  # zip entries lose their mode
            part.rename(home)
    return home


if __name__ == "__main__" and "--triton" in sys.argv:  # run again with that release first on the path
    _at = sys.argv.index("--triton")
    if _at + 1 >= len(sys.argv):
        raise SystemExit("--triton needs a version, e.g. --triton 3.6.0")
    _home = triton_release(sys.argv[_at + 1])
    _env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_home), *filter(None, [os.environ.get("PYTHONPATH")])])}
    _argv = sys.argv[1:_at] + sys.argv[_at + 2:]
    os.execve(sys.executable, [sys.executable, __file__, *_argv], _env)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sgl_vericache.kernels import triton_decode as td  # noqa: E402
from sgl_vericache.kernels import triton_quest as tq  # noqa: E402
from sgl_vericache.kernels import triton_verify as tv  # noqa: E402
from sgl_vericache.kernels.packing import FMT_DENSE, FMT_FP8, FMT_INT8, FMT_KIVI  # noqa: E402

# name -> (FMT, BITS, HALF, ASM, BN, warps, stages); ASM as LaunchConfig.asm. Each quantizer
# at its measured launch (ops.MEASURED_LAUNCH at e399a85, fp8 at 4 warps as first profiled):
# fp32 dequantization, half products in Triton code, with inline PTX, and (int8 / fp8 / kivi4) on words
VARIANTS = {"dense": (FMT_DENSE, 16, False, 0, 32, 4, 2)}
for _name, _fmt, _bits, _warps in (("int8", FMT_INT8, 8, 2), ("fp8", FMT_FP8, 8, 4), ("kivi4", FMT_KIVI, 4, 2),
                                   ("kivi2", FMT_KIVI, 2, 2)):
    for _suffix, _half, _asm in (("", False, 0), ("_half", True, 0), ("_half_asm", True, 1), ("_half_words", True, 2)):
        if _name != "kivi2" or _asm < 2:  # kivi2 reads bytes: words are int8 / fp8 / kivi4
            VARIANTS[_name + _suffix] = (_fmt, _bits, _half, _asm, 32, _warps, 3)



def signature(fmt: int) -> dict:
    codes = {FMT_DENSE: "*bf16", FMT_KIVI: "*u8", FMT_INT8: "*i8", FMT_FP8: "*u8"}[fmt]
    types = {"q_ptr": "*bf16", "meta_ptr": "*i32", "k_ptr": codes, "v_ptr": codes,
             "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vs_ptr": "*fp16", "vz_ptr": "*fp16",
             "kr_ptr": "*bf16", "vr_ptr": "*bf16", "ke_ptr": "*bf16", "ve_ptr": "*bf16", "idx_ptr": "*i32",
             "addr_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16",
             "lse_ptr": "*fp32", "tick_ptr": "*i32", "qk_scale": "fp32", "softcap": "fp32", "H": "i32", "HQ": "i32",
             "E_CAP": "i32", "EXT_ADD": "i32", "NUM_SPLITS": "i32"}
    if fmt == FMT_INT8:
        types["ks_ptr"] = types["vs_ptr"] = "*fp16"
    return types


# Quest's kernels at ops.MEASURED_LAUNCH (per KV head: the dense kernel's sizes), Llama-3-8B's
# group of 4, d=128, 16-token pages: name -> (kernel, argument types, constexprs, BN, warps, stages)
_QUEST_HEAD = {"q_ptr": "*bf16", "meta_ptr": "*i32", "k_ptr": "*bf16", "v_ptr": "*bf16", "sel_ptr": "*i32",
               "ke_ptr": "*bf16", "ve_ptr": "*bf16", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
               "addr_ptr": "*i64"}
_QUEST_TAIL = {"qk_scale": "fp32", "softcap": "fp32", "H": "i32", "HQ": "i32", "E_CAP": "i32", "EXT_ADD": "i32",
               "K_SEL": "i32"}
_FUSED_ARGS = {"out_ptr": "*bf16", "lse_ptr": "*fp32", "tick_ptr": "*i32"}  # the fused merge's outputs
_SCORE_ARGS = {"q_ptr": "*bf16", "meta_ptr": "*i32", "pmin_ptr": "*bf16", "pmax_ptr": "*bf16", "addr_ptr": "*i64",
               "out_ptr": "*fp32", "H": "i32", "HQ": "i32", "HC": "i32", "P_MAX": "i32", "PAGE_SIZE": "i32"}
_QUEST_KV_ARGS = {**_QUEST_HEAD, **_FUSED_ARGS, **_QUEST_TAIL, "NUM_SPLITS": "i32"}
_QUEST_KV = dict(GROUP=4, GP=16, D=128, BN=32, PAGE=16, ROUND=2, DOT=2, FUSED=False, HAS_LSE=False, SP=2)
QUEST_VARIANTS = {
    "quest_kv": (tq._quest_group_kernel, _QUEST_KV_ARGS, _QUEST_KV, 32, 4, 2),
    "quest_query": (tq._quest_split_kernel, {**_QUEST_HEAD, **_QUEST_TAIL, "PAGE_SIZE": "i32", "NUM_SPLITS": "i32"},
                    dict(GROUP=4, D=128, BN=64, ROUND=2), 64, 4, 2),
    "page_scores_kv": (tq._page_scores_kernel, _SCORE_ARGS, dict(GROUP=4, PER_KV=True, D=128, BP=64), 0, 4, 2),
    "page_scores_query": (tq._page_scores_kernel, _SCORE_ARGS, dict(GROUP=4, PER_KV=False, D=128, BP=64), 0, 4, 2),
}
# the verify kernel (kernels/verify.py) as verify_attention launches it on a bf16 pool, d=128:
# Llama-3-8B's group of 4 with 5 block tokens (QP 32), Llama-70B/TP8's group of 8 with 9 (QP
# 128, 8 warps), under a verify mask (TREE) and soft-capped (SOFTCAP). name -> as QUEST_VARIANTS
_VERIFY_ARGS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i32", "row_ptr": "*i64",
                "prefix_ptr": "*i64", "live_ptr": "*i32", "mask_ptr": "*u8", "m_ptr": "*fp32", "l_ptr": "*fp32",
                "acc_ptr": "*fp32", "qk_scale": "fp32", "T": "i32", "H": "i32", "HQ": "i32", "NUM_SPLITS": "i32",
                "table_stride": "i32", "softcap": "fp32", "window": "i32", "stride_kt": "i32", "stride_kh": "i32",
                "stride_vt": "i32", "stride_vh": "i32"}
_VERIFY = dict(GROUP=4, QP=32, D=128, DP=128, BN=32, ROUND=2, DOT=2, TREE=False, SOFTCAP=False)
VERIFY_VARIANTS = {
    "verify_qp32": (tv._verify_split_kernel, _VERIFY_ARGS, _VERIFY, 32, 4, 2),
    "verify_qp128": (tv._verify_split_kernel, _VERIFY_ARGS, {**_VERIFY, "GROUP": 8, "QP": 128}, 32, 8, 2),
    "verify_tree": (tv._verify_split_kernel, _VERIFY_ARGS, {**_VERIFY, "TREE": True}, 32, 4, 2),
    "verify_softcap": (tv._verify_split_kernel, _VERIFY_ARGS, {**_VERIFY, "SOFTCAP": True}, 32, 4, 2),
}
# the split merge (ops._combine), for 16 splits of d=128, as verify and every unfused draft
# launch it; with a model's attention sinks (SINK). name -> as QUEST_VARIANTS (no main loop)
_MERGE_ARGS = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
               "sink_ptr": "*fp32", "NUM_SPLITS": "i32", "HQ": "i32"}
MERGE_VARIANTS = {
    "merge": (td._combine_kernel, _MERGE_ARGS, dict(SP=16, D=128, HAS_LSE=False, SINK=False), 0, 4, 2),
    "merge_sinks": (td._combine_kernel, _MERGE_ARGS, dict(SP=16, D=128, HAS_LSE=False, SINK=True), 0, 4, 2),
}
# what test_kernels.py compiles: each format's default launch on a GPU (half products, inline PTX),
# for a lone entry and, _addr, for several read in place (and the fused split merge, LaunchConfig.fused,
# on the dense kernel; int8 keys against the query's int8 terms, LaunchConfig.int8_query; KIVI
# int4 codes read as words, LaunchConfig.asm=2: its inline PTX assembled by ptxas)
DEFAULTS = ["dense", "dense_fused", "kivi4_half_asm", "kivi2_half_asm", "int8_half_asm", "fp8_half_asm",
            "quest_kv", "quest_kv_fused", *(n for n in QUEST_VARIANTS if n != "quest_kv")]
DEFAULTS += [f"{name}_addr" for name in DEFAULTS if name != "dense_fused"] + ["int8_half_asm_q8", "kivi4_half_words"]
DEFAULTS += list(VERIFY_VARIANTS) + list(MERGE_VARIANTS)
DEFAULTS += ["dense_softcap", "kivi4_half_asm_softcap", "quest_kv_softcap"]  # a soft-capped model's drafts
# name suffixes: _softcap (the scores soft-capped: Gemma 2, Grok), _q8 (int8 only:
# LaunchConfig.int8_query), _fused (LaunchConfig.fused), then _addr (several entries read in
# place through their address table, packing.pack(in_place=True)) or _off64 (int64 offsets
# within an entry)
SUFFIXES = ("_softcap", "_q8", "_fused", "_addr", "_off64")


def compile_kernel(fn, types: dict, constexprs: dict, warps: int, stages: int, arch: int = 90):
    """``fn`` compiled for sm_<arch> as a launch would specialize it: constexprs bound, every
    pointer 16-byte aligned and every stride a multiple of 16 (the verify kernel's pool and
    token table strides: Triton specializes integer arguments on that at launch)."""
    sig = {**types, **{k: "constexpr" for k in constexprs}}
    names = fn.arg_names
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in types if p.endswith("_ptr") or "stride" in p}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps,
                                                                          "num_stages": stages})


def compile_any(name: str, arch: int = 90):
    """(compiled kernel, warps, key tokens a main-loop iteration reads; 0: no such loop)."""
    base, flags = split_name(name)
    if name in VERIFY_VARIANTS or name in MERGE_VARIANTS:  # whole names ("verify_softcap": no suffixes)
        fn, types, constexprs, bn, warps, stages = {**VERIFY_VARIANTS, **MERGE_VARIANTS}[name]
        return compile_kernel(fn, types, constexprs, warps, stages, arch), warps, bn
    if base in QUEST_VARIANTS:
        fn, types, constexprs, bn, warps, stages = QUEST_VARIANTS[base]
        if "OFF32" in fn.arg_names:  # the per-KV-head kernel (the others address in int64)
            constexprs = {**constexprs, "OFF32": "_off64" not in flags}
        if "ADDR" in fn.arg_names:
            constexprs = {**constexprs, "ADDR": "_addr" in flags}
        if "SOFTCAP" in fn.arg_names:
            constexprs = {**constexprs, "SOFTCAP": "_softcap" in flags}
        if "_fused" in flags:  # split_name takes "_fused" off "quest_kv_fused": put it back
            if "FUSED" not in fn.arg_names:
                raise ValueError(f"{name}: {base} has no fused merge")
            constexprs = {**constexprs, "FUSED": True, "SP": 16}
        return compile_kernel(fn, types, constexprs, warps, stages, arch), warps, bn
    _, _, _, _, bn, warps, _ = VARIANTS[base]
    return compile_variant(base, arch=arch, fused="_fused" in flags, off32="_off64" not in flags,
                           addr="_addr" in flags, int8_query="_q8" in flags,
                           softcap="_softcap" in flags), warps, bn


def split_name(name: str) -> tuple[str, set]:
    """'int8_half_asm_q8_fused_addr' -> ('int8_half_asm', {'_q8', '_fused', '_addr'})."""
    flags = set()
    for suffix in reversed(SUFFIXES):
        if name.endswith(suffix):
            flags.add(suffix)
            name = name.removesuffix(suffix)
    return name, flags


def compile_variant(name: str, group: int = 4, head_dim: int = 128, arch: int = 90, fused: bool = False,
                    off32: bool = True, addr: bool = False, int8_query: bool = False, softcap: bool = False):
    """One launch variant of the decode kernel; off32: offsets within an entry in int32, as
    the drafter launches it (ops.offsets32), else the int64 addressing it replaces; addr:
    entries read in place through their address table; int8_query (int8): the keys' scores
    from the query's int8 terms; softcap: the scores soft-capped."""
    fmt, bits, half, asm, bn, warps, stages = VARIANTS[name]
    constexprs = dict(GROUP=group, GP=16, D=head_dim, BN=bn, FMT=fmt, BITS=bits, QGROUP=32, CGROUP=32,
                      KMODE=1 if bn <= 32 else 2, HEAD_SCALE=False, INDEXED=False, ROUND=2, DOT=2,
                      FOLD=fmt in (FMT_INT8, FMT_FP8), UNPACK=0, HALF=half, Q_BF16=True, ASM=asm,
                      MROUND=1 if half else 2, MDOT=1 if half else 2, FUSED=fused, HAS_LSE=False,
                      SP=16 if fused else 2, OFF32=off32, ADDR=addr, QK8=int8_query, SOFTCAP=softcap)
    return compile_kernel(td._decode_split_kernel, signature(fmt), constexprs, warps, stages, arch)


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
    int8 = [n for n in VARIANTS if n.startswith("int8")]
    decode = [*VARIANTS, *(f"{n}_fused" for n in VARIANTS), *(f"{n}_q8" for n in int8), "quest_kv", "quest_kv_fused"]
    every = [*VARIANTS, *(f"{n}_fused" for n in VARIANTS), *(f"{n}_q8" for n in int8), *QUEST_VARIANTS, "quest_kv_fused",
             *VERIFY_VARIANTS, *MERGE_VARIANTS,
             *(f"{n}_off64" for n in decode),
             *(f"{n}_addr" for n in [*decode, "quest_query", "page_scores_kv", "page_scores_query"]),
             *(f"{n}_softcap" for n in [*VARIANTS, "quest_kv", "quest_query"])]
    ap.add_argument("--only", nargs="*", choices=every, default=every)
    ap.add_argument("--defaults", action="store_true", help="only each kernel's default launch on a GPU")
    ap.add_argument("--arch", type=int, default=90, help="SM version (90: H100 / H200)")
    ap.add_argument("--triton", metavar="VERSION",
                    help="compile with this Triton release (e.g. 3.6.0, the lent GPU machine's), fetched once")
    ap.add_argument("--dump", type=Path, help="write each variant's SASS and PTX here")
    ap.add_argument("--jobs", type=int, default=1,
                    help="compile in this many processes (a compile is single-threaded); lines keep their order")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="vc_sass_"))
    print(f"triton {triton.__version__} ({Path(triton.__file__).parent}), sm_{args.arch}", flush=True)
    names = list(DEFAULTS if args.defaults else args.only)
    if args.jobs > 1 and len(names) > 1:
        raise SystemExit(_in_processes(names, args))
    failed = 0
    for name in names:
        try:
            kernel, warps, bn = compile_any(name, arch=args.arch)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{name}: compile failed: {type(exc).__name__}: {str(exc)[-1500:]}", flush=True)
            failed += 1
            continue
        sass, regs = sass_of(kernel)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{name}.sass").write_text(sass)
            (args.dump / f"{name}.ptx").write_text(kernel.asm["ptx"])
        main_loop = loops(sass)[0] if loops(sass) else collections.Counter()
        # thread-instructions per K/V element (d=128) of the main loop
        per_elem = f"({sum(main_loop.values()) * warps * 32 / (2 * bn * 128):.2f} per element)" if bn else ""
        top = ", ".join(f"{k} {v}" for k, v in main_loop.most_common(10))
        print(f"{name:17s} regs {regs:3d} main loop {sum(main_loop.values()):5d} instr {per_elem}: {top}", flush=True)
    if failed:
        raise SystemExit(f"{failed} variant(s) failed to compile")


def _in_processes(names: list[str], args) -> int:
    """Compile ``names`` over ``args.jobs`` processes of this script (this Triton, the same
    cache); print their lines in ``names``' order; the exit status is 1 when any failed."""
    jobs = min(args.jobs, len(names))
    shares = [names[i::jobs] for i in range(jobs)]
    extra = ["--arch", str(args.arch)] + (["--dump", str(args.dump)] if args.dump else [])
    procs = [subprocess.Popen([sys.executable, __file__, *extra, "--only", *share], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for share in shares]
    lines, status = {}, 0
    for share, proc in zip(shares, procs):
        out, _ = proc.communicate()
        status |= proc.returncode != 0
        body = [line for line in out.splitlines()[1:] if line.strip()]  # less its "triton ..." line
        for name in share:  # a variant's line starts with its name
            lines[name] = [line for line in body if line.split(":")[0].split()[0] == name]
        rest = [line for line in body if not any(line in got for got in lines.values())]
        if rest:
            lines.setdefault("", []).extend(rest)
    for name in [*names, ""]:
        for line in lines.get(name, []):
            print(line, flush=True)
    return status


if __name__ == "__main__":
    main()
