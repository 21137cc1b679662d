"""The CPU engine's extend attention (sgl_vericache.cpu.attention) against SGLang's own
torch_native extend on random pools: prefix hits, no prefix, GQA, scattered slots, long
extends crossing query blocks. Fast (no engine)."""

from __future__ import annotations

import pytest
import torch

from sgl_vericache.cpu import attention as cpu_attention
from sgl_vericache.cpu.attention import extend_attention


def _sglang_extend():
    """SGLang's torch_native extend as shipped (the plugin may have replaced the method)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    method = TorchNativeAttnBackend._run_sdpa_forward_extend
    return getattr(method, "sglang_original", method)


def _batch(prefixes, news, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    totals = [p + n for p, n in zip(prefixes, news)]
    slots = sum(totals) + 7
    k_cache = torch.randn(slots, hkv, d, generator=g)
    v_cache = torch.randn(slots, hkv, d, generator=g)
    perm = torch.randperm(slots - 1, generator=g) + 1  # slot 0 is padding, never used
    req_to_token = torch.zeros(len(totals) + 2, max(totals) + 3, dtype=torch.int32)
    rows = torch.tensor([len(totals) + 1 - i for i in range(len(totals))])  # not 0..bs-1
    used = 0
    for row, total in zip(rows.tolist(), totals):
        req_to_token[row, :total] = perm[used : used + total].to(torch.int32)
        used += total
    query = torch.randn(sum(news), hq, d, generator=g)
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token,
                req_pool_indices=rows, seq_lens=torch.tensor(totals),
                extend_prefix_lens=torch.tensor(prefixes), extend_seq_lens=torch.tensor(news))


@pytest.mark.parametrize("prefixes,news,hq,hkv", [
    ([0], [9], 4, 4),  # no prefix
    ([37], [1], 9, 3),  # a prefix hit, one new token (GQA)
    ([0, 50, 3, 120], [12, 1, 40, 6], 9, 3),  # mixed batch
    ([200], [0], 2, 1),  # nothing new in one request
])
def test_extend_attention_equals_sglang_torch_native(prefixes, news, hq, hkv):
    b = _batch(prefixes, news, hq, hkv, d=16)
    ours = extend_attention(output=torch.full_like(b["query"], float("nan")), scaling=0.3, enable_gqa=hq != hkv,
                            causal=True, **b)
    theirs = torch.full_like(b["query"], float("nan"))
    _sglang_extend()(None, b["query"], theirs, b["k_cache"], b["v_cache"], b["req_to_token"], b["req_pool_indices"],
                     b["seq_lens"], b["extend_prefix_lens"], b["extend_seq_lens"], None, 0.3, hq != hkv, True)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_extend_attention_query_blocks(monkeypatch):
    """Extends longer than a query block: each block's mask and keys end at its last
    visible key; the result is the one-call reference."""
    b = _batch([30], [23], 4, 2, d=8, seed=3)
    whole = extend_attention(output=torch.empty_like(b["query"]), scaling=None, enable_gqa=True, **b)
    monkeypatch.setattr(cpu_attention, "QUERY_BLOCK", 5)
    blocked = extend_attention(output=torch.empty_like(b["query"]), scaling=None, enable_gqa=True, **b)
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-6)
    # and row i really sees exactly keys 0..prefix+i: recompute row 7 by hand
    q = b["query"][7]  # [H_q, D]
    slots = b["req_to_token"][b["req_pool_indices"][0], : 30 + 8].long()
    keys = b["k_cache"][slots].repeat_interleave(2, dim=1)  # [38, H_q, D]
    values = b["v_cache"][slots].repeat_interleave(2, dim=1)
    weights = torch.softmax(torch.einsum("hd,lhd->hl", q, keys) / 8 ** 0.5, dim=-1)
    torch.testing.assert_close(blocked[7], torch.einsum("hl,lhd->hd", weights, values), rtol=1e-5, atol=1e-6)


def test_plugin_installs_extend_attention():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sgl_vericache.sglang.attention import install_cpu_extend_attention
    from sgl_vericache.sglang.runtime import Runtime

    install_cpu_extend_attention(Runtime())
    assert getattr(TorchNativeAttnBackend._run_sdpa_forward_extend, "_vericache", False)
    install_cpu_extend_attention(Runtime())  # idempotent: not wrapped twice
    patched = TorchNativeAttnBackend._run_sdpa_forward_extend
    assert not getattr(patched.sglang_original, "_vericache", False)
