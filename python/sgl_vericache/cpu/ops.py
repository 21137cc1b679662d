"""Pure-torch implementations of the ``sgl_kernel`` CPU ops that SGLang's CPU engine calls
on our code paths (served by ``cpu.compat`` when no usable sgl_kernel is installed).

Each op follows the signature and in-place semantics of the op of the same name in
SGLang's CPU kernel build (``sgl-kernel/csrc/cpu``) and of its Triton/CUDA twin; the
twin named in each docstring is the reference its semantics were read from. Index
tensors are small (batch x draft width), so clarity beats micro-optimisation here; the
ragged copies are vectorised, the tree walks are short host loops.

The speculative tree ops (verify / build / reconstruct) live in ``ops_spec``.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np
import torch

from sgl_vericache.cpu import ops_spec as cpu_ops_spec

# --- model ops (dense Llama) ------------------------------------------------------------


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    x = input.float()
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(rmsnorm(residual, weight, eps))


def silu_and_mul(input, out=None, enable_pdl=None):
    d = input.shape[-1] // 2
    y = torch.nn.functional.silu(input[..., :d]) * input[..., d:]
    if out is None:
        return y
    out.copy_(y)
    return out


# --- KV pool ----------------------------------------------------------------------------


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every KV buffer (given by its base address and row size in bytes), copy the
    rows at ``src_loc`` onto the rows at ``tgt_loc``. Twin: ``copy_all_layer_kv_cache_tiled``
    (kernels/ops/kvcache/cache_move.py). All rows are read before any is written, so
    overlapping src/tgt sets are safe, as in the twin."""
    # data_ptrs: [n_buffers] uint64 addresses; strides: [n_buffers] row bytes
    # tgt_loc, src_loc: [n] slot indices (the caller already sliced them to n)
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64).numpy()
    tgt = tgt_loc.to(torch.int64).numpy()
    rows = int(max(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buf = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        view = np.frombuffer(buf, dtype=np.uint8).reshape(rows, int(stride))
        view[tgt] = view[src]  # fancy-index read makes a copy first


# --- req_to_token <-> out_cache_loc -----------------------------------------------------


def _ragged_slots(req_pool_indices, start_offset, end_offset):
    """(row, col) of every req_to_token cell in the per-request windows [start, end),
    requests back to back in batch order (the layout of the packed side)."""
    lens = (end_offset - start_offset).to(torch.int64)  # [bs]
    owner = torch.repeat_interleave(torch.arange(lens.numel()), lens)  # [total]
    packed_start = torch.cumsum(lens, 0) - lens  # [bs] exclusive prefix sum
    within = torch.arange(owner.numel()) - packed_start[owner]
    rows = req_pool_indices.to(torch.int64)[owner]
    cols = start_offset.to(torch.int64)[owner] + within
    return rows, cols


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """Scatter: ``req_to_token[rpi[b], start[b]:end[b]] = out_cache_loc[packed window b]``.
    Twin: ``assign_req_to_token_pool`` (srt/mem_cache/allocation.py)."""
    # req_to_token: [max_reqs, pool_len] int32; out_cache_loc: [sum(end-start)] int64
    assert req_to_token.shape[1] == pool_len
    rows, cols = _ragged_slots(req_pool_indices, start_offset, end_offset)
    req_to_token[rows, cols] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """Gather: ``out_cache_loc[packed window b] = req_to_token[rpi[b], start[b]:end[b]]``.
    Twin: ``assign_extend_cache_locs`` (kernels/ops/speculative/cache_locs.py). Entries of
    ``out_cache_loc`` past the packed total are left untouched."""
    assert req_to_token.shape[1] == pool_len
    rows, cols = _ragged_slots(req_pool_indices, start_offset, end_offset)
    out_cache_loc[: rows.numel()] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
):
    """Gather each request's ``topk * num_steps`` slots from ``seq_lens[b]`` on into
    ``out_cache_loc[b * topk * num_steps:]``. Twin: ``assign_draft_cache_locs_contiguous``
    (kernels/ops/speculative/cache_locs.py; the CPU path writes no positions)."""
    assert req_to_token.shape[1] == pool_len
    width = topk * num_steps
    bs = seq_lens.numel()
    cols = seq_lens.to(torch.int64)[:, None] + torch.arange(width)  # [bs, width]
    rows = req_pool_indices.to(torch.int64)[:, None].expand(bs, width)
    out_cache_loc[: bs * width] = req_to_token[rows, cols].flatten().to(out_cache_loc.dtype)


# --- accept bookkeeping -----------------------------------------------------------------


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact the slots of accepted tokens: the k-th entry of ``accept_index`` (flattened,
    row-major) that is not -1 contributes ``out_cache_loc[accept_index]`` at position k'
    = number of non -1 entries before it. Twin: ``fill_accept_out_cache_loc``
    (kernels/ops/speculative/eagle.py). The tail of ``accept_out_cache_loc`` is untouched."""
    # accept_index: [bs, accept_width] int32, -1 = not accepted (global verify-token index)
    flat = accept_index.flatten().to(torch.int64)
    picked = flat[flat != -1]
    accept_out_cache_loc[: picked.numel()] = out_cache_loc[picked].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """``bonus_tokens[b] = accept_tokens[b * accept_stride + accept_lens[b] - 1]`` (the last
    accepted token; ``accept_lens`` counts the bonus). Twin: ``fill_bonus_tokens``
    (kernels/ops/speculative/eagle.py)."""
    bs = accept_lens.numel()
    idx = torch.arange(bs) * accept_stride + accept_lens.to(torch.int64) - 1
    bonus_tokens[:bs] = accept_tokens.flatten()[idx].to(bonus_tokens.dtype)


# --- sampling ----------------------------------------------------------------------------

def _rotl32(x, r: int):
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _murmur_key(k):
    return _rotl32(k * np.uint32(0xCC9E2D51), 15) * np.uint32(0x1B873593)


def _murmur_mix(h, k):
    return _rotl32(h ^ _murmur_key(k), 13) * np.uint32(5) + np.uint32(0xE6546B64)


def murmur_hash32_cpu(seed, positions, col_indices):
    """MurmurHash3 (32-bit) of (seed as two 32-bit blocks, position, column) per element:
    [n] x [n] x [m] -> [n, m] uint32. The seeded sampler turns it into Gumbel noise, so the
    draw at a position depends only on (seed, position). Twin: ``murmur_hash32_kernel``
    (Triton, sglang/kernels/ops/sampling/murmur_hash.py). numpy uint32 arithmetic wraps
    mod 2**32 as the hash needs (torch has no uint32 shifts)."""
    bits = seed.to(torch.int64).numpy().view(np.uint64)  # the seed's uint64 bit pattern
    lo = (bits & np.uint64(0xFFFFFFFF)).astype(np.uint32)[:, None]
    hi = (bits >> np.uint64(32)).astype(np.uint32)[:, None]
    pos = positions.to(torch.int64).numpy().astype(np.uint32)[:, None]  # low 32 bits
    col = col_indices.to(torch.int64).numpy().astype(np.uint32)[None, :]
    with np.errstate(over="ignore"):
        h = np.zeros_like(lo)
        h = _murmur_mix(h, lo)
        h = _murmur_mix(h, hi)
        h = _murmur_mix(h, pos)
        h = _murmur_mix(h, col)  # [n, m] from here on
        h ^= np.uint32(16)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return torch.from_numpy(np.ascontiguousarray(h)).view(torch.uint32)


OPS: dict[str, Callable] = {
    "rmsnorm": rmsnorm,
    "fused_add_rmsnorm": fused_add_rmsnorm,
    "silu_and_mul": silu_and_mul,
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs_cpu,
    "assign_draft_cache_locs_contiguous_cpu": assign_draft_cache_locs_contiguous_cpu,
    "fill_accept_out_cache_loc_cpu": fill_accept_out_cache_loc_cpu,
    "fill_bonus_tokens_cpu": fill_bonus_tokens_cpu,
    "murmur_hash32_cpu": murmur_hash32_cpu,
    **cpu_ops_spec.OPS,
}
