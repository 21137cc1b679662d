"""Triton kernels for Quest: per-page upper bounds, then attention over the chosen pages only.

Who chooses is the compressor's ``heads`` option. Per KV head (the default): a page scores
the largest bound among the KV head's query heads, and ``_quest_group_kernel`` reads each
chosen page once for the whole GQA group, the group's queries as the rows of a matrix
product (as ``triton_decode._decode_split_kernel`` reads a dense entry). Per query head
(the paper's): two heads of one group may read different pages, so ``_quest_split_kernel``
runs per (row, query head), a one-row query, scores by multiply-and-sum. Keys and values are dense in the
entry dtype; the pages come from a page table [R, H_c, K] (H_c the choosing heads; the
top-scored pages, best first), of which a row reads its first ``pages_read``. The partial
states use the layout of ``triton_decode._combine_kernel``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import _load_dense
from .triton_decode import (K_COL, PMAX_COL, PMIN_COL, V_COL, _addressed, _dense_segment, _dot_in, _finish_rows, _mm,
                            _round_to, _soft_cap, _softmax_step)


@triton.jit(do_not_specialize=["P_MAX"])  # see triton_decode.ROUND_VARYING
def _page_scores_kernel(q_ptr, meta_ptr, pmin_ptr, pmax_ptr, addr_ptr, out_ptr, H, HQ, HC, P_MAX, PAGE_SIZE,
                        GROUP: tl.constexpr, PER_KV: tl.constexpr, D: tl.constexpr, BP: tl.constexpr,
                        ADDR: tl.constexpr = False):
    """out[r, c, p] for p < the row's pages (the rest is left as the caller filled it, -inf):
    sum_d max(q_d * min_d, q_d * max_d) over page p for query head c, or with PER_KV the
    largest of those bounds among KV head c's query heads."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    blk = tl.program_id(2)
    meta = meta_ptr + r * 9
    num_pages = tl.cdiv(tl.load(meta + 1), PAGE_SIZE)
    page_start = tl.load(meta + 7).to(tl.int64)
    if ADDR:  # the entry's page bounds where they lie (page_start is 0)
        entry = tl.load(meta + 6)
        pmin_ptr = _addressed(addr_ptr, entry, PMIN_COL, pmin_ptr)
        pmax_ptr = _addressed(addr_ptr, entry, PMAX_COL, pmax_ptr)
    h = c if PER_KV else c // GROUP
    d = tl.arange(0, D)
    p = blk * BP + tl.arange(0, BP)
    valid = p < num_pages
    off = (((page_start + p.to(tl.int64)) * H + h) * D)[:, None] + d[None, :]
    low = tl.load(pmin_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
    high = tl.load(pmax_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
    q_row0 = r.to(tl.int64) * HQ + (c * GROUP if PER_KV else c)
    bound = tl.full([BP], float("-inf"), tl.float32)
    for g in tl.static_range(GROUP if PER_KV else 1):
        q = tl.load(q_ptr + (q_row0 + g) * D + d).to(tl.float32)
        bound = tl.maximum(bound, tl.sum(tl.maximum(q[None, :] * low, q[None, :] * high), 1))
    tl.store(out_ptr + (r.to(tl.int64) * HC + c) * P_MAX + p, bound, mask=valid)


@triton.jit(do_not_specialize=["E_CAP", "EXT_ADD", "K_SEL", "NUM_SPLITS"])  # see triton_decode.ROUND_VARYING
def _quest_group_kernel(
    q_ptr, meta_ptr, k_ptr, v_ptr, sel_ptr, ke_ptr, ve_ptr, m_ptr, l_ptr, acc_ptr, addr_ptr, out_ptr, lse_ptr,
    tick_ptr, qk_scale, softcap, H, HQ, E_CAP, EXT_ADD, K_SEL, NUM_SPLITS,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr,
    ROUND: tl.constexpr, DOT: tl.constexpr, FUSED: tl.constexpr = False, HAS_LSE: tl.constexpr = False,
    SP: tl.constexpr = 2, OFF32: tl.constexpr = False, ADDR: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    """Per-KV-head choice: one program reads one row's KV head h (its GQA group's queries
    together) over a slice of the pages the page table chose for (row, h), then, in the
    last split, the row's provisional tokens (FUSED, OFF32, ADDR: see triton_decode's
    _finish_rows, _entry_base, _entry_tensors; SOFTCAP: scores soft-capped, _soft_cap)."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    meta = meta_ptr + r * 9
    main_start = tl.load(meta + 0).to(tl.int64)
    num_tokens = tl.load(meta + 1)
    pages_read = tl.load(meta + 8)
    gi = tl.arange(0, GP)
    d = tl.arange(0, D)
    q_rows = r.to(tl.int64) * HQ + h * GROUP + gi
    q = _dot_in(tl.load(q_ptr + (q_rows * D)[:, None] + d[None, :], mask=(gi < GROUP)[:, None], other=0.0), DOT)
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)

    if ADDR:  # the entry's K / V where they lie (main_start is 0)
        entry = tl.load(meta + 6)
        k_ptr = _addressed(addr_ptr, entry, K_COL, k_ptr)
        v_ptr = _addressed(addr_ptr, entry, V_COL, v_ptr)
    elif OFF32:  # K / V at the entry's first row: offsets within it in int32 (as triton_decode._entry_base)
        k_ptr += main_start * (H * D)
        v_ptr += main_start * (H * D)
    table = sel_ptr + (r.to(tl.int64) * H + h) * K_SEL
    span = pages_read * PAGE  # slots of the chosen pages, in table order
    per_split = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BN) * BN
    lo = split * per_split
    hi = tl.minimum(span, lo + per_split)
    for start in range(lo, hi, BN):
        i = start + tl.arange(0, BN)
        page = tl.load(table + i // PAGE, mask=i < hi, other=0)
        t = page * PAGE + i % PAGE
        valid = (i < hi) & (t < num_tokens)  # the last page may be partial
        tok = t if OFF32 else main_start + t.to(tl.int64)
        k = _dot_in(_round_to(_load_dense(k_ptr, tok, h, H, valid, D), ROUND), DOT)
        s = tl.where(valid[None, :], _soft_cap(_mm(q, tl.trans(k), DOT) * qk_scale, softcap, SOFTCAP), float("-inf"))
        v = _dot_in(_round_to(_load_dense(v_ptr, tok, h, H, valid, D), ROUND), DOT)
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, DOT)

    ext_len = tl.where(split == NUM_SPLITS - 1, tl.load(meta + 5) + EXT_ADD, 0)
    ext_row0 = tl.load(meta + 4).to(tl.int64) * E_CAP
    m_i, l_i, acc = _dense_segment(q, m_i, l_i, acc, ke_ptr, ve_ptr, ext_row0, ext_len, h, H, qk_scale, softcap,
                                   ROUND, DOT, BN, D, SOFTCAP)
    _finish_rows(m_i, l_i, acc, r.to(tl.int64) * HQ + h * GROUP, split, m_ptr, l_ptr, acc_ptr, out_ptr, lse_ptr,
                 tick_ptr + r * H + h, NUM_SPLITS, GROUP, D, SP, FUSED, HAS_LSE)


@triton.jit
def _fold_rows(q, m_i, l_i, acc, k_ptr, v_ptr, tok, h, H, valid, qk_scale, softcap,
               ROUND: tl.constexpr, D: tl.constexpr, SOFTCAP: tl.constexpr):
    d = tl.arange(0, D)
    off = ((tok * H + h) * D)[:, None] + d[None, :]
    k = _round_to(tl.load(k_ptr + off, mask=valid[:, None], other=0.0), ROUND).to(tl.float32)
    s = tl.where(valid, _soft_cap(tl.sum(k * q[None, :], 1) * qk_scale, softcap, SOFTCAP), float("-inf"))
    v = _round_to(tl.load(v_ptr + off, mask=valid[:, None], other=0.0), ROUND).to(tl.float32)
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    return m_new, l_i * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p[:, None] * v, 0)


@triton.jit(do_not_specialize=["E_CAP", "EXT_ADD", "K_SEL", "NUM_SPLITS"])  # see triton_decode.ROUND_VARYING
def _quest_split_kernel(
    q_ptr, meta_ptr, k_ptr, v_ptr, sel_ptr, ke_ptr, ve_ptr, m_ptr, l_ptr, acc_ptr, addr_ptr,
    qk_scale, softcap, H, HQ, E_CAP, EXT_ADD, K_SEL, PAGE_SIZE, NUM_SPLITS,
    GROUP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, ROUND: tl.constexpr, ADDR: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    r = tl.program_id(0)
    hq = tl.program_id(1)
    split = tl.program_id(2)
    meta = meta_ptr + r * 9
    main_start = tl.load(meta + 0).to(tl.int64)
    num_tokens = tl.load(meta + 1)
    pages_read = tl.load(meta + 8)
    if ADDR:  # the entry's K / V where they lie (main_start is 0)
        entry = tl.load(meta + 6)
        k_ptr = _addressed(addr_ptr, entry, K_COL, k_ptr)
        v_ptr = _addressed(addr_ptr, entry, V_COL, v_ptr)
    h = hq // GROUP
    rh = r.to(tl.int64) * HQ + hq
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rh * D + d).to(tl.float32)
    m_i = tl.full([], -1.0e30, tl.float32)
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([D], tl.float32)

    span = pages_read * PAGE_SIZE  # slots of the chosen pages, in table order
    per_split = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BN) * BN
    lo = split * per_split
    hi = tl.minimum(span, lo + per_split)
    for start in range(lo, hi, BN):
        i = start + tl.arange(0, BN)
        page = tl.load(sel_ptr + rh * K_SEL + i // PAGE_SIZE, mask=i < hi, other=0)
        t = page * PAGE_SIZE + i % PAGE_SIZE
        valid = (i < hi) & (t < num_tokens)  # the last page may be partial
        m_i, l_i, acc = _fold_rows(q, m_i, l_i, acc, k_ptr, v_ptr, main_start + t.to(tl.int64), h, H, valid,
                                   qk_scale, softcap, ROUND, D, SOFTCAP)

    ext_len = tl.where(split == NUM_SPLITS - 1, tl.load(meta + 5) + EXT_ADD, 0)
    ext_row0 = tl.load(meta + 4).to(tl.int64) * E_CAP
    for start in range(0, ext_len, BN):
        t = start + tl.arange(0, BN)
        m_i, l_i, acc = _fold_rows(q, m_i, l_i, acc, ke_ptr, ve_ptr, ext_row0 + t.to(tl.int64), h, H,
                                   t < ext_len, qk_scale, softcap, ROUND, D, SOFTCAP)

    out = rh * NUM_SPLITS + split
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)
    tl.store(acc_ptr + out * D + d, acc)
