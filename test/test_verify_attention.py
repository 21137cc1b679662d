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


def _verify(k, v, table, rows, q, window, deterministic, logit_cap=0.0, sinks=None, backend=None):
    backend = backend or _backend(k, v, table, deterministic)
    layer = SimpleNamespace(tp_q_head_num=HQ, qk_head_dim=D, v_head_dim=D, layer_id=0, scaling=SCALE,
                            sliding_window_size=-1 if window is None else window, is_cross_attention=False,
                            logit_cap=logit_cap)
    batch = SimpleNamespace(batch_size=len(PREFIXES), seq_lens=torch.tensor(PREFIXES), req_pool_indices=rows,
                            spec_info=None)
    return verify_attention(backend, q, layer, batch, sinks)


def _backend(k, v, table, deterministic=False, kernel=False):
    return SimpleNamespace(runtime=SimpleNamespace(parking=None), token_to_kv_pool=_kv_pool(k, v), skip_rows=(),
                           req_to_token_pool=SimpleNamespace(req_to_token=table), deterministic=deterministic,
                           kernel=kernel)


def test_a_verify_kernel_that_fails_on_this_gpu_leaves_the_torch_path_for_good(monkeypatch, caplog):
    """A Triton compile, resource or launch error (a GPU, Triton or shape no check compiled)
    would have stopped the scheduler at the first round: the layer is verified on the torch
    path instead, and every later one, logged; running out of memory still raises."""
    from sgl_vericache.kernels import verify as kv
    from sgl_vericache.sglang import attention

    k, v, table, rows, q = _setup(3)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Triton Error [CUDA]: device kernel image is invalid")  # as Triton's launcher words it

    from sgl_vericache import kernels

    monkeypatch.setattr(kernels, "_verify_failure", None)
    monkeypatch.setattr(kv, "unsupported", lambda *args: None)
    monkeypatch.setattr(kv, "verify_attention", failing)
    monkeypatch.setattr(attention, "kernel_batch", lambda *args: (None, None, max(PREFIXES) + BLOCK))
    backend = _backend(k, v, table, kernel=True)
    with caplog.at_level("ERROR", logger=attention.__name__):
        out = _verify(k, v, table, rows, q, None, False, backend=backend)
    assert calls == [1] and backend.kernel is False and "device kernel image is invalid" in caplog.text
    assert kernels.verify_kernel_failed().startswith("the verify kernel failed at layer 0 (H_q 6, head_dim 16)")
    assert kernels.verify_kernel_off("cuda") == kernels.verify_kernel_failed()  # new backends start on torch
    assert torch.equal(out, _verify(k, v, table, rows, q, None, False))
    _verify(k, v, table, rows, q, None, False, backend=backend)
    assert calls == [1]  # not tried again

    # running out of memory (torch's, or the driver's through Triton) and our own bugs are not
    # the GPU's: they raise
    for error in (torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("Triton Error [CUDA]: out of memory"),
                  ValueError("a bug")):
        def raising(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(kv, "verify_attention", raising)
        with pytest.raises(type(error)):
            _verify(k, v, table, rows, q, None, False, backend=_backend(k, v, table, kernel=True))


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


def _explicit_decode_rows(k, v, table, rows, q, window, sinks=None, cap=None):
    """The CPU engine's decode of each block token at its position for a layer with sinks or
    a soft cap: cpu.attention.explicit_attention, one token at a time."""
    from sgl_vericache.cpu.attention import explicit_attention

    q = q.view(len(PREFIXES), BLOCK, HQ, D)
    out = torch.empty_like(q)
    for b, n in enumerate(PREFIXES):
        for j in range(BLOCK):
            explicit_attention(q[b, j : j + 1], out[b, j : j + 1], k, v, table, rows[b : b + 1], torch.tensor([n + j + 1]), [1],
                               SCALE, window, sinks, cap)
    return out.reshape(len(PREFIXES) * BLOCK, HQ * D)


@pytest.mark.parametrize("window", [None, 7], ids=lambda w: f"window={w}")
def test_a_logit_cap_is_applied_as_decode_applies_it(window):
    """A soft-capped layer (Gemma 2, Grok: scores cap * tanh(score / cap)) is capped by
    SGLang's CUDA backends and, as the plugin gives it, by the CPU engine's torch_native
    (which by itself ignored the cap and computed another model's attention). Verify caps
    alike on every device: deterministic mode bit-equal to that decode (with sinks too),
    the default path within fp32 rounding; the kernel is held to the torch path by
    kernel_checks' soft-cap cases."""
    k, v, table, rows, q = _setup()
    sinks = torch.linspace(-1.0, 2.0, HQ)
    for cap, sink in ((1.0, None), (1.0, sinks)):
        decode = _explicit_decode_rows(k, v, table, rows, q, window, sink, cap)
        assert (decode - _decode_rows(k, v, table, rows, q, window)).abs().max() > 0.05  # the cap matters here
        exact = _verify(k, v, table, rows, q, window, True, logit_cap=cap, sinks=sink)
        assert torch.equal(exact, decode), (exact - decode).abs().max()
        torch.testing.assert_close(_verify(k, v, table, rows, q, window, False, logit_cap=cap, sinks=sink), decode,
                                   atol=2e-6, rtol=2e-6)


def test_the_cpu_engine_decodes_capped_and_sink_layers_explicitly():
    """torch_native's decode, as the plugin installs it, sends a layer with a soft cap or
    attention sinks to explicit_attention, and any other layer to SGLang's own code."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType

    from sgl_vericache.sglang.attention import install_cpu_extend_attention
    from sgl_vericache.sglang.runtime import Runtime

    install_cpu_extend_attention(Runtime())
    k, v, table, rows, q = _setup(4)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    backend.token_to_kv_pool, backend.req_to_token_pool = _kv_pool(k, v), SimpleNamespace(req_to_token=table)
    backend.swa_out_cache_loc = None
    sinks = torch.linspace(-1.0, 2.0, HQ)
    n = PREFIXES[0]
    batch = SimpleNamespace(batch_size=1, req_pool_indices=rows[:1], seq_lens=torch.tensor([n]), encoder_lens=None,
                            out_cache_loc=None, forward_mode=SimpleNamespace(is_decode=lambda: True,
                                                                             is_idle=lambda: False))
    q1 = q.view(len(PREFIXES), BLOCK, HQ * D)[0, :1]
    for cap, sink in ((0.0, None), (1.0, None), (0.0, sinks), (1.0, sinks)):
        layer = SimpleNamespace(tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D, layer_id=0,
                                scaling=SCALE, sliding_window_size=-1, is_cross_attention=False, logit_cap=cap,
                                attn_type=AttentionType.DECODER)
        got = backend.forward_decode(q1, None, None, layer, batch, save_kv_cache=False,
                                     **({} if sink is None else {"sinks": sink}))
        want = torch.empty(1, HQ, D)
        if cap or sink is not None:
            from sgl_vericache.cpu.attention import explicit_attention

            explicit_attention(q1.view(1, HQ, D), want, k, v, table, rows[:1], torch.tensor([n]), [1], SCALE, None,
                               sink, cap or None)
        else:
            backend._run_sdpa_forward_decode(q1.view(1, HQ, D), want, k, v, table, rows[:1], torch.tensor([n]),
                                             scaling=SCALE, enable_gqa=True)
        assert torch.equal(got.view(1, HQ, D), want), (cap, sink is not None)


def test_attention_sinks_take_their_share_of_each_softmax():
    """A layer's attention sinks (gpt-oss, Granite-SWA, MiMo-V2: one more term exp(sink) in
    each query head's softmax denominator, as SGLang's decode kernels add it) scale every
    verify row of decode's attention by Z / (Z + exp(sink)), Z the sum of its visible
    scores' exponentials: checked against torch_native's decode (which has no sinks) times
    that factor, on both torch paths and with a window. kernel_checks' `sinks` cases hold
    the kernel to SGLang's own Triton decode with sinks."""
    k, v, table, rows, q = _setup(1)
    sinks = torch.tensor([0.5, -1.0, 2.0, 3.5, 0.0, 1.0])  # [H_q]
    for window in (None, 7):
        decode = _decode_rows(k, v, table, rows, q, window).view(len(PREFIXES), BLOCK, HQ, D)
        share = torch.empty(len(PREFIXES), BLOCK, HQ)
        for b, n in enumerate(PREFIXES):
            slots = table[rows[b], : n + BLOCK].long()
            keys = k[slots].repeat_interleave(HQ // HKV, 1)  # [n + BLOCK, H_q, D]
            for j in range(BLOCK):
                first = 0 if window is None else max(0, n + j - window)
                scores = torch.einsum("hd,thd->ht", q.view(len(PREFIXES), BLOCK, HQ, D)[b, j], keys[first : n + j + 1])
                lse = torch.logsumexp(scores * SCALE, -1)
                share[b, j] = torch.sigmoid(lse - sinks)  # Z / (Z + e^sink)
        expected = (decode * share[..., None]).reshape(len(PREFIXES) * BLOCK, HQ * D)
        for deterministic in (True, False):
            backend = SimpleNamespace(runtime=SimpleNamespace(parking=None), token_to_kv_pool=_kv_pool(k, v),
                                      skip_rows=(), req_to_token_pool=SimpleNamespace(req_to_token=table),
                                      deterministic=deterministic, kernel=False)
            layer = SimpleNamespace(tp_q_head_num=HQ, qk_head_dim=D, v_head_dim=D, layer_id=0, scaling=SCALE,
                                    sliding_window_size=-1 if window is None else window, is_cross_attention=False,
                                    logit_cap=0.0)
            batch = SimpleNamespace(batch_size=len(PREFIXES), seq_lens=torch.tensor(PREFIXES), req_pool_indices=rows,
                                    spec_info=None)
            got = verify_attention(backend, q, layer, batch, sinks)
            torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)
            assert (got - decode.reshape_as(got)).abs().max() > 0.05  # the sinks took a share


def test_backends_pass_attention_sinks_on_and_refuse_other_attention_arguments():
    """The verify backend hands a model's ``sinks`` to verify attention and the draft backend
    to the draft's store, with the layer's soft cap; an attention argument VeriCache does not compute (a ``score_mod``)
    stops with its name instead of attending otherwise than decode does."""
    from sgl_vericache.sglang.attention import make_draft_backend, make_verify_backend
    from sgl_vericache.sglang.runtime import Runtime

    k, v, table, rows, q = _setup(2)
    sinks = torch.linspace(-1.0, 2.0, HQ)
    written = []
    pool = SimpleNamespace(get_key_buffer=lambda layer_id: k, get_value_buffer=lambda layer_id: v,
                           set_kv_buffer=lambda *args: written.append(args))
    runner = SimpleNamespace(attn_backend=object(), req_to_token_pool=SimpleNamespace(req_to_token=table),
                             token_to_kv_pool=pool, device="cpu")
    backend = make_verify_backend(runner, Runtime())
    layer = SimpleNamespace(tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D, layer_id=0,
                            scaling=SCALE, sliding_window_size=-1, is_cross_attention=False, logit_cap=0.0)
    batch = SimpleNamespace(batch_size=len(PREFIXES), seq_lens=torch.tensor(PREFIXES), req_pool_indices=rows,
                            spec_info=None, out_cache_loc=None,
                            forward_mode=SimpleNamespace(is_target_verify=lambda: True))
    got = backend.forward(q, None, None, layer, batch, save_kv_cache=False, sinks=sinks)
    torch.testing.assert_close(got, verify_attention(backend, q, layer, batch, sinks))
    assert (got - verify_attention(backend, q, layer, batch)).abs().max() > 0.05
    with pytest.raises(NotImplementedError, match="score_mod"):
        backend.forward(q, None, None, layer, batch, save_kv_cache=False, sinks=sinks, score_mod=lambda s: s)
    assert not written  # refused before the KV was written

    seen = []

    class Store:
        def attend(self, layer_id, q, k_new, v_new, scale, sinks=None, softcap=None):
            seen.append((sinks, softcap))
            return torch.zeros_like(q)

    draft = make_draft_backend(runner, Store())
    kn = torch.zeros(2, HKV * D)
    draft.forward_decode(q[:2], kn, kn, layer, batch, sinks=sinks)
    draft.forward_decode(q[:2], kn, kn, layer, batch)
    draft.forward_decode(q[:2], kn, kn, SimpleNamespace(**{**vars(layer), "logit_cap": 30.0}), batch)
    # the draft passes read the layer's sinks and soft cap as its decode does
    assert seen == [(sinks, None), (None, None), (None, 30.0)], seen
    with pytest.raises(NotImplementedError, match="draft attention does not compute attention with score_mod.*--no-vericache-enable"):
        draft.forward_decode(q[:2], kn, kn, layer, batch, score_mod=lambda s: s)


def test_attention_verify_does_not_compute_is_refused_at_start_where_decode_applies_it():
    """A model whose decode attention does what verify does not (Grok's temperature by
    position, another capping method, ALiBi in the kernel, Llama 4's chunked attention,
    cross-attention) is refused when the worker starts on CUDA, naming it; on the CPU engine,
    whose torch_native decode does none of it either, it is served (outputs equal there)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    from sgl_vericache.sglang.attention_layers import check_attention, unreproduced_attention

    def model(**attrs):
        net = torch.nn.ModuleList([RadixAttention(4, 16, 0.25, 2, layer_id=i) for i in range(2)])
        for name, value in attrs.items():
            setattr(net[1], name, value)
        return net

    config = SimpleNamespace(attention_chunk_size=None)
    assert unreproduced_attention(model(), config, "cuda") == []
    assert unreproduced_attention(model(logit_cap=30.0, sliding_window_size=7), config, "cuda") == []
    for attrs, chunked, said in (({"xai_temperature_len": 1024}, None, "xai_temperature_len"),
                                 ({"logit_cap": 30.0, "logit_capping_method": "clamp"}, None, "clamp"),
                                 ({"pos_encoding_mode": "ALIBI"}, None, "ALIBI"),
                                 ({"use_irope": True}, 8192, "attention_chunk_size 8192"),
                                 ({"is_cross_attention": True}, None, "cross-attention")):
        cfg = SimpleNamespace(attention_chunk_size=chunked)
        assert unreproduced_attention(model(**attrs), cfg, "cpu") == []
        with pytest.raises(ValueError, match=f"cannot verify this model exactly.*{said}.*--no-vericache-enable"):
            check_attention(model(**attrs), cfg, "cuda")
    assert unreproduced_attention(model(use_irope=True), config, "cuda") == []  # no chunk size: no chunking


def test_layers_sharing_another_layers_kv_are_refused_at_start_on_every_device():
    """Gemma 3n / Gemma 4's last layers (``is_kv_shared_layer``) attend over an earlier
    layer's KV: their attention modules carry its layer id and pass no keys or values, so a
    draft step would have none to append. Refused on CPU and CUDA alike, naming them. An MLA
    layer's two attention modules (prefill and decode forms) share one id and their own KV:
    served as far as this check goes (a tiny DeepSeek-V2 was refused here before, with the
    wrong reason; its pool is refused by ``check_kv_pool``)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    from sgl_vericache.sglang.attention_layers import check_attention, shared_kv_layers

    class Attention(torch.nn.Module):  # the shape of Gemma 3n's attention module that matters here
        def __init__(self, layer_id, reads):
            super().__init__()
            self.layer_id, self.is_kv_shared_layer = layer_id, reads != layer_id
            self.kv_shared_layer_index = reads if reads != layer_id else None
            self.attn = RadixAttention(4, 16, 0.25, 2, layer_id=reads)

    config = SimpleNamespace(attention_chunk_size=None)
    mla = torch.nn.ModuleList([RadixAttention(4, 16, 0.25, 1, layer_id=i // 2) for i in range(4)])
    assert shared_kv_layers(mla) == []
    check_attention(mla, config, "cuda")
    gemma = torch.nn.ModuleList([Attention(i, min(i, 1)) for i in range(4)])  # layers 2 and 3 read layer 1's KV
    assert shared_kv_layers(gemma) == [2, 3]
    assert shared_kv_layers(torch.nn.ModuleList([Attention(i, i) for i in range(4)])) == []
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match=r"another layer's KV.*layers \[2, 3\].*--no-vericache-enable"):
            check_attention(gemma, config, device)
