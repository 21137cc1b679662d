"""cost_model.py's ``--gpu-kernels``: the paper's Llama-70B example projected with attention
terms a GPU measured (bench_kernels.py's JSON) instead of the roofline's ideal ones.

    python benchmark/cost_model.py --gpu-kernels bench_kernels.json

``gpu_kernel_terms`` reads the JSON at the combination nearest 32k x 8 for Llama-70B/TP8
heads; ``gpu_projection`` runs cost_model's ``predict`` with them per compressor.
"""

from __future__ import annotations

import math
from dataclasses import replace

from cost_model import GB, PAPER, PAPER_ASSUMPTIONS, h100_nvl_x2, llama_70b, paper_report, predict

PROJECTION_METHODS = ("kivi4", "kivi2", "int8", "fp8", "droppers")  # Quest keeps the full KV resident: reads only
GPU_PROJECTION_WHY = (
    "Acceptance is held at the paper's 23 for every method and the context / concurrency are "
    "PAPER_ASSUMPTIONS' guesses (32k, 32 offered), so the projection isolates the kernels. The "
    "attention terms are shares of the HBM peak measured on the bench GPU (the JSON's `gpu`) at Llama-70B's "
    "per-GPU heads under 8-way TP (8 query / 1 KV head), carried over to the paper's 2x H100 NVL "
    "(TP=2: 32 / 4 heads a GPU); the verify pass's attention is the verify kernel's share of the HBM "
    "peak where bench_kernels timed it (its block nearest draft_len + 1 tokens), else taken to read "
    "the full KV as efficiently as full-KV decode does. Weights are still read at the roofline, and TP "
    "all-reduces, kernel launches, sampling and the scheduler cost nothing: the result stays an upper bound.")


def gpu_kernel_terms(data: dict, shape: str = "llama70b-tp8", context: int = 32768, batch: int = 8) -> dict:
    """bench_kernels.py's JSON -> the attention terms at the measured combination nearest
    (context, batch) for ``shape``: the faster full-KV baseline's and each draft kernel's share
    of the HBM peak, each draft's read ratio (full KV bytes / bytes it reads), and the host
    link's GB/s from the loader measurement (None when not measured); and, where timed, the
    verify kernel's (``verify_tokens``: the block it verified; its share of the HBM peak is
    the full KV's bytes over its time: None when no verify row was timed)."""
    peak = data["hbm_bytes_per_s"]
    rows = [r for r in data.get("rows", []) if r.get("shape") == shape and "ms" in r]
    combos = {(r["context"], r["batch"]) for r in rows if r["kind"] == "full"}
    if not combos:
        raise ValueError(f"no timed full-KV rows for shape {shape!r} in the bench_kernels JSON")
    near = min(combos, key=lambda cb: (abs(math.log2(cb[0] / context)), abs(math.log2(cb[1] / batch))))
    at = [r for r in rows if (r["context"], r["batch"]) == near]
    full = min((r for r in at if r["kind"] == "full"), key=lambda r: r["ms"])
    draft = {r["method"]: {"hbm_fraction": r["hbm_fraction"], "read_ratio": r["read_ratio"], "ms": r["ms"],
                           "speedup_vs_full": full["ms"] / r["ms"]} for r in at if r["kind"] == "draft"}
    loader = data.get("loader") or {}
    kernel_verifies = [r for r in at if r["kind"] == "verify" and r["method"].startswith("triton_verify_t")]
    verify = None
    if kernel_verifies:
        want = PAPER_ASSUMPTIONS["draft_len"] + 1
        r = min(kernel_verifies, key=lambda r: abs(int(r["method"].rsplit("_t", 1)[1]) - want))
        verify = {"method": r["method"], "verify_tokens": int(r["method"].rsplit("_t", 1)[1]), "ms": r["ms"],
                  "hbm_fraction": r["hbm_fraction"], "decode_steps": r["ms"] / full["ms"]}
    return {"shape": shape, "context": near[0], "batch": near[1], "hbm_bytes_per_s": peak,
            "full": {"method": full["method"], "hbm_fraction": full["hbm_fraction"], "ms": full["ms"]},
            "draft": draft, "verify": verify, "host_link_GBps": loader.get("GBps"), "gpu": data.get("gpu"),
            "commit": data.get("commit"), "smoke": bool(data.get("smoke"))}


def gpu_projection(terms: dict) -> dict:
    """The paper's Llama-70B example (paper_report's assumptions and hardware) with the
    measured attention terms, per compressor, beside the roofline's prediction."""
    a, shape, hw0 = PAPER_ASSUMPTIONS, llama_70b(), h100_nvl_x2()
    full_bw = terms["full"]["hbm_fraction"] * hw0.mem_bw
    verify_bw = terms["verify"]["hbm_fraction"] * hw0.mem_bw if terms.get("verify") else full_bw
    link = hw0.host_link_bw if not terms["host_link_GBps"] else 2 * terms["host_link_GBps"] * GB  # one link a GPU
    roofline = paper_report()["prediction"]
    methods = {}
    for name in PROJECTION_METHODS:
        if name not in terms["draft"]:
            continue
        d = terms["draft"][name]
        hw = replace(hw0, full_kv_bw=full_bw, verify_kv_bw=verify_bw, draft_kv_bw=d["hbm_fraction"] * hw0.mem_bw,
                     host_link_bw=link)
        p = predict(shape, hw, a["context"], a["offered_batch"], a["dtype_bytes"], d["read_ratio"], a["draft_len"],
                    acc_len=a["acc_len"])
        methods[name] = {"read_ratio": d["read_ratio"], "tok_s": p["tok_s"], "batch": p["batch"],
                         "best_speedup": p["best_speedup"],
                         "vericache_over_paper": p["tok_s"]["vericache_offloaded"] / PAPER["vericache_tok_s"],
                         "full_over_paper": p["tok_s"]["full_resident"] / PAPER["full_kv_tok_s"]}
    return {"terms": terms, "host_link_bw": link, "paper": PAPER, "assumptions": a,
            "roofline": {"tok_s": roofline["tok_s"], "best_speedup": roofline["best_speedup"]},
            "methods": methods, "why": GPU_PROJECTION_WHY}


def print_gpu(rep: dict) -> None:
    t = rep["terms"]
    print(f"GPU attention terms ({t['gpu']}, {t['shape']} at {t['context']} x {t['batch']}{', SMOKE RUN' if t['smoke'] else ''}):"
          f" full-KV {t['full']['method']} {100 * t['full']['hbm_fraction']:.0f}% of HBM")
    v = t.get("verify")
    print(f"  verify: {v['method']} {100 * v['hbm_fraction']:.0f}% of HBM ({v['decode_steps']:.2f} decode steps)"
          if v else "  verify: not timed, taken as the full-KV decode's share")
    r = rep["roofline"]
    print(f"  roofline: full {r['tok_s']['full_resident']:.1f}, VeriCache {r['tok_s']['vericache_offloaded']:.1f} tok/s"
          f" ({r['best_speedup']:.2f}x); paper {PAPER['full_kv_tok_s']:.0f} -> {PAPER['vericache_tok_s']:.0f}")
    for name, m in rep["methods"].items():
        draft = t["draft"][name]
        print(f"  {name:<9} draft {100 * draft['hbm_fraction']:3.0f}% of HBM, reads 1/{m['read_ratio']:.2f}: full "
              f"{m['tok_s']['full_resident']:6.1f}, VeriCache {m['tok_s']['vericache_offloaded']:6.1f} tok/s "
              f"({m['best_speedup']:.2f}x; {m['vericache_over_paper']:.2f} of the paper's 256)")
