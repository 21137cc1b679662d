"""Triton split-KV decode attention that reads a compressed entry where it lies.

One program handles one query row, one KV head (all its GQA query heads at once, so each
key block is loaded and dequantized once for the group) and one slice of the row's
compressed tokens. A row's keys are three segments read in order:

    main     the entry proper: dense rows (droppers, full), KIVI's packed codes, int8 or
             fp8 codes; scales and zero points are loaded beside them and applied in
             registers: nothing is dequantized to memory
    recent   KIVI's full-precision window (empty for the other formats)
    extra    the round's provisional draft KV, of which the row sees its first ext_len

The main segment is split across ``num_splits`` programs (flash-decoding); the last split
also reads the two short segments. Partial softmax states go to a small fp32 buffer and
``_combine_kernel`` merges them, or (FUSED) the program that finishes a (row, KV head)'s
last split merges them itself (``_finish_rows``), so no second kernel runs. Dequantized
values are rounded to the entry's dtype before the products, exactly as ``materialize``
does on the torch path, or, with half products
(HALF), computed and multiplied in fp16 (see ops.LaunchConfig.half); softmax and
accumulation are fp32 (scores in the log2 domain). Codes become floats without conversion
instructions (_codes_float), compiled by inline PTX where ASM is set.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import (_codes_float, _gather_codes, _gather_value_scales, _kivi4_words_f16, _kivi_f16_asm,
                    _load_codes, _load_dense, _unpack_codes)

# The row table (packing.PackedKV.rows) is read by column index: 0 main_start, 1 main_len,
# 2 rec_start, 3 rec_len, 4 ext_row, 5 ext_base (+ EXT_ADD = extras seen), 6 entry,
# 7 page_start, 8 pages_read. FMT as packing.FMT_*; ROUND / DOT: 0 fp32, 1 fp16, 2 bf16
# (ROUND 3: bf16 values kept in fp32, for the interpreter).
# the running max starts at -1e30 (finite), so a block that is all masked never makes NaNs


@triton.jit
def _round_to(x, MODE: tl.constexpr):
    """x rounded to the entry dtype (what torch's materialize stores), as fp32 or that dtype."""
    if MODE == 1:
        x = x.to(tl.float16)
    elif MODE == 2:
        x = x.to(tl.bfloat16)
    elif MODE == 3:  # bf16 rounded to nearest even by hand: the interpreter's cast truncates
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _dot_in(x, DOT: tl.constexpr):
    if DOT == 1:
        return x.to(tl.float16)
    elif DOT == 2:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _half_query(q, RESCALE: tl.constexpr):
    """(q16, unit) for fp16 products. RESCALE (a bf16 query): q times a power of two that
    brings its largest element to [2^13, 2^14) (exact, inside fp16's range; elements below
    2^-27 of the largest flush), and 1 / that power, which the scores take back. Otherwise
    (an fp16 query) q as it is."""
    if RESCALE:
        qa = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
        e = tl.maximum((qa.to(tl.int32, bitcast=True) >> 23) & 0xFF, 14)  # biased exponent of the largest
        up = ((267 - e) << 23).to(tl.float32, bitcast=True)  # 2^(140 - e)
        unit = ((e - 13) << 23).to(tl.float32, bitcast=True)  # 2^(e - 140)
        return (q.to(tl.float32) * up).to(tl.float16), unit
    else:
        return q.to(tl.float16), 1.0


@triton.jit
def _round_int8(x):
    """x (|x| <= 127.5) to the nearest int8, halves away from zero."""
    return tl.where(x >= 0, x + 0.5, x - 0.5).to(tl.int8)


@triton.jit
def _int8_query(q):
    """(hi, lo, step): each query row as two int8 terms, q ~ (254 hi + lo) * step, where
    254 * step is the row's largest |element| / 127 (a row of zeros: 1): hi the row rounded
    to int8 in those units, lo the remainder in 254ths of them. The error, at most step / 2
    (1/64516 of the largest element), is below a bf16 query's own rounding (half an ulp, at
    least 2^-9 of the element) for every element above a 126th of the largest
    (ops.int8_query_terms is the torch twin)."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), 1)
    unit = tl.where(amax > 0, amax / 127.0, 1.0)
    x = qf / unit[:, None]
    hi = _round_int8(x)
    lo = _round_int8((x - hi.to(tl.float32)) * 254.0)
    return hi, lo, unit / 254.0


@triton.jit
def _int_scores(q_hi, q_lo, k8):
    """q.k in the query's steps: 254 hi @ k8^T + lo @ k8^T, int8 codes multiplied on the
    integer tensor cores (the keys' codes as stored: no decode), the sums exact in int32
    (|254 hi.k + lo.k| <= 255 * 127^2 * D < 2^31 for D <= 256; ops.int8_query_applies)."""
    s = tl.dot(q_hi, tl.trans(k8), out_dtype=tl.int32)
    return tl.dot(q_lo, tl.trans(k8), s * 254, out_dtype=tl.int32).to(tl.float32)


@triton.jit
def _queries(q, qk_scale, DOT: tl.constexpr, HALF: tl.constexpr, Q_BF16: tl.constexpr, QK8: tl.constexpr):
    """The query in each form a program multiplies it in, once: (q in the dot dtype, for the
    short segments; qm and its score scale, for the main segment: fp16 with half products,
    else q; the int8 terms and their scale with QK8, else placeholders)."""
    if HALF:  # the main segment multiplies fp16: codes and dequantized values are exact or rounded there
        qm, unit = _half_query(q, Q_BF16)
        main_scale = qk_scale * unit
    q8, q8_lo, q8_scale = q, q, qk_scale
    if QK8:
        q8, q8_lo, q8_step = _int8_query(q)
        q8_scale = q8_step * qk_scale
    q = _dot_in(q, DOT)
    if not HALF:
        qm, main_scale = q, qk_scale
    return q, qm, main_scale, q8, q8_lo, q8_scale


@triton.jit
def _mm(a, b, DOT: tl.constexpr):
    """a @ b with fp32 accumulation; DOT 0 multiplies in fp32 (no TF32)."""
    if DOT == 0:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _soft_cap(s, softcap, SOFTCAP: tl.constexpr):
    """Scores s (base-2 units) soft-capped as a capped model's attention does, cap *
    tanh(score / cap), with ``softcap`` the cap in those units; as they are without SOFTCAP.
    tanh(y) = 1 - 2 / (e^2y + 1): +-1 where e^2y over- or underflows."""
    if SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / softcap)) + 1.0))
    return s


@triton.jit
def _softmax_step(m_i, l_i, acc, s, v, DOT: tl.constexpr):
    """Fold one block into the running state. s [GP, BN] scores (log2 domain, -inf where
    masked), v [BN, D] values in the dot dtype."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mm(_dot_in(p, DOT), v, DOT)
    return m_new, l_i, acc


@triton.jit
def _softmax_step_scaled(m_i, l_i, acc, s, v, v_scale, DOT: tl.constexpr):
    """_softmax_step over values v_scale[n] * v[n]: the per-token scale goes on the
    probabilities ([GP, BN] products) instead of the values ([BN, D])."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mm(_dot_in(p * v_scale[None, :], DOT), v, DOT)
    return m_new, l_i, acc


@triton.jit
def _token_scales(s_ptr, tok, entry, h, H, valid, HEAD_SCALE: tl.constexpr, BN: tl.constexpr):
    """[BN] fp32 scales of int8 / fp8 rows: one per token, or one per entry and head."""
    if HEAD_SCALE:
        return tl.zeros([BN], tl.float32) + tl.load(s_ptr + entry * H + h).to(tl.float32)
    else:
        return tl.load(s_ptr + tok * H + h, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _kivi_keys(codes, s_ptr, z_ptr, tok, tok0, h, H, valid,
               QGROUP: tl.constexpr, KMODE: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    """Per-channel key scales: one [D] row per QGROUP tokens. KMODE 1: the block lies in one
    group (QGROUP % BN == 0), one row for all; 2: whole groups (BN % QGROUP == 0), a row
    each; 0: any other size, a row gathered per token. Arithmetic in codes' dtype (fp32,
    or fp16 for half products)."""
    d = tl.arange(0, D)
    if KMODE == 1:
        off = ((tok0 // QGROUP) * H + h) * D + d
        x = codes * tl.load(s_ptr + off).to(codes.dtype)[None, :] + tl.load(z_ptr + off).to(codes.dtype)[None, :]
    elif KMODE == 2:  # each group's row from its first token (tok is clamped to the entry's rows)
        rows = tl.min(tl.reshape(tok, (BN // QGROUP, QGROUP)), 1) // QGROUP
        off = ((rows * H + h) * D)[:, None] + d[None, :]
        scale = tl.load(s_ptr + off).to(codes.dtype)
        zero = tl.load(z_ptr + off).to(codes.dtype)
        x3 = tl.reshape(codes, (BN // QGROUP, QGROUP, D)) * scale[:, None, :] + zero[:, None, :]
        x = tl.reshape(x3, (BN, D))
    else:
        off = (((tok // QGROUP) * H + h) * D)[:, None] + d[None, :]
        scale = tl.load(s_ptr + off, mask=valid[:, None], other=0.0).to(codes.dtype)
        zero = tl.load(z_ptr + off, mask=valid[:, None], other=0.0).to(codes.dtype)
        x = codes * scale + zero
    return x


@triton.jit
def _kivi_values(codes, s_ptr, z_ptr, tok, h, H, valid, CGROUP: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    """Per-token value scales, one per CGROUP channels (a power of two dividing D)."""
    c = tl.arange(0, D // CGROUP)
    off = ((tok * H + h) * (D // CGROUP))[:, None] + c[None, :]
    scale = tl.load(s_ptr + off, mask=valid[:, None], other=0.0).to(codes.dtype)
    zero = tl.load(z_ptr + off, mask=valid[:, None], other=0.0).to(codes.dtype)
    x3 = tl.reshape(codes, (BN, D // CGROUP, CGROUP)) * scale[:, :, None] + zero[:, :, None]
    return tl.reshape(x3, (BN, D))


@triton.jit
def _load_main(data_ptr, s_ptr, z_ptr, tok, tok0, entry, h, H, valid,
               FMT: tl.constexpr, BITS: tl.constexpr, QGROUP: tl.constexpr, CGROUP: tl.constexpr, KMODE: tl.constexpr,
               HEAD_SCALE: tl.constexpr, IS_KEY: tl.constexpr, UNPACK: tl.constexpr, HALF: tl.constexpr,
               BN: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr = 0):
    """[BN, D] fp32 (or stored dtype for dense; fp16 for KIVI with HALF) keys/values of the
    main segment; tok0 is the block's first row (blocks start on multiples of BN within an
    entry). UNPACK (KIVI): 0 unpacks a row's bytes with join / reshape, 1 gathers each
    channel's byte (KMODE 0 or 1). int8 / fp8 here are the unfolded fp32 path."""
    if FMT == 0:
        x = _load_dense(data_ptr, tok, h, H, valid, D)
    elif FMT == 1:
        if UNPACK == 1:
            codes = _codes_float(_gather_codes(data_ptr, tok, h, H, valid, BITS, D), HALF)
        elif HALF and ASM == 2 and BITS == 4:
            codes = _kivi4_words_f16(data_ptr, tok, h, H, valid, BN, D, True)
        else:
            j = tl.arange(0, D * BITS // 8)
            b = tl.load(data_ptr + ((tok * H + h) * (D * BITS // 8))[:, None] + j[None, :], mask=valid[:, None],
                        other=0)
            if HALF and ASM:
                codes = _kivi_f16_asm(b, BITS, BN, D)
            else:
                codes = _codes_float(_unpack_codes(b.to(tl.int32), BITS, BN, D), HALF)
        if IS_KEY:
            x = _kivi_keys(codes, s_ptr, z_ptr, tok, tok0, h, H, valid, QGROUP, KMODE, BN, D)
        elif UNPACK == 1:
            scale, zero = _gather_value_scales(s_ptr, z_ptr, tok, h, H, valid, CGROUP, D, HALF)
            x = codes * scale + zero
        else:
            x = _kivi_values(codes, s_ptr, z_ptr, tok, h, H, valid, CGROUP, BN, D)
    else:
        codes = _load_codes(data_ptr, tok, h, H, valid, FMT, D, False)
        if HEAD_SCALE:  # fp8 "head": one scale per entry and head
            scale = tl.load(s_ptr + entry * H + h).to(tl.float32)
            x = codes * scale
        else:
            scale = tl.load(s_ptr + tok * H + h, mask=valid, other=0.0).to(tl.float32)
            x = codes * scale[:, None]
    return x


# columns of the in-place address table (packing.ADDR_FIELDS; ops checks they agree)
ADDR_COLS = tl.constexpr(10)
K_COL, V_COL, KS_COL, KZ_COL, VS_COL, VZ_COL, KR_COL, VR_COL, PMIN_COL, PMAX_COL = (tl.constexpr(i) for i in range(10))


@triton.jit
def _addressed(addr_ptr, entry, COL: tl.constexpr, like):
    """Entry ``entry``'s tensor of address-table column COL, as a pointer of ``like``'s type,
    16-byte aligned (packing checks every address is, as Triton assumes of its pointer
    arguments; without it no load of the entry would be vectorized)."""
    return tl.multiple_of(tl.load(addr_ptr + entry.to(tl.int64) * ADDR_COLS + COL).to(like.dtype, bitcast=True), 16)


@triton.jit
def _entry_tensors(addr_ptr, entry, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr,
                   FMT: tl.constexpr, HEAD_SCALE: tl.constexpr):
    """An entry read in place (packing.pack(in_place=True)): its own tensors' addresses, each
    row 0 of the entry (the row table's starts are all 0). fp8's per-head scales stay the
    [E, H] tensor read by entry index."""
    k_ptr = _addressed(addr_ptr, entry, K_COL, k_ptr)
    v_ptr = _addressed(addr_ptr, entry, V_COL, v_ptr)
    if FMT == 1:
        ks_ptr = _addressed(addr_ptr, entry, KS_COL, ks_ptr)
        kz_ptr = _addressed(addr_ptr, entry, KZ_COL, kz_ptr)
        vs_ptr = _addressed(addr_ptr, entry, VS_COL, vs_ptr)
        vz_ptr = _addressed(addr_ptr, entry, VZ_COL, vz_ptr)
        kr_ptr = _addressed(addr_ptr, entry, KR_COL, kr_ptr)
        vr_ptr = _addressed(addr_ptr, entry, VR_COL, vr_ptr)
    elif FMT != 0 and not HEAD_SCALE:
        ks_ptr = _addressed(addr_ptr, entry, KS_COL, ks_ptr)
        vs_ptr = _addressed(addr_ptr, entry, VS_COL, vs_ptr)
    return k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr


@triton.jit
def _entry_base(k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, first, H, FMT: tl.constexpr, BITS: tl.constexpr,
                QGROUP: tl.constexpr, CGROUP: tl.constexpr, HEAD_SCALE: tl.constexpr, D: tl.constexpr):
    """The main segment's pointers (codes, and the scales and zeros indexed by token) moved to
    row ``first`` (int64) of their tensors, once a program: the blocks then index rows
    relative to it in int32 (ops.offsets32 checks an entry's offsets fit), instead of int64
    address arithmetic for every row of every block. KIVI entries start on a whole key-scale
    group (an entry's quantized length is a multiple of it)."""
    row = D * BITS // 8 if FMT == 1 else D
    k_ptr += first * (H * row)
    v_ptr += first * (H * row)
    if FMT == 1:
        ks_ptr += (first // QGROUP) * (H * D)
        kz_ptr += (first // QGROUP) * (H * D)
        vs_ptr += first * (H * (D // CGROUP))
        vz_ptr += first * (H * (D // CGROUP))
    elif FMT != 0 and not HEAD_SCALE:  # int8 / fp8 scales per token (fp8 "head": per entry, left as is)
        ks_ptr += first * H
        vs_ptr += first * H
    return k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr


@triton.jit
def _dense_segment(q, m_i, l_i, acc, k_ptr, v_ptr, row0, count, h, H, qk_scale, softcap,
                   ROUND: tl.constexpr, DOT: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                   SOFTCAP: tl.constexpr):
    """Fold ``count`` consecutive dense rows starting at row0 of [N, H, D] K/V (scores
    soft-capped with SOFTCAP: _soft_cap)."""
    for start in range(0, count, BN):
        t = start + tl.arange(0, BN)
        valid = t < count
        tok = row0 + t.to(tl.int64)
        k = _dot_in(_round_to(_load_dense(k_ptr, tok, h, H, valid, D), ROUND), DOT)
        s = _soft_cap(_mm(q, tl.trans(k), DOT) * qk_scale, softcap, SOFTCAP)
        s = tl.where(valid[None, :], s, float("-inf"))
        v = _dot_in(_round_to(_load_dense(v_ptr, tok, h, H, valid, D), ROUND), DOT)
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, DOT)
    return m_i, l_i, acc


@triton.jit
def _main_block(qm, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, tok, tok0, entry, h, H, live,
                scale, FMT: tl.constexpr, BITS: tl.constexpr, QGROUP: tl.constexpr, CGROUP: tl.constexpr,
                KMODE: tl.constexpr, HEAD_SCALE: tl.constexpr, MROUND: tl.constexpr, MDOT: tl.constexpr,
                FOLD: tl.constexpr, UNPACK: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr,
                BN: tl.constexpr, D: tl.constexpr, q8, q8_lo, q8_scale, QK8: tl.constexpr, softcap,
                SOFTCAP: tl.constexpr):
    """Fold one block of the main segment (rows tok) into the running state. qm is the query
    in the main segment's product dtype (MDOT), ``scale`` its score scale; with QK8 (int8
    entries) the keys' codes meet the query's two int8 terms (q8, q8_lo: _int8_query) on
    the integer tensor cores and q8_scale [GP] (each row's step times the score scale) goes
    on the scores. Rows past the row's end (not ``live``) are the entry's last row again
    (the caller clamps tok): no load is masked, their scores are (the loads' masks and
    their predication cost as much as the rest of the address math: offline the int8 loop
    751 -> 695 instructions and 227 -> 160 registers)."""
    valid = tl.full([BN], 1, tl.int1)  # what the loads are told: every row exists
    if FOLD:  # int8 / fp8: exact codes in the products, the token scales on scores and probabilities
        k_scale = _token_scales(ks_ptr, tok, entry, h, H, valid, HEAD_SCALE, BN)
        v_scale = _token_scales(vs_ptr, tok, entry, h, H, valid, HEAD_SCALE, BN)
        if HALF and FMT == 3:  # fp8 codes in fp16 are 2^-8 of the value
            k_scale = k_scale * 256.0
            v_scale = v_scale * 256.0
        if QK8:  # the codes as they are stored: no decode at all on the key side
            s = _int_scores(q8, q8_lo, _load_dense(k_ptr, tok, h, H, valid, D)) * q8_scale[:, None] * k_scale[None, :]
        else:
            k = _dot_in(_load_codes(k_ptr, tok, h, H, valid, FMT, D, HALF, ASM, BN), MDOT)
            s = _mm(qm, tl.trans(k), MDOT) * (k_scale * scale)[None, :]
        s = tl.where(live[None, :], _soft_cap(s, softcap, SOFTCAP), float("-inf"))
        v = _dot_in(_load_codes(v_ptr, tok, h, H, valid, FMT, D, HALF, ASM, BN), MDOT)
        m_i, l_i, acc = _softmax_step_scaled(m_i, l_i, acc, s, v, v_scale, MDOT)
    else:  # dense rows, or KIVI dequantized (in fp16 with HALF, else fp32 rounded to the entry dtype)
        k = _load_main(k_ptr, ks_ptr, kz_ptr, tok, tok0, entry, h, H, valid,
                       FMT, BITS, QGROUP, CGROUP, KMODE, HEAD_SCALE, True, UNPACK, HALF, BN, D, ASM)
        s = _soft_cap(_mm(qm, tl.trans(_dot_in(_round_to(k, MROUND), MDOT)), MDOT) * scale, softcap, SOFTCAP)
        s = tl.where(live[None, :], s, float("-inf"))
        v = _load_main(v_ptr, vs_ptr, vz_ptr, tok, tok0, entry, h, H, valid,
                       FMT, BITS, QGROUP, CGROUP, KMODE, HEAD_SCALE, False, UNPACK, HALF, BN, D, ASM)
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, _dot_in(_round_to(v, MROUND), MDOT), MDOT)
    return m_i, l_i, acc


# Arguments that change from one draft step or batch to the next are not specialized on: Triton
# would compile a kernel apart for a value of 1 and for multiples of 16 (EXT_ADD runs 1, 2, ...
# through a round), stalling the first rounds of a server with compiles
ROUND_VARYING = ("E_CAP", "EXT_ADD", "NUM_SPLITS", "K_SEL", "P_MAX")


@triton.jit(do_not_specialize=["E_CAP", "EXT_ADD", "NUM_SPLITS"])
def _decode_split_kernel(
    q_ptr, meta_ptr,
    k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,  # main segment: data and its scales / zeros
    kr_ptr, vr_ptr,  # KIVI's recent window [Nr, H, D]
    ke_ptr, ve_ptr,  # extras [X, E_cap, H, D]
    idx_ptr,  # INDEXED: main token t of a row lives at pool row idx[main_start + t]
    addr_ptr,  # ADDR: [E, ADDR_COLS] int64, each entry's tensors where they lie (the starts are 0)
    m_ptr, l_ptr, acc_ptr,  # partials [R, HQ, NUM_SPLITS] (x D for acc)
    out_ptr, lse_ptr, tick_ptr,  # FUSED: the output [R, HQ, D], its lse [R, HQ], a ticket per (row, KV head)
    qk_scale, softcap, H, HQ, E_CAP, EXT_ADD, NUM_SPLITS,  # softcap: the scores' soft cap, base-2 units (SOFTCAP)
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
    FMT: tl.constexpr, BITS: tl.constexpr, QGROUP: tl.constexpr, CGROUP: tl.constexpr, KMODE: tl.constexpr,
    HEAD_SCALE: tl.constexpr, INDEXED: tl.constexpr, ROUND: tl.constexpr, DOT: tl.constexpr,
    FOLD: tl.constexpr, UNPACK: tl.constexpr, HALF: tl.constexpr, Q_BF16: tl.constexpr, ASM: tl.constexpr,
    MROUND: tl.constexpr, MDOT: tl.constexpr,  # the main segment's ROUND / DOT: fp16 (1, 1) with HALF
    FUSED: tl.constexpr = False, HAS_LSE: tl.constexpr = False, SP: tl.constexpr = 2,  # SP: splits, pow2 >= 2
    OFF32: tl.constexpr = False,  # main-segment offsets in int32 from the entry's first row (not INDEXED)
    ADDR: tl.constexpr = False,
    QK8: tl.constexpr = False,  # int8 entries (FOLD): scores from the query's int8 terms x the codes (int8_query)
    SOFTCAP: tl.constexpr = False,  # scores soft-capped (Gemma 2, Grok): _soft_cap
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    meta = meta_ptr + r * 9
    main_start = tl.load(meta + 0).to(tl.int64)
    main_len = tl.load(meta + 1)
    entry = tl.load(meta + 6)
    gi = tl.arange(0, GP)
    d = tl.arange(0, D)
    q_rows = r.to(tl.int64) * HQ + h * GROUP + gi
    q = tl.load(q_ptr + (q_rows * D)[:, None] + d[None, :], mask=(gi < GROUP)[:, None], other=0.0)
    tl.static_assert(not QK8 or (FMT == 2 and FOLD and D >= 32 and D <= 256),
                     "int8 query: int8 entries, folded, 32 <= D <= 256")
    q, qm, main_scale, q8, q8_lo, q8_scale = _queries(q, qk_scale, DOT, HALF, Q_BF16, QK8)
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)

    per_split = tl.cdiv(tl.cdiv(main_len, NUM_SPLITS), BN) * BN
    lo = split * per_split
    hi = tl.minimum(main_len, lo + per_split)
    tl.static_assert(not ((OFF32 or ADDR) and INDEXED), "a pool read through a token table keeps int64 rows")
    if ADDR:
        k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr = _entry_tensors(
            addr_ptr, entry, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr, FMT, HEAD_SCALE)
    elif OFF32:  # the main segment's pointers at the entry's first row: offsets within it in int32
        k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr = _entry_base(k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                                                                   main_start, H, FMT, BITS, QGROUP, CGROUP,
                                                                   HEAD_SCALE, D)
    for start in range(lo, hi, BN):
        t = start + tl.arange(0, BN)
        live = t < hi
        t = tl.minimum(t, hi - 1)  # rows past the end read the last one again (see _main_block)
        if OFF32:
            tok0 = start
            tok = t
        else:
            tok0 = main_start + start
            tok = main_start + t.to(tl.int64)
        if INDEXED:
            tok = tl.load(idx_ptr + tok).to(tl.int64)
        m_i, l_i, acc = _main_block(qm, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, tok, tok0,
                                    entry, h, H, live, main_scale, FMT, BITS, QGROUP, CGROUP, KMODE, HEAD_SCALE,
                                    MROUND, MDOT, FOLD, UNPACK, HALF, ASM, BN, D, q8, q8_lo, q8_scale, QK8,
                                    softcap, SOFTCAP)

    last = split == NUM_SPLITS - 1  # the short segments go to the split with the least main work
    rec_len = tl.where(last, tl.load(meta + 3), 0)
    rec_start = tl.load(meta + 2).to(tl.int64)
    m_i, l_i, acc = _dense_segment(q, m_i, l_i, acc, kr_ptr, vr_ptr, rec_start, rec_len, h, H, qk_scale, softcap,
                                   ROUND, DOT, BN, D, SOFTCAP)
    ext_len = tl.where(last, tl.load(meta + 5) + EXT_ADD, 0)
    ext_row0 = tl.load(meta + 4).to(tl.int64) * E_CAP
    m_i, l_i, acc = _dense_segment(q, m_i, l_i, acc, ke_ptr, ve_ptr, ext_row0, ext_len, h, H, qk_scale, softcap,
                                   ROUND, DOT, BN, D, SOFTCAP)
    _finish_rows(m_i, l_i, acc, r.to(tl.int64) * HQ + h * GROUP, split, m_ptr, l_ptr, acc_ptr, out_ptr, lse_ptr,
                 tick_ptr + r * H + h, NUM_SPLITS, GROUP, D, SP, FUSED, HAS_LSE)


@triton.jit
def _finish_rows(m_i, l_i, acc, q_row0, split, m_ptr, l_ptr, acc_ptr, out_ptr, lse_ptr, tick_ptr, NUM_SPLITS,
                 GROUP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr, FUSED: tl.constexpr,
                 HAS_LSE: tl.constexpr):
    """Store one program's split state for its query rows q_row0 + [0, GROUP) (m_i etc. hold
    GP >= GROUP rows, the rest padding). FUSED: then take the (row, KV head)'s ticket; the
    program that takes the last one merges every split of those rows into the output
    (_merge_splits, as _combine_kernel does) and resets the ticket for the next launch. Its
    loads bypass L1 (.cg): other programs wrote the states."""
    d = tl.arange(0, D)
    gi = tl.arange(0, m_i.shape[0])
    keep = gi < GROUP
    q_rows = q_row0 + gi
    out_rows = q_rows * NUM_SPLITS + split
    tl.store(m_ptr + out_rows, m_i, mask=keep)
    tl.store(l_ptr + out_rows, l_i, mask=keep)
    tl.store(acc_ptr + (out_rows * D)[:, None] + d[None, :], acc, mask=keep[:, None])
    if FUSED:
        tl.debug_barrier()  # every thread's stores come before the ticket (released with it)
        if tl.atomic_add(tick_ptr, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
            for g in tl.static_range(GROUP):  # the query rows' merges are independent loads, unrolled
                _merge_splits(m_ptr, l_ptr, acc_ptr, out_ptr, lse_ptr, q_row0 + g, NUM_SPLITS, SP, D, HAS_LSE,
                              ".cg", m_ptr, 1, False)
            tl.atomic_xchg(tick_ptr, 0)


@triton.jit(do_not_specialize=["NUM_SPLITS", "HQ"])
def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, lse_ptr, sink_ptr, NUM_SPLITS, HQ,
                    SP: tl.constexpr, D: tl.constexpr, HAS_LSE: tl.constexpr, SINK: tl.constexpr = False):
    """Merge one (row, query head)'s split states (see _merge_splits)."""
    _merge_splits(m_ptr, l_ptr, acc_ptr, out_ptr, lse_ptr, tl.program_id(0).to(tl.int64), NUM_SPLITS, SP, D,
                  HAS_LSE, "", sink_ptr, HQ, SINK)


@triton.jit
def _merge_splits(m_ptr, l_ptr, acc_ptr, out_ptr, lse_ptr, rh, NUM_SPLITS, SP: tl.constexpr, D: tl.constexpr,
                  HAS_LSE: tl.constexpr, CACHE: tl.constexpr, sink_ptr, HQ, SINK: tl.constexpr):
    """(row, query head) rh's split states, all SP >= NUM_SPLITS in one load (CACHE: the
    loads' cache modifier), merged: out = sum_s w_s acc_s / sum_s w_s l_s. A row that saw
    no key at all gets zeros (and lse -inf). SINK: the query head's attention sink
    (``sink_ptr`` [HQ], natural-log units, rh = row * HQ + head) adds exp(sink) to the
    denominator, as SGLang's decode does."""
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    live = s < NUM_SPLITS
    m = tl.load(m_ptr + rh * NUM_SPLITS + s, mask=live, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(l_ptr + rh * NUM_SPLITS + s, mask=live, other=0.0, cache_modifier=CACHE)
    acc = tl.load(acc_ptr + ((rh * NUM_SPLITS + s) * D)[:, None] + d[None, :], mask=live[:, None], other=0.0,
                  cache_modifier=CACHE)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)
    total = tl.sum(w * l, 0)
    if SINK:  # in the scores' base-2 units, relative to the same maximum; not for a row that saw nothing
        gap = tl.load(sink_ptr + rh % HQ).to(tl.float32) * 1.4426950408889634 - m_max
        total += tl.exp2(tl.where(total > 0, gap, float("-inf")))
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + rh * D + d, out.to(out_ptr.dtype.element_ty))
    if HAS_LSE:
        lse = tl.where(total > 0, (m_max + tl.log2(tl.where(total > 0, total, 1.0))) / 1.4426950408889634,
                       float("-inf"))
        tl.store(lse_ptr + rh, lse)
