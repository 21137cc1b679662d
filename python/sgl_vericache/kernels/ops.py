"""Host side of the draft kernels: choose launch sizes and dtypes, launch, merge the splits.

    packed = pack(compressor, layers)            # one layer of E requests (packing.py)
    rows = packed.rows()                         # row r reads entry r (any map is allowed)
    out = decode_attention(packed, q, scale, rows, k_extra, v_extra, ext_add=step + 1)

q [R, H_q, D]; k_extra/v_extra [X, E_cap, H_kv, D], the round's provisional KV, of which row
r reads extras row ext_row[r], its first ext_base[r] + ext_add tokens (``PackedKV.rows``).
The result is [R, H_q, D] in q.dtype: what each row's compressor.attend(...) computes in
fp32, up to the summation order (and, for bf16 / fp16 entries on a GPU, the probabilities
rounded to that dtype before P @ V, as FlashAttention does).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from sgl_vericache.cpu.linear import weights_generation

from . import MAX_DRAFT_HEAD_DIM, draft_head_dim
from . import triton_decode as td
from . import triton_quest as tq
from .packing import ADDR_COLS, FMT_DENSE, FMT_FP8, FMT_INT8, FMT_KIVI, META_COLS, PackedKV, RowTable

assert td.ADDR_COLS == ADDR_COLS, "the kernels' address table columns differ from packing.ADDR_FIELDS"

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_SPLITS = 64
DEFAULT_BLOCK_N = 64
PAGE_SCORE_BLOCK = 64
LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2


def interpreting() -> bool:
    """Kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class LaunchConfig:
    """Tunables (None: chosen per call). Tests pin them to reach every code path."""

    num_splits: Optional[int] = None  # rounded up to a power of two
    block_n: Optional[int] = None  # None: the format's entry in MEASURED_LAUNCH
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    # int8 / fp8: multiply the exact codes and put the token scales on the scores and the
    # probabilities ([BN] products a block) instead of dequantizing every element
    fold: bool = True
    # KIVI codes: 0 join / reshape a row's bytes; 1 gathers each channel's byte: right at every
    # block size but 10-20x slower on an H200 (one byte load per channel), kept as the fallback
    unpack: int = 0
    waves: int = 2  # num_splits=None: enough splits for this many waves of programs over the SMs
    # quantized entries in fp16 / bf16 under a half query: decode the codes and dequantize in
    # fp16 and multiply in fp16 (a bf16 query scaled by a power of two into fp16's range),
    # instead of fp32 dequantization rounded to the entry dtype. None: MEASURED_HALF[format]
    half: Optional[bool] = None
    # compiled half products decode the codes with inline PTX (byte permutes, masks,
    # sub.f16x2, two fp16 lanes an instruction): 1 decodes codes as Triton lays them out; 2
    # reads int8 / fp8 / KIVI int4 codes as 32-bit words and decodes them where they are
    # loaded (KIVI int2: as 1). Offline at sm_90, 2 has fewer instructions a loop with the
    # venv's Triton 3.8 (kivi4 688 -> 559, int8 695 -> 613, fp8 472 -> 377) and more with
    # Triton 3.6 (kivi4 693 -> 710, int8 697 -> 710), where int8's was 8% slower than 1 on the
    # H200; 0 the Triton code the interpreter runs (5-12% slower than 1 on the H200)
    asm: int = 1
    # merge the splits in the decode kernel: the program that finishes a (row, KV head)'s last
    # split merges them (an atomic ticket per (row, KV head)), instead of a second kernel.
    # For small launches, where the merge's launch is a fixed cost (Llama-70B/TP8's dropper
    # rows); not yet timed on a GPU, so off unless asked (bench_kernels searches it)
    fused: bool = False
    # address an entry's rows in int32 from a pointer to its first row, set once a program,
    # instead of int64 arithmetic for every row of every block (offline at sm_90: the int8
    # main loop 841 -> 751 instructions, fp8 534 -> 492, the dense kernel's registers 96 -> 80).
    # Used where an entry's offsets fit (offsets32); a pool read through a token table and
    # Quest per query head keep int64. Not yet timed on a GPU: bench_kernels searches it off
    int32_offsets: bool = True
    # int8 entries: the query as two int8 terms a row (int8_query_terms: ~16 bits of it, once a
    # program) and the scores from int8 x int8 products on the integer tensor cores, so the
    # keys' codes are used as stored, with no decode (offline at sm_90: the int8 main loop 695
    # -> 559 instructions). Drafts change by the query's rounding (on SmolLM2 bench_compressors
    # saw no change in agreement or accepted lengths), never the output: verification reads
    # the full KV. Not yet timed on a GPU, so off unless asked (bench_kernels searches it);
    # other formats, and head dims outside 32..256, ignore it (int8_query_applies)
    int8_query: bool = False


# (block_n, num_warps, num_stages) per format, the fastest bench_kernels.py found on an H200
# at 32k x 8 for both Llama-3-8B and Llama-70B/TP8 heads (benchmark/results/gpu_h200/:
# edf012c for dense and Quest, 1348b4a and e399a85 for the quantizers)
MEASURED_LAUNCH = {FMT_DENSE: (32, 4, 2), FMT_KIVI: (32, 2, 3), FMT_INT8: (32, 2, 3), FMT_FP8: (32, 2, 3),
                   "quest": (64, 4, 2)}

# whether half products are the default per format (see LaunchConfig.half): on the H200 at
# 32k x 8 they took KIVI4 from 314 to 260 us (Llama-3-8B), int8 from 313 to 238 us, fp8
# from 45 to 37 us (Llama-70B/TP8; Llama-3-8B's fp8 half launch was not reached by the search)
MEASURED_HALF = {FMT_KIVI: True, FMT_INT8: True, FMT_FP8: True}


@functools.lru_cache(maxsize=64)
def launch_for(config: LaunchConfig, fmt) -> LaunchConfig:
    """``config`` with its unset sizes taken from MEASURED_LAUNCH[fmt] (cached: the drafter
    asks once per layer and draft step with the same few configs)."""
    block_n, warps, stages = MEASURED_LAUNCH.get(fmt, (DEFAULT_BLOCK_N, 4, 2))
    half = MEASURED_HALF.get(fmt, False) if config.half is None else config.half
    return dataclasses.replace(config, block_n=config.block_n or block_n, num_warps=config.num_warps or warps,
                               num_stages=config.num_stages or stages, half=half)


def dot_modes(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[int, int]:
    """(ROUND, DOT): dequantized values are rounded to the entry dtype (as materialize does);
    products run in that dtype when the query has it too (exact: the torch path multiplies
    the same rounded values in fp32, only the probabilities are rounded here), otherwise in
    fp32. The interpreter's bf16 matmul is wrong and its bf16 cast truncates (numpy has no
    bf16), so there bf16 values are rounded by hand and multiplied in fp32."""
    rnd = _DTYPE_CODE[kv_dtype]
    if interpreting() and rnd == 2:
        return 3, 0  # bf16 values rounded by hand, fp32 products
    return rnd, (rnd if q_dtype == kv_dtype else 0)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_splits(programs: int, longest: int, block_n: int, device: torch.device, waves: int = 2) -> int:
    """Enough programs for ``waves`` waves over the GPU, each with at least two key blocks."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = min(-(-waves * sms // max(programs, 1)), max(1, longest // (2 * block_n)), MAX_SPLITS)
    return _pow2(want)


def key_scale_mode(token_group: int, block_n: int) -> int:
    """How a block of block_n keys finds its per-channel KIVI scales (see _kivi_keys)."""
    if token_group % block_n == 0:
        return 1
    if block_n % token_group == 0 and token_group & (token_group - 1) == 0:
        return 2
    return 0


JOIN_MIN_BLOCK_N = 32


def join_block_n(config: LaunchConfig, packed: PackedKV, dot: int, device: torch.device, half: bool = False) -> int:
    """The block size a launch really uses. Compiled Triton (3.6, H200) gets the join /
    reshape unpacking of KIVI codes wrong at block_n 16 when the products run in fp16 / bf16
    (errors of 1.4-4 on six shapes that pass at 32 and 64, and gathered, ``unpack=1``, at
    every size: benchmark/results/gpu_h200/kernel_checks_1ced50f.log), so there it is raised
    to 32. int8 / fp8 codes read as words (``asm=2``, half products) are put in channel order
    by the same join / reshape and have not been compiled at 16 on a GPU: raised too. The
    interpreter computes both right and keeps the size asked for."""
    joins = ((packed.fmt == FMT_KIVI and dot != 0 and config.unpack == 0)
             or (packed.fmt in (FMT_INT8, FMT_FP8) and half and config.asm == 2))
    if joins and device.type == "cuda" and config.block_n < JOIN_MIN_BLOCK_N:
        return JOIN_MIN_BLOCK_N
    return config.block_n


def folds(config: LaunchConfig, packed: PackedKV, q_dtype: torch.dtype) -> bool:
    """int8 / fp8 scales go on scores and probabilities, except for fp32 queries over a
    half-precision entry: there the products are fp32 and must see the dequantized values
    rounded to the entry dtype, as materialize stores them."""
    if not config.fold or packed.fmt not in (FMT_INT8, FMT_FP8):
        return False
    return q_dtype == packed.dtype or packed.dtype == torch.float32


def halves(config: LaunchConfig, packed: PackedKV, q_dtype: torch.dtype) -> bool:
    """Half products (LaunchConfig.half) apply to KIVI, int8 and fp8 entries stored in fp16
    or bf16 under an fp16 or bf16 query. Values that dequantize beyond fp16's range
    (|x| > 65504) would overflow there: such a draft is wrong and verification rejects it."""
    half_types = (torch.float16, torch.bfloat16)
    return (bool(config.half) and packed.fmt in (FMT_KIVI, FMT_INT8, FMT_FP8) and packed.dtype in half_types
            and q_dtype in half_types)


def folded(config: LaunchConfig, packed: PackedKV, q_dtype: torch.dtype) -> bool:
    """Whether a launch multiplies int8 / fp8 codes as they are, their scales on scores and
    probabilities: ``folds``, or half products (which always do)."""
    config = launch_for(config, packed.fmt)
    return folds(config, packed, q_dtype) or (halves(config, packed, q_dtype) and packed.fmt != FMT_KIVI)


def int8_query_applies(config: LaunchConfig, packed: PackedKV, q_dtype: torch.dtype) -> bool:
    """Whether a launch takes its scores from the query's int8 terms (LaunchConfig.int8_query):
    an int8 entry with its scales folded and 32 <= head_dim <= 256 (the integer MMA's
    reduction is 32 deep; the int32 sums stay exact to 256)."""
    return (config.int8_query and packed.fmt == FMT_INT8 and 32 <= packed.head_dim <= 256
            and folded(config, packed, q_dtype))


def int8_query_terms(q: torch.Tensor) -> torch.Tensor:
    """The query as the int8_query kernels see it (torch twin of triton_decode._int8_query),
    in fp32: per row (last dim) of q, (254 hi + lo) * step, hi and lo int8 rounded half away
    from zero, 254 * step the row's largest |element| / 127. Reproducible on a CPU, so its
    effect on drafting can be measured there (bench_compressors --int8-query)."""
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True)
    unit = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    x = qf / unit
    hi = torch.trunc(torch.where(x >= 0, x + 0.5, x - 0.5))
    lo = torch.trunc(torch.where(x - hi >= 0, (x - hi) * 254.0 + 0.5, (x - hi) * 254.0 - 0.5))
    return (254.0 * hi + lo) * (unit / 254.0)


def int8_query_attention(compressor, layer, q: torch.Tensor, scale: float, k_extra: Optional[torch.Tensor] = None,
                         v_extra: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32,
                         softcap: Optional[float] = None) -> torch.Tensor:
    """What an int8_query launch drafts, in torch (the kernels' twin in kernel_checks, and
    bench_compressors' int8(int8_query) row): compressor.attend's attention, q [S, H_q, D],
    except that the entry's keys (``materialize``) meet int8_query_terms(q) and the
    provisional ones q itself; query i sees k_extra[: E - S + i + 1]. Computed in ``dtype``;
    the result in q.dtype (zeros where a query sees no key); scores soft-capped by ``softcap``."""
    k, v, _ = compressor.materialize(layer)
    num_q, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    num_extra = 0 if k_extra is None else k_extra.shape[0]
    if k.shape[0] + num_extra == 0:
        return torch.zeros_like(q)
    keys = torch.cat([k, k_extra]) if num_extra else k
    values = torch.cat([v, v_extra]) if num_extra else v
    keys, values = (x.to(dtype).repeat_interleave(group, 1) for x in (keys, values))
    n = k.shape[0]
    scores = torch.cat([torch.einsum("shd,nhd->hsn", int8_query_terms(q).to(dtype), keys[:n]),
                        torch.einsum("shd,nhd->hsn", q.to(dtype), keys[n:])], -1) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    seen = torch.arange(num_extra, device=q.device)[None, :] <= torch.arange(num_q, device=q.device)[:, None] + (
        num_extra - num_q)
    scores[:, :, n:] = scores[:, :, n:].masked_fill(~seen, float("-inf"))
    return torch.einsum("hsn,nhd->shd", torch.softmax(scores, -1), values).to(q.dtype)


def offsets32(config: LaunchConfig, packed: PackedKV, longest: int, block_n: int) -> bool:
    """Whether a launch addresses entries in int32 (LaunchConfig.int32_offsets): entries laid
    end to end or in place (not a pool read through a token table) whose element offsets,
    ``longest`` rows of H_kv heads and a block past them (masked rows compute theirs too),
    stay below 2^31."""
    rows = longest + block_n
    return config.int32_offsets and packed.indices is None and rows * packed.num_kv_heads * packed.head_dim < 2**31


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _extras(k_extra, v_extra, packed: PackedKV, ext_add: int):
    if k_extra is None:
        if ext_add:
            raise ValueError("ext_add > 0 without extras")
        dummy = torch.zeros(1, 1, packed.num_kv_heads, packed.head_dim, dtype=packed.dtype, device=packed.device)
        return dummy, dummy, 1
    assert k_extra.dim() == 4 and k_extra.shape == v_extra.shape, (k_extra.shape, v_extra.shape)
    return k_extra.contiguous(), v_extra.contiguous(), k_extra.shape[1]


def _check(packed: PackedKV, q: torch.Tensor, rows: RowTable) -> int:
    num_rows, num_q_heads, head_dim = q.shape
    if head_dim != packed.head_dim or num_q_heads % packed.num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit {packed.num_kv_heads} KV heads of dim {packed.head_dim}")
    if not draft_head_dim(head_dim):
        raise ValueError(f"the draft kernels need a power-of-two head_dim from 16 to {MAX_DRAFT_HEAD_DIM}, "
                         f"got {head_dim}")
    assert rows.meta.shape == (num_rows, META_COLS) and rows.meta.dtype == torch.int32, rows.meta.shape
    return num_q_heads // packed.num_kv_heads


def decode_attention(packed: PackedKV, q: torch.Tensor, scale: float, rows: RowTable,
                     k_extra: Optional[torch.Tensor] = None, v_extra: Optional[torch.Tensor] = None,
                     ext_add: int = 0, config: LaunchConfig = LaunchConfig(),
                     return_lse: bool = False, sinks: Optional[torch.Tensor] = None,
                     softcap: Optional[float] = None):
    """Draft attention of q over each row's entry (+ extras). See the module docstring.
    ``sinks`` [H_q]: the layer's attention sinks, added where the splits merge (so by the
    second kernel: a fused launch merges without them). ``softcap``: the layer's logit soft
    cap (Gemma 2, Grok: scores -> cap * tanh(score / cap), as the target's decode); None: none."""
    if packed.page_size:
        return quest_decode(packed, q, scale, rows, k_extra, v_extra, ext_add, config, return_lse, sinks=sinks,
                            softcap=softcap)
    group = _check(packed, q, rows)
    cap = check_softcap(softcap)
    config = launch_for(config, packed.fmt)
    if sinks is not None and config.fused:
        config = dataclasses.replace(config, fused=False)
    q = q.contiguous()
    num_rows, num_q_heads, head_dim = q.shape
    ke, ve, e_cap = _extras(k_extra, v_extra, packed, ext_add)
    longest = max((packed.main_len[e] for e in rows.entries), default=0)
    splits = config.num_splits or choose_splits(num_rows * packed.num_kv_heads, longest, config.block_n, q.device,
                                                config.waves)
    splits = _pow2(splits)
    rnd, dot = dot_modes(q.dtype, packed.dtype)
    m, l, acc = _partials(num_rows, num_q_heads, splits, head_dim, q.device)
    out, lse, tickets = _outputs(config, num_rows, packed.num_kv_heads, q, return_lse)
    k = packed.k
    half = halves(config, packed, q.dtype)
    block_n = join_block_n(config, packed, 1 if half else dot, q.device, half)
    kmode = key_scale_mode(packed.token_group, block_n)
    td._decode_split_kernel[(num_rows, packed.num_kv_heads, splits)](
        q, rows.meta, k, packed.v,
        _or(packed.k_scale, k), _or(packed.k_zero, k), _or(packed.v_scale, k), _or(packed.v_zero, k),
        _or(packed.k_recent, ke), _or(packed.v_recent, ve), ke, ve, _or(packed.indices, rows.meta),
        _or(packed.addresses, rows.meta), m, l, acc, _or(out, m), _or(lse, m), _or(tickets, rows.meta),
        scale * LOG2E, cap * LOG2E, packed.num_kv_heads, num_q_heads, e_cap, ext_add, splits,
        GROUP=group, GP=max(16, _pow2(group)), D=head_dim, BN=block_n,
        FMT=packed.fmt, BITS=packed.bits, QGROUP=packed.token_group, CGROUP=packed.channel_group,
        KMODE=kmode if kmode != 2 or config.unpack == 0 else 0,
        HEAD_SCALE=packed.head_scale, INDEXED=packed.indices is not None, ROUND=rnd, DOT=dot,
        FOLD=folded(config, packed, q.dtype), UNPACK=config.unpack, HALF=half,
        QK8=int8_query_applies(config, packed, q.dtype),
        MROUND=1 if half else rnd, MDOT=1 if half else dot, Q_BF16=q.dtype == torch.bfloat16,
        ASM=config.asm if half and q.device.type == "cuda" and not interpreting() else 0,
        FUSED=config.fused, HAS_LSE=return_lse, SP=max(2, splits) if config.fused else 2,
        OFF32=offsets32(config, packed, longest, block_n), ADDR=packed.addresses is not None, SOFTCAP=cap > 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if config.fused:
        return (out, lse) if return_lse else out
    return _combine(m, l, acc, q.dtype, return_lse, sinks)


def page_scores(packed: PackedKV, q: torch.Tensor, rows: RowTable) -> torch.Tensor:
    """What Quest ranks pages by: [R, H_c, P] fp32 (P: the most pages of any row's entry),
    -inf past a row's pages. H_c = H_kv, the largest of the group's bounds
    (``page_per_kv_head``), else H_q, each query head's upper bound of q.k."""
    group = _check(packed, q, rows)
    num_rows, num_q_heads, head_dim = q.shape
    heads = packed.num_kv_heads if packed.page_per_kv_head else num_q_heads
    row_pages = max((-(-packed.main_len[e] // packed.page_size) for e in rows.entries), default=1)
    out = torch.full((num_rows, heads, max(row_pages, 1)), float("-inf"), dtype=torch.float32, device=q.device)
    grid = (num_rows, heads, -(-max(row_pages, 1) // PAGE_SCORE_BLOCK))
    tq._page_scores_kernel[grid](q.contiguous(), rows.meta, packed.page_min, packed.page_max,
                                 _or(packed.addresses, rows.meta), out, packed.num_kv_heads, num_q_heads, heads,
                                 out.shape[2], packed.page_size, GROUP=group, PER_KV=packed.page_per_kv_head,
                                 D=head_dim, BP=PAGE_SCORE_BLOCK, ADDR=packed.addresses is not None)
    return out


def select_pages(scores: torch.Tensor, pages_read: int) -> torch.Tensor:
    """[R, H_c, pages_read] int32: the best pages first; ties go to the earlier page, as
    QuestCompressor.selected_tokens breaks them."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., : max(pages_read, 1)].to(torch.int32).contiguous()


def quest_decode(packed: PackedKV, q: torch.Tensor, scale: float, rows: RowTable,
                 k_extra=None, v_extra=None, ext_add: int = 0, config: LaunchConfig = LaunchConfig(),
                 return_lse: bool = False, selection: Optional[torch.Tensor] = None,
                 sinks: Optional[torch.Tensor] = None, softcap: Optional[float] = None):
    """Quest: score every page of each row's entry, keep each choosing head's top pages_read
    pages, attend over those pages (+ extras). ``selection`` [R, H_c, K] skips the scoring
    (a soft cap keeps the scores' order: it does not change the choice); ``sinks`` and
    ``softcap`` as decode_attention's."""
    group = _check(packed, q, rows)
    cap = check_softcap(softcap)
    per_kv = packed.page_per_kv_head
    config = launch_for(config, FMT_DENSE if per_kv else "quest")
    if sinks is not None and config.fused:
        config = dataclasses.replace(config, fused=False)
    q = q.contiguous()
    num_rows, num_q_heads, head_dim = q.shape
    if selection is None:
        scores = page_scores(packed, q, rows)
        selection = select_pages(scores, max((packed.pages_read[e] for e in rows.entries), default=1))
    ke, ve, e_cap = _extras(k_extra, v_extra, packed, ext_add)
    longest = max((packed.pages_read[e] for e in rows.entries), default=0) * packed.page_size
    heads = packed.num_kv_heads if per_kv else num_q_heads
    splits = _pow2(config.num_splits or choose_splits(num_rows * heads, longest, config.block_n, q.device,
                                                      config.waves))
    rnd, dot = dot_modes(q.dtype, packed.dtype)
    m, l, acc = _partials(num_rows, num_q_heads, splits, head_dim, q.device)
    head = (q, rows.meta, packed.k, packed.v, selection, ke, ve, m, l, acc, _or(packed.addresses, rows.meta))
    addr = packed.addresses is not None
    tail = (scale * LOG2E, cap * LOG2E, packed.num_kv_heads, num_q_heads, e_cap, ext_add, selection.shape[2])
    if per_kv:
        entry_rows = max((packed.main_len[e] for e in rows.entries), default=0)
        out, lse, tickets = _outputs(config, num_rows, heads, q, return_lse)
        tq._quest_group_kernel[(num_rows, heads, splits)](
            *head, _or(out, m), _or(lse, m), _or(tickets, rows.meta), *tail, splits, GROUP=group,
            GP=max(16, _pow2(group)), D=head_dim, BN=config.block_n, PAGE=packed.page_size, ROUND=rnd, DOT=dot,
            FUSED=config.fused, HAS_LSE=return_lse, SP=max(2, splits) if config.fused else 2,
            OFF32=offsets32(config, packed, entry_rows, config.block_n), ADDR=addr, SOFTCAP=cap > 0,
            num_warps=config.num_warps, num_stages=config.num_stages)
        if config.fused:
            return (out, lse) if return_lse else out
    else:  # one program per query head: merged by the second kernel (config.fused does not apply)
        tq._quest_split_kernel[(num_rows, heads, splits)](
            *head, *tail, packed.page_size, splits, GROUP=group, D=head_dim, BN=config.block_n, ROUND=rnd,
            ADDR=addr, SOFTCAP=cap > 0, num_warps=config.num_warps, num_stages=config.num_stages)
    return _combine(m, l, acc, q.dtype, return_lse, sinks)


def _or(t: Optional[torch.Tensor], fallback: torch.Tensor) -> torch.Tensor:
    return fallback if t is None else t


# device -> int32 zeros: the fused merge's tickets, reset by the kernels. One buffer a device:
# fused launches must not run concurrently on two streams of one device (the drafter's run on one)
_TICKETS: dict = {}
# the buffers a growth replaced, kept alive: a CUDA graph captured over one still replays on it
_RETIRED_TICKETS: list = []


def _outputs(config: LaunchConfig, num_rows: int, num_kv_heads: int, q: torch.Tensor, return_lse: bool):
    """(out, lse, tickets) a fused launch writes into; (None, None, None) otherwise. The
    tickets are kept per device (zero between launches: the merging program resets its own),
    grown outside a CUDA-graph capture only."""
    if not config.fused:
        return None, None, None
    _, num_q_heads, head_dim = q.shape
    out = torch.empty(num_rows, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_rows, num_q_heads, dtype=torch.float32, device=q.device) if return_lse else None
    key, need = str(q.device), num_rows * num_kv_heads
    tickets = _TICKETS.get(key)
    if tickets is None or tickets.numel() < need:
        if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"fused split merge: {need} tickets needed while a CUDA graph is captured; "
                               "run the launch once before capturing it")
        if tickets is not None:
            _RETIRED_TICKETS.append(tickets)
        tickets = _TICKETS[key] = torch.zeros(max(need, 2 * tickets.numel() if tickets is not None else 4096),
                                              dtype=torch.int32, device=q.device)
    return out, lse, tickets


def _partials(num_rows, num_q_heads, splits, head_dim, device):
    m = torch.empty(num_rows, num_q_heads, splits, dtype=torch.float32, device=device)
    return m, torch.empty_like(m), torch.empty(num_rows, num_q_heads, splits, head_dim, dtype=torch.float32,
                                               device=device)


def warm_merges(num_q_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                sinks: bool = False) -> None:
    """Launch the split merge once at every split count a launch may choose (1 .. MAX_SPLITS:
    its SP is a compile-time size), so none compiles inside a draft round (spec/warm_up.py);
    ``sinks``: its variant adding a model's attention sinks."""
    splits = 1
    sink = torch.zeros(num_q_heads, device=device) if sinks else None
    while splits <= MAX_SPLITS:
        m, l, acc = (t.zero_() for t in _partials(1, num_q_heads, splits, head_dim, device))
        _combine(m, l, acc, dtype, False, sink)
        splits *= 2


def _combine(m, l, acc, dtype, return_lse, sinks: Optional[torch.Tensor] = None):
    """Merge the split states; ``sinks`` [H_q]: attention sinks, one exp(sink) more in each
    query head's denominator (None: none)."""
    num_rows, num_q_heads, splits, head_dim = acc.shape
    out = torch.empty(num_rows, num_q_heads, head_dim, dtype=dtype, device=acc.device)
    lse = torch.empty(num_rows, num_q_heads, dtype=torch.float32, device=acc.device) if return_lse else m
    if sinks is not None:
        sinks = check_sinks(sinks, num_q_heads, acc.device)
    td._combine_kernel[(num_rows * num_q_heads,)](m, l, acc, out, lse, m if sinks is None else sinks, splits,
                                                  num_q_heads, SP=max(2, splits), D=head_dim, HAS_LSE=return_lse,
                                                  SINK=sinks is not None)
    return (out, lse) if return_lse else out


# (address, device) of a model's sinks -> (the sinks, their version, the weights' generation, their fp32
# copy): see check_sinks
_SINKS_FP32: dict = {}
_SINKS_FP32_MAX = 1024  # layers' worth; past it the cache starts over


def check_sinks(sinks: torch.Tensor, num_q_heads: int, device) -> torch.Tensor:
    """A layer's attention sinks as the merge reads them: [H_q] fp32 (a model holds them in
    bf16 or fp32: one kernel variant for both), contiguous, on ``device``. A conversion is
    kept while the sinks are unchanged: the same tensor at the same version and weights
    generation (SGLang's loaders write ``param.data``, which leaves the version as it was, and
    its weight updates bump the generation: ``sglang/linear.install_weight_update_hook``). So
    a bf16 model (gpt-oss, Granite-SWA on most backends) pays one cast a layer, not one per
    merge (every layer of every draft step and verify)."""
    if sinks.dim() != 1 or sinks.shape[0] != num_q_heads:
        raise ValueError(f"attention sinks of shape {tuple(sinks.shape)}: accepted: [{num_q_heads}], one a query head")
    device = torch.device(device)
    if sinks.dtype == torch.float32 and sinks.device == device and sinks.is_contiguous():
        return sinks
    key = (sinks.data_ptr(), str(device))
    held = _SINKS_FP32.get(key)
    state = (sinks._version, weights_generation())
    if held is not None and held[0] is sinks and held[1] == state:
        return held[2]
    converted = sinks.to(device=device, dtype=torch.float32).contiguous()
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return converted  # a graph's own memory: not kept past its capture
    if len(_SINKS_FP32) >= _SINKS_FP32_MAX:
        _SINKS_FP32.clear()
    _SINKS_FP32[key] = (sinks, state, converted)  # held: its memory cannot be reused meanwhile
    return converted


def check_softcap(softcap: Optional[float]) -> float:
    """A layer's logit soft cap as the kernels take it: a positive finite float, or 0.0 for
    none (None or 0, as SGLang's layers say "no cap")."""
    if not softcap:
        return 0.0
    cap = float(softcap)
    if not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"logit soft cap {softcap!r}: accepted: a positive finite number, or None / 0 for none")
    return cap
