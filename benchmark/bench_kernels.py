"""Draft attention over compressed KV against full-KV decode attention, one layer, on a GPU.

For each head shape (Llama-3-8B: 32 query / 8 KV heads; Llama-70B per GPU at 8-way tensor
parallelism: 8 / 1), context (8k / 32k / 128k) and batch (1 / 8 / 32), bf16, one decode step
of one layer mid-round (16 provisional draft tokens):

  draft    the kernels of sgl_vericache.kernels over each compressor's entry: kivi4, kivi2
           (group 32, residual 128), int8, fp8 (per-head scale), the droppers at 4x (StreamingLLM,
           SnapKV and H2O share one kernel: dense kept tokens) and Quest at 4x (page bounds +
           choice + attention over the chosen pages)
  full     torch SDPA (enable_gqa) and a Triton paged decode over SGLang's pool layout
           ([slots, H, D] + a token table), both over the whole KV
  verify   the verify forward's attention over the same pool: a block of 5 or 17 tokens
           (the last verified token + the drafts) per request, each seeing the prefix and
           the block's tokens before it: the Triton verify kernel (kernels/verify.py, what
           sglang/attention.py runs on CUDA) and, up to 32k x 8, the per-request fp32 SDPA
           path it replaced; ``decode_steps``: its time in full-KV decode steps. Its launch
           sizes are searched at 32k x 8 (``verify_tuning``: VERIFY_LAUNCHES, within a share
           of each shape's tuning time); the rows above time the defaults, what the server runs

Each row: median GPU time (a CUDA graph of the call, L2 flushed before each replay), bytes
the call reads, achieved GB/s and share of the HBM peak (the device's datasheet figure: H200
4.8 TB/s, H100 SXM 3.35; --hbm-tbps to override), and the
speedup over the faster full-KV baseline. The entries are synthetic (random codes and
scales in each compressor's exact layout): timing does not depend on the values.

Then several requests' entries read together (kivi4 and the droppers at 32k x 8, and int8 at
Llama-3-8B): packed end to end (one copy of their compressed bytes a layer and round) against
in place (a table of their addresses, what the drafter does), one draft step's kernel over
each, and the round's end: each entry's append of 4 verified tokens (a new entry: a value).

Then the full-KV host -> device layer loader: one layer's pinned host KV copied to each of
the 80 layers' device buffers on a side stream with an event per layer, alone and while a
draft round (draft_len x 80 kernel calls, one CUDA graph) runs on the main stream: GB/s
and the share of the transfer the round hides.

    python benchmark/bench_kernels.py --out $OUT/bench_kernels.json    # on a GPU (~3-5 min)
    TRITON_INTERPRET=1 python benchmark/bench_kernels.py --smoke        # CPU: code paths only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from sgl_vericache.kernels import ops  # noqa: E402
from sgl_vericache.kernels.packing import FMT_DENSE, FMT_FP8, FMT_INT8, FMT_KIVI, PackedKV, paged_pool  # noqa: E402
from sgl_vericache.mem_cache.compress import get_compressor  # noqa: E402

from gpu_timer import Timer, clock_peak, hbm_peak  # noqa: E402 - beside this script

SHAPES = {"llama3-8b": (32, 8, 128), "llama70b-tp8": (8, 1, 128)}  # (H_q, H_kv, D)
# the acceptance combos (32k x 8) first, so a tight time budget still measures them
COMBOS = [(32768, 8), (131072, 8), (32768, 32), (8192, 8), (131072, 32), (8192, 32), (32768, 1),
          (131072, 1), (8192, 1)]
METHODS = {"kivi4": {"group_size": 32, "residual_length": 128}, "kivi2": {"group_size": 32, "residual_length": 128},
           "int8": {}, "fp8": {"scale": "head"}, "droppers": {}, "quest": {},
           "quest_query": {"heads": "query"}}  # Quest's default heads="kv", and the paper's per-query-head choice
# the launch search, per head shape at 32k x 8: (block_n, num_warps, num_stages) x the
# method's variants (quantizers: half products or fp32 dequantization, and how the codes are
# decoded), in trial_order's order (one change from the default at a time first), then the
# best at 1 and 4 waves of programs instead of 2. The droppers are searched too (their 70B/TP8 launch is small
# and split-bound); Quest keeps ops.MEASURED_LAUNCH. (Not searched any more: KIVI's gather
# unpacking, unpack=1, 10-20x slower; int8 / fp8 unfolded, fold=False, 0.7x of folded at
# edf012c.)
TUNE_CONFIGS = [(32, 2, 3), (64, 4, 3), (32, 4, 2), (128, 4, 2), (64, 2, 3)]
# Each method's default launch first, then what a GPU has yet to time against it, by its
# offline main loop under Triton 3.6 (the GPU machine's; sass_offline.py --triton 3.6.0): int8
# with the keys' scores from the query's int8 terms (int8_query: 573 instructions a loop
# against the default's 697; with words 565); int8 / fp8 / kivi4 codes read as words (asm=2:
# 8% slower at e399a85; fp8 457 against 479, int8 710 against 697, kivi4 710 against 693, so
# int8's and kivi4's come after the fused merge and int64 addressing; with the venv's Triton
# 3.8, what SGLang 0.5.23's torch brings and users run, words count fewer: 377, 613, 559); the
# fused split merge; the int64 addressing that int32 offsets within an entry replaced; then
# the slower alternatives measured before. At gpu_check.sh's budget a method gets 2-4 trials
# (compiles dominate)
_WIDE = {"int32_offsets": False}
TUNE_VARIANTS = {m: [{"half": True}, {"half": True, "fused": True}, {"half": True, **_WIDE},
                     {"half": True, "asm": 0}, {"half": False}] for m in ("kivi4", "kivi2")}
TUNE_VARIANTS["kivi4"].insert(3, {"half": True, "asm": 2})  # int4 codes read as words: 710 against 693
TUNE_VARIANTS["fp8"] = [{"half": True}, {"half": True, "asm": 2}, {"half": True, "fused": True},
                        {"half": True, **_WIDE}, {"half": True, "asm": 0}, {"half": False}]
_Q8 = {"half": True, "int8_query": True}
TUNE_VARIANTS["int8"] = [{"half": True}, _Q8, {**_Q8, "asm": 2}, *TUNE_VARIANTS["fp8"][2:4], {"half": True, "asm": 2},
                         *TUNE_VARIANTS["fp8"][4:]]
TUNE_VARIANTS["droppers"] = [{}, _WIDE, {"fused": True}]
EXTRAS = 16  # provisional tokens seen (draft step 16 of 32)
VERIFY_TOKENS = (5, 17)  # verify blocks: a short adaptive round, and the default draft length's (16 + 1)
# the verify kernel's launch search (a block of 17 tokens at 32k x 8, per head shape, within
# that shape's share of the tuning budget): (block_n, num_warps (None: the kernel's rule, 4
# up to 64 query rows, 8 above), num_stages, max_query_rows), its default first; each trial's
# output is compared with the default's, so a launch that computes wrong cannot win
VERIFY_LAUNCHES = [(32, None, 2, 128), (64, None, 2, 128), (32, None, 3, 128), (32, None, 2, 64), (16, None, 2, 128),
                   (64, 8, 3, 128), (32, 4, 2, 32)]
VERIFY_SEARCH_SHARE = 0.2  # of each shape's tuning time
RATIO = 4.0


# ---------------------------------------------------------------- synthetic entries


def _rand(shape, dtype, device, gen):
    if dtype in (torch.uint8, torch.int8):
        low = -128 if dtype == torch.int8 else 0
        return torch.randint(low, low + 256, shape, dtype=torch.int16, device=device, generator=gen).to(dtype)
    return torch.randn(shape, dtype=torch.float32, device=device, generator=gen).to(dtype)


def synth_entry(method: str, batch: int, context: int, kv_heads: int, head_dim: int, device, gen) -> PackedKV:
    """`batch` entries of `context` tokens, end to end, in the compressor's layout."""
    bf16, f16 = torch.bfloat16, torch.float16
    name = {"droppers": "snapkv", "quest_query": "quest"}.get(method, method)
    comp = get_compressor(name, RATIO, **METHODS[method])
    lens_of = lambda n: [n] * batch  # noqa: E731
    starts = lambda n: [i * n for i in range(batch)]  # noqa: E731
    h, d = kv_heads, head_dim
    if method.startswith("kivi"):
        tq = comp.quantized_len(context)
        nq, nr, group = batch * tq, batch * (context - tq), comp.options["group_size"]
        dp = d * comp.bits // 8
        scale = lambda *s: (_rand(s, torch.float32, device, gen).abs() * 0.05 + 0.01).to(f16)  # noqa: E731
        return PackedKV(FMT_KIVI, h, d, bf16, _rand((nq, h, dp), torch.uint8, device, gen),
                        _rand((nq, h, dp), torch.uint8, device, gen), starts(tq), lens_of(tq),
                        scale(nq // group, h, d), _rand((nq // group, h, d), f16, device, gen),
                        scale(nq, h, d // group), _rand((nq, h, d // group), f16, device, gen),
                        _rand((nr, h, d), bf16, device, gen), _rand((nr, h, d), bf16, device, gen),
                        starts(context - tq), lens_of(context - tq), bits=comp.bits, token_group=group,
                        channel_group=min(group, d))
    if method in ("int8", "fp8"):
        n = batch * context
        codes = lambda: _rand((n, h, d), torch.uint8 if method == "fp8" else torch.int8, device, gen)  # noqa: E731
        if method == "int8":
            sc = lambda: (_rand((n, h, 1), torch.float32, device, gen).abs() * 0.02).to(f16)  # noqa: E731
        else:
            sc = lambda: _rand((batch, h), torch.float32, device, gen).abs() * 0.01  # noqa: E731
        fmt = FMT_INT8 if method == "int8" else FMT_FP8
        return PackedKV(fmt, h, d, bf16, codes(), codes(), starts(context), lens_of(context), k_scale=sc(),
                        v_scale=sc(), head_scale=method == "fp8")
    if method == "droppers":
        kept = comp.budget(context)
        kv = lambda: _rand((batch * kept, h, d), bf16, device, gen)  # noqa: E731
        return PackedKV(FMT_DENSE, h, d, bf16, kv(), kv(), starts(kept), lens_of(kept))
    assert method.startswith("quest"), method
    pages = comp.num_pages(context)
    kv = lambda: _rand((batch * context, h, d), bf16, device, gen)  # noqa: E731
    low = _rand((batch * pages, h, d), bf16, device, gen)
    return PackedKV(FMT_DENSE, h, d, bf16, kv(), kv(), starts(context), lens_of(context),
                    page_min=low, page_max=(low.float() + 1).to(bf16), page_start=starts(pages),
                    pages_read=[comp.pages_read(context)] * batch, page_size=comp.options["page_size"],
                    page_per_kv_head=comp.options["heads"] == "kv")


def read_bytes(packed: PackedKV, context: int, batch: int, num_q_heads: int) -> int:
    """Bytes one call reads (extras, queries and output are < 0.1% and left out). Quest
    chosen per query head reads a KV head's pages once per query head of its group."""
    if not packed.page_size:
        return packed.nbytes()
    readers = 1 if packed.page_per_kv_head else num_q_heads // packed.num_kv_heads
    per_token = 2 * packed.num_kv_heads * packed.head_dim * 2
    tokens = min(context, packed.pages_read[0] * packed.page_size)
    return batch * tokens * per_token * readers + (packed.page_min.nbytes + packed.page_max.nbytes)


def full_bytes(context: int, batch: int, kv_heads: int, head_dim: int) -> int:
    return 2 * batch * context * kv_heads * head_dim * 2  # K and V, bf16


# ---------------------------------------------------------------- timing


# ---------------------------------------------------------------- one combination


def _draft_call(packed, q, ke, ve, config):
    rows = packed.rows()
    ext_add = 0 if ke is None else EXTRAS  # full-KV decoding has no provisional tokens
    return lambda: ops.decode_attention(packed, q, 1 / math.sqrt(q.shape[-1]), rows, ke, ve, ext_add=ext_add,
                                        config=config)


def bench_combo(shape_name, context, batch, timer, configs, device, gen) -> list[dict]:
    hq, hkv, d = SHAPES[shape_name]
    full = full_bytes(context, batch, hkv, d)
    q = _rand((batch, hq, d), torch.bfloat16, device, gen)
    ke, ve = (_rand((batch, 32, hkv, d), torch.bfloat16, device, gen) for _ in range(2))
    base = {"shape": shape_name, "context": context, "batch": batch, "full_kv_bytes": full}
    rows = []
    for method in METHODS:
        def draft(method=method):
            packed = synth_entry(method, batch, context, hkv, d, device, gen)
            return _draft_call(packed, q, ke, ve, configs[method]), read_bytes(packed, context, batch, hq)
        rows.append(_measure(base, "draft", method, draft, timer))

    def quest_choice():  # what Quest's page choice alone costs: the bounds kernel and the sort
        packed = synth_entry("quest", batch, context, hkv, d, device, gen)
        rows_ = packed.rows()
        return (lambda: ops.select_pages(ops.page_scores(packed, q, rows_), packed.pages_read[0]),
                packed.page_min.nbytes + packed.page_max.nbytes)
    rows.append(_measure(base, "part", "quest_choice", quest_choice, timer))
    pool_k, pool_v = (_rand((batch * context, hkv, d), torch.bfloat16, device, gen) for _ in range(2))
    table = torch.arange(batch * context, dtype=torch.int32, device=device)  # SGLang's slots, allocated in order
    pool = paged_pool(pool_k, pool_v, table, [context] * batch)
    rows.append(_measure(base, "full", "triton_paged", lambda: (
        _draft_call(pool, q, None, None, configs["droppers"]), full + table.nbytes), timer))
    if device.type == "cuda":  # SDPA over the same pool, viewed [B, H, T, D] (strided, as SGLang's)
        k4 = pool_k.view(batch, context, hkv, d).transpose(1, 2)
        v4 = pool_v.view(batch, context, hkv, d).transpose(1, 2)
        q4 = q[:, :, None, :]
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)  # noqa: E731
        rows.append(_measure(base, "full", "torch_sdpa", lambda: (sdpa, full), timer))
    for tokens in VERIFY_TOKENS:  # a round's verify block over the same pool (its last positions)
        rows.append(_measure(base, "verify", f"triton_verify_t{tokens}", lambda t=tokens: _verify_call(
            pool_k, pool_v, context, hq, t, True, device, gen), timer))
    if batch * context <= 32768 * 8:  # the per-request fp32 SDPA path it replaces on CUDA (slow: one size)
        rows.append(_measure(base, "verify", f"torch_verify_t{VERIFY_TOKENS[-1]}", lambda: _verify_call(
            pool_k, pool_v, context, hq, VERIFY_TOKENS[-1], False, device, gen), timer))
    timed = [r for r in rows if "ms" in r]
    best_full = min((r["ms"] for r in timed if r["kind"] == "full"), default=None)
    for r in timed:
        r["speedup_vs_full"] = best_full / r["ms"] if best_full else None
        if r["kind"] == "verify" and best_full:
            r["decode_steps"] = r["ms"] / best_full  # what one verify costs, in full-KV decode steps
    return rows


def _verify_call(pool_k, pool_v, context, hq, tokens, kernel, device, gen):
    """sglang/attention.py's verify_attention (kernel: its CUDA path, kernels/verify.py; else
    its per-request torch path) for a block of ``tokens`` at the end of each request's
    ``context`` positions of the pool (request b owns slots b * context ...)."""
    from types import SimpleNamespace

    from sgl_vericache.sglang import attention

    hkv, d = pool_k.shape[1], pool_k.shape[2]
    batch = pool_k.shape[0] // context
    table = torch.arange(batch * context, dtype=torch.int32, device=device).view(batch, context)
    prefix = torch.full((batch,), context - tokens, dtype=torch.int64, device=device)
    q = _rand((batch * tokens, hq * d), torch.bfloat16, device, gen)
    pool = SimpleNamespace(get_key_buffer=lambda layer_id: pool_k, get_value_buffer=lambda layer_id: pool_v)
    backend = SimpleNamespace(runtime=SimpleNamespace(parking=None), token_to_kv_pool=pool, skip_rows=frozenset(),
                              req_to_token_pool=SimpleNamespace(req_to_token=table), deterministic=False,
                              kernel=kernel, soft_caps=False)
    layer = SimpleNamespace(tp_q_head_num=hq, qk_head_dim=d, v_head_dim=d, layer_id=0, scaling=1 / math.sqrt(d))
    chain = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool, device=device)).repeat(batch, 1, 1)
    fb = SimpleNamespace(batch_size=batch, seq_lens=prefix, seq_lens_cpu=prefix.cpu(),
                         req_pool_indices=torch.arange(batch, device=device),
                         spec_info=SimpleNamespace(custom_mask=chain.flatten()))

    def call():
        out = attention.verify_attention(backend, q, layer, fb)
        if kernel and not backend.kernel:
            raise RuntimeError("the verify kernel refused this layer")
        return out

    call.host_syncs = not kernel  # the torch path reads the lengths on the host
    return call, full_bytes(context, batch, hkv, d) + table.nbytes


def _measure(base, kind, method, build, timer) -> dict:
    """One row; a failure (out of memory, a backend that refuses) is recorded, not fatal."""
    try:
        fn, nbytes = build()
        ms, mode = timer(fn)
        return _row(base, kind, method, ms, nbytes, mode, timer)
    except Exception as exc:  # noqa: BLE001
        return {**base, "kind": kind, "method": method, "error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # this entry (and its graph's pool) before the next one


def _row(base, kind, method, ms, nbytes, mode, timer) -> dict:
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {**base, "kind": kind, "method": method, "ms": ms, "bytes_read": nbytes,
            "read_ratio": base["full_kv_bytes"] / nbytes, "GBps": gbps, "hbm_fraction": gbps * 1e9 / timer.hbm,
            "timing": mode}


def tune(timer, device, gen, context, batch, shape_name, deadline, configs=None) -> tuple[dict, list]:
    """Per method, the fastest launch (TUNE_CONFIGS x TUNE_VARIANTS, then waves) at one
    combination of one head shape; each method gets an equal share of the time to
    ``deadline``, and at least one trial."""
    hq, hkv, d = SHAPES[shape_name]
    q = _rand((batch, hq, d), torch.bfloat16, device, gen)
    ke, ve = (_rand((batch, 32, hkv, d), torch.bfloat16, device, gen) for _ in range(2))
    best, log = {}, []
    tuned = [m for m in METHODS if m in TUNE_VARIANTS]
    for i, method in enumerate(tuned):
        # each method an equal share of the time left, so the last ones are searched too
        until = time.monotonic() + max(0.0, deadline - time.monotonic()) / (len(tuned) - i)
        packed = synth_entry(method, batch, context, hkv, d, device, gen)
        timed = []

        def trial(cfg):
            try:
                ms, _ = timer(_draft_call(packed, q, ke, ve, cfg))
            except Exception as exc:  # noqa: BLE001 - a launch that fails to compile is not a candidate
                log.append({"shape": shape_name, "method": method, **_launch(cfg), "error": str(exc)[:200]})
                return
            timed.append((ms, cfg))
            log.append({"shape": shape_name, "method": method, **_launch(cfg), "ms": ms})

        for (block_n, warps, stages), variant in trial_order(configs or TUNE_CONFIGS, TUNE_VARIANTS[method]):
            if time.monotonic() < until or not timed:
                trial(ops.LaunchConfig(block_n=block_n, num_warps=warps, num_stages=stages, **variant))
        if timed:
            top = min(timed, key=lambda t: t[0])[1]
            for waves in (1, 4):
                if time.monotonic() < until:
                    trial(dataclasses.replace(top, waves=waves))
            best[method] = min(timed, key=lambda t: t[0])[1]
        del packed
    return best, log


def search_verify(timer, device, gen, context, batch, shape_name, deadline, launches=None) -> list[dict]:
    """The verify kernel (kernels/verify.py, called directly) on a chain block of the last
    VERIFY_TOKENS[-1] positions of ``batch`` requests of ``context`` at the launch sizes of
    ``launches`` (default VERIFY_LAUNCHES) in order, while time to ``deadline`` is left (the
    default at least): one log row each, ``ms`` and ``max_diff`` from the default's output (a
    trial off by more than bf16 rounding is an error row, not a candidate)."""
    from sgl_vericache.kernels import verify

    hq, hkv, d = SHAPES[shape_name]
    tokens = VERIFY_TOKENS[-1]
    pool_k, pool_v = (_rand((batch * context, hkv, d), torch.bfloat16, device, gen) for _ in range(2))
    table = torch.arange(batch * context, dtype=torch.int32, device=device).view(batch, context)
    prefix = torch.full((batch,), context - tokens, dtype=torch.int64, device=device)
    q = _rand((batch, tokens, hq, d), torch.bfloat16, device, gen)
    chain = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool, device=device)).repeat(batch, 1, 1)
    rows = torch.arange(batch, device=device)
    log, reference = [], None
    for block_n, warps, stages, most in launches or VERIFY_LAUNCHES:
        if reference is not None and time.monotonic() > deadline:
            break
        row = {"shape": shape_name, "context": context, "batch": batch, "tokens": tokens, "block_n": block_n,
               "num_warps": warps, "num_stages": stages, "max_query_rows": most}

        def call(block_n=block_n, warps=warps, stages=stages, most=most):
            return verify.verify_attention(q, pool_k, pool_v, table, rows, prefix, d ** -0.5, mask=chain,
                                           longest=context, block_n=block_n, num_warps=warps, num_stages=stages,
                                           max_query_rows=most)

        try:
            out = call().float()
            if reference is None:
                reference = out
            row["max_diff"] = float((out - reference).abs().max())
            if not row["max_diff"] <= 2e-2:  # bf16 outputs of the same sums in another order agree to ~1e-2
                raise ValueError(f"output differs from the default launch's by {row['max_diff']:.3g}")
            row["ms"], row["timing"] = timer(call)
        except Exception as exc:  # noqa: BLE001 - a launch that fails to compile or computes wrong is no candidate
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        log.append(row)
    return log


def trial_order(sizes: list, variants: list) -> list:
    """The search's trials, most informative first for a budget that allows a few: the
    default (first sizes, first variant), then, alternately, one other variant at the first
    sizes and the first variant at other sizes (each one change from the default), then the
    remaining combinations."""
    order = [(sizes[0], variants[0])]
    for k in range(1, max(len(sizes), len(variants))):
        order += [(sizes[0], variants[k])] if k < len(variants) else []
        order += [(sizes[k], variants[0])] if k < len(sizes) else []
    return order + [(c, v) for c in sizes for v in variants if (c, v) not in order]


def _launch(cfg: ops.LaunchConfig) -> dict:  # unset sizes are ops.MEASURED_LAUNCH's for the method
    return {"block_n": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "fold": cfg.fold,
            "unpack": cfg.unpack, "waves": cfg.waves, "half": cfg.half,
            "asm": cfg.asm, "fused": cfg.fused, "int32_offsets": cfg.int32_offsets, "int8_query": cfg.int8_query}


# ---------------------------------------------------------------- the layer loader


def bench_loader(timer, device, gen, context=32768, batch=8, layers=80, draft_len=30, method="kivi4",
                 shape_name="llama70b-tp8", config=ops.LaunchConfig()) -> dict:
    """The full KV of ``batch`` requests streamed host -> device layer by layer (pinned
    memory, a side stream, an event per layer) alone, and beside a draft round of
    ``draft_len`` steps over every layer (the kernels, one CUDA graph) on the main stream."""
    hq, hkv, d = SHAPES[shape_name]
    layer_elems = full_bytes(context, batch, hkv, d) // 2
    host = torch.empty(layer_elems, dtype=torch.bfloat16, pin_memory=True)  # every layer copies from it
    dev = [torch.empty(layer_elems, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    entries = [synth_entry(method, batch, context, hkv, d, device, gen) for _ in range(layers)]
    tables = [e.rows() for e in entries]
    q = _rand((batch, hq, d), torch.bfloat16, device, gen)
    ke, ve = (_rand((batch, 32, hkv, d), torch.bfloat16, device, gen) for _ in range(2))
    scale = 1 / math.sqrt(d)

    def draft_round():
        for _ in range(draft_len):
            for e, t in zip(entries, tables):
                ops.decode_attention(e, q, scale, t, ke, ve, ext_add=EXTRAS, config=config)

    draft_round()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        draft_round()
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    arrived = [ev() for _ in range(layers)]

    def run(copy: bool, draft: bool) -> float:
        torch.cuda.synchronize()
        start, end = ev(), ev()
        start.record(main)
        if copy:
            side.wait_event(start)
            with torch.cuda.stream(side):
                for i in range(layers):
                    dev[i].copy_(host, non_blocking=True)
                    arrived[i].record(side)
        if draft:
            graph.replay()
        if copy:
            main.wait_stream(side)
        end.record(main)
        torch.cuda.synchronize()
        if copy:
            run.arrivals = [start.elapsed_time(a) for a in arrived]
        return start.elapsed_time(end)

    run(True, False)  # warm the copy engine
    t_copy = min(run(True, False) for _ in range(3))
    arrivals = run.arrivals
    t_draft = min(run(False, True) for _ in range(3))
    t_both = min(run(True, True) for _ in range(3))
    total = layers * layer_elems * 2
    return {"shape": shape_name, "context": context, "batch": batch, "layers": layers, "draft_len": draft_len,
            "draft_method": method, "bytes": total, "copy_ms": t_copy, "GBps": total / (t_copy * 1e-3) / 1e9,
            "layer_arrival_ms": {"first": arrivals[0], "median": arrivals[layers // 2], "last": arrivals[-1]},
            "draft_round_ms": t_draft, "both_ms": t_both,
            "transfer_hidden_fraction": max(0.0, min(1.0, (t_copy + t_draft - t_both) / t_copy)),
            "draft_round_over_transfer": t_draft / t_copy,
            "note": "draft round = attention only (draft_len x layers kernel calls); a real round also reads "
                    "the weights every pass, which only makes it longer and the transfer easier to hide. "
                    "One pinned layer buffer is the source of every layer's copy (same DMA cost as 80)."}


# ---------------------------------------------------------------- several requests' entries


def bench_pack(timer, device, gen, method: str, shape_name: str, context: int, batch: int, steps: int = 30,
               config=ops.LaunchConfig(), accepted: int = 4) -> dict:
    """What reading ``batch`` requests' entries together costs the drafter per layer and round:
    real entries (the compressor's own ``compress`` of random K/V, each its own tensors, as
    the store keeps them) packed end to end (``pack``: one copy of the compressed bytes) or
    in place (``pack(in_place=True)``: a table of their addresses), wall time with the host
    work; and one draft step's kernel over each (a CUDA graph, L2 flushed), which should be
    the same. ``copy_share_of_round``: the copy against ``steps`` draft steps of that layer.
    ``append_ms``: the round's end, each entry's ``append`` of ``accepted`` verified tokens
    to the entry the last append returned (int8 / fp8 / KIVI's groups grow in place, the
    droppers reselect, KIVI quantizes only a full group), wall time for the batch's entries of
    that layer; ``append_copy_ms`` the same from entries already grown past, which copies
    every row (what every append did before entries grew in place)."""
    from sgl_vericache.kernels.packing import pack

    hq, hkv, d = SHAPES[shape_name]
    name = {"droppers": "snapkv"}.get(method, method)
    comp = get_compressor(name, RATIO, **METHODS[method])
    queries = _rand((8, hq, d), torch.bfloat16, device, gen) if comp.needs_queries else None
    layers = [comp.compress(_rand((context, hkv, d), torch.bfloat16, device, gen),
                            _rand((context, hkv, d), torch.bfloat16, device, gen), queries) for _ in range(batch)]
    q = _rand((batch, hq, d), torch.bfloat16, device, gen)
    ke, ve = (_rand((batch, 32, hkv, d), torch.bfloat16, device, gen) for _ in range(2))

    def wall(fn, reps=max(3, timer.reps // 2)) -> float:
        fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[len(times) // 2]

    copied, in_place = pack(comp, layers), pack(comp, layers, in_place=True)
    assert copied.copied and in_place.addresses is not None
    out = {"method": method, "shape": shape_name, "context": context, "batch": batch, "steps": steps,
           "entry_bytes": in_place.nbytes(),
           "pack_copy_ms": wall(lambda: pack(comp, layers)),
           "pack_in_place_ms": wall(lambda: pack(comp, layers, in_place=True)),
           "draft_copied_ms": timer(_draft_call(copied, q, ke, ve, config))[0],
           "draft_in_place_ms": timer(_draft_call(in_place, q, ke, ve, config))[0]}
    for way, draft in (("copy", "draft_copied_ms"), ("in_place", "draft_in_place_ms")):
        packing_ms = out[f"pack_{way}_ms"]
        out[f"{way}_share_of_round"] = packing_ms / (packing_ms + steps * out[draft])
    k_new, v_new = (_rand((accepted, hkv, d), torch.bfloat16, device, gen) for _ in range(2))
    out["accepted"] = accepted
    grown = list(layers)

    def grow():  # each request's entry takes the round's tokens, as the store's sync does
        grown[:] = [comp.append(layer, k_new, v_new) for layer in grown]

    out["append_ms"] = wall(grow)
    # from entries that others have already grown past (the originals, now): every row copied,
    # as every append did before entries grew in place (mem_cache/compress/rows.py)
    out["append_copy_ms"] = wall(lambda: [comp.append(layer, k_new, v_new) for layer in layers])
    out["append_share_of_round"] = out["append_ms"] / (out["append_ms"] + steps * out["draft_in_place_ms"])
    return out


# ---------------------------------------------------------------- the sweep


def _fits(context, batch, hkv, d, device) -> tuple[bool, str]:
    if device.type != "cuda":
        return True, ""
    need = 1.4 * full_bytes(context, batch, hkv, d) + 2**30  # the pool, or Quest's full copy + bounds
    free = torch.cuda.mem_get_info(device)[0]
    return need < 0.9 * free, f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def targets(rows: list[dict]) -> dict:
    """Issue 27's kernel targets, where measured: quantizers >= 70% of HBM at 32k x 8, and
    draft attention at 4x (droppers, Quest) >= 3x faster than full-KV attention at >= 32k."""
    quant = [r for r in rows if r["kind"] == "draft" and r["method"] in ("kivi4", "kivi2", "int8", "fp8")
             and r["context"] == 32768 and r["batch"] == 8]
    at4x = [r for r in rows if r["kind"] == "draft" and r["method"] in ("droppers", "quest") and r["context"] >= 32768]
    out = {"quantizer_hbm_fraction_32k_b8": {f"{r['shape']}/{r['method']}": r["hbm_fraction"] for r in quant},
           "speedup_4x_32k_up": {f"{r['shape']}/{r['method']}/{r['context']}x{r['batch']}": r["speedup_vs_full"]
                                 for r in at4x}}
    # None: not measured (no such rows)
    out["quantizers_at_70pct"] = all(r["hbm_fraction"] >= 0.7 for r in quant) if quant else None
    out["draft_4x_at_3x"] = all(r["speedup_vs_full"] >= 3 for r in at4x) if at4x else None
    return out


def _provenance(device) -> dict:
    import triton

    root = Path(__file__).resolve().parents[1]
    try:  # the GPU machine gets a working tree, maybe without .git or git
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter smoke run)"
    return {"commit": commit or os.environ.get("VERICACHE_COMMIT", "unknown"), "gpu": gpu, "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "host": platform.node()}


def _clocks(device) -> float | None:
    """The memory clock x bus width peak, recorded beside the one used, as a cross-check."""
    return clock_peak(torch.cuda.get_device_properties(device)) if device.type == "cuda" else None


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = Path(os.environ["OUT"]) / "bench_kernels.json" if os.environ.get("OUT") else None
    ap.add_argument("--out", type=Path, default=default_out, help="JSON result (default: $OUT/bench_kernels.json)")
    ap.add_argument("--hbm-tbps", type=float, default=None,
                    help="the device's HBM peak, TB/s (default: its datasheet figure by name, H200 4.8, "
                         "H100 SXM 3.35; else memory clock x bus width)")
    ap.add_argument("--budget-s", type=float, default=300, help="stop starting new combinations after this")
    ap.add_argument("--tune-budget-s", type=float, default=150, help="stop the launch search after this")
    ap.add_argument("--reps", type=int, default=20, help="timed replays per measurement (median)")
    ap.add_argument("--no-tune", action="store_true", help="skip the launch-size search")
    ap.add_argument("--tune-configs", nargs="*", metavar="BN,WARPS,STAGES",
                    help="the launch sizes to search (default: TUNE_CONFIGS)")
    ap.add_argument("--no-loader", action="store_true", help="skip the host -> device loader measurement")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on any device (CPU: TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.hbm_tbps is not None and not args.hbm_tbps > 0:
        ap.error(f"--hbm-tbps must be a positive TB/s figure (H200: 4.8); got {args.hbm_tbps}")
    if not torch.cuda.is_available() and not (args.smoke and ops.interpreting()):
        ap.error("without CUDA only --smoke runs, under TRITON_INTERPRET=1")
    return args


def main() -> None:
    args = _arguments()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.monotonic()
    gen = torch.Generator(device=device).manual_seed(0)
    peak, peak_source = hbm_peak(device, args.hbm_tbps)
    timer = Timer(device, 2 if args.smoke else args.reps, peak)
    default = {m: ops.LaunchConfig(block_n=16 if args.smoke else None) for m in METHODS}  # None: ops.MEASURED_LAUNCH
    configs = {name: dict(default) for name in SHAPES}  # shape -> method -> launch
    result = {"generated": time.strftime("%Y-%m-%d %H:%M:%S"), **_provenance(device), "hbm_bytes_per_s": timer.hbm,
              "hbm_peak_source": peak_source, "hbm_bytes_per_s_from_clocks": _clocks(device),
              "dtype": "bf16", "extras_seen": EXTRAS, "methods": METHODS, "ratio_droppers_quest": RATIO,
              "smoke": args.smoke, "rows": [], "skipped": []}
    if not (args.no_tune or args.smoke):
        result["tuning"], result["verify_tuning"] = _tune_shapes(args, timer, device, gen, configs, started)
    elif args.smoke:  # the verify search's code path, two launches at a tiny size
        result["verify_tuning"] = _search_verify_logged(timer, device, gen, 256, 2, "llama70b-tp8", float("inf"),
                                                        VERIFY_LAUNCHES[:1] + VERIFY_LAUNCHES[3:4])
    result["launch"] = {name: {m: _launch(c) for m, c in per.items()} for name, per in configs.items()}
    _bench_combos(args, timer, device, gen, configs, started, result)
    result["pack"] = _bench_packs(args, timer, device, gen, configs, started, result)
    if device.type == "cuda" and not args.no_loader:
        try:
            result["loader"] = loader = bench_loader(timer, device, gen, config=configs["llama70b-tp8"]["kivi4"])
            print(f"loader: {loader['GBps']:.1f} GB/s, {loader['transfer_hidden_fraction']:.2f} of the transfer "
                  f"hidden behind a draft round ({loader['draft_round_ms']:.1f} ms vs {loader['copy_ms']:.1f} ms)")
        except Exception as exc:  # noqa: BLE001
            result["loader"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    result["targets"] = targets([r for r in result["rows"] if "ms" in r])
    result["seconds"] = time.monotonic() - started
    print(f"bench_kernels: {len(result['rows'])} rows, {len(result['skipped'])} skipped, targets "
          f"quantizers>=70%: {result['targets']['quantizers_at_70pct']}, 4x>=3x: {result['targets']['draft_4x_at_3x']},"
          f" {result['seconds']:.0f} s")
    if args.out:
        _write(args.out, result)
        print(f"wrote {args.out}")


def _tune_shapes(args, timer, device, gen, configs, started) -> tuple[list[dict], list[dict]]:
    """The launch search at 32k x 8 per shape, each its share of the tuning budget (of which
    VERIFY_SEARCH_SHARE for the verify kernel's); the draft kernels' best sizes go into
    ``configs``. Returns the two searches' logs (draft kernels, verify kernel)."""
    log, verify_log = [], []
    sizes = [tuple(int(x) for x in c.split(",")) for c in args.tune_configs] if args.tune_configs else None
    for i, shape_name in enumerate(SHAPES):
        deadline = started + args.tune_budget_s * (i + 1) / len(SHAPES)
        slot = args.tune_budget_s / len(SHAPES)
        try:
            best, tried = tune(timer, device, gen, 32768, 8, shape_name, deadline - VERIFY_SEARCH_SHARE * slot, sizes)
            configs[shape_name].update(best)
            log += tried
        except Exception as exc:  # noqa: BLE001 - measure with the defaults instead
            log.append({"shape": shape_name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(f"tuned {shape_name}: " + ", ".join(f"{m} {_launch(c)}" for m, c in configs[shape_name].items()),
              flush=True)
        verify_log += _search_verify_logged(timer, device, gen, 32768, 8, shape_name, deadline)
    return log, verify_log


def _search_verify_logged(timer, device, gen, context, batch, shape_name, deadline, launches=None) -> list[dict]:
    try:
        tried = search_verify(timer, device, gen, context, batch, shape_name, deadline, launches)
    except Exception as exc:  # noqa: BLE001 - the default verify rows are still measured
        return [{"shape": shape_name, "error": f"{type(exc).__name__}: {exc}"[:300]}]
    timed = [r for r in tried if "ms" in r]
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        print(f"verify search {shape_name}: default {timed[0]['ms']:.3f} ms, best {best['ms']:.3f} ms at block "
              f"{best['block_n']}, warps {best['num_warps']}, stages {best['num_stages']}, rows "
              f"{best['max_query_rows']} ({len(tried)} tried)", flush=True)
    return tried


def _bench_combos(args, timer, device, gen, configs, started, result) -> None:
    """Every (context, batch, shape) that fits the device and the time budget: its rows into
    ``result``, written after each (partial results survive a timeout)."""
    combos = [(256, 2)] if args.smoke else COMBOS
    shapes = {"llama70b-tp8"} if args.smoke else set(SHAPES)
    for context, batch in combos:
        for shape_name in SHAPES:
            if shape_name not in shapes:
                continue
            combo = {"shape": shape_name, "context": context, "batch": batch}
            ok, why = _fits(context, batch, SHAPES[shape_name][1], SHAPES[shape_name][2], device)
            if time.monotonic() - started > args.budget_s:
                ok, why = False, f"time budget {args.budget_s:.0f} s spent"
            if not ok:
                result["skipped"].append({**combo, "reason": why})
                print(f"skip {shape_name} {context}x{batch}: {why}", flush=True)
                continue
            rows = bench_combo(shape_name, context, batch, timer, configs[shape_name], device, gen)
            result["rows"] += rows
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"{shape_name:13s} {context:6d} x {batch:2d}: " + ", ".join(_brief(r) for r in rows), flush=True)
            _write(args.out, result)


def _bench_packs(args, timer, device, gen, configs, started, result) -> list[dict]:
    """Copying entries into a packed buffer against reading them in place (bench_pack)."""
    rows = []
    for method, shape_name in (("kivi4", "llama70b-tp8"), ("droppers", "llama70b-tp8"), ("kivi4", "llama3-8b"),
                               ("droppers", "llama3-8b"), ("int8", "llama3-8b")):
        if (args.smoke and shape_name != "llama70b-tp8") or (
                not args.smoke and time.monotonic() - started > args.budget_s + 20):
            continue
        context, batch = (256, 2) if args.smoke else (32768, 8)
        try:
            row = bench_pack(timer, device, gen, method, shape_name, context, batch, config=configs[shape_name][method])
            print(f"pack {method} {shape_name} {context}x{batch}: copy {row['pack_copy_ms']:.2f} ms "
                  f"({100 * row['copy_share_of_round']:.1f}% of a 30-step round), in place "
                  f"{row['pack_in_place_ms']:.2f} ms; draft step {row['draft_copied_ms']:.3f} ms copied, "
                  f"{row['draft_in_place_ms']:.3f} ms in place; append of {row['accepted']} tokens "
                  f"{row['append_ms']:.2f} ms ({100 * row['append_share_of_round']:.1f}% of the round; "
                  f"{row['append_copy_ms']:.2f} ms copying every row)", flush=True)
        except Exception as exc:  # noqa: BLE001
            row = {"method": method, "shape": shape_name, "error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        result["pack"] = rows
        _write(args.out, result)
    return rows


def _brief(r: dict) -> str:
    if "error" in r:
        return f"{r['method']} ERROR {r['error'][:60]}"
    return f"{r['method']} {r['ms']:.3f} ms {100 * r['hbm_fraction']:.0f}% {r['speedup_vs_full']:.2f}x"


def _write(path, result) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
