"""The GPU draft attention kernels (sgl_vericache.kernels) against their torch twins.

The cases live in kernel_checks.py, a plain script (the bare GPU machine has no pytest).
Each family runs in a subprocess: Triton's interpreter must be switched on
(TRITON_INTERPRET=1) before anything imports triton, and this test process may already
have imported it without. On CPU the interpreter runs every case except the `large`
family (~1 min on 2 cores); with CUDA the `gpu` tests run them compiled, large ones too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "test" / "kernel_checks.py"
INTERPRETED_FAMILIES = ["quantizers", "droppers", "layouts", "store", "verify"]


def _run_checks(args: list[str], interpret: bool, timeout: float = 600) -> str:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(CHECKS), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.mark.parametrize("family", INTERPRETED_FAMILIES)
def test_kernels_match_torch_twins_in_the_interpreter(family):
    # the interpreter is single-threaded Python: a process a core (CI's 2) halves the wait
    jobs = str(max(1, min(len(os.sched_getaffinity(0)), 4)))
    out = _run_checks(["--device", "cpu", "--family", family, "--jobs", jobs], interpret=True)
    assert " 0 failed" in out and "interpreter" in out, out[-3000:]


def test_checks_split_over_processes_run_every_case_once():
    """--jobs n (what gpu_check.sh uses: Triton compiles are single-threaded) runs each
    selected case in exactly one of n processes and sums their counts."""
    listed = _run_checks(["--device", "cpu", "--family", "layouts", "--list"], interpret=True).splitlines()
    names = sorted(line.split(None, 1)[1] for line in listed if line.strip())
    out = _run_checks(["--device", "cpu", "--family", "layouts", "--jobs", "3"], interpret=True)
    ran = [line[6:].rsplit(": max abs error", 1)[0] for line in out.splitlines() if line.startswith("ok    ")]
    skipped = [line[6:].rsplit(" (compiled only", 1)[0] for line in out.splitlines() if line.startswith("SKIP  ")]
    assert len(names) >= 5 and sorted(ran + skipped) == names, out[-3000:]
    assert out.rstrip().splitlines()[-1].startswith(f"{len(ran)} passed, 0 failed"), out[-1000:]


def test_checks_past_their_budget_report_what_they_did_not_run():
    """gpu_check.sh gives the compiled checks a time budget below its step's limit: cases past
    it are named and counted as not run (the run fails), so the log holds every case that
    ran instead of a run killed with its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(CHECKS), "--device", "cpu", "--family", "layouts", "--jobs", "2",
                           "--budget-s", "0"], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = proc.stdout + proc.stderr
    lines = out.splitlines()
    not_run = [line for line in lines if line.startswith("NOT RUN  ")]
    assert proc.returncode == 1 and len(not_run) >= 5, out[-3000:]
    assert lines[-1].startswith(f"0 passed, {len(not_run)} failed"), out[-1000:]


@pytest.mark.gpu
@pytest.mark.parametrize("family", INTERPRETED_FAMILIES + ["large"])
def test_kernels_match_torch_twins_on_cuda(family):
    out = _run_checks(["--device", "cuda", "--family", family], interpret=False)
    assert " 0 failed" in out and "compiled" in out, out[-3000:]


def test_checks_refuse_cpu_without_the_interpreter():
    """Compiled Triton cannot run on a CPU: the script says so instead of crashing later."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(CHECKS), "--device", "cpu"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and "TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-2000:]


def test_cpu_drafting_never_touches_the_kernels():
    """On a CPU the draft store keeps its dense torch path: the kernels are not even imported
    (nor triton), and draft_attention_available says no."""
    code = """
import sys, torch
from sgl_vericache.kernels import draft_attention_available
from sgl_vericache.mem_cache.compress import get_compressor
from sgl_vericache.spec.drafter import CompressedKVStore
k, v = torch.randn(300, 2, 64), torch.randn(300, 2, 64)
store = CompressedKVStore(get_compressor("kivi4"), num_layers=1)
store.sync("r", 300, lambda _, s, e: (k[s:e], v[s:e]))
store.begin_round(["r"], 2)
store.attend(0, torch.randn(1, 4, 64), torch.randn(1, 2, 64), torch.randn(1, 2, 64), 0.125)
assert store._kernel_round is None and store._round is not None
assert not draft_attention_available("cpu") and not draft_attention_available(torch.device("cpu"))
loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith("sgl_vericache.kernels."))
assert not loaded, loaded
print("dense path")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "dense path" in proc.stdout, proc.stderr[-3000:]


class _FakeFlashInfer:
    """A torch stand-in for the parts of FlashInfer's API the opt-in backend calls, with their
    documented semantics: paged decode (NHD, one token a page here) returning the natural
    log-sum-exp, and merge_state joining two (output, lse) pairs."""

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, workspace, layout, use_tensor_cores=False):
            assert layout == "NHD" and not workspace.any()  # zeroed, as FlashInfer asks
            self.use_tensor_cores = use_tensor_cores

        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
            # FlashInfer's CUDA-core decode is built for these group sizes only
            assert self.use_tensor_cores or num_qo_heads // num_kv_heads in (1, 2, 3, 4, 6, 8, 16)
            assert page_size == 1 and bool((last_page_len == 1).all()) and indices.dtype == torch.int32
            self.rows = [indices[a:b].long() for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist())]
            self.group, self.scale = num_qo_heads // num_kv_heads, kw["sm_scale"]

        def run(self, q, kv, return_lse):
            k_cache, v_cache = kv
            outs, lses = [], []
            for r, idx in enumerate(self.rows):
                k = k_cache[idx, 0].float().repeat_interleave(self.group, 1)  # [n, H_q, D]
                v = v_cache[idx, 0].float().repeat_interleave(self.group, 1)
                logits = torch.einsum("hd,nhd->hn", q[r].float(), k) * self.scale
                outs.append(torch.einsum("hn,nhd->hd", logits.softmax(-1), v))
                lses.append(logits.logsumexp(-1))
            return torch.stack(outs).to(q.dtype), torch.stack(lses)

    @staticmethod
    def merge_state(v_a, s_a, v_b, s_b):
        s = torch.logaddexp(s_a, s_b)
        return v_a * (s_a - s).exp()[..., None] + v_b * (s_b - s).exp()[..., None], s


def test_flashinfer_backend_composes_entries_and_drafts_like_the_torch_path():
    """The opt-in FlashInfer branch (never run here: no FlashInfer kernel runs on a CPU)
    builds its page tables and merges its two calls so that, under FlashInfer's documented
    semantics, each row gets its compressor's reference attention."""
    from sgl_vericache.kernels.flashinfer_backend import FlashInferDecode, page_tables
    from sgl_vericache.kernels.packing import pack
    from sgl_vericache.mem_cache.compress import get_compressor

    indptr, indices, last = page_tables([5, 0], [2, 3], "cpu")
    assert indptr.tolist() == [0, 2, 5] and indices.tolist() == [5, 6, 0, 1, 2] and last.tolist() == [1, 1]
    with pytest.raises(ValueError, match="at least one token"):
        page_tables([0], [0], "cpu")
    assert FlashInferDecode.maybe("cpu") is None
    g = torch.Generator().manual_seed(0)
    comp = get_compressor("streamingllm", 4.0, min_budget=8)
    layers = [comp.compress(torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g)) for n in (90, 33)]
    packed = pack(comp, layers)
    q = torch.randn(2, 6, 64, generator=g)
    k_extra, v_extra = torch.randn(2, 4, 2, 64, generator=g), torch.randn(2, 4, 2, 64, generator=g)
    backend = FlashInferDecode(torch.device("cpu"), flashinfer_module=_FakeFlashInfer)
    for seen in (1, 3):
        out = backend.decode("round", packed, [0, 1], q, 0.125, k_extra, v_extra, [0, 1], [seen, seen])
        ref = torch.cat([comp.attend(layers[r], q[r : r + 1], 0.125, k_extra[r, :seen], v_extra[r, :seen])
                         for r in range(2)])
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_flashinfer_backends_are_made_once_a_group_slot(monkeypatch):
    """Each group slot's backend (two 128 MiB workspaces) is made at its first round and kept:
    a later round reuses it and replans under its own round id."""
    from sgl_vericache.kernels import flashinfer_backend as fb
    from sgl_vericache.kernels.packing import pack
    from sgl_vericache.mem_cache.compress import get_compressor

    made = []

    class Counting(_FakeFlashInfer):
        class BatchDecodeWithPagedKVCacheWrapper(_FakeFlashInfer.BatchDecodeWithPagedKVCacheWrapper):
            def __init__(self, workspace, layout, use_tensor_cores=False):
                super().__init__(workspace, layout, use_tensor_cores)
                made.append((workspace.numel(), use_tensor_cores))

    monkeypatch.setattr(fb, "_SHARED", {})
    cpu = torch.device("cpu")
    first = fb.FlashInferDecode.shared(cpu, 0, Counting)
    assert fb.FlashInferDecode.shared(cpu, 0, Counting) is first
    assert fb.FlashInferDecode.shared(cpu, 1, Counting) is not first
    assert len(first._workspaces) == 2 and not made  # two workspaces a slot; wrappers at the first decode
    g = torch.Generator().manual_seed(1)
    comp = get_compressor("streamingllm", 4.0, min_budget=8)
    q = torch.randn(1, 4, 64, generator=g)
    k_extra, v_extra = torch.randn(1, 2, 2, 64, generator=g), torch.randn(1, 2, 2, 64, generator=g)
    for round_id, n in ((0, 40), (1, 70)):  # the second round's entry is longer: replanned
        layer = comp.compress(torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g))
        out = first.decode((round_id, 0), pack(comp, [layer]), [0], q, 0.125, k_extra, v_extra, [0], [2])
        torch.testing.assert_close(out, comp.attend(layer, q, 0.125, k_extra[0, :2], v_extra[0, :2]),
                                   atol=1e-5, rtol=1e-5)
    assert made == [(fb.WORKSPACE_BYTES, False)] * 2  # group 2: FlashInfer's CUDA-core decode, made once
    # a group FlashInfer's CUDA-core decode is not built for (7: Qwen2.5-7B's 28 / 4) plans on
    # its tensor cores; before, plan() raised "Unsupported group_size" inside the round
    assert [fb.use_tensor_cores(g) for g in (1, 2, 3, 4, 5, 7, 8)] == [False] * 3 + [True] * 4
    q7 = torch.randn(1, 14, 64, generator=g)
    out = fb.FlashInferDecode.shared(cpu, 1, Counting).decode((2, 0), pack(comp, [layer]), [0], q7, 0.125,
                                                              k_extra, v_extra, [0], [2])
    torch.testing.assert_close(out, comp.attend(layer, q7, 0.125, k_extra[0, :2], v_extra[0, :2]), atol=1e-5, rtol=1e-5)
    assert made[2:] == [(fb.WORKSPACE_BYTES, True)] * 2


def test_entries_are_packed_in_place_through_their_addresses_unless_unreadable():
    """pack(in_place=True): no copy, each entry's tensors' addresses in the table, starts 0;
    an entry whose tensor is not 16-byte aligned (what the kernels assume), or whose layout
    differs from the others', is copied end to end instead, as pack's default does."""
    from sgl_vericache.kernels.packing import ADDR_FIELDS, pack
    from sgl_vericache.mem_cache.compress import get_compressor

    g = torch.Generator().manual_seed(0)
    comp = get_compressor("int8", 2.0)
    layers = [comp.compress(torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g)) for n in (9, 30)]
    packed = pack(comp, layers, in_place=True)
    assert packed.main_start == [0, 0] and packed.main_len == [9, 30] and not packed.copied
    col = {name: i for i, name in enumerate(ADDR_FIELDS)}
    for e, layer in enumerate(layers):
        assert packed.addresses[e, col["k"]] == layer.k_codes.data_ptr()
        assert packed.addresses[e, col["v_scale"]] == layer.v_scale.data_ptr()
    assert packed.nbytes() == sum(t.nbytes for layer in layers for t in layer.tensors())
    assert pack(comp, layers[:1], in_place=True).addresses is None  # a lone entry needs no table
    copied = pack(comp, layers)
    assert copied.addresses is None and copied.main_start == [0, 9] and copied.copied
    assert torch.equal(copied.k, torch.cat([layer.k_codes for layer in layers]))
    base = torch.zeros(30 * 2 * 64 + 1, dtype=torch.int8)
    odd = base[1:].view(30, 2, 64)  # one byte off 16-byte alignment
    odd.copy_(layers[1].k_codes)
    layers[1] = dataclasses.replace(layers[1], k_codes=odd)
    fallback = pack(comp, layers, in_place=True)
    assert fallback.addresses is None and fallback.main_start == [0, 9]
    assert torch.equal(fallback.k, torch.cat([layer.k_codes for layer in layers]))
    # entries whose scales differ in dtype cannot be read as one layout either
    mixed = [layers[0], dataclasses.replace(layers[0], k_scale=layers[0].k_scale.float())]
    assert pack(comp, mixed, in_place=True).addresses is None


def test_bench_kernels_smoke_runs_in_the_interpreter(tmp_path):
    """benchmark/bench_kernels.py (which only a GPU times for real) runs end to end at tiny
    sizes: every method and baseline gives a row, with the bytes each layout reads."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / "bench_kernels.py"), "--smoke", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    rows = {(r["context"], r["method"]): r for r in result["rows"]}
    assert not [r for r in result["rows"] if "error" in r]
    assert result["hbm_bytes_per_s"] == 4.8e12 and result["hbm_peak_source"].startswith("cpu smoke")
    assert {m for _, m in rows} == {"kivi4", "kivi2", "int8", "fp8", "droppers", "quest", "quest_query", "quest_choice",
                                    "triton_paged", "triton_verify_t5", "triton_verify_t17", "torch_verify_t17"}
    big = {m: r for (c, m), r in rows.items() if c == 256}
    assert big["droppers"]["read_ratio"] == pytest.approx(4.0)
    # Quest at 4x: a quarter of the pages once per KV head, plus min / max of every 16-token page;
    # chosen per query head, the quarter is read once per query head (8 of them at 70B / TP8)
    assert big["quest"]["read_ratio"] == pytest.approx(1 / (1 / 4 + 1 / 16))
    assert big["quest_query"]["read_ratio"] == pytest.approx(1 / (8 / 4 + 1 / 16))
    assert big["quest_choice"]["read_ratio"] == pytest.approx(16.0)
    assert big["int8"]["read_ratio"] == pytest.approx(2 * 128 / (128 + 2))  # codes + an fp16 scale a token
    assert 1 < big["kivi4"]["read_ratio"] < big["kivi2"]["read_ratio"]  # window of 128 exact tokens at 256
    assert big["triton_paged"]["read_ratio"] < 1 and big["triton_paged"]["speedup_vs_full"] == 1.0
    # verify blocks read the same pool as a decode step (their kernel and the torch path it replaced)
    for name in ("triton_verify_t5", "triton_verify_t17", "torch_verify_t17"):
        assert big[name]["kind"] == "verify" and big[name]["read_ratio"] == big["triton_paged"]["read_ratio"]
        assert big[name]["decode_steps"] == pytest.approx(big[name]["ms"] / big["triton_paged"]["ms"])
    assert result["targets"]["quantizers_at_70pct"] is None  # nothing at 32k x 8 measured
    # several requests' real entries, copied end to end and in place (the smoke run: 70B/TP8 heads)
    packs = {r["method"]: r for r in result["pack"]}
    assert set(packs) == {"kivi4", "droppers"} and not [r for r in packs.values() if "error" in r]
    for r in packs.values():
        assert r["entry_bytes"] > 0 and 0 < r["copy_share_of_round"] < 1 and 0 < r["in_place_share_of_round"] < 1
        assert r["accepted"] == 4 and r["append_ms"] > 0 and 0 < r["append_share_of_round"] < 1
        assert r["append_copy_ms"] > 0
    # the verify kernel's launch search: the default and 64 query rows a program, the same output
    search = result["verify_tuning"]
    assert [(r["max_query_rows"], r["tokens"]) for r in search] == [(128, 17), (64, 17)], search
    assert all("ms" in r and r["max_diff"] <= 1e-6 for r in search), search


def test_the_launch_search_tries_one_change_from_the_default_first():
    """bench_kernels' search gets a few trials a method on a GPU: after the default, each trial
    changes one thing (a variant, or the sizes), and every combination comes once."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    from bench_kernels import trial_order

    sizes, variants = ["s0", "s1", "s2"], ["v0", "v1", "v2", "v3"]
    order = trial_order(sizes, variants)
    assert order[:6] == [("s0", "v0"), ("s0", "v1"), ("s1", "v0"), ("s0", "v2"), ("s2", "v0"), ("s0", "v3")]
    assert sorted(order) == sorted((s, v) for s in sizes for v in variants)


@pytest.mark.parametrize("release", [None, "3.6.0"], ids=["venv-triton", "triton-3.6.0"])
def test_default_kernels_compile_for_sm90_without_a_gpu(tmp_path, release):
    """The interpreter accepts code the compiler refuses (and the other way round), so every
    kernel the drafter launches by default on a GPU is compiled for an H100 / H200 here, by
    the Triton and ptxas the venv ships and by Triton 3.6, the lent GPU machine's (fetched
    from the package index once; benchmark/sass_offline.py --defaults, ~25 s each)."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if release is None and (not (bundled / "ptxas").exists() or not (bundled / "cuobjdump").exists()):
        pytest.skip(f"this Triton ships no ptxas / cuobjdump under {bundled}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile from scratch, as a fresh GPU machine would
    jobs = str(max(1, min(len(os.sched_getaffinity(0)), 4)))  # compiles are single-threaded
    cmd = [sys.executable, str(ROOT / "benchmark" / "sass_offline.py"), "--defaults", "--jobs", jobs]
    proc = subprocess.run(cmd + (["--triton", release] if release else []), env=env, capture_output=True, text=True,
                          timeout=400, cwd=ROOT)
    out = proc.stdout + proc.stderr
    if release and "pip could not fetch it" in out:  # no package index reachable: nothing compiled
        pytest.skip(out.strip().splitlines()[-1][:500])
    assert proc.returncode == 0 and "compile failed" not in out, out[-6000:]
    assert proc.stdout.startswith(f"triton {release or triton.__version__} "), proc.stdout[:200]
    loops = {line.split()[0]: int(line.split("main loop")[1].split()[0]) for line in proc.stdout.splitlines()
             if " regs " in line}
    lone = {"dense", "kivi4_half_asm", "kivi2_half_asm", "int8_half_asm", "fp8_half_asm", "quest_kv", "quest_kv_fused",
            "quest_query", "page_scores_kv", "page_scores_query"}
    verify = {"verify_qp32", "verify_qp128", "verify_tree", "verify_softcap"}
    capped = {"dense", "kivi4_half_asm", "quest_kv"}  # a soft-capped model's drafts (Gemma 2, Grok)
    assert set(loops) == lone | verify | {"dense_fused", "int8_half_asm_q8", "kivi4_half_words", "merge",
                                          "merge_sinks"} | {f"{name}_addr" for name in lone} | {
                                              f"{name}_softcap" for name in capped}, out[-3000:]
    # the cap's tanh per score: offline at sm_90, dense 187 -> 219 instructions a loop, kivi4
    # 688 -> 743, Quest per KV head 255 -> 294
    for name in capped:
        assert loops[f"{name}_softcap"] <= 1.25 * loops[name], (name, loops[f"{name}_softcap"], loops[name])
    # the verify kernel's first loop: 32 query rows (5 tokens x 4 heads) over a block of 32
    # positions read through the token table, vectorized (the strides known to be multiples of
    # 16, as a launch specializes them): ~345 instructions; ~575 when every row is loaded apart.
    # Soft-capped scores add a tanh per score (~420)
    for name in verify - {"verify_softcap"}:
        assert loops[name] <= 2 * loops["dense"], (name, loops[name], loops["dense"])
    assert loops["verify_softcap"] <= 1.35 * loops["verify_qp32"], (loops["verify_softcap"], loops["verify_qp32"])
    # int8 keys against the query's int8 terms (LaunchConfig.int8_query): no key decode left
    # (offline 695 -> 559 instructions a loop, 697 -> 573 with 3.6); the reason the variant exists
    q8, plain = loops["int8_half_asm_q8"], loops["int8_half_asm"]
    assert q8 <= 0.9 * plain, (q8, plain)
    # KIVI int4 codes read as words (asm=2): with the venv's Triton the bytes are no longer
    # unpacked a register each and packed again for the PTX (688 -> 559); Triton 3.6 lays the
    # words out through shared memory instead (693 -> 710), so only the venv's is held to it
    if release is None:
        assert loops["kivi4_half_words"] <= 0.85 * loops["kivi4_half_asm"], loops
    # several entries read in place through their address table: the same main loop as one
    # entry's (the addresses are declared 16-byte aligned; without that no load is vectorized
    # and the dense loop grows from ~210 to ~365 instructions)
    for name in lone:
        assert loops[f"{name}_addr"] <= 1.05 * loops[name], (name, loops[f"{name}_addr"], loops[name])


def test_join_unpacked_half_precision_blocks_are_raised_on_cuda_only():
    """Compiled Triton unpacks KIVI codes wrongly at block_n 16 with fp16 / bf16 products (two
    H200 runs, benchmark/results/gpu_h200/): the launcher raises the block to 32 there, and
    only there; so for int8 / fp8 codes read as words (asm 2), which the same join orders."""
    from types import SimpleNamespace

    from sgl_vericache.kernels import ops
    from sgl_vericache.kernels.packing import FMT_DENSE, FMT_FP8, FMT_INT8, FMT_KIVI

    kivi, int8, fp8 = (SimpleNamespace(fmt=f) for f in (FMT_KIVI, FMT_INT8, FMT_FP8))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    small = ops.LaunchConfig(block_n=16)
    assert ops.join_block_n(small, kivi, 2, cuda) == 32
    assert ops.join_block_n(small, kivi, 1, cuda) == 32
    assert ops.join_block_n(small, kivi, 0, cuda) == 16  # fp32 products: right at 16
    assert ops.join_block_n(small, kivi, 2, cpu) == 16  # the interpreter: right at 16
    assert ops.join_block_n(ops.LaunchConfig(block_n=16, unpack=1), kivi, 2, cuda) == 16
    assert ops.join_block_n(ops.LaunchConfig(block_n=128), kivi, 2, cuda) == 128
    words = ops.LaunchConfig(block_n=16, asm=2)
    for codes in (int8, fp8):
        assert ops.join_block_n(small, codes, 2, cuda, half=True) == 16  # a byte a code: no join
        assert ops.join_block_n(words, codes, 2, cuda) == 16  # fp32 products do not read words
        assert ops.join_block_n(words, codes, 1, cuda, half=True) == 32
        assert ops.join_block_n(words, codes, 1, cpu, half=True) == 16
    assert ops.join_block_n(words, SimpleNamespace(fmt=FMT_DENSE), 1, cuda, half=True) == 16


def test_entries_are_addressed_in_int32_only_where_their_offsets_fit():
    """ops.offsets32: int32 offsets from an entry's first row where the longest entry's
    element offsets (plus a block of masked rows) stay below 2^31; int64 past that, for a
    pool read through a token table, and when asked."""
    from types import SimpleNamespace

    from sgl_vericache.kernels import ops

    packed = SimpleNamespace(num_kv_heads=8, head_dim=128, indices=None)
    on, off = ops.LaunchConfig(), ops.LaunchConfig(int32_offsets=False)
    limit = 2**31 // (8 * 128)  # rows of 8 heads x 128 elements
    assert ops.offsets32(on, packed, 131072, 32)  # 128k tokens at Llama-3-8B's heads
    assert ops.offsets32(on, packed, limit - 33, 32)
    assert not ops.offsets32(on, packed, limit - 32, 32)  # the last block's masked rows would overflow
    assert not ops.offsets32(off, packed, 1024, 32)
    assert not ops.offsets32(on, SimpleNamespace(num_kv_heads=8, head_dim=128, indices=torch.zeros(1)), 1024, 32)


def test_arguments_that_vary_within_a_round_compile_once():
    """Triton specializes an int argument equal to 1 and multiples of 16: a draft step's
    EXT_ADD (1, 2, ... through a round), the round's E_CAP, the split count, Quest's K_SEL and
    P_MAX would each compile a kernel apart. The kernels opt out, so one launch variant is one
    compile however a round goes."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    from sgl_vericache.kernels import triton_decode as td
    from sgl_vericache.kernels import triton_quest as tq

    kernels = (td._decode_split_kernel, td._combine_kernel, tq._page_scores_kernel, tq._quest_group_kernel,
               tq._quest_split_kernel)
    for kernel in kernels:
        varying = [p for p in kernel.params if p.name in td.ROUND_VARYING]
        assert varying, kernel.fn.__name__
        for p in varying:
            keys = {native_specialize_impl(BaseBackend, v, False, not p.do_not_specialize, True) for v in range(1, 65)}
            assert len(keys) == 1, (kernel.fn.__name__, p.name, keys)


def test_unset_launch_sizes_come_from_the_measured_table():
    from sgl_vericache.kernels import ops
    from sgl_vericache.kernels.packing import FMT_INT8, FMT_KIVI

    got = ops.launch_for(ops.LaunchConfig(), FMT_KIVI)
    assert (got.block_n, got.num_warps, got.num_stages) == ops.MEASURED_LAUNCH[FMT_KIVI]
    got = ops.launch_for(ops.LaunchConfig(block_n=16, num_stages=1), FMT_INT8)
    assert (got.block_n, got.num_warps, got.num_stages) == (16, ops.MEASURED_LAUNCH[FMT_INT8][1], 1)


def test_half_products_apply_to_half_quantized_entries_under_half_queries():
    from sgl_vericache.kernels import ops
    from sgl_vericache.kernels.packing import FMT_DENSE, FMT_FP8, FMT_INT8, FMT_KIVI

    class Packed:  # the two fields halves() reads
        def __init__(self, fmt, dtype):
            self.fmt, self.dtype = fmt, dtype

    b16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    on = ops.LaunchConfig(half=True)
    for fmt in (FMT_KIVI, FMT_INT8, FMT_FP8):
        assert ops.halves(on, Packed(fmt, b16), b16) and ops.halves(on, Packed(fmt, f16), b16)
        assert not ops.halves(on, Packed(fmt, f32), b16)  # fp32 entries: fp32 dequantization
        assert not ops.halves(on, Packed(fmt, b16), f32)  # an fp32 query: fp32 products
        assert not ops.halves(ops.LaunchConfig(half=False), Packed(fmt, b16), b16)
    assert not ops.halves(on, Packed(FMT_DENSE, b16), b16)  # nothing to decode
    # unset: the measured default per format; set: as given
    for fmt in (FMT_KIVI, FMT_INT8, FMT_FP8):
        assert ops.launch_for(ops.LaunchConfig(), fmt).half is ops.MEASURED_HALF[fmt]
        assert ops.launch_for(ops.LaunchConfig(half=False), fmt).half is False


def test_int8_query_terms_and_the_drafting_benchmarks_twin():
    """ops.int8_query_terms (the kernels' twin: kernel_checks compares them) is within half a
    step of the query, 1/64516 of its row's largest element, and exact on the steps' grid; and
    bench_compressors' int8(int8_query) row drafts with it for the entry's keys and with q for
    the provisional ones, causally (told apart from terms or q everywhere)."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    from bench_compressors import Int8QueryTerms, with_int8_query

    from sgl_vericache.kernels import ops
    from sgl_vericache.mem_cache.compress import get_compressor

    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 6, 64, generator=g) * torch.logspace(-3, 2, 6)[None, :, None]
    q[0, 0] = 0.0  # a row of zeros stays zeros
    terms = ops.int8_query_terms(q)
    step = q.abs().amax(-1, keepdim=True) / 127 / 254
    assert bool((terms[0, 0] == 0).all())
    err = ((terms - q).abs() / step)[step.expand_as(q) > 0]  # at most half a step (0.5004: fp32 rounding)
    assert float(err.max()) <= 0.501 and float(err.max()) > 0.45, float(err.max())
    # values on the steps' grid come back exactly (largest 127: a step of 1/254)
    x = torch.tensor([[127.0, 0.5, -0.5, 2.5, -2.5, 3 / 254, -125 / 254]])
    assert torch.equal(ops.int8_query_terms(x), x)

    comp = get_compressor("int8")
    twin = Int8QueryTerms(comp.config)
    assert [type(c) for c in with_int8_query([comp, get_compressor("fp8")])] == [
        type(comp), Int8QueryTerms, type(get_compressor("fp8"))]
    # queries whose terms differ from them visibly: one channel at 64 (its keys all 1.0, the
    # same logit for every key), the rest within two steps, which the terms round to steps
    step = 64.0 / 127 / 254
    q = torch.cat([torch.full((3, 6, 1), 64.0), (torch.rand(3, 6, 63, generator=g) * 4 - 2) * step], -1)
    terms = ops.int8_query_terms(q)
    keys_of = lambda n: torch.cat([torch.ones(n, 2, 1), torch.randn(n, 2, 63, generator=g)], -1)  # noqa: E731
    layer = comp.compress(keys_of(40), torch.randn(40, 2, 64, generator=g))
    ke, ve = keys_of(4), torch.randn(4, 2, 64, generator=g)
    scale = 1.5  # logits ~100, the terms move them by ~1e-2
    out = twin.attend(layer, q, scale, ke, ve)
    kk, vv, _ = comp.materialize(layer)
    for i in range(3):  # query i sees the entry and provisional keys [: 4 - 3 + i + 1]
        keys = torch.cat([kk, ke[: 2 + i]]).double().repeat_interleave(3, 1)
        vals = torch.cat([vv, ve[: 2 + i]]).double().repeat_interleave(3, 1)
        logits = {}
        for name, entry_q, extra_q in (("twin", terms[i], q[i]), ("terms everywhere", terms[i], terms[i]),
                                       ("q everywhere", q[i], q[i])):
            s = torch.cat([torch.einsum("hd,nhd->hn", entry_q.double(), keys[:40]),
                           torch.einsum("hd,nhd->hn", extra_q.double(), keys[40:])], -1) * scale
            logits[name] = torch.einsum("hn,nhd->hd", s.softmax(-1), vals).float()
        err = float((out[i] - logits.pop("twin")).abs().max())
        assert err < 1e-4, (i, err)
        for name, other in logits.items():  # and it is told apart from the two wrong ways
            assert float((out[i] - other).abs().max()) > 20 * max(err, 1e-5), (i, name)


def test_sinks_are_converted_once_while_they_are_unchanged():
    """A bf16 model's attention sinks become the merge's fp32 once, not at every merge (each
    layer of each draft step and verify); a weight update in place is seen at the next merge,
    and fp32 sinks already on the device are read as they are."""
    from sgl_vericache.cpu.linear import weights_updated
    from sgl_vericache.kernels import ops

    sinks = torch.tensor([0.5, -1.25, 3.0, 2.0], dtype=torch.bfloat16)
    first = ops.check_sinks(sinks, 4, "cpu")
    assert first.dtype == torch.float32 and torch.equal(first, sinks.float())
    assert ops.check_sinks(sinks, 4, torch.device("cpu")) is first
    with torch.no_grad():
        sinks.add_(1.0)  # e.g. /update_weights_from_disk loading in place
    again = ops.check_sinks(sinks, 4, "cpu")
    assert again is not first and torch.equal(again, sinks.float())
    param = torch.nn.Parameter(sinks.clone(), requires_grad=False)
    held = ops.check_sinks(param, 4, "cpu")
    param.data.copy_(torch.full((4,), 3.0))  # as SGLang's loaders write weights: the version stays
    weights_updated()  # what the weight-update hook does after SGLang's update_weights_*
    assert torch.equal(ops.check_sinks(param, 4, "cpu"), torch.full((4,), 3.0)), held
    fp32 = torch.zeros(4)
    assert ops.check_sinks(fp32, 4, "cpu") is fp32
    with pytest.raises(ValueError, match=r"attention sinks of shape \(3,\): accepted: \[4\]"):
        ops.check_sinks(torch.zeros(3), 4, "cpu")


def test_fused_merge_tickets_grow_without_freeing_a_captured_buffer(monkeypatch):
    """The fused split merge's ticket buffer grows (doubling) for a larger launch; the one
    it replaces stays alive, since a CUDA graph captured over it replays on its address."""
    from sgl_vericache.kernels import ops

    monkeypatch.setattr(ops, "_TICKETS", {})
    monkeypatch.setattr(ops, "_RETIRED_TICKETS", [])
    fused = ops.LaunchConfig(fused=True)
    q = torch.zeros(8, 4, 16)
    *_, first = ops._outputs(fused, 8, 2, q, return_lse=False)
    assert first.numel() == 4096 and not ops._RETIRED_TICKETS
    *_, same = ops._outputs(fused, 1000, 4, torch.zeros(1000, 4, 16), return_lse=True)
    assert same is first  # 4000 tickets fit
    *_, grown = ops._outputs(fused, 3000, 2, torch.zeros(3000, 4, 16), return_lse=False)
    assert grown.numel() == 8192 and ops._RETIRED_TICKETS == [first] and ops._TICKETS["cpu"] is grown
    assert ops._outputs(ops.LaunchConfig(fused=False), 8, 2, q, return_lse=False) == (None, None, None)
