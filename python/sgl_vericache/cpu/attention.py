"""Full-KV attention for the CPU engine, shared by every arm (speculation on or off).

SGLang's ``torch_native`` backend computes an extend (prefill) of ``n`` new tokens after a
cached prefix of ``p`` tokens as a causal attention of ``p + n`` queries, of which it keeps
the last ``n`` (the first ``p`` rows are uninitialized and thrown away). On a prefix hit
that is quadratic in the prefix: the one new token of a 4 x 8k cached prompt cost ~80 s
on this 2-core CPU. ``extend_attention`` computes only the ``n`` rows that are kept, each
seeing the prefix and the new tokens up to itself, in query blocks whose mask and keys
stop at the block's last visible key. With no prefix it makes SGLang's own call.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

QUERY_BLOCK = 1024  # rows per SDPA call when a prefix is cached (bounds the mask to QUERY_BLOCK x keys)


def extend_attention(
    query: torch.Tensor,  # [num_tokens, H_q, D] the batch's new tokens
    output: torch.Tensor,  # [num_tokens, H_q, Dv], written in place
    k_cache: torch.Tensor,  # [slots, H_kv, D]
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,  # [rows, max_len] slot of each position
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs] prefix + new
    extend_prefix_lens: torch.Tensor,  # [bs]
    extend_seq_lens: torch.Tensor,  # [bs]
    scaling=None,
    enable_gqa: bool = False,
    causal: bool = True,
) -> torch.Tensor:
    """Causal (or, with ``causal=False``, all-visible) attention of each request's new
    tokens over its whole KV: prefix and new tokens, already written to the cache."""
    rows, totals = req_pool_indices.tolist(), seq_lens.tolist()
    prefixes, news = extend_prefix_lens.tolist(), extend_seq_lens.tolist()
    start = 0
    for row, total, prefix, new in zip(rows, totals, prefixes, news):
        assert prefix + new == total, (prefix, new, total)
        if new == 0:
            continue
        q = query[start : start + new].movedim(0, 1)  # [H_q, new, D]
        slots = req_to_token[row, :total]
        keys = k_cache[slots].movedim(0, 1)  # [H_kv, total, D]
        values = v_cache[slots].movedim(0, 1)
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        out = output[start : start + new]  # [new, H_q, Dv]
        if prefix == 0 or not causal:
            # exactly SGLang's call when nothing is cached
            o = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                               enable_gqa=enable_gqa, scale=scaling, is_causal=causal)
            out.copy_(o.squeeze(0).movedim(1, 0))
        else:
            for b0 in range(0, new, QUERY_BLOCK):
                b1 = min(new, b0 + QUERY_BLOCK)
                visible_end = prefix + b1  # the block's last query sees keys [0, prefix + b1)
                key_pos = torch.arange(visible_end, device=q.device)
                query_pos = prefix + torch.arange(b0, b1, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]  # [b1 - b0, visible_end]
                o = F.scaled_dot_product_attention(
                    q[:, b0:b1].unsqueeze(0), keys[:, :visible_end].unsqueeze(0),
                    values[:, :visible_end].unsqueeze(0), attn_mask=mask, enable_gqa=enable_gqa, scale=scaling)
                out[b0:b1].copy_(o.squeeze(0).movedim(1, 0))
        start += new
    return output


EXPLICIT_QUERY_BLOCK = 512  # query rows per score matrix in explicit_attention (bounds it to 512 x keys x H_q)


def explicit_attention(
    query: torch.Tensor,  # [num_tokens, H_q, D] the batch's new tokens (a decode: one a request)
    output: torch.Tensor,  # [num_tokens, H_q, Dv], written in place
    k_cache: torch.Tensor,  # [slots, H_kv, D]
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,  # [rows, max_len] slot of each position
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs] every position, the new tokens' included
    new_lens: list[int],  # per request: its new tokens (the last ones of its positions)
    scaling: float,
    window: Optional[int] = None,  # a sliding-window layer's: position p sees p - window .. p
    sinks: Optional[torch.Tensor] = None,  # [H_q] the layer's attention sinks
    cap: Optional[float] = None,  # the layer's logit soft cap
) -> torch.Tensor:
    """Causal attention written out, for what SGLang's ``torch_native`` backend does not
    compute: attention sinks (gpt-oss, Granite-SWA, MiMo-V2: each query head's softmax gets
    one more term, exp(sink), in its denominator) and a logit soft cap (Gemma 2, Grok:
    scores cap * tanh(score / cap)), as SGLang's CUDA kernels apply them. fp32, the new
    tokens' rows only, EXPLICIT_QUERY_BLOCK rows at a time. Deterministic verify calls it
    for one row at a time, exactly as a decode step does."""
    group = query.shape[1] // k_cache.shape[1]
    sink = None if sinks is None else sinks.float()[:, None, None]  # [H_q, 1, 1]
    start = 0
    for row, total, new in zip(req_pool_indices.tolist(), seq_lens.tolist(), new_lens):
        if new == 0:
            continue
        prefix = total - new
        slots = req_to_token[row, :total]
        keys = k_cache[slots].float().movedim(0, 1).repeat_interleave(group, 0)  # [H_q, total, D]
        values = v_cache[slots].float().movedim(0, 1).repeat_interleave(group, 0)
        for b0 in range(0, new, EXPLICIT_QUERY_BLOCK):
            b1 = min(new, b0 + EXPLICIT_QUERY_BLOCK)
            q = query[start + b0 : start + b1].float().movedim(0, 1)  # [H_q, rows, D]
            end = prefix + b1  # the block's last query sees keys [0, end)
            key_pos = torch.arange(end, device=q.device)
            query_pos = prefix + torch.arange(b0, b1, device=q.device)
            visible = key_pos[None, :] <= query_pos[:, None]
            if window is not None:
                visible &= key_pos[None, :] >= query_pos[:, None] - window
            scores = q @ keys[:, :end].transpose(1, 2) * scaling
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            scores = scores.masked_fill(~visible, float("-inf"))
            if sink is None:
                probs = torch.softmax(scores, -1)
            else:
                probs = torch.softmax(torch.cat([scores, sink.expand(-1, b1 - b0, 1)], -1), -1)[..., :-1]
            output[start + b0 : start + b1] = (probs @ values[:, :end]).movedim(1, 0).to(output.dtype)
        start += new
    return output
