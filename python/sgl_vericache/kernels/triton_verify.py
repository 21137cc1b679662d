"""Triton split-KV verify attention: a round's verify block over the full paged KV pool.

A verify forward has, for each request b, T query tokens (the last verified token and the
round's drafts) whose K/V the forward has just written into the pool; token j of the block
sees the request's verified prefix (prefix_b tokens) and the block's tokens under the verify
mask (a linear chain: tokens 0..j; TREE: a [B, T, T] mask). Both the prefix and the block
are read through SGLang's token table (req_to_token: row -> pool slot of each position).
On a sliding-window layer token j sees only positions from prefix + j - window on (as
SGLang's decode: a query at position p sees p - window .. p).

One program handles one request, one KV head and one slice of the request's positions, for
a chunk of the block's tokens times the KV head's GQA query heads at once: QP query rows
(token j = c * TQ + i // GROUP, head i % GROUP), so each key block is loaded once for all
of them (the draft kernel, triton_decode, would load it once per token). The positions are
split across programs (flash-decoding); partial softmax states go to the same fp32 buffers
as the draft kernel's and its ``_combine_kernel`` merges them. Products in the pool's dtype
when the query has it (fp32 accumulation, probabilities rounded to that dtype before P @ V,
as FlashAttention does), else fp32; softmax in base 2 (qk_scale carries log2 e).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_decode import _dot_in, _mm, _round_to, _soft_cap, _softmax_step


@triton.jit
def _pool_rows(ptr, slot, h, stride_t, stride_h, live, D: tl.constexpr, DP: tl.constexpr):
    """Rows ``slot`` (int64 [BN]) of head h of a [slots, H, D] pool buffer -> [BN, DP]."""
    d = tl.arange(0, DP)
    return tl.load(ptr + (slot * stride_t + h * stride_h)[:, None] + d[None, :],
                   mask=live[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _fold_block(q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr, row, table_stride, t, visible, h, stride_kt, stride_kh,
                stride_vt, stride_vh, qk_scale, softcap, D: tl.constexpr, DP: tl.constexpr, ROUND: tl.constexpr,
                DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold the positions t [BN] (each a position the table holds) into the running state,
    scores masked where not ``visible`` [QP, BN]. SOFTCAP: scores soft-capped first, cap *
    tanh(score / cap) (``softcap``: the cap in the scores' base-2 units)."""
    slot = tl.load(table_ptr + row * table_stride + t).to(tl.int64)
    every = tl.full(t.shape, 1, tl.int1)
    k = _dot_in(_round_to(_pool_rows(k_ptr, slot, h, stride_kt, stride_kh, every, D, DP), ROUND), DOT)
    s = tl.where(visible, _soft_cap(_mm(q, tl.trans(k), DOT) * qk_scale, softcap, SOFTCAP), float("-inf"))
    v = _dot_in(_round_to(_pool_rows(v_ptr, slot, h, stride_vt, stride_vh, every, D, DP), ROUND), DOT)
    return _softmax_step(m_i, l_i, acc, s, v, DOT)


@triton.jit
def _fold_prefix(q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr, row, table_stride, lo, end, lowest, h, stride_kt,
                 stride_kh, stride_vt, stride_vh, qk_scale, softcap, PER_ROW: tl.constexpr, BN: tl.constexpr,
                 D: tl.constexpr, DP: tl.constexpr, ROUND: tl.constexpr, DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold verified positions lo .. end - 1, which every query row sees (PER_ROW: each row
    only from its ``lowest`` position on, where a sliding window has left some of them)."""
    for start in range(lo, end, BN):
        t = start + tl.arange(0, BN)
        visible = (t < end)[None, :]
        if PER_ROW:
            visible = visible & (t[None, :] >= lowest[:, None])
        t = tl.minimum(t, end - 1)  # positions past the end read the last one again, unseen
        m_i, l_i, acc = _fold_block(q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr, row, table_stride, t, visible, h,
                                    stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, softcap, D, DP, ROUND,
                                    DOT, SOFTCAP)
    return m_i, l_i, acc


# T (the round's block) and the split count change from one round to the next; the token
# table's width is the server's, but not specializing on it keeps the variants a start-up
# warm-up compiles (spec/warm_up.py: warm_verify) independent of it
@triton.jit(do_not_specialize=["T", "NUM_SPLITS", "table_stride", "window"])
def _verify_split_kernel(
    q_ptr,  # [B * T, HQ, D] the block's queries
    k_ptr, v_ptr,  # the pool's [slots, H, D] key / value buffers of this layer
    table_ptr, row_ptr,  # req_to_token [rows, table_stride]; each request's table row [B]
    prefix_ptr,  # [B] verified tokens before the block (all visible)
    live_ptr,  # [B] 0: the request is not verified this round (no position is read; its output is zeros)
    mask_ptr,  # TREE: [B, T, T] the verify mask, nonzero where token j sees block token i
    m_ptr, l_ptr, acc_ptr,  # partials [B * T, HQ, NUM_SPLITS] (x DP for acc)
    qk_scale, T, H, HQ, NUM_SPLITS, table_stride,
    softcap,  # SOFTCAP: the layer's logit cap times log2 e
    window,  # a sliding-window layer's: token j (position prefix + j) sees positions from prefix + j - window; -1: all
    stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, QP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr,
    ROUND: tl.constexpr, DOT: tl.constexpr, TREE: tl.constexpr, SOFTCAP: tl.constexpr = False,
):
    TQ: tl.constexpr = QP // GROUP  # block tokens a program takes
    chunks = tl.cdiv(T, TQ)
    b = tl.program_id(0) // chunks
    c = tl.program_id(0) % chunks
    h = tl.program_id(1)
    split = tl.program_id(2)
    prefix = tl.load(prefix_ptr + b).to(tl.int32)
    live_row = tl.load(live_ptr + b) != 0
    total = tl.where(live_row, prefix + T, 0)
    prefix = tl.where(live_row, prefix, 0)
    row = tl.load(row_ptr + b).to(tl.int64)

    gi = tl.arange(0, QP)
    j = c * TQ + gi // GROUP  # the query row's token in the block
    qvalid = (gi < TQ * GROUP) & (j < T)
    q_rows = (b.to(tl.int64) * T + j) * HQ + h * GROUP + gi % GROUP
    d = tl.arange(0, DP)
    q = tl.load(q_ptr + (q_rows * D)[:, None] + d[None, :], mask=qvalid[:, None] & (d < D)[None, :], other=0.0)
    q = _dot_in(q, DOT)
    m_i = tl.full([QP], -1.0e30, tl.float32)  # finite: a block all masked makes no NaN
    l_i = tl.zeros([QP], tl.float32)
    acc = tl.zeros([QP, DP], tl.float32)

    windowed = window >= 0
    lowest = tl.where(windowed, prefix + j - window, 0)  # each query row's first visible position
    base = tl.where(windowed, tl.maximum(prefix - window, 0), 0)  # no row sees a position below it
    per_split = tl.cdiv(tl.cdiv(total - base, NUM_SPLITS), BN) * BN
    lo = base + split * per_split
    hi = tl.minimum(total, lo + per_split)
    prefix_hi = tl.minimum(hi, prefix)
    # the verified prefix: positions below prefix + T - 1 - window, which the window hides
    # from some rows, masked per row; the rest (all of it without a window) seen by every row
    seen_by_all = tl.minimum(tl.maximum(lo, tl.where(windowed, prefix + T - 1 - window, 0)), prefix_hi)
    m_i, l_i, acc = _fold_prefix(q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr, row, table_stride, lo, seen_by_all,
                                 lowest, h, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, softcap, True, BN,
                                 D, DP, ROUND, DOT, SOFTCAP)
    m_i, l_i, acc = _fold_prefix(q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr, row, table_stride,
                                 tl.maximum(lo, seen_by_all), prefix_hi, lowest, h, stride_kt, stride_kh, stride_vt,
                                 stride_vh, qk_scale, softcap, False, BN, D, DP, ROUND, DOT, SOFTCAP)
    for start in range(tl.maximum(lo, prefix), hi, BN):  # the block, under the verify mask
        t = start + tl.arange(0, BN)
        live = t < hi
        i = t - prefix  # the position in the block
        if TREE:
            seen = tl.load(mask_ptr + (b.to(tl.int64) * T + j)[:, None] * T + i[None, :],
                           mask=qvalid[:, None] & live[None, :], other=0) != 0
        else:
            seen = i[None, :] <= j[:, None]
        seen = seen & live[None, :] & (t[None, :] >= lowest[:, None])
        t = tl.minimum(t, hi - 1)
        m_i, l_i, acc = _fold_block(q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr, row, table_stride, t, seen, h,
                                    stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, softcap, D, DP, ROUND,
                                    DOT, SOFTCAP)

    out_rows = q_rows * NUM_SPLITS + split
    tl.store(m_ptr + out_rows, m_i, mask=qvalid)
    tl.store(l_ptr + out_rows, l_i, mask=qvalid)
    tl.store(acc_ptr + (out_rows * DP)[:, None] + d[None, :], acc, mask=qvalid[:, None])
