"""Verify attention (sglang/attention.py) against what it must equal: SGLang's torch_native
decode of one token at each verified position, the spec-off engine's attention on CPU.

Deterministic mode must be bit-equal to it, the default fp32 path equal up to summation
order, on full-attention layers and on sliding-window ones (Gemma 2/3, gpt-oss, OLMo 3,
Granite-SWA...: a query at position p sees positions p - window .. p). The verify kernel
(CUDA) is held to the torch path by kernel_checks' `verify` family.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_vericache.sglang.attention import verify_attention

HQ, HKV, D, SCALE = 6, 2, 16, 0.3
PREFIXES, BLOCK = (23, 9), 5  # verified tokens per request; the round's block (root + drafts)


def _kv_pool(k_buffer, v_buffer):
    """A KV pool as verify reads one: every layer's buffers are these."""
    return SimpleNamespace(get_key_buffer=lambda layer_id: k_buffer, get_value_buffer=lambda layer_id: v_buffer)


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = sum(PREFIXES) + len(PREFIXES) * BLOCK + 7
    k, v = torch.randn(slots, HKV, D, generator=g), torch.randn(slots, HKV, D, generator=g)
    table = torch.zeros(4, 64, dtype=torch.int32)
    rows = torch.tensor([3, 1])
    order = torch.randperm(slots, generator=g)
    start = 0
    for row, n in zip(rows.tolist(), PREFIXES):
        table[row, : n + BLOCK] = order[start : start + n + BLOCK].to(torch.int32)
        start += n + BLOCK
    q = torch.randn(len(PREFIXES) * BLOCK, HQ * D, generator=g)
    return k, v, table, rows, q


def _decode_rows(k, v, table, rows, q, window):
    """torch_native's decode of each block token at its position, one token at a time."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    q = q.view(len(PREFIXES), BLOCK, HQ, D)
    out = torch.empty_like(q)
    for b, n in enumerate(PREFIXES):
        for j in range(BLOCK):
            backend._run_sdpa_forward_decode(
                q[b, j : j + 1], out[b, j : j + 1], k, v, table, rows[b : b + 1], torch.tensor([n + j + 1]),
                scaling=SCALE, enable_gqa=True, sliding_window_size=window)
    return out.reshape(len(PREFIXES) * BLOCK, HQ * D)


def _verify(k, v, table, rows, q, window, deterministic, logit_cap=0.0):
    backend = SimpleNamespace(runtime=SimpleNamespace(parking=None), token_to_kv_pool=_kv_pool(k, v), skip_rows=(),
                              req_to_token_pool=SimpleNamespace(req_to_token=table), deterministic=deterministic,
                              kernel=False, soft_caps=False)
    layer = SimpleNamespace(tp_q_head_num=HQ, qk_head_dim=D, v_head_dim=D, layer_id=0, scaling=SCALE,
                            sliding_window_size=-1 if window is None else window, is_cross_attention=False,
                            logit_cap=logit_cap)
    batch = SimpleNamespace(batch_size=len(PREFIXES), seq_lens=torch.tensor(PREFIXES), req_pool_indices=rows,
                            spec_info=None)
    return verify_attention(backend, q, layer, batch)


@pytest.mark.parametrize("window", [None, 12, 7, 2, 0], ids=lambda w: f"window={w}")
def test_verify_rows_equal_decode_steps_at_their_positions(window):
    """Windows cutting inside both prefixes, inside one (the 9-token prefix is shorter than
    12), narrower than the block, and 0 (each token sees itself only)."""
    k, v, table, rows, q = _setup()
    decode = _decode_rows(k, v, table, rows, q, window)
    exact = _verify(k, v, table, rows, q, window, deterministic=True)
    assert torch.equal(exact, decode), (exact - decode).abs().max()
    fp32 = _verify(k, v, table, rows, q, window, deterministic=False)
    torch.testing.assert_close(fp32, decode, atol=2e-6, rtol=2e-6)


def test_a_window_changes_what_verify_sees():
    """The case above can fail: ignoring the window (full attention over the prefix) moves
    every row whose window cuts the prefix."""
    k, v, table, rows, q = _setup()
    full, windowed = _verify(k, v, table, rows, q, None, True), _verify(k, v, table, rows, q, 7, True)
    assert (full - windowed).abs().max() > 0.05


def test_a_logit_cap_is_applied_where_the_devices_decode_applies_it():
    """SGLang's CUDA backends soft-cap a layer's scores by its logit_cap (Gemma 2, Grok);
    torch_native, the CPU engine's decode, ignores it, and so does verify on CPU (equal to
    that decode with a cap of 1 set). On CUDA the verify backend caps (the kernel and its
    torch fallback: kernel_checks' soft-cap cases), except in deterministic mode, which
    mirrors torch_native."""
    from sgl_vericache.sglang.attention import make_verify_backend
    from sgl_vericache.sglang.runtime import Runtime

    k, v, table, rows, q = _setup()
    decode = _decode_rows(k, v, table, rows, q, None)
    for deterministic in (True, False):
        got = _verify(k, v, table, rows, q, None, deterministic, logit_cap=1.0)
        torch.testing.assert_close(got, decode, atol=2e-6, rtol=2e-6)

    def backend(device, deterministic):
        runner = SimpleNamespace(attn_backend=object(), req_to_token_pool=None, token_to_kv_pool=None, device=device)
        return make_verify_backend(runner, Runtime(), deterministic)

    assert not backend("cpu", False).soft_caps and not backend("cpu", False).kernel
    assert backend("cuda", False).soft_caps and not backend("cuda", True).soft_caps
    assert not backend("cuda", True).kernel  # deterministic: the torch path, as on CPU
