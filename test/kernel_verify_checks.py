"""The verify kernel (sgl_vericache.kernels.verify) against SDPA, and the verify backend's two
paths against each other. Cases for kernel_checks.py (family ``verify``); not a pytest module.

The pool is SGLang's layout: [slots, H_kv, D] buffers, a token table whose rows are
requests (not in batch order) and whose slots are scattered; each request's block tokens
sit right after its prefix in the table, as a verify forward writes them.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from sgl_vericache.kernels import verify as kv
from sgl_vericache.sglang import attention

from kernel_fixtures import Case, Shape, _close, _gen, _kv
from kernel_store_checks import LaunchKeys, _compiled_count, _run_launches

SCALE = 0.11


def _pool(shape: Shape, tokens: int, device, seed: int = 0):
    """(k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens) for requests with
    shape.lengths verified tokens and ``tokens`` block tokens each."""
    bs = len(shape.lengths)
    need = sum(shape.lengths) + bs * tokens
    slots = torch.randperm(need + 13, generator=_gen(seed))
    k_buffer, v_buffer = _kv(need + 13, shape, seed + 1)
    table = torch.zeros(bs + 3, max(shape.lengths) + tokens + 5, dtype=torch.int32)
    rows = torch.randperm(bs + 3, generator=_gen(seed + 2))[:bs]
    start = 0
    for b, n in enumerate(shape.lengths):
        table[rows[b], : n + tokens] = slots[start : start + n + tokens].to(torch.int32)
        start += n + tokens
    prefix = torch.tensor(shape.lengths, dtype=torch.int64)
    return (t.to(device) for t in (k_buffer, v_buffer, table, rows, prefix))


def _reference(q, k_buffer, v_buffer, table, rows, prefix, mask, live, window=None, softcap=None, sinks=None):
    """fp32 SDPA per request over its gathered K/V: token j sees the prefix and mask[b, j]
    (with a window: only positions from prefix + j - window on; with a soft cap, scores
    cap * tanh(score / cap), by hand; with attention sinks [H_q], a softmax over the scores
    and the head's sink, the sink's share dropped)."""
    bs, tokens, hq, d = q.shape
    out = torch.zeros(bs, tokens, hq, d)
    for b in range(bs):
        if not live[b]:
            continue
        n = int(prefix[b])
        slots = table[rows[b], : n + tokens].long().cpu()
        k, v = k_buffer.cpu()[slots].float(), v_buffer.cpu()[slots].float()
        visible = torch.cat([torch.ones(tokens, n, dtype=torch.bool), mask[b].cpu()], dim=1)
        if window is not None:
            positions = torch.arange(n + tokens)
            visible &= positions[None, :] >= positions[n:, None] - window
        qb = q[b].cpu().float().transpose(0, 1)
        if softcap or sinks is not None:
            g = hq // k.shape[1]
            scores = qb @ k.repeat_interleave(g, 1).permute(1, 2, 0) * SCALE
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                scores = torch.cat([scores, sinks.cpu().float()[:, None, None].expand(-1, tokens, 1)], -1)
            p = torch.softmax(scores, -1)[..., : n + tokens]
            o = p @ v.repeat_interleave(g, 1).transpose(0, 1)
        else:
            o = F.scaled_dot_product_attention(qb, k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible,
                                               scale=SCALE, enable_gqa=hq != k.shape[1])
        out[b] = o.transpose(0, 1)
    return out


def _mask(bs: int, tokens: int, tree: bool, seed: int) -> torch.Tensor:
    if not tree:
        return torch.tril(torch.ones(tokens, tokens, dtype=torch.bool)).expand(bs, tokens, tokens)
    mask = torch.rand(bs, tokens, tokens, generator=_gen(seed)) < 0.4  # any mask, not only a tree's
    return mask | torch.eye(tokens, dtype=torch.bool)


def check_verify_kernel(shape: Shape, tokens: int, device, tree: bool = False, skip: tuple[int, ...] = (),
                        num_splits: int = 1, block_n: int = 16, seed: int = 0, window: int | None = None,
                        softcap: float | None = None, sinks: bool = False, **launch) -> float:
    k_buffer, v_buffer, table, rows, prefix = _pool(shape, tokens, device, seed)
    bs, hq = len(shape.lengths), shape.kv_heads * shape.group
    q = torch.randn(bs, tokens, hq, shape.head_dim, generator=_gen(seed + 7)).to(shape.dtype).to(device)
    mask = _mask(bs, tokens, tree, seed + 8)
    live = torch.tensor([b not in skip for b in range(bs)], dtype=torch.int32)
    sink = _sinks(hq, seed, device) if sinks else None
    out = kv.verify_attention(q, k_buffer, v_buffer, table, rows, prefix, SCALE, live=live.to(device),
                              mask=mask.to(device) if tree else None, num_splits=num_splits, block_n=block_n,
                              window=window, softcap=softcap, sinks=sink, **launch)
    assert out.dtype == q.dtype and out.shape == q.shape, (out.dtype, out.shape)
    assert all(bool((out[b] == 0).all()) for b in skip), "a request not verified must get zeros"
    ref = _reference(q, k_buffer, v_buffer, table, rows, prefix, mask, live, window, softcap, sink)
    return _close(out, ref, shape.dtype, f"verify T={tokens}")


def _sinks(num_q_heads: int, seed: int, device) -> torch.Tensor:
    """Attention sinks as a model holds them ([H_q], bf16 as gpt-oss loads them), large enough
    to take a good share of each head's softmax (gpt-oss's reach several units)."""
    return (2.0 + 2.0 * torch.randn(num_q_heads, generator=_gen(seed + 11))).to(torch.bfloat16).to(device)


def _kv_pool(k_buffer, v_buffer):
    """A KV pool as verify reads one: every layer's buffers are these."""
    return SimpleNamespace(get_key_buffer=lambda layer_id: k_buffer, get_value_buffer=lambda layer_id: v_buffer)


def check_verify_backend(shape: Shape, tokens: int, device, skip: tuple[int, ...] = (), seed: int = 3,
                         window: int | None = None, logit_cap: float = 0.0, sinks: bool = False,
                         full_layout: bool = False) -> float:
    """sglang/attention.py's verify_attention with its kernel on (what CUDA runs) against
    the same call on its torch path, from the same forward batch, chain mask, deferred rows
    and (a layer's ``sliding_window_size``) window; with a ``logit_cap``, as a CUDA backend
    whose decode caps the scores; with ``sinks``, a layer's attention sinks. The verify mask
    is laid out as NGRAM builds it on CPU ([bs, n, n]), or with ``full_layout`` as on CUDA
    (each request's [n, prefix + n] rows, prefix all visible)."""
    k_buffer, v_buffer, table, rows, prefix = _pool(shape, tokens, device, seed)
    bs, hq, d = len(shape.lengths), shape.kv_heads * shape.group, shape.head_dim
    q = torch.randn(bs * tokens, hq * d, generator=_gen(seed + 7)).to(shape.dtype).to(device)
    layer = SimpleNamespace(tp_q_head_num=hq, qk_head_dim=d, v_head_dim=d, layer_id=0, scaling=SCALE,
                            sliding_window_size=-1 if window is None else window, is_cross_attention=False,
                            logit_cap=logit_cap)
    mask = _mask(bs, tokens, False, 0).flatten()
    if full_layout:
        chain = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool))
        mask = torch.cat([torch.cat([torch.ones(tokens, int(p), dtype=torch.bool), chain], 1).flatten()
                          for p in prefix.cpu()])
    batch = SimpleNamespace(batch_size=bs, seq_lens=prefix, seq_lens_cpu=prefix.cpu(), req_pool_indices=rows,
                            spec_info=SimpleNamespace(custom_mask=mask.to(device)))

    def backend(kernel: bool):
        return SimpleNamespace(runtime=SimpleNamespace(parking=None), token_to_kv_pool=_kv_pool(k_buffer, v_buffer),
                               req_to_token_pool=SimpleNamespace(req_to_token=table), skip_rows=frozenset(skip),
                               deterministic=False, kernel=kernel)

    sink = _sinks(hq, seed, device) if sinks else None
    on = backend(True)
    got = attention.verify_attention(on, q, layer, batch, sink)
    assert on.kernel, "the kernel path fell back to torch"
    shared = on.kernel_batch  # made at the first layer, reused by the next ones of this forward
    assert shared[0] is batch and torch.equal(attention.verify_attention(on, q, layer, batch, sink), got)
    assert on.kernel_batch is shared
    ref = attention.verify_attention(backend(False), q, layer, batch, sink)
    assert got.shape == ref.shape == (bs * tokens, hq * d), (got.shape, ref.shape)
    return _close(got, ref, shape.dtype, "verify backend, kernel vs torch")


def check_verify_matches_sglang_decode(device, window: int | None = None) -> float:
    """What sinks mean is SGLang's to say: each verify row of a round (the verify backend's
    torch path and its kernel, a layer with attention sinks) against SGLang's own Triton
    decode kernel (``decode_attention_fwd``, what its triton backend runs for gpt-oss) of
    one token at that row's position, with the layer's sinks and, on a sliding-window
    layer, the window's positions only (as SGLang's backend gives its decode)."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    shape, tokens, seed = Shape((23, 9), kv_heads=2, group=3), 4, 5
    k_buffer, v_buffer, table, rows, prefix = _pool(shape, tokens, device, seed)
    bs, hq, d = len(shape.lengths), shape.kv_heads * shape.group, shape.head_dim
    q = torch.randn(bs * tokens, hq * d, generator=_gen(seed + 7)).to(device)
    sinks = _sinks(hq, seed, device)
    decode = torch.empty(bs * tokens, hq, d, device=device)
    splits = 2
    for b in range(bs):
        for j in range(tokens):
            pos = int(prefix[b]) + j
            first = 0 if window is None else max(0, pos - window)
            indices = table[rows[b], first : pos + 1].to(torch.int32)
            indptr = torch.tensor([0, indices.numel()], dtype=torch.int32, device=device)
            logits = torch.empty(1, hq, splits, d, dtype=torch.float32, device=device)
            lse = torch.empty(1, hq, splits, dtype=torch.float32, device=device)
            row = b * tokens + j
            decode_attention_fwd(q[row].view(1, hq, d), k_buffer, v_buffer, decode[row : row + 1], indptr, indices,
                                 logits, lse, torch.full((1,), splits, dtype=torch.int32, device=device), splits,
                                 SCALE, 1.0, 1.0, sinks=sinks)
    layer = SimpleNamespace(tp_q_head_num=hq, qk_head_dim=d, v_head_dim=d, layer_id=0, scaling=SCALE,
                            sliding_window_size=-1 if window is None else window, is_cross_attention=False,
                            logit_cap=0.0)
    batch = SimpleNamespace(batch_size=bs, seq_lens=prefix, seq_lens_cpu=prefix.cpu(), req_pool_indices=rows,
                            spec_info=None)
    worst = 0.0
    for kernel, deterministic in ((False, False), (False, True), (True, False)):
        backend = SimpleNamespace(runtime=SimpleNamespace(parking=None), token_to_kv_pool=_kv_pool(k_buffer, v_buffer),
                                  req_to_token_pool=SimpleNamespace(req_to_token=table), skip_rows=(),
                                  deterministic=deterministic, kernel=kernel)
        got = attention.verify_attention(backend, q, layer, batch, sinks)
        label = f"verify with sinks (kernel {kernel}, deterministic {deterministic}) vs SGLang decode"
        worst = max(worst, _close(got, decode.reshape(bs * tokens, hq * d), torch.float32, label))
    return worst


def check_verify_refuses(device) -> float:
    """What the kernel cannot read is refused by name (the backend then keeps torch)."""
    k = torch.zeros(8, 2, 64, device=device)
    for why, args in (("head dims", (4, 64, 32, k, k)), ("query heads", (3, 64, 64, k, k)),
                      ("pool", (4, 64, 64, k.to(torch.int8), k.to(torch.int8)))):
        reason = kv.unsupported(*args)
        assert reason and why in reason, (why, reason)
    assert kv.unsupported(4, 64, 64, k, k) is None
    return 0.0


def check_verify_warm_up(device) -> float:
    """spec.warm_up.warm_verify compiles every verify kernel variant later rounds launch:
    blocks of every length up to its bound, other batch sizes, prefix lengths and token
    table widths, deferred rows, through the verify backend, launch no kernel whose Triton
    cache key the warm-up did not (and on CUDA, compile nothing new); for a model that
    soft-caps its scores (the layout's ``logit_cap``), the capped variant's; for one with
    attention sinks, the merge variant that adds them."""
    from sgl_vericache.spec.warm_up import HeadLayout, warm_verify

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for cap, sinks in ((0.0, False), (30.0, False), (0.0, True)):
        with LaunchKeys(run=_run_launches()) as warm:  # the rounds below run theirs: they check values
            warm_verify(HeadLayout(8, 2, 64, dtype, dtype, logit_cap=cap, sinks=sinks), 9, device)
        assert any(name == "_verify_split_kernel" for name, _ in warm.keys), warm.keys
        compiled = _compiled_count(device)
        with LaunchKeys() as real:
            for tokens, lengths, skip, full in ((1, (5,), (), False), (3, (40, 17), (0,), False),
                                                (6, (90, 3, 33), (), True), (9, (64, 70), (1,), False),
                                                (9, (64, 70), (), True)):  # full: the mask as NGRAM lays it out on CUDA
                check_verify_backend(Shape(lengths, kv_heads=2, group=4, dtype=dtype), tokens, device, skip=skip,
                                     logit_cap=cap, sinks=sinks, full_layout=full)
        missing = real.keys - warm.keys
        assert real.keys and not missing, f"cap {cap} sinks {sinks}: {len(missing)} verify launch variants the warm-up did not " + \
            "compile: " + "; ".join(f"{name} {key[:300]}" for name, key in sorted(missing))
        assert _compiled_count(device) == compiled, (cap, compiled, _compiled_count(device))
    return 0.0


def verify_cases() -> list[Case]:
    cases = []
    for shape, tokens, tree, skip, splits in (
        (Shape((45, 70, 3)), 4, False, (), 1),  # GQA 3, ragged, prefixes not multiples of the block
        (Shape((45, 70, 3)), 4, False, (1,), 4),  # a deferred request; splits, one with nothing to read
        (Shape((0, 33), kv_heads=3, group=1), 1, False, (), 2),  # MHA; an empty prefix; a one-token block
        (Shape((40, 17), kv_heads=1, group=8, head_dim=128, dtype=torch.bfloat16), 17, True, (), 2),  # 2 chunks
        (Shape((21,), kv_heads=2, group=3, head_dim=96), 17, True, (), 1),  # head_dim padded to 128
        (Shape((30, 5), kv_heads=2, group=1, dtype=torch.float16), 6, False, (0,), 2),
    ):
        name = (f"verify T={tokens} lengths={list(shape.lengths)} gqa={shape.group} d={shape.head_dim} "
                f"{str(shape.dtype)[6:]} {'mask' if tree else 'chain'} splits={splits}"
                + (f" skip={list(skip)}" if skip else ""))
        cases.append(Case(name, lambda dev, a=(shape, tokens, tree, skip, splits): check_verify_kernel(
            a[0], a[1], dev, tree=a[2], skip=a[3], num_splits=a[4]), family="verify", tags=("verify",)))
    # sliding windows: cut inside the prefix (unaligned, across splits), wider than a short
    # prefix, narrower than the block (under a chain and a mask), and 0 (each token alone)
    for shape, tokens, tree, splits, window in ((Shape((45, 70, 3)), 4, False, 4, 20),
                                                (Shape((33, 64), kv_heads=1, group=8), 9, False, 2, 5),
                                                (Shape((40,), kv_heads=2, group=2), 6, True, 1, 2),
                                                (Shape((17, 4), kv_heads=1, group=2), 3, False, 2, 0)):
        name = (f"verify window={window} T={tokens} lengths={list(shape.lengths)} gqa={shape.group} "
                f"{'mask' if tree else 'chain'} splits={splits}")
        cases.append(Case(name, lambda dev, a=(shape, tokens, tree, splits, window): check_verify_kernel(
            a[0], a[1], dev, tree=a[2], num_splits=a[3], window=a[4]), family="verify", tags=("verify", "window")))
    # launch sizes bench_kernels' verify search tries: fewer query rows a program (16: three
    # programs for 9 tokens at GQA 4), 8 warps, 3 stages, a 64-position block
    cases.append(Case("verify search launch: 16 query rows, block 64, 8 warps, 3 stages", lambda dev: check_verify_kernel(
        Shape((45, 70, 3), kv_heads=2, group=4), 9, dev, tree=True, num_splits=2, block_n=64, num_warps=8,
        num_stages=3, max_query_rows=16), family="verify", tags=("verify", "launch")))
    cases.append(Case("verify backend kernel vs torch path", lambda dev: check_verify_backend(
        Shape((50, 9, 31), kv_heads=2, group=4), 5, dev, skip=(1,)), family="verify", tags=("verify",)))
    cases.append(Case("verify backend kernel vs torch path, sliding window", lambda dev: check_verify_backend(
        Shape((50, 9, 31), kv_heads=2, group=4), 5, dev, window=12), family="verify", tags=("verify", "window")))
    cases.append(Case("verify soft-capped scores (cap 2)", lambda dev: check_verify_kernel(
        Shape((45, 70, 3), kv_heads=2, group=4), 5, dev, num_splits=2, softcap=2.0, window=30), family="verify",
        tags=("verify", "softcap")))
    cases.append(Case("verify backend kernel vs torch path, soft cap", lambda dev: check_verify_backend(
        Shape((50, 9, 31), kv_heads=2, group=4), 5, dev, skip=(2,), logit_cap=1.5), family="verify",
        tags=("verify", "softcap")))
    cases.append(Case("verify attention sinks (bf16, per query head)", lambda dev: check_verify_kernel(
        Shape((45, 70, 3), kv_heads=2, group=4), 5, dev, num_splits=2, sinks=True, window=30), family="verify",
        tags=("verify", "sinks")))
    cases.append(Case("verify backend kernel vs torch path, sinks", lambda dev: check_verify_backend(
        Shape((50, 9, 31), kv_heads=2, group=4), 5, dev, skip=(2,), sinks=True), family="verify",
        tags=("verify", "sinks")))
    if importlib.util.find_spec("sglang") is not None:  # the lent GPU machine has none
        cases.append(Case("verify with sinks equals SGLang's Triton decode at each position", lambda dev:
                          check_verify_matches_sglang_decode(dev), family="verify", tags=("verify", "sinks")))
        cases.append(Case("verify with sinks equals SGLang's Triton decode at each position, window 6", lambda dev:
                          check_verify_matches_sglang_decode(dev, window=6), family="verify",
                          tags=("verify", "sinks", "window")))
    cases.append(Case("verify warm-up compiles what rounds launch", check_verify_warm_up, family="verify",
                      tags=("verify", "warm")))
    cases.append(Case("verify kernel refuses what it cannot read", check_verify_refuses, family="verify",
                      tags=("verify",)))
    big = Shape((4000, 1500, 777), kv_heads=2, group=4, head_dim=128, dtype=torch.bfloat16)
    for tokens in (5, 17):
        cases.append(Case(f"verify default launch T={tokens} lengths={list(big.lengths)}", lambda dev, t=tokens:
                          check_verify_kernel(big, t, dev, num_splits=None, block_n=kv.VERIFY_BLOCK_N),
                          family="large", interpret=False, tags=("verify",)))
    return cases
