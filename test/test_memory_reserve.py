"""How VeriCache's reserve splits SGLang's KV budget (spec/memory_reserve.py): the plan's
arithmetic, and that the entries a real store holds for requests of at least
REFERENCE_TOKENS tokens fit in what it reserves for them. The hook that applies it in a
server is checked on the CPU engine in test_context_limit.py. No engine here."""

from __future__ import annotations

import pytest
import torch

from sgl_vericache.config import AUTO_CANDIDATES, VeriCacheConfig
from sgl_vericache.mem_cache.compress import full_nbytes, get_compressor
from sgl_vericache.mem_cache.compress.rows import held_nbytes
from sgl_vericache.spec.drafter import CompressedKVStore
from sgl_vericache.spec.memory_reserve import (REFERENCE_TOKENS, DraftMemoryError, entry_fraction,
                                               plan_draft_memory)

GIB = 1 << 30


def test_the_pool_gets_the_budget_less_the_prefix_cache_over_one_plus_entries_and_buffers():
    kivi4 = get_compressor("kivi4")
    e = entry_fraction(kivi4, 8, 128, torch.bfloat16)
    assert 0.3 < e < 0.36, e  # 4-bit codes, their scales and a 128-token full-precision window
    on_kernels = plan_draft_memory(10 * GIB, [kivi4], 8, 128, torch.bfloat16, 512 << 20, dense_buffers=False)
    assert on_kernels.pool_bytes == int((10 * GIB - (512 << 20)) / (1 + e))
    assert on_kernels.buffer_fraction == 0.0
    assert on_kernels.reserved_bytes == 10 * GIB - on_kernels.pool_bytes
    dense = plan_draft_memory(10 * GIB, [kivi4], 8, 128, torch.bfloat16, 0, dense_buffers=True)
    assert dense.buffer_fraction == 1.0  # a quantizer's dense buffer holds every row, dequantized
    assert dense.pool_bytes == int(10 * GIB / (2 + e))
    snap = plan_draft_memory(10 * GIB, [get_compressor("snapkv", 8.0)], 8, 128, torch.bfloat16, 0, True)
    # an eighth of the tokens, their positions and scores, and a sixteenth more in spare rows (rows.py)
    assert snap.buffer_fraction == pytest.approx(1 / 8) and 0.13 < snap.entry_fraction < 0.14
    assert "GiB kept for compressed entries (snapkv: 0.135" in snap.describe()


def test_auto_reserves_for_the_costlier_candidate():
    cfg = VeriCacheConfig()
    both = [cfg.build_compressor(name) for name in AUTO_CANDIDATES]
    plan = plan_draft_memory(GIB, both, 8, 128, torch.float16, 0, dense_buffers=True)
    assert plan.entry_fraction == max(entry_fraction(c, 8, 128, torch.float16) for c in both)
    assert plan.entry_fraction == entry_fraction(both[1], 8, 128, torch.float16)  # kivi4's, above streamingllm's
    assert plan.buffer_fraction == 1.0 and plan.compressors == AUTO_CANDIDATES
    assert plan.as_dict()["compressors"] == list(AUTO_CANDIDATES)


def test_a_prefix_cache_the_budget_cannot_hold_names_the_flags():
    with pytest.raises(DraftMemoryError, match=r"\(512 MiB, --vericache-compressed-cache-mb\) leaves nothing of "
                                               r"the 300 MiB KV budget.*--mem-fraction-static"):
        plan_draft_memory(300 << 20, [get_compressor("kivi4")], 8, 128, torch.bfloat16, 512 << 20, False)
    with pytest.raises(ValueError, match="at least one compressor"):
        plan_draft_memory(GIB, [], 8, 128, torch.bfloat16, 0, False)


@pytest.mark.parametrize("name", ["kivi4", "kivi2", "int8", "fp8", "streamingllm", "snapkv", "h2o", "quest"])
def test_a_stores_entries_fit_the_reserve_for_requests_of_the_reference_length_and_up(name):
    """Entries built by a real store, for requests of REFERENCE_TOKENS and 1.5 x that, take
    no more than the plan's entry fraction of their full KV (and most of it: the estimate is
    not loose either)."""
    heads, dim, layers, dtype = 2, 32, 2, torch.float16
    comp = get_compressor(name)
    store = CompressedKVStore(comp, num_layers=layers)
    gen = torch.Generator().manual_seed(0)
    total = 0
    for rid, tokens in enumerate((REFERENCE_TOKENS, REFERENCE_TOKENS * 3 // 2)):
        k = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
        v = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
        queries = torch.randn(32, heads, dim, generator=gen).to(dtype) if comp.needs_queries else None
        store.sync(rid, tokens, lambda layer, start, end: (k[start:end], v[start:end]),
                   queries=None if queries is None else [queries] * layers)
        total += tokens
    plan = plan_draft_memory(GIB, [comp], heads, dim, dtype, 0, dense_buffers=False)
    full = layers * full_nbytes(total, heads, dim, dtype)
    # what the entries hold, spare rows included (rows.py), fits; what they count is most of it
    held = held_nbytes(t for rid in range(2) for layer in store.entry(rid)[1] for t in layer.tensors())
    assert store.nbytes() <= held <= plan.entry_fraction * full * 1.0001, (store.nbytes(), held, plan.entry_fraction * full)
    assert store.nbytes() >= 0.9 * plan.entry_fraction * full, (store.nbytes(), plan.entry_fraction * full)
