"""Host side of the verify kernel (triton_verify.py): a round's verify block over the full
paged KV pool, one launch for the whole batch plus the split merge.

    out = verify_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, scale)

q [B, T, H_q, D]: each request's T block tokens (their K/V already written to the pool at
the table's positions prefix .. prefix + T - 1). Token j sees positions [0, prefix + j]
(``mask=None``: a linear chain, what VERICACHE drafts) or the prefix and the block tokens
``mask[b, j]`` marks. The result is [B, T, H_q, D] in q.dtype: what SDPA computes in fp32
over each request's gathered K/V under that mask, up to the summation order and, in bf16 /
fp16, the probabilities rounded to that dtype before P @ V.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import triton_verify as tv
from .ops import LOG2E, _combine, _partials, _pow2, check_softcap, choose_splits, dot_modes

VERIFY_QUERY_ROWS = 128  # the most query rows (block tokens x GQA heads) one program holds
VERIFY_BLOCK_N = 32
MAX_HEAD_DIM = 256


def unsupported(q_heads: int, head_dim: int, v_head_dim: int, k_buffer: torch.Tensor,
                v_buffer: torch.Tensor) -> Optional[str]:
    """Why the kernel cannot serve this layer (None: it can). The caller keeps its torch path."""
    if k_buffer.dim() != 3 or v_buffer.dim() != 3:
        return f"pool buffers of shape {tuple(k_buffer.shape)} (the kernel reads [slots, H, D])"
    if head_dim != v_head_dim or k_buffer.shape[2] != head_dim or v_buffer.shape[2] != head_dim:
        return f"key / value head dims {head_dim} / {v_head_dim} (the kernel needs them equal)"
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} > {MAX_HEAD_DIM}"
    if k_buffer.dtype not in (torch.bfloat16, torch.float16, torch.float32) or v_buffer.dtype != k_buffer.dtype:
        return f"a {k_buffer.dtype} / {v_buffer.dtype} pool (the kernel reads bf16, fp16 or fp32)"
    if k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        return "pool buffers whose head dim is strided"
    if q_heads % k_buffer.shape[1] or k_buffer.shape[1] != v_buffer.shape[1]:
        return f"{q_heads} query heads over {k_buffer.shape[1]} / {v_buffer.shape[1]} KV heads"
    return None


def query_rows(group: int, tokens: int, most: int = VERIFY_QUERY_ROWS) -> int:
    """QP: query rows a program holds, a power of two >= 16 (tl.dot's least) holding at
    least one token's GQA group; as many of the block's tokens as fit ``most``."""
    return max(16, _pow2(group), min(most, _pow2(group * tokens)))


def verify_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, scale: float, *,
                     live: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                     longest: Optional[int] = None, window: Optional[int] = None, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None, num_splits: Optional[int] = None,
                     block_n: int = VERIFY_BLOCK_N, num_warps: Optional[int] = None,
                     num_stages: int = 2, max_query_rows: int = VERIFY_QUERY_ROWS) -> torch.Tensor:
    """See the module docstring. ``live`` [B] (nonzero: verified; default all): a request
    not verified reads nothing and gets zeros. ``longest``: the most positions any request
    reads (prefix + T), known on the host (None: read from prefix_lens, a device sync).
    ``window``: a sliding-window layer's (token j at position prefix + j sees positions
    prefix + j - window .. on, as SGLang's decode); None: every position. ``softcap``: a
    soft-capped layer's cap (scores become cap * tanh(score / cap), as SGLang's CUDA
    backends apply ``logit_cap``); None: no cap. ``sinks`` [H_q]: a layer's attention sinks
    (one exp(sink) more in each query head's softmax denominator, as SGLang's decode kernels
    add it: gpt-oss, Granite-SWA); None: none. The launch sizes (``block_n``, ``num_warps``
    (None: 4 up to 64 query rows, 8 above), ``num_stages``, ``max_query_rows``: the most a
    program holds) are bench_kernels.py's verify search's to try; callers keep the defaults."""
    bs, tokens, num_q_heads, head_dim = q.shape
    why = unsupported(num_q_heads, head_dim, head_dim, k_buffer, v_buffer)
    if why:
        raise ValueError(f"verify kernel: {why}")
    if req_to_token.stride(1) != 1:
        raise ValueError("verify kernel: the token table's positions must be contiguous")
    device = q.device
    num_kv_heads = k_buffer.shape[1]
    group = num_q_heads // num_kv_heads
    qp = query_rows(group, tokens, max_query_rows)
    chunks = -(-tokens // (qp // group))
    dp = _pow2(head_dim)
    if longest is None:
        longest = int(prefix_lens.max()) + tokens if bs else 0
    if window is not None:
        if window < 0:
            raise ValueError(f"verify kernel: a sliding window of {window} positions (None: no window)")
        longest = min(longest, window + tokens)
    splits = _pow2(num_splits or choose_splits(bs * chunks * num_kv_heads, longest, block_n, device))
    live = torch.ones(bs, dtype=torch.int32, device=device) if live is None else live.to(device, torch.int32)
    tree = mask is not None
    if tree:
        if tuple(mask.shape) != (bs, tokens, tokens):
            raise ValueError(f"verify kernel: a mask of shape {tuple(mask.shape)} for {bs} x {tokens} tokens")
        mask = mask.to(device=device, dtype=torch.uint8).contiguous()
    rnd, dot = dot_modes(q.dtype, k_buffer.dtype)
    cap = check_softcap(softcap)
    q = q.reshape(bs * tokens, num_q_heads, head_dim).contiguous()
    m, l, acc = _partials(bs * tokens, num_q_heads, splits, dp, device)
    tv._verify_split_kernel[(bs * chunks, num_kv_heads, splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, live, mask if tree else live,
        m, l, acc, scale * LOG2E, tokens, num_kv_heads, num_q_heads, splits, req_to_token.stride(0),
        cap * LOG2E, -1 if window is None else int(window),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        GROUP=group, QP=qp, D=head_dim, DP=dp, BN=block_n, ROUND=rnd, DOT=dot, TREE=tree, SOFTCAP=cap > 0,
        num_warps=num_warps or (4 if qp <= 64 else 8), num_stages=num_stages,
    )
    out = _combine(m, l, acc, q.dtype, False, sinks)
    return out[..., :head_dim].reshape(bs, tokens, num_q_heads, head_dim)
