"""The draft attention kernels against their torch twins, as a plain script (no pytest needed,
so the bare GPU machine runs it too):

    TRITON_INTERPRET=1 python test/kernel_checks.py --device cpu      # CI, Triton's interpreter
    python test/kernel_checks.py --device cuda                        # compiled, on a GPU
    python test/kernel_checks.py --device cpu --only kivi4 quest      # cases whose name has a word
    python test/kernel_checks.py --device cpu --family quantizers     # one family (see FAMILIES)
    python test/kernel_checks.py --device cuda --jobs 8               # compiles in 8 processes

The twin of each kernel is the compressor's own ``attend`` (fp32 attention over
``materialize``, per request, with the causal provisional KV); test_kernels.py runs this
file in a subprocess because TRITON_INTERPRET must be set before anything imports triton.
Every case prints one line (max abs error, tolerance, seconds); exit status 1 if any fails.

Tolerances (max |kernel - reference| <= atol + rtol * |reference|): fp32 queries 1e-4 / 1e-4
(the same products, summed in another order); bf16 2e-2 / 2e-2 and fp16 4e-3 / 4e-3 (the
output's own rounding is 4e-3 / 5e-4, and the kernel's P @ V rounds probabilities to the
entry dtype on a GPU; the interpreter rounds bf16 by truncation, a further ulp).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sgl_vericache.kernels import ops  # noqa: E402
from sgl_vericache.kernels.codes import _kivi4_words_f16  # noqa: E402
from sgl_vericache.kernels.packing import pack, paged_pool  # noqa: E402
from sgl_vericache.mem_cache.compress import causal_attention, get_compressor  # noqa: E402

from kernel_fixtures import KIVI, SMALL, TOL, Case, Shape, _close, _gen, _kv, _line, run_sharded  # noqa: E402,F401
from kernel_store_checks import (check_mixed_packing, check_recording_sees_the_keys_running_does,  # noqa: E402
                                 check_store_rounds, check_warm_up, check_window_rounds,
                                 check_window_warm_up)
from kernel_verify_checks import verify_cases  # noqa: E402

def _entries(method, options, shape: Shape, device, seed=0):
    """(compressor, one entry per request): compress most of each prompt, append the rest
    (the drafter's path), on ``device``."""
    comp = get_compressor(method, 4.0, **options)
    layers = []
    for i, n in enumerate(shape.lengths):
        k, v = _kv(n, shape, seed + i)
        queries = torch.randn(min(n, 8), shape.kv_heads * shape.group, shape.head_dim, generator=_gen(seed + 50 + i))
        head = max(0, n - 3)
        layer = comp.compress(k[:head].to(device), v[:head].to(device),
                              queries[: min(head, 8)].to(shape.dtype).to(device) if comp.needs_queries else None)
        layers.append(comp.append(layer, k[head:].to(device), v[head:].to(device)))
    return comp, layers


def check_method(method: str, options: dict, shape: Shape, config: ops.LaunchConfig, device,
                 extras: int = 4, seed: int = 0, in_place: bool = True, softcap: float | None = None) -> float:
    """A ragged batch, one query row per request; row r sees its first 1 + r % extras
    provisional tokens. Each row against its compressor's attend. The entries are read in
    place (the drafter's way), or, ``in_place=False``, copied end to end. With ``softcap``,
    a logit soft cap on both (which must move the outputs: else both could ignore it alike)."""
    comp, layers = _entries(method, options, shape, device, seed)
    rows_n, hq, d = len(layers), shape.kv_heads * shape.group, shape.head_dim
    q_dtype = shape.q_dtype or shape.dtype
    q = (torch.randn(rows_n, hq, d, generator=_gen(seed + 100)) * shape.q_gain).to(q_dtype).to(device)
    k_ext, v_ext = (torch.randn(rows_n, extras, shape.kv_heads, d, generator=_gen(seed + s)).to(shape.dtype).to(device)
                    for s in (200, 201))
    ext_base = [r % extras for r in range(rows_n)]
    packed = pack(comp, layers, in_place=in_place)
    assert (packed.addresses is not None) == (in_place and len(layers) > 1), "in place: an address table"
    rows = packed.rows(ext_base=ext_base)
    scale = 1 / (math.sqrt(d) * shape.q_gain)
    out = ops.decode_attention(packed, q, scale, rows, k_ext, v_ext, ext_add=1, config=config, softcap=softcap)
    twin = _int8_query_twin if ops.int8_query_applies(config, packed, q_dtype) else comp.attend.__func__

    def reference(cap):
        return torch.cat([twin(comp, layers[r], q[r : r + 1], scale, k_ext[r, : ext_base[r] + 1],
                               v_ext[r, : ext_base[r] + 1], softcap=cap) for r in range(rows_n)])

    ref = reference(softcap)
    if softcap:
        moved = float((reference(None).float() - ref.float()).abs().max())
        assert moved > 0.05, f"{method}: the soft cap {softcap} moved the outputs by only {moved}"
    if config.fused:  # the merging programs reset their tickets: a second launch merges the same way
        _check_tickets_reset()
        again = ops.decode_attention(packed, q, scale, rows, k_ext, v_ext, ext_add=1, config=config, softcap=softcap)
        assert torch.equal(again, out), f"{method}: a second fused launch differs from the first"
        _check_tickets_reset()
    return _close(out, ref, q_dtype, f"{method} {options} {shape}")


def _int8_query_twin(comp, layer, q, scale, k_extra, v_extra, softcap=None) -> torch.Tensor:
    """What an int8_query launch computes (ops.int8_query_attention), in float64."""
    return ops.int8_query_attention(comp, layer, q, scale, k_extra, v_extra, dtype=torch.float64, softcap=softcap)


def check_int8_query_discriminates(device, head_dim: int = 64) -> float:
    """The int8_query kernels really use the query's int8 terms for the entry's keys, and q
    itself for the provisional ones: a query whose terms differ from it by a lot relative to
    the scores' spread (one channel at 64, every key's copy of it the same, 4.0, so it adds
    the same to every score; the other channels within two of the terms' steps), so the two
    twins (query as terms, query as is) differ by 0.5-1, and each launch (int8_query on /
    off) must match its own twin within 2e-2 (fp32 sums of scores near 4e4: ~7e-3 measured)
    and miss the other's by 10x that."""
    g = _gen(31)
    lengths, hq, kv_heads, d = (40, 23), 4, 2, head_dim
    comp = get_compressor("int8", 4.0)
    layers = []
    for n in lengths:  # channel 0 is every token's largest: code 127 and the same scale for all
        others = torch.randn(n, kv_heads, d - 1, generator=g).clamp(-3.9, 3.9)
        k = torch.cat([torch.full((n, kv_heads, 1), 4.0), others], -1)
        layers.append(comp.compress(k.to(device), torch.randn(n, kv_heads, d, generator=g).to(device)))
    step = 64.0 / 127 / 254
    q = torch.cat([torch.full((len(lengths), hq, 1), 64.0),
                   (torch.rand(len(lengths), hq, d - 1, generator=g) * 4 - 2) * step], -1).to(device)
    k_ext = torch.cat([torch.full((len(lengths), 2, kv_heads, 1), 4.0),
                       torch.randn(len(lengths), 2, kv_heads, d - 1, generator=g)], -1).to(device)
    v_ext = torch.randn(len(lengths), 2, kv_heads, d, generator=g).to(device)
    packed = pack(comp, layers, in_place=True)
    rows = packed.rows(ext_base=[0, 1])
    scale = 0.3 / step  # the varying part of a score, and the terms' error in it, ~ O(1)
    worst = 0.0
    for as_terms in (True, False):
        config = ops.LaunchConfig(block_n=16, int8_query=as_terms)
        assert ops.int8_query_applies(config, packed, q.dtype) == as_terms
        out = ops.decode_attention(packed, q, scale, rows, k_ext, v_ext, ext_add=1, config=config).double().cpu()
        twins = {}
        for name, twin in (("terms", _int8_query_twin), ("exact", comp.attend.__func__)):
            twins[name] = torch.cat([twin(comp, layers[r], q[r : r + 1], scale, k_ext[r, : r + 1], v_ext[r, : r + 1])
                                     for r in range(len(lengths))]).double().cpu()
        own, other = (twins["terms"], twins["exact"]) if as_terms else (twins["exact"], twins["terms"])
        err, miss = float((out - own).abs().max()), float((out - other).abs().max())
        assert err <= 2e-2 and miss >= 0.2, f"int8_query={as_terms}: {err:.3g} from its twin, {miss:.3g} from the other"
        worst = max(worst, err)
    return worst


def _check_tickets_reset() -> None:
    left = {key: int(t.count_nonzero()) for key, t in ops._TICKETS.items()}
    for t in ops._TICKETS.values():
        t.zero_()  # so one failure does not fail the cases after it
    assert not any(left.values()), f"fused merge left tickets set: {left}"


def check_tokens(method: str, options: dict, shape: Shape, device, steps: int = 5) -> float:
    """Teacher forcing (the store's attend_tokens): S rows of ONE entry, row i sees extras
    [:i + 1], against one causal attend over all S queries."""
    comp, layers = _entries(method, options, shape, device)
    hq, d = shape.kv_heads * shape.group, shape.head_dim
    q = torch.randn(steps, hq, d, generator=_gen(7)).to(shape.dtype).to(device)
    k_ext, v_ext = (torch.randn(1, steps, shape.kv_heads, d, generator=_gen(s)).to(shape.dtype).to(device)
                    for s in (8, 9))
    packed = pack(comp, layers[:1])
    rows = packed.rows(row_entry=[0] * steps, ext_row=[0] * steps, ext_base=list(range(steps)))
    out = ops.decode_attention(packed, q, 0.125, rows, k_ext, v_ext, ext_add=1, config=SMALL)
    ref = comp.attend(layers[0], q, 0.125, k_ext[0], v_ext[0])
    return _close(out, ref, shape.dtype, f"{method} teacher-forced")


def check_quest_selection(shape: Shape, device, page_size: int = 8, heads: str = "kv", in_place=True) -> float:
    """Quest's page scores (per KV head: the group's largest bound) and choice equal the
    torch path's."""
    comp, layers = _entries("quest", {"page_size": page_size, "heads": heads}, shape, device)
    hq, d = shape.kv_heads * shape.group, shape.head_dim
    per_kv = heads == "kv"
    q = torch.randn(len(layers), hq, d, generator=_gen(11)).to(shape.dtype).to(device)
    packed = pack(comp, layers, in_place=in_place)
    rows = packed.rows()
    scores = ops.page_scores(packed, q, rows)
    err = 0.0
    for r, layer in enumerate(layers):
        ref = comp.choice_scores(layer, q[r : r + 1])[0]  # [H_c, P]
        err = max(err, _close(scores[r, :, : ref.shape[1]], ref, torch.float32, f"quest bounds row {r}"))
        assert bool(torch.isinf(scores[r, :, ref.shape[1]:]).all()), "pages past a row's entry must score -inf"
        chosen = ops.select_pages(scores[r : r + 1], comp.pages_read(layer.num_tokens))[0].long()
        tokens = torch.zeros(hq, layer.num_tokens, dtype=torch.bool, device=device)
        assert chosen.shape[0] == (shape.kv_heads if per_kv else hq), chosen.shape
        for h in range(hq):
            for page in chosen[h // shape.group if per_kv else h].tolist():
                tokens[h, page * page_size : (page + 1) * page_size] = True
        want = comp.selected_tokens(layer, q[r : r + 1])[:, 0]
        assert torch.equal(tokens, want), f"quest row {r}: chosen pages differ from the torch path"
    return err


def check_paged_pool(shape: Shape, device) -> float:
    """The full-KV baseline: a Triton decode over SGLang's layout (a pool of token slots and
    a token table), scattered slots, against SDPA over each request's gathered K/V."""
    total = sum(shape.lengths)
    slots = torch.randperm(total + 17, generator=_gen(3))[:total].to(device)
    k_pool, v_pool = (t.to(device) for t in _kv(total + 17, shape, 4))
    packed = paged_pool(k_pool, v_pool, slots.to(torch.int32), shape.lengths)
    hq = shape.kv_heads * shape.group
    q = torch.randn(len(shape.lengths), hq, shape.head_dim, generator=_gen(5)).to(shape.dtype).to(device)
    out = ops.decode_attention(packed, q, 0.1, packed.rows(), config=SMALL)
    refs, start = [], 0
    for r, n in enumerate(shape.lengths):
        idx = slots[start : start + n]
        refs.append(causal_attention(q[r : r + 1], k_pool[idx], v_pool[idx], 0.1))
        start += n
    return _close(out, torch.cat(refs), shape.dtype, "paged full-KV pool")


def check_empty_and_lse(device, config: ops.LaunchConfig = None) -> float:
    """A row with no keys at all returns zeros (as causal_attention does); the log-sum-exp
    output (for merging with another kernel's state) equals torch's."""
    config = config or SMALL
    shape = Shape((0, 21), kv_heads=1, group=2)
    comp, layers = _entries("int8", {}, shape, device)
    layers[0] = None  # a request with no verified KV yet
    q = torch.randn(2, 2, 64, generator=_gen(12)).to(device)
    packed = pack(comp, layers, in_place=True)
    out, lse = ops.decode_attention(packed, q, 0.125, packed.rows(), config=config, return_lse=True)
    assert bool((out[0] == 0).all()) and bool(torch.isinf(lse[0]).all()), "an empty row must give zeros, lse -inf"
    k, v, _ = comp.materialize(layers[1])
    logits = torch.einsum("hd,nhd->hn", q[1].float(), k.float().repeat_interleave(2, 1)) * 0.125
    err = _close(lse[1], torch.logsumexp(logits, -1), torch.float32, "lse")
    return max(err, _close(out[1:], comp.attend(layers[1], q[1:], 0.125), torch.float32, "int8 row"))


@triton.jit
def _words_kernel(data_ptr, out_ptr, n, H, BN: tl.constexpr, D: tl.constexpr, PTX: tl.constexpr):
    tok = tl.program_id(0) * BN + tl.arange(0, BN)
    h = tl.program_id(1)
    valid = tok < n
    x = _kivi4_words_f16(data_ptr, tok.to(tl.int64), h, H, valid, BN, D, PTX)
    d = tl.arange(0, D)
    tl.store(out_ptr + ((tok * H + h) * D)[:, None] + d[None, :], x, mask=valid[:, None])


def check_kivi4_words(device, ptx: bool) -> float:
    """codes._kivi4_words_f16 (KIVI int4 read as 32-bit words, LaunchConfig.asm=2) in a
    kernel of its own against the bytes unpacked in torch: the words' addressing, masked
    rows and channel order (the join tree), with the Triton decode (the interpreter) or
    the inline PTX (compiled); test_kernel_ptx.py checks the PTX itself on every byte."""
    err = 0.0
    for n, heads, dim in ((37, 2, 64), (16, 3, 128)):
        data = torch.randint(0, 256, (n, heads, dim // 2), generator=_gen(n), dtype=torch.int32).to(torch.uint8)
        want = torch.stack([data & 15, data >> 4], -1).reshape(n, heads, dim).to(torch.float16)
        out = torch.full((n, heads, dim), -1.0, dtype=torch.float16, device=device)
        _words_kernel[(-(-n // 16), heads)](data.to(device), out, n, heads, BN=16, D=dim, PTX=ptx)
        err = max(err, _close(out, want, torch.float32, f"kivi4 words n={n} H={heads} D={dim}"))
    return err


# ---------------------------------------------------------------- the case list

QUANTIZERS = ("kivi4", "kivi2", "int8", "fp8")
FAMILIES = ("quantizers", "droppers", "layouts", "store", "verify", "large")


def _label(method, options, shape: Shape, splits) -> str:
    label = (f"{method}{'-' + str(options.get('scale')) if method == 'fp8' else ''} T={list(shape.lengths)} "
             f"gqa={shape.group} d={shape.head_dim} {str(shape.dtype)[6:]}"
             f"{' q=' + str(shape.q_dtype)[6:] if shape.q_dtype else ''}"
             f"{f' q*{shape.q_gain:g}' if shape.q_gain != 1 else ''} splits={splits}")
    if method.startswith("kivi"):
        label += f" G={options['group_size']} R={options['residual_length']}"
    if method == "quest":
        label += f" heads={options.get('heads', 'kv')}"
    return label


def _method_case(method, options, shape: Shape, splits, family=None, interpret=True, in_place=True,
                 softcap=None, **launch) -> Case:
    cfg = ops.LaunchConfig(num_splits=splits, **{"block_n": 16, **launch})
    family = family or ("quantizers" if method in QUANTIZERS else "droppers")
    label = _label(method, options, shape, splits) + "".join(f" {k}={v}" for k, v in launch.items())
    label += ("" if in_place else " copied") + (f" softcap={softcap}" if softcap else "")
    return Case(label, lambda dev, a=(method, options, shape, cfg): check_method(*a, dev, in_place=in_place,
                                                                                 softcap=softcap),
                family=family, interpret=interpret, tags=(method,) + (("softcap",) if softcap else ()))


def _launch_variants() -> list[Case]:
    """The launch options off their defaults: KIVI codes gathered per channel (unpack=1),
    int8 / fp8 dequantized per element (fold=False); and, compiled only, the KIVI shapes
    with half-precision entries that Triton got wrong at block_n 16 (asked for 16, run at 32)."""
    b16, f16 = torch.bfloat16, torch.float16
    cases = [
        _method_case("kivi4", KIVI, Shape((37, 70, 5)), 2, unpack=1),  # group 8: key scales per token
        _method_case("kivi4", {"group_size": 16, "residual_length": 8}, Shape((40, 33), dtype=b16), 1, unpack=1),
        _method_case("kivi2", {"group_size": 32, "residual_length": 0}, Shape((70, 9), head_dim=128, dtype=f16), 2,
                     unpack=1),
        _method_case("int8", {}, Shape((33, 81, 2), group=8, kv_heads=1, dtype=b16), 2, fold=False),
        _method_case("fp8", {"scale": "token"}, Shape((29, 66, 3), head_dim=128, dtype=f16), 1, fold=False),
    ]
    cases += _half_product_cases()
    # the splits merged by the decode kernel itself (LaunchConfig.fused): dense, quantized and
    # Quest rows, one split and several, GQA 1 / 3 / 8; each launched twice (tickets reset)
    cases += [_method_case(*row, fused=True) for row in (
        ("snapkv", {"window_size": 4, "min_budget": 8}, Shape((90, 41, 7), group=8, kv_heads=1), 4),
        ("streamingllm", {"min_budget": 8}, Shape((40, 9), group=1, dtype=b16), 1),
        ("int8", {}, Shape((50, 17), dtype=b16), 2),
        ("kivi4", KIVI, Shape((37, 70, 5)), 2),
        ("quest", {"page_size": 8}, Shape((83, 30, 9)), 2),
    )]
    cases += _int8_query_cases()
    # a logit soft cap (Gemma 2, Grok) on the scores of every path that computes them: KIVI
    # dequantized, int8 folded in half products, fp8, dense rows, Quest per KV head and per
    # query head, the fused merge, the int8 query terms
    cases += [_method_case(*row, softcap=1.5, **launch) for row, launch in (
        (("kivi4", KIVI, Shape((37, 70, 5)), 2), {}),
        (("int8", {}, Shape((33, 81, 2), group=8, kv_heads=1, dtype=b16), 2), {}),
        (("fp8", {"scale": "token"}, Shape((29, 66, 3), head_dim=128, dtype=f16), 1), {}),
        (("streamingllm", {"min_budget": 8}, Shape((90, 23, 7)), 2), {}),
        (("quest", {"page_size": 8}, Shape((83, 30, 9)), 2), {}),
        (("quest", {"page_size": 8, "heads": "query"}, Shape((83, 30, 9)), 2), {}),
        (("snapkv", {"window_size": 4, "min_budget": 8}, Shape((90, 41, 7), group=8, kv_heads=1), 4), {"fused": True}),
        (("int8", {}, Shape((50, 17), head_dim=32), 1), {"int8_query": True}),
    )]
    # how several entries are addressed: copied end to end (pack's default; the drafter reads
    # them in place), with int32 offsets from each entry's start and with int64 ones (also in
    # place): every format and Quest both ways
    addressing = [
        ("kivi4", KIVI, Shape((37, 70, 5), dtype=b16), 2),
        ("kivi2", {"group_size": 16, "residual_length": 0}, Shape((48, 96), group=8, kv_heads=1), 4),
        ("int8", {}, Shape((33, 81, 2), group=8, kv_heads=1, dtype=b16), 2),
        ("fp8", {"scale": "token"}, Shape((29, 66, 3), head_dim=128, dtype=f16), 1),
        ("h2o", {"min_budget": 8}, Shape((77, 30), dtype=b16), 2),
        ("quest", {"page_size": 8}, Shape((83, 30, 9)), 2),
        ("quest", {"page_size": 8, "heads": "query"}, Shape((83, 30, 9)), 2),
    ]
    cases += [_method_case(*row, in_place=False) for row in addressing]
    cases += [_method_case(*row, in_place=False, int32_offsets=False) for row in addressing]
    cases += [_method_case(*row, int32_offsets=False) for row in addressing[:-1]]  # per query head: int64 anyway
    half_kivi = [
        ("kivi2", {"group_size": 32, "residual_length": 16}, Shape((100, 49), head_dim=128, dtype=b16), 1),
        ("kivi4", KIVI, Shape((37, 70, 5), dtype=f16), 2),
        ("kivi4", {"group_size": 16, "residual_length": 8}, Shape((27, 15, 90), head_dim=128, dtype=b16), 4),
        ("kivi4", {"group_size": 32, "residual_length": 32}, Shape((96, 82, 11), group=8, kv_heads=1, dtype=f16), 2),
        ("kivi2", {"group_size": 8, "residual_length": 0}, Shape((1, 112, 84), group=8, kv_heads=1, dtype=b16), 1),
        ("kivi2", {"group_size": 16, "residual_length": 16}, Shape((98, 97, 95), group=1, head_dim=128, dtype=f16), 4),
    ]
    # the first H200 run failed all six with join / reshape at block_n 16; the second passed
    # them at 32 and 64 and, gathered, at 16, 32 and 64 (kernel_checks_1ced50f.log): the
    # launcher now raises KIVI's half-precision block size to 32 on CUDA (ops.join_block_n)
    for unpack, block_n in ((0, 16), (0, 32), (1, 16)):
        cases += [_method_case(*row, family="large", interpret=False, unpack=unpack, block_n=block_n)
                  for row in half_kivi]
    return cases


def _half_product_cases() -> list[Case]:
    """Half products (fp16 decoding and products): every quantizer, both half dtypes, the
    three KIVI key-scale paths (group 8 / 16 / 32 at block 16), gathered codes, and bf16
    queries far outside fp16's range either way (the power-of-two rescaling); the fp32
    dequantization they replace; and, compiled, each inline-PTX mode."""
    b16, f16 = torch.bfloat16, torch.float16
    cases = [
        _method_case("kivi4", KIVI, Shape((37, 70, 5), dtype=b16), 2, half=True),
        _method_case("kivi4", {"group_size": 16, "residual_length": 8}, Shape((40, 33), dtype=b16), 1, half=True),
        _method_case("kivi2", {"group_size": 32, "residual_length": 0}, Shape((70, 9), head_dim=128, dtype=f16), 2,
                     half=True),
        _method_case("kivi4", {"group_size": 4, "residual_length": 5}, Shape((41, 30), group=8, kv_heads=1,
                                                                             dtype=b16), 2, half=True),
        _method_case("kivi4", KIVI, Shape((37, 70, 5), dtype=b16, q_dtype=f16), 2, half=True),
        _method_case("kivi2", KIVI, Shape((37, 70, 5), dtype=b16, q_gain=3e5), 2, half=True),
        _method_case("kivi2", KIVI, Shape((37, 70, 5), dtype=b16, q_gain=1e-6), 2, half=True),
        _method_case("kivi4", KIVI, Shape((37, 70, 5), dtype=b16), 2, half=True, unpack=1),
        _method_case("int8", {}, Shape((33, 81, 2), group=8, kv_heads=1, dtype=b16), 2, half=True),
        _method_case("int8", {}, Shape((33, 81, 2), dtype=b16, q_gain=1e-6), 1, half=True),
        _method_case("int8", {}, Shape((33, 81, 2), dtype=f16, head_dim=128), 2, half=True),
        _method_case("fp8", {"scale": "token"}, Shape((29, 66, 3), head_dim=128, dtype=f16), 1, half=True),
        _method_case("fp8", {"scale": "head"}, Shape((29, 66, 3), dtype=b16, q_gain=3e5), 2, half=True),
        _method_case("fp8", {"scale": "head"}, Shape((29, 66, 3), group=1, dtype=b16), 2, half=True),
    ]
    # half products are the default for half entries (ops.MEASURED_HALF): the fp32
    # dequantization they replace, for half entries, stays covered
    cases += [_method_case(*row, half=False) for row in (
        ("kivi4", KIVI, Shape((37, 70, 5), dtype=b16), 2),
        ("kivi2", {"group_size": 16, "residual_length": 16}, Shape((50, 33), head_dim=128, dtype=f16), 1),
        ("int8", {}, Shape((33, 81, 2), group=8, kv_heads=1, dtype=b16), 2),
        ("fp8", {"scale": "token"}, Shape((29, 66, 3), dtype=b16), 2),
    )]
    # compiled, half products decode codes with inline PTX (asm=1, the default; the
    # interpreter runs the Triton code, asm=0): asm 0 and 2 (codes read as words) compiled too
    cases += [_method_case(*row, interpret=False, half=True, asm=2) for row in (
        ("kivi4", KIVI, Shape((37, 70, 5), dtype=b16), 2),
        ("kivi4", {"group_size": 32, "residual_length": 0}, Shape((70, 9), head_dim=128, dtype=f16), 1),
        ("int8", {}, Shape((33, 81, 2), group=8, kv_heads=1, dtype=b16), 2),
        ("fp8", {"scale": "token"}, Shape((29, 66, 3), head_dim=128, dtype=f16), 1),
    )]
    cases += [_method_case(*row, interpret=False, half=True, asm=1) for row in (
        ("int8", {}, Shape((33, 81, 2), group=8, kv_heads=1, dtype=b16), 2),
        ("fp8", {"scale": "token"}, Shape((29, 66, 3), head_dim=128, dtype=f16), 1),
    )]
    cases += [_method_case(*row, interpret=False, half=True, asm=0) for row in (
        ("kivi4", KIVI, Shape((37, 70, 5), dtype=b16), 2),
        ("kivi2", {"group_size": 32, "residual_length": 0}, Shape((70, 9), head_dim=128, dtype=f16), 2),
        ("int8", {}, Shape((33, 81, 2), group=8, kv_heads=1, dtype=b16), 2),
        ("fp8", {"scale": "head"}, Shape((29, 66, 3), dtype=b16, q_gain=3e5), 2),
    )]
    return cases


def _int8_query_cases() -> list[Case]:
    """int8 keys' scores from the query's int8 terms (LaunchConfig.int8_query): half and fp32
    entries, GQA 1 / 3 / 8, d 32 / 64 / 128, bf16 queries far outside fp16's range and tiny
    ones, the fused merge, copied with int64 offsets; d=16 (the integer MMA is 32 deep) and
    fp32 queries over a bf16 entry (not folded) keep the usual products; and the check that
    tells the terms from the query."""
    f32, b16, f16 = torch.float32, torch.bfloat16, torch.float16
    cases = [_method_case(*row, int8_query=True) for row in (
        ("int8", {}, Shape((33, 81, 2), group=8, kv_heads=1, dtype=b16), 2),
        ("int8", {}, Shape((50, 17), head_dim=32), 1),
        ("int8", {}, Shape((45, 19, 64), group=1, head_dim=128, dtype=f16), 4),
        ("int8", {}, Shape((33, 81, 2), dtype=b16, q_gain=3e5), 2),
        ("int8", {}, Shape((33, 81, 2), dtype=b16, q_gain=1e-6), 1),
        ("int8", {}, Shape((40, 12), head_dim=16), 1),
        ("int8", {}, Shape((40, 12), q_dtype=f32, dtype=b16), 1),
    )]
    cases += [_method_case("int8", {}, Shape((50, 17), dtype=b16), 2, int8_query=True, fused=True),
              _method_case("int8", {}, Shape((33, 81, 2), group=8, kv_heads=1, dtype=b16), 2, in_place=False,
                           int8_query=True, int32_offsets=False)]
    cases += [Case(f"int8 query terms discriminate d={d}", lambda dev, d=d: check_int8_query_discriminates(dev, d),
                   family="layouts", tags=("int8", "int8_query")) for d in (64, 128)]
    return cases


def _curated() -> list[Case]:
    f32, b16, f16 = torch.float32, torch.bfloat16, torch.float16
    grid = [  # (method, options, shape, splits): the edges named in the issue
        ("kivi4", KIVI, Shape((37, 70, 5)), 1),
        ("kivi4", KIVI, Shape((37, 70, 5), group=8, kv_heads=1, head_dim=128), 2),
        ("kivi2", KIVI, Shape((45, 19, 64), group=1), 2),
        ("kivi2", {"group_size": 32, "residual_length": 16}, Shape((100, 49), head_dim=128, dtype=b16), 1),
        ("kivi4", {"group_size": 16, "residual_length": 0}, Shape((64, 32)), 2),  # empty residual window
        ("kivi2", {"group_size": 16, "residual_length": 0}, Shape((48, 96), group=8, kv_heads=1), 4),
        ("kivi4", {"group_size": 16, "residual_length": 128}, Shape((60, 9)), 1),  # all in the window
        ("kivi4", KIVI, Shape((37, 70, 5), dtype=f16), 2),
        ("kivi4", {"group_size": 72, "residual_length": 8}, Shape((150, 80)), 2),  # key scales gathered per token
        ("kivi2", {"group_size": 4, "residual_length": 4}, Shape((41, 23), head_dim=128), 1),  # 4 groups a block
        ("int8", {}, Shape((33, 81, 2), group=8, kv_heads=1), 2),
        ("int8", {}, Shape((50, 17), dtype=b16), 1),
        ("int8", {}, Shape((40, 12), q_dtype=f32, dtype=b16), 1),  # fp32 queries over a bf16 entry
        ("fp8", {"scale": "head"}, Shape((29, 66), group=1), 2),
        ("fp8", {"scale": "token"}, Shape((29, 66, 3), head_dim=128, dtype=f16), 1),
        ("streamingllm", {"min_budget": 8}, Shape((90, 23, 7)), 2),
        ("snapkv", {"window_size": 4, "min_budget": 8}, Shape((90, 41), group=8, kv_heads=1), 1),
        ("h2o", {"min_budget": 8}, Shape((77, 30), dtype=b16), 2),
        ("full", {}, Shape((19, 40), group=1, head_dim=128), 2),
        ("quest", {"page_size": 8}, Shape((83, 30, 9)), 2),
        ("quest", {"page_size": 8, "heads": "query"}, Shape((83, 30, 9)), 2),
        ("quest", {"page_size": 16, "min_budget": 16}, Shape((70, 130), group=8, kv_heads=1, dtype=b16), 1),
    ]
    return [_method_case(*row) for row in grid]


def _sweep() -> list[Case]:
    """Every method three times, rotating GQA ratio (1/3/8), head dim (64/128), dtype
    (fp32/bf16/fp16), splits and options; ragged lengths from a fixed seed."""
    methods = ("kivi4", "kivi2", "int8", "fp8", "streamingllm", "snapkv", "h2o", "quest", "full")
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    g = _gen(2024)
    cases = []
    for i, method in enumerate(methods):
        for j in range(3):
            group = (1, 3, 8)[(i + j) % 3]
            lengths = tuple(int(n) for n in torch.randint(1, 120, (3,), generator=g))
            shape = Shape(lengths, kv_heads=1 if group == 8 else 2, group=group, head_dim=(64, 128)[(i + j) % 2],
                          dtype=dtypes[j])
            options = {"kivi4": {"group_size": (8, 16, 32)[j], "residual_length": (0, 8, 32)[(i + j) % 3]},
                       "fp8": {"scale": ("head", "token")[j % 2]},
                       "quest": {"page_size": (8, 16)[j % 2], "heads": ("kv", "query")[j % 2]},
                       "snapkv": {"window_size": 4, "min_budget": 8}}.get(method, {})
            if method == "kivi2":
                options = {"group_size": (32, 8, 16)[j], "residual_length": (8, 0, 16)[j]}
            if method in ("streamingllm", "h2o"):
                options = {"min_budget": 8}
            cases.append(_method_case(method, options, shape, (1, 2, 4)[(i + 2 * j) % 3]))
    return cases


def all_cases() -> list[Case]:
    cases = _curated() + _sweep() + _launch_variants() + verify_cases()
    cases += [Case(f"{m} teacher-forced rows", lambda dev, m=m, o=o: check_tokens(m, o, Shape((50,)), dev),
                   family="layouts", tags=(m, "tokens"))
              for m, o in (("kivi4", KIVI), ("snapkv", {"window_size": 4, "min_budget": 8}))]
    for heads, in_place in (("kv", True), ("query", True), ("kv", False)):
        cases.append(Case(f"quest page scores and choice, heads={heads}{'' if in_place else ' copied'}",
                          lambda dev, h=heads, i=in_place: check_quest_selection(Shape((83, 30)), dev, heads=h,
                                                                                  in_place=i),
                          family="layouts", tags=("quest",)))
    cases.append(Case("paged full-KV pool", lambda dev: check_paged_pool(Shape((45, 70, 3)), dev), family="layouts",
                      tags=("full",)))
    cases.append(Case("kivi4 codes read as words", lambda dev: check_kivi4_words(dev, False), family="layouts",
                      tags=("kivi4", "words")))
    cases.append(Case("kivi4 codes read as words, inline PTX", lambda dev: check_kivi4_words(dev, True),
                      family="layouts", interpret=False, tags=("kivi4", "words")))
    cases.append(Case("empty row and lse", check_empty_and_lse, family="layouts", tags=("int8",)))
    cases.append(Case("empty row and lse, fused merge", lambda dev: check_empty_and_lse(
        dev, ops.LaunchConfig(block_n=16, num_splits=2, fused=True)), family="layouts", tags=("int8", "fused")))
    for methods in (("kivi4", "streamingllm", "full"), ("quest", "h2o", "int8"), ("fp8", "kivi2", "snapkv"),
                    ("kivi4",), ("int8", "kivi4", "int8"), ("quest", "snapkv", "quest")):
        cases.append(Case(f"store rounds {'+'.join(methods)}", lambda dev, m=methods: check_store_rounds(m, dev),
                          family="store", tags=methods))
    for dtype, group, dim in ((torch.float32, 3, 64), (torch.bfloat16, 1, 128)):
        cases.append(Case(f"sliding-window layers over the pool {str(dtype)[6:]} group {group} d{dim}",
                          lambda dev, a=(dtype, group, dim): check_window_rounds(dev, *a), family="store",
                          tags=("window",)))
    cases.append(Case("store rounds kivi4+streamingllm+quest with attention sinks", lambda dev: check_store_rounds(
        ("kivi4", "streamingllm", "quest"), dev, sinks=True), family="store", tags=("kivi4", "quest", "sinks")))
    cases.append(Case("sliding-window layers over the pool with attention sinks", lambda dev: check_window_rounds(
        dev, sinks=True), family="store", tags=("window", "sinks")))
    cases.append(Case("store rounds int8+fp8+kivi2 with a soft cap", lambda dev: check_store_rounds(
        ("int8", "fp8", "kivi2"), dev, softcap=1.0), family="store", tags=("int8", "fp8", "kivi2", "softcap")))
    cases.append(Case("store rounds kivi4+streamingllm+quest with attention sinks and a soft cap",
                      lambda dev: check_store_rounds(("kivi4", "streamingllm", "quest"), dev, sinks=True, softcap=1.0),
                      family="store", tags=("kivi4", "quest", "sinks", "softcap")))
    cases.append(Case("sliding-window layers over the pool with a soft cap", lambda dev: check_window_rounds(
        dev, softcap=1.0), family="store", tags=("window", "softcap")))
    cases.append(Case("warm-up compiles what rounds launch: sliding-window layers", check_window_warm_up,
                      family="store", tags=("window", "warm")))
    cases.append(Case("warm-up compiles what rounds launch: sliding-window layers with a soft cap",
                      lambda dev: check_window_warm_up(dev, softcap=30.0), family="store",
                      tags=("window", "warm", "softcap")))
    for method in ("int8", "kivi4"):
        cases.append(Case(f"store round {method}: one layer read in place, one copied",
                          lambda dev, m=method: check_mixed_packing(m, dev), family="store", tags=(method,)))
    cases.append(Case("store rounds kivi4+snapkv bf16", lambda dev: check_store_rounds(
        ("kivi4", "snapkv"), dev, torch.bfloat16), family="store", tags=("kivi4", "snapkv")))
    for methods in (("kivi4", "streamingllm"), ("quest", "snapkv", "h2o"), ("int8", "fp8", "kivi2", "full")):
        cases.append(Case(f"warm-up compiles what rounds launch: {'+'.join(methods)}",
                          lambda dev, m=methods: check_warm_up(m, dev), family="store", tags=methods + ("warm",)))
    cases.append(Case("warm-up compiles what rounds launch: kivi4+quest with attention sinks",
                      lambda dev: check_warm_up(("kivi4", "quest"), dev, sinks=True), family="store",
                      tags=("kivi4", "quest", "sinks", "warm")))
    cases.append(Case("warm-up compiles what rounds launch: kivi4+streamingllm with a soft cap",
                      lambda dev: check_warm_up(("kivi4", "streamingllm"), dev, softcap=30.0), family="store",
                      tags=("kivi4", "streamingllm", "softcap", "warm")))
    # the premise of the cases above under the interpreter, which records their launches
    # without running them: Quest's page choice is the one place values steer launches
    cases.append(Case("warm-up launches recorded see the keys run ones do: quest+snapkv+h2o",
                      lambda dev: check_recording_sees_the_keys_running_does(("quest", "snapkv", "h2o"), dev),
                      family="store", tags=("quest", "snapkv", "h2o", "warm")))
    # head dim 256 (Gemma 2 / 3: bf16, GQA 2, a soft cap) at the default launch sizes, compiled:
    # the largest head the drafts take (kernels.draft_head_dim), never compiled before
    wide = Shape((4000, 1500, 777), kv_heads=2, group=2, head_dim=256, dtype=torch.bfloat16)
    for method in ("kivi4", "int8", "fp8", "snapkv", "quest"):
        cases.append(Case(f"{method} d=256 default launch sizes softcap=5 T={list(wide.lengths)}",
                          lambda dev, m=method: check_method(m, {}, wide, ops.LaunchConfig(), dev, softcap=5.0),
                          family="large", interpret=False, tags=(method, "softcap")))
    big = Shape((4000, 1500, 777), kv_heads=2, group=4, head_dim=128, dtype=torch.bfloat16)
    for method, options in (("kivi4", {}), ("kivi2", {}), ("int8", {}), ("fp8", {}), ("snapkv", {}),
                            ("quest", {}), ("quest", {"heads": "query"})):
        name = method + "".join(f" {k}={v}" for k, v in options.items())
        cases.append(Case(f"{name} default launch sizes T={list(big.lengths)}", lambda dev, a=(method, options):
                          check_method(*a, big, ops.LaunchConfig(), dev), family="large", interpret=False,
                          tags=(method,)))
        if method in ("snapkv", "int8", "quest") and not options:  # the fused merge at the default sizes, compiled
            cases.append(Case(f"{name} default launch sizes fused T={list(big.lengths)}", lambda dev, m=method:
                              check_method(m, {}, big, ops.LaunchConfig(fused=True), dev), family="large",
                              interpret=False, tags=(method, "fused")))
        if method == "int8":  # the query's int8 terms at the default sizes, compiled
            cases.append(Case(f"int8 default launch sizes int8_query T={list(big.lengths)}", lambda dev:
                              check_method("int8", {}, big, ops.LaunchConfig(int8_query=True), dev),
                              family="large", interpret=False, tags=("int8", "int8_query")))
        if method in QUANTIZERS:  # both settings of half products at the default sizes
            cases.append(Case(f"{method} default launch sizes half T={list(big.lengths)}",
                              lambda dev, m=method: check_method(m, {}, big, ops.LaunchConfig(half=True), dev),
                              family="large", interpret=False, tags=(method,)))
            cases.append(Case(f"{method} default launch sizes no half T={list(big.lengths)}",
                              lambda dev, m=method: check_method(m, {}, big, ops.LaunchConfig(half=False), dev),
                              family="large", interpret=False, tags=(method,)))
    return cases


def _selected(cases: list[Case], only: list[str] | None, family: str | None) -> list[Case]:
    return [c for c in cases if (not only or any(w in c.name or w in c.tags for w in only))
            and (not family or c.family == family)]


def run(device: str, only: list[str] | None = None, family: str | None = None, shard: tuple[int, int] = (0, 1),
        budget_s: float | None = None, summary: str | None = None) -> int:
    """Every selected case (of shard k of n: every n-th from the k-th), one line each; with
    ``budget_s``, no case starts after that many seconds (the rest are counted as not run, a
    failure: a device check that ends in its time limit still reports every case it ran).
    The summary line goes to ``summary`` too (a file: what run_sharded reads)."""
    dev = torch.device(device)
    interpreted = ops.interpreting()
    failures = passed = not_run = 0
    start = time.perf_counter()
    cases = all_cases()
    if not interpreted:  # compiled, most of the time is Triton compiles: what the drafter runs first
        cases.sort(key=lambda c: ("large", "store", "verify", "layouts", "quantizers", "droppers").index(c.family))
    for case in _selected(cases, only, family)[shard[0] :: shard[1]]:
        assert case.family in FAMILIES, case
        if interpreted and not case.interpret:
            _line(f"SKIP  {case.name} (compiled only: too large for the interpreter, or inline PTX)")
            continue
        if budget_s is not None and time.perf_counter() - start > budget_s:
            not_run += 1
            _line(f"NOT RUN  {case.name} (past the {budget_s:.0f} s budget)")
            continue
        t0 = time.perf_counter()
        _no_fallback(quiet=True)  # a case that fell back and failed otherwise leaves its flag to the next
        try:
            err = case.run(dev)
            _no_fallback()
            passed += 1
            _line(f"ok    {case.name}: max abs error {err:.2e} ({time.perf_counter() - t0:.1f} s)")
        except Exception as exc:  # report every case, then fail
            failures += 1
            _line(f"FAIL  {case.name}: {type(exc).__name__}: {exc}")
    line = (f"{passed} passed, {failures + not_run} failed, {time.perf_counter() - start:.1f} s, device {device}, "
            f"{'interpreter' if interpreted else 'compiled'}" + (f", {not_run} not run (budget)" if not_run else ""))
    _line(line)
    if summary is not None:
        Path(summary).write_text(line + "\n")
    return 1 if failures or not_run or not passed else 0


def _no_fallback(quiet: bool = False) -> None:
    """A draft launch that fails turns the kernels off and the store drafts on its torch twin
    (kernels.turn_draft_kernels_off): a case compared against that twin would then pass
    without its kernel having run. Such a case fails here, and the next case starts with the
    kernels on again."""
    import sgl_vericache.kernels as kernels

    failure, kernels._draft_failure = kernels.draft_kernels_failed(), None
    if failure is not None and not quiet:
        raise AssertionError(f"the kernel fell back to torch: {failure}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", nargs="*", help="run the cases whose name or tag contains one of these words")
    ap.add_argument("--family", choices=FAMILIES, help="run one family of cases")
    ap.add_argument("--jobs", type=int, default=1,
                    help="split the cases over this many processes (compiled, most of the time is Triton's "
                         "single-threaded compiles: the GPU machine's 16 cores take 8)")
    ap.add_argument("--budget-s", type=float, help="start no case after this many seconds (each process); the "
                    "rest count as failed, not run: a run cut by its time limit still reports what it ran")
    ap.add_argument("--shard", help=argparse.SUPPRESS)  # "k/n": what one of --jobs n runs
    ap.add_argument("--summary", help=argparse.SUPPRESS)  # a shard's summary line goes to this file too
    ap.add_argument("--list", action="store_true", help="print the selected cases' names, run nothing")
    args = ap.parse_args()
    if args.list:
        for case in _selected(all_cases(), args.only, args.family):
            print(f"{case.family:10s} {case.name}")
        return
    if args.device == "cpu" and not ops.interpreting():
        ap.error("on CPU the kernels run under Triton's interpreter: set TRITON_INTERPRET=1")
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.jobs > 1:
        sys.exit(run_sharded(__file__, args.jobs, sys.argv[1:]))
    shard = tuple(int(x) for x in args.shard.split("/")) if args.shard else (0, 1)
    sys.exit(run(args.device, args.only, args.family, shard, args.budget_s, args.summary))


if __name__ == "__main__":
    main()
