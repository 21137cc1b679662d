"""The compressed KV store drafts read (``spec/drafter.py``), on CPU: entries synced
incrementally from the full KV, seeded from a shared prefix, drafts over them equal to
causal attention over what they hold, batched rounds equal to each request alone. No
engine is started here."""

from __future__ import annotations

import pytest
import torch

from sgl_vericache.mem_cache.compress import causal_attention, get_compressor
from sgl_vericache.spec.drafter import CompressedKVStore


def _kv(tokens, heads=3, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads, dim, generator=g), torch.randn(tokens, heads, dim, generator=g)


def test_store_syncs_incrementally_and_drafts_over_true_kv():
    """With the uncompressed 'full' method, drafting over the store equals causal
    attention over the verified KV plus the round's provisional KV."""
    layers, k_all, v_all = 2, *_kv(40)
    reads = []

    def read_kv(layer_id, start, end):
        reads.append((layer_id, start, end))
        return k_all[start:end], v_all[start:end]

    store = CompressedKVStore(get_compressor("full"), num_layers=layers)
    store.sync("r", 30, read_kv)
    store.sync("r", 34, read_kv)  # only the 4 new verified tokens are read
    assert reads == [(0, 0, 30), (1, 0, 30), (0, 30, 34), (1, 30, 34)]
    assert store.cached_len("r") == 34
    store.check_integrity()
    q = torch.randn(2, 9, 16)
    k_new, v_new = _kv(2, seed=1)
    store.begin_round(["r"], steps=2)
    outs = [store.attend(0, q[i : i + 1], k_new[i : i + 1], v_new[i : i + 1], 0.25) for i in range(2)]
    for i in range(2):
        ref = causal_attention(q[i : i + 1], k_all[:34], v_all[:34], 0.25, k_new[: i + 1], v_new[: i + 1])
        torch.testing.assert_close(outs[i], ref)
    with pytest.raises(AssertionError):  # the round has room for 2 draft steps only
        store.attend(0, q[:1], k_new[:1], v_new[:1], 0.25)
    # a new round forgets the provisional KV; a shorter verified length rebuilds
    store.sync("r", 34, read_kv)
    store.begin_round(["r"], steps=1)
    out = store.attend(0, q[:1], k_new[:1], v_new[:1], 0.25)
    torch.testing.assert_close(out, outs[0])
    store.sync("r", 10, read_kv)
    assert store.cached_len("r") == 10 and reads[-1] == (1, 0, 10)
    store.release("r")
    assert "r" not in store and store.nbytes() == 0


def test_drafts_soft_cap_their_scores_as_the_layer_does():
    """A layer with a logit soft cap (Gemma 2, Grok: scores -> cap * tanh(score / cap)):
    drafting over the uncompressed 'full' store, one step at a time and teacher-forced,
    equals capped attention over the verified KV and the round's provisional KV, as the
    target's decode computes it; without the cap the drafts would read other weights (a
    tiny Gemma 2 with cap 2 took 18 verify rounds for 40 tokens on 'full', 5 with it)."""
    k_all, v_all = _kv(40, seed=5)
    q, (k_new, v_new) = torch.randn(3, 9, 16) * 4, _kv(3, seed=6)
    store = CompressedKVStore(get_compressor("full"), num_layers=1)
    store.sync("r", 40, lambda _, s, e: (k_all[s:e], v_all[s:e]))
    ref = causal_attention(q, k_all, v_all, 0.25, k_new, v_new, softcap=2.0)
    store.begin_round(["r"], steps=3)
    steps = torch.cat([store.attend(0, q[i : i + 1], k_new[i : i + 1], v_new[i : i + 1], 0.25, None, 2.0)
                       for i in range(3)])
    store.begin_round(["r"], steps=3)
    forced = store.attend_tokens(0, q, k_new, v_new, 0.25, None, 2.0)
    torch.testing.assert_close(steps, ref)
    torch.testing.assert_close(forced, ref)
    assert (ref - causal_attention(q, k_all, v_all, 0.25, k_new, v_new)).abs().max() > 0.05  # the cap binds
    with pytest.raises(ValueError, match="soft cap -1.0"):
        from sgl_vericache.kernels.ops import check_softcap

        check_softcap(-1.0)


def test_seeded_store_reads_only_the_tokens_after_the_shared_prefix():
    """A request seeded from a prefix entry (what the worker does on a compressed prefix
    hit) reads and appends only the tokens after it, drafts like a request that
    compressed everything itself ('full': the same KV either way), and never changes the
    shared entry; bad seeds are refused."""
    layers, k_all, v_all = 2, *_kv(40)
    reads = []

    def read_kv(layer_id, start, end):
        reads.append((layer_id, start, end))
        return k_all[start:end], v_all[start:end]

    comp = get_compressor("full")
    donor = CompressedKVStore(comp, num_layers=layers)
    donor.sync("a", 30, read_kv)
    _, shared, n = donor.entry("a")
    assert n == 30 and len(shared) == layers
    store = CompressedKVStore(comp, num_layers=layers)
    store.seed("b", comp, shared, 30)
    reads.clear()
    store.sync("b", 36, read_kv, compressor=comp)
    assert reads == [(0, 30, 36), (1, 30, 36)] and store.tokens_reused == 30
    assert all(layer.num_tokens == 30 for layer in donor.entry("a")[1])  # the shared entry is unchanged
    alone = CompressedKVStore(comp, num_layers=layers)
    alone.sync("c", 36, read_kv)
    q, (k_new, v_new) = torch.randn(1, 9, 16), _kv(1, seed=2)
    outs = []
    for st, rid in ((store, "b"), (alone, "c")):
        st.begin_round([rid], steps=1)
        outs.append(st.attend(0, q, k_new, v_new, 0.25))
    torch.testing.assert_close(outs[0], outs[1])
    with pytest.raises(ValueError, match="already has a compressed entry"):
        store.seed("b", comp, shared, 30)
    with pytest.raises(ValueError, match="a seed needs 2 layers of 29 tokens"):
        store.seed("d", comp, shared, 29)
    store.check_integrity()


@pytest.mark.parametrize("method", ["kivi4", "streamingllm", "snapkv"])
def test_attend_tokens_equals_one_attend_per_token(method):
    """Teacher forcing a prompt's known tokens in one pass (``attend_tokens``, what drafting
    during a storage fetch does) computes what one ``attend`` step per token computes, and
    drafting continues after it from the same buffer; per-query selection (Quest) is refused."""
    k_all, v_all = _kv(200, seed=3)
    comp = get_compressor(method, 4.0)
    q, (k_new, v_new) = torch.randn(7, 9, 16), _kv(7, seed=4)
    prompt_queries = [torch.randn(32, 9, 16)]  # SnapKV votes with them
    outs = []
    for block in (False, True):
        store = CompressedKVStore(comp, num_layers=1)
        store.sync("r", 200, lambda _, s, e: (k_all[s:e], v_all[s:e]), queries=prompt_queries)
        store.begin_round(["r"], steps=7)
        if block:
            got = [store.attend_tokens(0, q[:5], k_new[:5], v_new[:5], 0.25)]
        else:
            got = [store.attend(0, q[i : i + 1], k_new[i : i + 1], v_new[i : i + 1], 0.25) for i in range(5)]
        got += [store.attend(0, q[i : i + 1], k_new[i : i + 1], v_new[i : i + 1], 0.25) for i in (5, 6)]
        outs.append(torch.cat(got))
        with pytest.raises(AssertionError):  # the round's 7 steps are used up
            store.attend_tokens(0, q[:1], k_new[:1], v_new[:1], 0.25)
    torch.testing.assert_close(outs[1], outs[0])
    quest = CompressedKVStore(get_compressor("quest", 4.0, page_size=8), num_layers=1)
    quest.sync("r", 200, lambda _, s, e: (k_all[s:e], v_all[s:e]))
    quest.begin_round(["r"], steps=2)
    with pytest.raises(AssertionError, match="per-step selection"):
        quest.attend_tokens(0, q[:2], k_new[:2], v_new[:2], 0.25)


def _check_round(store, compressors, rows, steps, label):
    """One draft round over ``rows``: every step's batched output equals each request's
    reference attention (its compressor's attend over its own entry plus its own drafts)."""
    q = torch.randn(steps, len(rows), 9, 16)
    k_new, v_new = torch.randn(steps, len(rows), 3, 16), torch.randn(steps, len(rows), 3, 16)
    store.begin_round(rows, steps)
    for step in range(steps):
        for layer_id in range(store.num_layers):
            out = store.attend(layer_id, q[step], k_new[step], v_new[step], 0.125)
            for b, rid in enumerate(rows):
                entry = store._entries[rid].layers[layer_id]
                ref = compressors[rid].attend(entry, q[step, b : b + 1], 0.125,
                                              k_new[: step + 1, b], v_new[: step + 1, b])
                torch.testing.assert_close(out[b : b + 1], ref, msg=f"{label}: request {rid} step {step}")


@pytest.mark.parametrize("methods", [("kivi4", "streamingllm", "full"), ("quest", "h2o", "int8"),
                                     ("fp8", "kivi2", "snapkv")])
def test_batched_draft_rounds_equal_each_request_alone(methods):
    """Rounds of requests of different lengths and compressors, drafted together, give each
    request what its compressor's reference attention gives (padding and other requests'
    rows never leak in). Between rounds the requests grow by verified tokens: a request
    that keeps its buffer row rewrites only what its compressor says changed (KIVI flushes
    recent tokens into quantized groups on the way), one that
    moves rewrites everything, and a batch that outgrows the buffers reallocates them.
    Quest selects pages per step (a mask per request); the others read every key."""
    lengths = [300, 57, 180]
    kv = [_kv(700, dim=16, seed=i) for i in range(3)]
    store = CompressedKVStore(get_compressor("full"), num_layers=2)
    compressors = [get_compressor(m, 4.0, **({"page_size": 8} if m == "quest" else {})) for m in methods]
    queries = torch.randn(32, 9, 16)

    def sync_all():
        for i, (k, v) in enumerate(kv):
            store.sync(i, lengths[i], lambda _, s, e, k=k, v=v: (k[s:e], v[s:e]), compressor=compressors[i],
                       queries=[queries, queries])

    sync_all()
    _check_round(store, compressors, [2, 0, 1], 3, "first round")
    for grow, rows, label in (((40, 90, 40), [2, 0, 1], "same rows"), ((33, 33, 9), [2, 0, 1], "same rows again"),
                              ((4, 4, 4), [0, 2, 1], "rows moved"), ((300, 2, 7), [0, 2, 1], "buffers grown")):
        lengths = [n + g for n, g in zip(lengths, grow)]
        sync_all()
        _check_round(store, compressors, rows, 4, label)
    _check_round(store, compressors, [1], 2, "one request left")
    store.check_integrity()
    store.release(0)
    store.release(2)
    assert store.buffer_nbytes() > 0  # kept while a request is running
    store.release(1)
    assert store.buffer_nbytes() == 0 and store.nbytes() == 0  # idle: nothing held


@pytest.mark.parametrize("method", ["kivi4", "streamingllm", "int8"])
def test_a_row_moved_down_lays_the_same_values_as_a_fresh_buffer(method):
    """When requests before it leave the batch, a request's row moves down: its kept rows
    are copied from its old row and only its tail is materialized. What it then holds is
    bit-equal to what a store that never saw the earlier rounds lays for the same entry."""
    compressor = get_compressor(method, 4.0)
    kv = [_kv(600, dim=16, seed=i) for i in range(3)]
    stores = [CompressedKVStore(compressor, num_layers=2) for _ in range(2)]

    def sync(store, rids, length):
        for i in rids:
            store.sync(i, length + 7 * i, lambda _, s, e, k=kv[i][0], v=kv[i][1]: (k[s:e], v[s:e]))

    sync(stores[0], [0, 1, 2], 300)
    stores[0].begin_round([0, 1, 2], 4)
    for store in stores:
        sync(store, [0, 1, 2], 341)  # KIVI flushes a group on the way: the tail is more than new tokens
        store.begin_round([2], 3)  # row 2 -> row 0; in the fresh store, laid whole
    n = stores[1]._round.dense_lens[0]
    assert stores[0]._round.dense_lens[0] == n
    for layer_id in range(2):
        for old, fresh in zip(stores[0]._buffers(layer_id, 1, n), stores[1]._buffers(layer_id, 1, n)):
            assert torch.equal(old, fresh), (method, layer_id)


def test_store_compresses_and_reports_size():
    k, v = _kv(2048, dim=64)
    store = CompressedKVStore(get_compressor("kivi4"), num_layers=1)
    store.sync("a", 2048, lambda _, s, e: (k[s:e], v[s:e]))
    assert 0 < store.nbytes() < store.full_nbytes() / 2  # fp32 KV -> 4 bits + scales


def test_query_aware_compressor_gets_prompt_queries():
    k, v = _kv(200)
    queries = torch.randn(32, 9, 16)
    store = CompressedKVStore(get_compressor("snapkv", 4.0), num_layers=1)
    store.sync("a", 200, lambda _, s, e: (k[s:e], v[s:e]), queries=[queries])
    store.check_integrity()
    assert store.nbytes() < store.full_nbytes()
