"""Attention backends: the draft's over compressed KV, the verify's over the full KV, and
the CPU engine's extend.

Touches SGLang's ``AttentionBackend`` interface (two backends of ours: the draft passes'
and a wrapper of the target's that adds TARGET_VERIFY, which ``torch_native`` lacks; and
the target's ``forward`` shadowed on its instance while a prefill's prompt queries are
captured for SnapKV/H2O), ``KVWriteLoc`` / the KV pool's ``set_kv_buffer``
(verify writes its tokens' KV like any forward), and ``TorchNativeAttnBackend.
_run_sdpa_forward_extend`` (the CPU engine's extend, patched for every engine).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from sgl_vericache.kernels import verify_kernel_available
from sgl_vericache.sglang.attention_layers import logit_cap, sliding_window
from sgl_vericache.sglang.runtime import Runtime, patch
from sgl_vericache.mem_cache.compress import attention
from sgl_vericache.spec.entry_sync import MAX_CAPTURED_QUERIES

logger = logging.getLogger(__name__)


def make_draft_backend(model_runner, store):
    """Decode-only attention over the compressed entries of ``store``; never writes the pool."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    class DraftAttentionBackend(AttentionBackend):
        def __init__(self):
            super().__init__()
            self.req_to_token_pool = model_runner.req_to_token_pool
            self.token_to_kv_pool = model_runner.token_to_kv_pool
            self.device = model_runner.device
            self.tokens_of_one = False  # True: the rows are consecutive tokens of one request (attend_tokens)

        def init_forward_metadata(self, forward_batch):
            pass

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
            attend = store.attend_tokens if self.tokens_of_one else store.attend
            out = attend(
                layer.layer_id,
                q.reshape(-1, hq, d),  # [bs, H_q, D], row b = the store's round row b
                k.reshape(-1, hkv, d),
                v.reshape(-1, hkv, layer.v_head_dim),
                layer.scaling,
                attention_extras(kwargs, "draft"),  # the layer's attention sinks, as the target's decode
                logit_cap(layer),  # and its soft cap
            )
            return out.reshape(-1, hq * layer.v_head_dim)

        def forward_extend(self, *args, **kwargs):
            raise RuntimeError("VeriCache draft attention runs decode steps only")

    return DraftAttentionBackend()


def make_verify_backend(model_runner, runtime: Runtime, deterministic: bool = False):
    """The target's attention backend plus a TARGET_VERIFY path: each request's draft
    queries attend over its full verified KV (all visible) and the draft block under the
    verify mask (a linear chain for VERICACHE: causal). On CUDA one Triton launch for the
    batch (kernels/verify.py); otherwise, and in deterministic mode, fp32 per request."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    inner = model_runner.attn_backend

    class VerifyBackend(AttentionBackend):
        def __init__(self):
            super().__init__()
            self.inner = inner
            self.req_to_token_pool = model_runner.req_to_token_pool
            self.token_to_kv_pool = model_runner.token_to_kv_pool
            self.deterministic = deterministic
            self.skip_rows = ()  # rows deferred this round (staggered verifies): no attention
            self.kernel_batch = None  # (forward batch, what its layers' verify kernel launches share)
            self.host_rows = None  # (forward batch, its prefix lengths, its token-table rows) on the host
            self.runtime = runtime  # its parking: verify waits for parked KV per layer
            self.kernel = verify_kernel_available(model_runner.device) and not deterministic

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def init_forward_metadata(self, forward_batch):
            self.inner.init_forward_metadata(forward_batch)

        def end_forward(self):
            """After a forward: no rows deferred, nothing of its batch kept."""
            self.skip_rows = ()
            self.kernel_batch = self.host_rows = None

        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if not forward_batch.forward_mode.is_target_verify():
                return self.inner.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            sinks = attention_extras(kwargs, "verify")
            if save_kv_cache:
                self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
            return verify_attention(self, q, layer, forward_batch, sinks)

    return VerifyBackend()


def attention_extras(kwargs: dict, what: str):
    """The keyword arguments a model's attention call passes beside q, k, v: a layer's
    attention sinks (``sinks``, [H_q]: gpt-oss, Granite-SWA, MiMo-V2), which VeriCache's
    attention applies as SGLang's decode does, returned; any other one set (an attention
    variant VeriCache does not compute) raises, naming it, rather than attend otherwise
    than decode does."""
    sinks = kwargs.get("sinks")
    other = sorted(name for name, value in kwargs.items() if name != "sinks" and value is not None
                   and value is not False)
    if other:
        raise NotImplementedError(f"VeriCache {what} attention does not compute attention with "
                                  f"{', '.join(other)} (this model's attention layers pass them); "
                                  "serve it with --no-vericache-enable")
    return sinks


def verify_attention(backend, q, layer, forward_batch, sinks=None):
    """``sinks``: the layer's attention sinks ([H_q], natural-log units: each query head's
    softmax has one more term, exp(sink), in its denominator and none in its sum of
    values, as SGLang's decode kernels add it), or None."""
    hq, d, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
    parking = backend.runtime.parking
    if parking is not None:
        parking.wait_layer(layer.layer_id)  # parked full KV copied back for this layer
    if backend.kernel:
        out = verify_on_kernel(backend, q, layer, forward_batch, sinks)
        if out is not None:
            return out
    bs = forward_batch.batch_size
    q = q.reshape(bs, -1, hq, d)  # [bs, n, H_q, D]
    n = q.shape[1]
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    seq_lens, rows = host_rows(backend, forward_batch)
    tree = verify_tree_mask(forward_batch, bs, n, q.device)  # [bs, n, n]
    window = sliding_window(layer)
    cap = logit_cap(layer)  # SGLang's CUDA backends cap, and torch_native as the plugin gives it
    out = q.new_empty((bs, n, hq, dv))
    for b in range(bs):
        if b in backend.skip_rows:  # its full KV stays parked; its logits are not used
            out[b] = 0
            continue
        prefix = seq_lens[b]
        slots = req_to_token[rows[b], : prefix + n].to(torch.int64)
        keys, values = k_cache[slots], v_cache[slots]  # [prefix + n, H_kv, D]
        if backend.deterministic:
            out[b] = decode_shaped_rows(q[b], keys, values, prefix, layer.scaling, hq != keys.shape[1], window,
                                        sinks, cap)
            continue
        visible = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=q.device), tree[b]], dim=1)
        if window is not None:  # token j (position prefix + j) sees positions prefix + j - window .. on
            positions = torch.arange(prefix + n, device=q.device)
            visible &= positions[None, :] >= positions[prefix:, None] - window
        o = attention(q[b].transpose(0, 1).float()[None], keys.transpose(0, 1).float()[None],
                      values.transpose(0, 1).float()[None], visible, layer.scaling, sinks, cap)[0]  # [H_q, n, Dv]
        out[b] = o.transpose(0, 1).to(out.dtype)
    return out.reshape(bs * n, hq * dv)


def host_rows(backend, forward_batch) -> tuple[list, list]:
    """The verify batch's prefix lengths and token-table rows on the host, read once a
    forward (each read waits for the device) and kept until ``end_forward``."""
    kept = getattr(backend, "host_rows", None)
    if kept is None or kept[0] is not forward_batch:
        kept = backend.host_rows = (forward_batch, forward_batch.seq_lens.tolist(),
                                    forward_batch.req_pool_indices.tolist())
    return kept[1], kept[2]


def verify_on_kernel(backend, q, layer, forward_batch, sinks=None):
    """verify_attention in one Triton launch (kernels/verify.py) reading the pool where it
    lies; None (and the torch path from then on, logged once) where the layer does not
    fit the kernel, or where the kernel fails to compile or launch on this GPU and Triton
    (a shape or device no check has compiled: the torch path is the one it is held to).
    Running out of device memory is not the kernel's failure: it raises."""
    from sgl_vericache.kernels import verify as kv

    hq, d, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    why = kv.unsupported(hq, d, dv, k_cache, v_cache)
    if why:
        backend.kernel = False
        logger.warning("VeriCache verify attention runs per request in torch: the Triton kernel does not take %s", why)
        return None
    bs = forward_batch.batch_size
    n = q.numel() // (bs * hq * d)
    live, mask, longest = kernel_batch(backend, forward_batch, n, q.device)
    try:
        out = kv.verify_attention(q.reshape(bs, n, hq, d), k_cache, v_cache, backend.req_to_token_pool.req_to_token,
                                  forward_batch.req_pool_indices, forward_batch.seq_lens, layer.scaling, live=live,
                                  mask=mask, longest=longest, window=sliding_window(layer),
                                  softcap=logit_cap(layer), sinks=sinks)
    except Exception as exc:
        from sgl_vericache.kernels import launch_failed, turn_verify_kernel_off

        if not launch_failed(exc):  # out of memory, or a bug: not the GPU's
            raise
        backend.kernel = False
        turn_verify_kernel_off(exc, f"the verify kernel failed at layer {layer.layer_id} (H_q {hq}, head_dim {d})")
        return None
    return out.reshape(bs * n, hq * dv)


def kernel_batch(backend, forward_batch, n, device):
    """(live, mask, longest): what every layer's verify kernel launch in one forward shares,
    made at its first layer (a host -> device copy and a mask conversion, not one a layer):
    the rows verified (None: all; deferred rows' full KV stays parked), the verify mask as
    the kernel reads it (uint8 [bs, n, n]; None: a chain), the longest row on the host."""
    cached = getattr(backend, "kernel_batch", None)
    if cached is not None and cached[0] is forward_batch:
        return cached[1]
    bs = forward_batch.batch_size
    mask = getattr(forward_batch.spec_info, "custom_mask", None)
    if mask is not None and mask.numel() == bs * n * n:
        mask = mask.reshape(bs, n, n).to(torch.uint8).contiguous()
    else:
        mask = None
    seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
    longest = int(seq_lens_cpu.max()) + n if seq_lens_cpu is not None and bs else None
    live = None
    if backend.skip_rows:
        live = torch.tensor([b not in backend.skip_rows for b in range(bs)], dtype=torch.int32).to(device)
    backend.kernel_batch = (forward_batch, (live, mask, longest))
    return live, mask, longest


def decode_shaped_rows(q, keys, values, prefix, scale, gqa, window=None, sinks=None, cap=None):
    """Deterministic mode: verify row j computed exactly as SGLang's torch_native decode
    computes a one-token step at that position (same call, shapes, strides and, on a
    sliding-window layer, the same window mask), so its output is bit-equal to decode's.
    Valid for a linear chain (row j sees the prefix and rows 0..j). q: [n, H_q, D];
    keys/values: [prefix + n, H_kv, D]. A layer with attention sinks or a soft cap decodes
    by ``cpu.attention.explicit_attention`` (``install_cpu_extend_attention``): each row is
    that function's one-token step at its position."""
    if sinks is not None or cap is not None:
        from sgl_vericache.cpu.attention import explicit_attention as decode_step

        out = q.new_empty((q.shape[0], q.shape[1], values.shape[-1]))
        table = torch.arange(keys.shape[0], device=q.device)[None]
        for j in range(q.shape[0]):
            decode_step(q[j : j + 1], out[j : j + 1], keys, values, table, torch.zeros(1, dtype=torch.int64),
                        torch.tensor([prefix + j + 1]), [1], scale, window, sinks, cap)
        return out
    rows = []
    for j in range(q.shape[0]):
        end = prefix + j + 1
        mask = None
        if window is not None:
            positions = torch.arange(end, device=q.device).unsqueeze(0)
            mask = (positions <= end - 1) & (positions >= end - 1 - window)  # [1, end]
        o = F.scaled_dot_product_attention(
            q[j : j + 1].movedim(0, 1).unsqueeze(0),  # [1, H_q, 1, D]
            keys[:end].movedim(0, 1).unsqueeze(0),
            values[:end].movedim(0, 1).unsqueeze(0),
            attn_mask=mask, enable_gqa=gqa, scale=scale, is_causal=False,
        )
        rows.append(o.squeeze(0).movedim(1, 0))  # [1, H_q, Dv]
    return torch.cat(rows)


def verify_tree_mask(forward_batch, bs, n, device):
    mask = getattr(forward_batch.spec_info, "custom_mask", None)
    if mask is None or mask.numel() != bs * n * n:
        return torch.tril(torch.ones(n, n, dtype=torch.bool, device=device)).expand(bs, n, n)
    return mask.reshape(bs, n, n).to(torch.bool)


@contextmanager
def capturing_queries(backend, captured: dict, rids: list, windows: list):
    """While an extend batch runs through SGLang's own attention backend, keep each request's
    trailing prompt queries (SnapKV / H2O score the prompt by them), the last ``windows[i]``
    of request i, in ``captured`` (rid -> {layer_id: [W, H_q, D]}). The backend object stays the one the model sees, so a model that
    tests its class (Gemma 3 multimodal on Triton: its image tokens' bidirectional mask) still
    matches: only this instance's ``forward`` is shadowed, and restored on the way out."""
    original = backend.forward
    own = "forward" in vars(backend)  # an instance attribute of its own, restored as it was

    def forward(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_extend():
            capture_queries(captured, rids, q, layer, forward_batch, windows)
        return original(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    backend.forward = forward
    try:
        yield
    finally:
        if own:
            backend.forward = original
        else:
            del backend.forward


def capture_queries(captured: dict, rids: list, q, layer, forward_batch, windows: list):
    """Keep the trailing prompt queries of each request in an extend batch: the last
    ``windows[i]`` of request i (what its compressor reads; 0: none), at most
    MAX_CAPTURED_QUERIES, a request and layer, each kept in a tensor of its own (a slice of
    a longer copy would hold the whole chunk's memory until the request's first round)."""
    q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)  # [tokens, H_q, D]
    lens = forward_batch.extend_seq_lens_cpu
    lens = lens.tolist() if hasattr(lens, "tolist") else list(lens)
    start = 0
    for rid, n, window in zip(rids, lens, windows):
        keep = min(window, MAX_CAPTURED_QUERIES)
        if keep > 0:
            per_layer = captured.setdefault(rid, {})
            prev = per_layer.get(layer.layer_id)
            new = q[max(start, start + n - keep) : start + n].detach()
            if prev is not None and new.shape[0] < keep:
                new = torch.cat([prev[-(keep - new.shape[0]):], new])  # a new tensor
            else:
                new = new.clone()
            per_layer[layer.layer_id] = new
        start += n


def install_cpu_extend_attention(runtime: Runtime) -> None:
    """``torch_native`` extends (prefills) compute only the new tokens' rows
    (``cpu.attention.extend_attention``) instead of a causal attention over prefix + new
    rows of which the prefix rows are thrown away. Every engine that loads the plugin gets
    it, speculation on or off. Encoder, cross-attention and sliding-window layers keep
    SGLang's code. And its extends and decodes take a layer's attention sinks and apply its
    logit soft cap, as SGLang's CUDA backends do and torch_native does not (it refuses the
    sinks and ignores the cap: ``cpu_explicit_forward``)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sgl_vericache.cpu.attention import extend_attention

    def make(original):
        def run_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                       extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                       causal=False, is_cross_attn=False, sliding_window_size=None):
            if encoder_lens is not None or is_cross_attn or (sliding_window_size is not None
                                                             and sliding_window_size > -1):
                return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                                is_cross_attn, sliding_window_size)
            return extend_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                    extend_prefix_lens, extend_seq_lens, scaling=scaling, enable_gqa=enable_gqa,
                                    causal=causal)

        return run_extend

    patch(TorchNativeAttnBackend, "_run_sdpa_forward_extend", runtime, make)

    def make_explicit_extend(original):
        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
            if (sinks is None and logit_cap(layer) is None) or kwargs or layer.is_cross_attention:
                return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            return cpu_explicit_forward(self, q, k, v, layer, forward_batch, save_kv_cache, sinks,
                                        forward_batch.extend_seq_lens.tolist())

        return forward_extend

    def make_explicit_decode(original):
        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
            if (sinks is None and logit_cap(layer) is None) or kwargs or layer.is_cross_attention:
                return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            return cpu_explicit_forward(self, q, k, v, layer, forward_batch, save_kv_cache, sinks,
                                        [1] * forward_batch.batch_size)

        return forward_decode

    # models with attention sinks (gpt-oss, Granite-SWA, MiMo-V2) pass them to every attention
    # call, which torch_native takes no argument for (a TypeError at the first forward); a
    # soft-capped layer's (Gemma 2, Grok) cap it ignores, computing another model's attention
    patch(TorchNativeAttnBackend, "forward_extend", runtime, make_explicit_extend)
    patch(TorchNativeAttnBackend, "forward_decode", runtime, make_explicit_decode)


def cpu_explicit_forward(backend, q, k, v, layer, forward_batch, save_kv_cache, sinks, new_lens):
    """torch_native's extend / decode for a layer with attention sinks or a logit soft cap:
    the KV written as torch_native writes it, then ``cpu.attention.explicit_attention`` over
    each request's positions (its sliding window, if the layer has one)."""
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from sgl_vericache.cpu.attention import explicit_attention

    if layer.attn_type == AttentionType.ENCODER_ONLY:
        raise NotImplementedError("attention sinks or a soft cap on an encoder layer: the CPU engine computes "
                                  "them for causal decoder layers only")
    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc,
                                                                 backend.swa_out_cache_loc), k, v)
    hq = layer.tp_q_head_num
    out = q.new_empty((q.numel() // (hq * layer.qk_head_dim), hq * layer.v_head_dim))
    explicit_attention(q.reshape(-1, hq, layer.qk_head_dim), out.view(-1, hq, layer.v_head_dim),
                       backend.token_to_kv_pool.get_key_buffer(layer.layer_id),
                       backend.token_to_kv_pool.get_value_buffer(layer.layer_id),
                       backend.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                       new_lens, layer.scaling, sliding_window(layer), sinks, logit_cap(layer))
    return out
