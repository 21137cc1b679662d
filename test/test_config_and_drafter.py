"""Fast unit tests: the --vericache-* flags, per-request overrides, the draft store and the
sgl_kernel CPU stand-in. No engine is started here."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from sgl_vericache.config import VeriCacheConfig, parse_known, request_config
from sgl_vericache.mem_cache.compress import causal_attention, get_compressor
from sgl_vericache.spec.drafter import CompressedKVStore


def test_flags_are_split_from_sglang_flags():
    vc, rest = parse_known(["--vericache-draft-len", "8", "--port", "1234", "--vericache-compressor=snapkv",
                            "--no-vericache-deterministic", "--log-level", "info"])
    assert (vc.draft_len, vc.compressor, vc.deterministic) == (8, "snapkv", False)
    assert rest == ["--port", "1234", "--log-level", "info"]
    assert vc.tier_checksums  # on unless turned off
    assert not parse_known(["--no-vericache-tier-checksums"])[0].tier_checksums


@pytest.mark.parametrize("argv, message", [
    (["--vericache-draft-lenn", "3"], "unknown flag --vericache-draft-lenn"),
    (["--vericache-draft-len", "65"], "out of range; accepted: 1 to 64"),
    (["--vericache-compressor", "lz4"], "is not one of"),
    (["--vericache-compressor-options", "group_size"], "not of the form name=value"),
    (["--vericache-compressed-cache-mb", "-1"], "compressed-cache-mb -1 is out of range; accepted: 0 to"),
])
def test_bad_flags_name_the_problem(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_known(argv)


def test_config_round_trips_through_the_environment(monkeypatch):
    vc = VeriCacheConfig(compressor="h2o", ratio=8.0, draft_len=5)
    monkeypatch.delenv("VERICACHE_CONFIG", raising=False)
    vc.to_env()
    assert VeriCacheConfig.from_env() == vc


def test_request_overrides():
    server = VeriCacheConfig(compressor="kivi4", draft_len=16)
    assert request_config(None, server) is server
    assert request_config({"other_key": 1}, server) is server
    cfg = request_config({"vericache_compressor": "quest", "vericache_draft_len": 4}, server)
    assert (cfg.compressor, cfg.draft_len, cfg.ratio) == ("quest", 4, server.ratio)
    with pytest.raises(ValueError, match="exceeds the server's --vericache-draft-len 16"):
        request_config({"vericache_draft_len": 17}, server)
    with pytest.raises(ValueError, match="unknown custom_params key 'vericache_speed'"):
        request_config({"vericache_speed": 2}, server)
    with pytest.raises(ValueError, match="custom_params vericache_ratio 0.1 is out of range"):
        request_config({"vericache_ratio": 0.1}, server)
    cfg = request_config({"vericache_compressor_options": {"group_size": 16, "residual_length": 8}}, server)
    assert cfg.options() == {"group_size": "16", "residual_length": "8"}


@pytest.mark.parametrize("params, message", [
    # the two bodies that once took the server down (issue 29): now each names its key
    ({"vericache_compressor_options": {"a": 1}}, "unknown option"),
    ({"vericache_draft_len": 4.5}, "vericache_draft_len 4.5 is not an integer"),
    ({"vericache_draft_len": True}, "vericache_draft_len True is not an integer"),
    ({"vericache_draft_len": "4"}, "vericache_draft_len '4' is not an integer"),
    ({"vericache_draft_len": 0}, "vericache_draft_len 0 is out of range"),
    ({"vericache_ratio": "x"}, "vericache_ratio 'x' is not a number"),
    ({"vericache_ratio": float("inf")}, "vericache_ratio inf is not a number"),
    ({"vericache_compressor": 3}, "vericache_compressor 3 is not a string"),
    ({"vericache_compressor": "nope"}, "vericache_compressor 'nope' is not one of"),
    ({"vericache_compressor_options": [1]}, "vericache_compressor_options \\[1\\] is not a string"),
    ({"vericache_compressor_options": {"group_size": [1]}}, "option 'group_size'"),
    ({"vericache_compressor_options": "group_size=x"}, "group_size='x' is invalid"),
    ("not an object", "custom_params 'not an object' is not an object"),
])
def test_bad_request_overrides_name_their_key(params, message):
    """Every malformed override is a ValueError (the request's 400), never another error
    type that would escape the round's plan and stop the scheduler."""
    with pytest.raises(ValueError, match=message):
        request_config(params, VeriCacheConfig(compressor="kivi4", draft_len=16))


def test_compressor_options_need_a_named_compressor():
    with pytest.raises(ValueError, match="need a named compressor, not auto"):
        request_config({"vericache_compressor_options": "group_size=16"}, VeriCacheConfig())
    cfg = request_config({"vericache_compressor": "kivi4", "vericache_compressor_options": "group_size=16"},
                         VeriCacheConfig())
    assert cfg.build_compressor().name == "kivi4"
    assert VeriCacheConfig().build_compressor().name == "streamingllm"  # auto's first candidate


def test_flag_values_are_type_checked():
    with pytest.raises(ValueError, match="--vericache-draft-len 4.5 is not an integer"):
        VeriCacheConfig(draft_len=4.5)
    with pytest.raises(ValueError, match="--vericache-enable 1 is not true or false"):
        VeriCacheConfig(enable=1)
    assert VeriCacheConfig(ratio=8).ratio == 8  # an integer is a number


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


def test_pad_drafts_fills_the_verify_width():
    from sgl_vericache.spec.round_batch import pad_drafts as _pad_drafts

    drafts = np.array([[5, 6, 7], [8, 9, 10]])
    out = _pad_drafts(drafts, [1, 3], 5)
    assert out.tolist() == [[5, 5, 5, 5, 5], [8, 9, 10, 10, 10]]


def test_narrow_rows_keeps_only_the_drafting_rows():
    """Staggered verifies: the draft pass runs over the rows that verify this round only."""
    import dataclasses

    from sgl_vericache.sglang.forward import narrow_rows as _narrow_rows

    @dataclasses.dataclass
    class FB:  # the shape of SGLang's ForwardBatch that matters here
        batch_size: int
        req_pool_indices: torch.Tensor
        seq_lens: torch.Tensor
        seq_lens_cpu: torch.Tensor
        seq_lens_sum: int
        rids: list
        weights: torch.Tensor  # not per row: left alone
        scalar: torch.Tensor

    fb = FB(4, torch.tensor([7, 8, 9, 10]), torch.tensor([3, 4, 5, 6]), torch.tensor([3, 4, 5, 6]), 18,
            ["a", "b", "c", "d"], torch.ones(2, 4), torch.tensor(1.0))
    _narrow_rows(fb, [1, 3], 4)
    assert fb.batch_size == 2 and fb.seq_lens_sum == 10
    assert fb.req_pool_indices.tolist() == [8, 10] and fb.seq_lens.tolist() == [4, 6] and fb.rids == ["b", "d"]
    assert fb.weights.shape == (2, 4) and fb.scalar.item() == 1.0


@dataclasses.dataclass
class _VerifyBatch:  # the shape of SGLang's ForwardBatch that narrowing a verify batch reads
    batch_size: int
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    seq_lens_sum: int
    input_ids: torch.Tensor = None
    out_cache_loc: torch.Tensor = None
    num_token_non_padded: torch.Tensor = None
    mrope_positions: torch.Tensor = None


def test_narrow_rows_of_a_verify_batch_keeps_each_rows_tokens():
    """The verify forward of a staggered round: per-row fields by row, per-token fields
    (``width`` tokens a row: ids, positions, write slots) by the kept rows' tokens, and the
    count of real tokens follows."""
    from sgl_vericache.sglang.forward import narrow_rows as _narrow_rows

    width = 3  # 4 rows x 3 tokens; row r's tokens are 10r, 10r+1, 10r+2
    ids = torch.tensor([10 * r + j for r in range(4) for j in range(width)])
    fb = _VerifyBatch(4, torch.tensor([3, 4, 5, 6]), torch.tensor([3, 4, 5, 6]), 18, ids, ids + 100, torch.tensor(12))
    _narrow_rows(fb, [0, 2], 4, width)
    assert fb.batch_size == 2 and fb.seq_lens.tolist() == [3, 5] and fb.seq_lens_sum == 8
    assert fb.input_ids.tolist() == [0, 1, 2, 20, 21, 22]
    assert fb.out_cache_loc.tolist() == [100, 101, 102, 120, 121, 122]
    assert int(fb.num_token_non_padded) == 6


def test_narrow_rows_takes_multimodal_rotary_positions_by_token():
    """``mrope_positions`` is [3, tokens] (temporal, height, width): narrowing takes the kept
    rows' tokens along its second dimension, and never reads its 3 as a row count (a batch
    of 3 rows would otherwise have lost a positional axis)."""
    from sgl_vericache.sglang.forward import narrow_rows as _narrow_rows

    for bs, width, keep in ((3, 1, [0, 2]), (4, 3, [1, 3]), (2, 1, [1])):
        mrope = torch.arange(bs * width)[None, :] + torch.tensor([[0], [100], [200]])
        fb = _VerifyBatch(bs, torch.arange(bs) + 3, torch.arange(bs) + 3, 0, mrope_positions=mrope)
        _narrow_rows(fb, keep, bs, width)
        tokens = [r * width + j for r in keep for j in range(width)]
        assert fb.mrope_positions.tolist() == [tokens, [t + 100 for t in tokens], [t + 200 for t in tokens]], (bs, width)


def test_draft_passes_move_multimodal_rotary_positions_with_each_step(monkeypatch):
    """Qwen2-VL / 2.5-VL / 3-VL and GLM-4.1V read positions from ``mrope_positions`` (3 rows:
    temporal, height, width). A draft step at position p must put each row at p + the
    request's delta (SGLang's ``mrope_position_delta``: how far an image moved its text
    positions; 0 without one), for the round's rows and for one request's teacher-forced
    tokens; before, the steps kept the batch's first positions (wrong drafts), a narrowed
    round kept every row's, and a fetch-drafting row had none. The model runner is stood in
    for by one that records what its forward reads."""
    from types import SimpleNamespace

    from sglang.srt.model_executor import forward_batch_info

    from sgl_vericache.sglang.forward import DraftPasses, mrope_deltas
    from sgl_vericache.sglang.runtime import Runtime

    def mm(delta):
        return SimpleNamespace(mrope_position_delta=None if delta is None else torch.tensor([[delta]]))

    assert mrope_deltas([None, mm(-7), mm(None), mm(12)]) == [0, -7, 0, 12]
    seen = []

    def forward(fb):
        seen.append(fb.mrope_positions.clone())
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=torch.zeros(len(fb.positions), 5)))

    runner = SimpleNamespace(device="cpu", model_config=SimpleNamespace(model_is_mrope=True), forward=forward,
                             req_to_token_pool=None, token_to_kv_pool=None)
    passes = DraftPasses(runner, Runtime(), None)
    fb = passes.one_row(SimpleNamespace(multimodal_inputs=mm(-7)))
    passes.place(fb, 20)
    with passes.run(fb, store=object()) as step:
        step([1, 2, 3], [20, 21, 22], tokens_of_one=True)
        step([4], [23])
    assert [m.tolist() for m in seen] == [[[13, 14, 15]] * 3, [[16]] * 3]

    assert not fb.needs_forward_metadata_init()  # SGLang's own backend does not plan a draft step
    three = passes.one_row()  # a round of three requests, of which rows 0 and 2 draft
    three.spec_info, three.forward_metadata_ready = SimpleNamespace(name="the last round's NgramVerifyInput"), False
    monkeypatch.setattr(forward_batch_info.ForwardBatch, "init_new", staticmethod(lambda *a, **k: three))
    batch = SimpleNamespace(reqs=[0, 1, 2], multimodal_inputs=[None, mm(5), mm(-3)])
    three.batch_size, three.seq_lens = 3, torch.tensor([4, 5, 6])
    fb = passes.for_rows(batch, [0, 2])
    assert fb.spec_info is None and not fb.needs_forward_metadata_init()
    seen.clear()
    with passes.run(fb, store=object()) as step:
        step([1, 2], [40, 50])
    assert seen[0].tolist() == [[40, 47]] * 3
    assert DraftPasses(SimpleNamespace(**{**vars(runner), "model_config": SimpleNamespace()}), Runtime(), None).mrope is False


def test_draft_passes_turn_sglangs_fused_rotary_kv_write_off(monkeypatch):
    """On CUDA with a bfloat16 pool, Qwen3-MoE, gpt-oss and others write K/V inside their
    rotary embedding at the batch's write slots when ``enable_fused_set_kv_buffer`` says so.
    A draft pass has no write slots and writes no pool: while a worker drafts the models are
    told the fused write is off (a module imported before the install included); otherwise
    SGLang's choice stands. The GPU is stood in for by the function's own inputs."""
    from types import SimpleNamespace

    import sglang.srt.models.qwen3_moe as imported_before
    from sglang.srt.models import utils

    from sgl_vericache.sglang.forward import install_unfused_draft_kv
    from sgl_vericache.sglang.runtime import Runtime

    runtime = Runtime()
    install_unfused_draft_kv(runtime)
    import sglang.srt.models.gpt_oss as imported_after

    monkeypatch.setattr(utils, "_is_cuda", True)
    monkeypatch.setattr(utils, "get_token_to_kv_pool", lambda: SimpleNamespace(dtype=torch.bfloat16))
    monkeypatch.setattr(utils, "is_cp_active", lambda fb: False)
    fb = SimpleNamespace(dcp_kv_mask=None)
    for module in (utils, imported_before, imported_after):
        assert module.enable_fused_set_kv_buffer(fb) is True, module.__name__  # SGLang's choice here
        runtime.drafting = True
        assert module.enable_fused_set_kv_buffer(fb) is False, module.__name__
        runtime.drafting = False


def test_cpu_stand_in_serves_ops_and_refuses_unknown_ones():
    code = (
        "import sgl_kernel, torch\n"
        "from sgl_vericache.cpu import compat as cpu_compat\n"
        "if not cpu_compat.stand_in_active():\n"
        "    print('REAL'); raise SystemExit\n"
        "x = torch.randn(4, 8); w = torch.ones(8)\n"
        "torch.testing.assert_close(sgl_kernel.rmsnorm(x, w, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))\n"
        "from sgl_kernel import fancy_gemm_cpu\n"
        "try:\n"
        "    fancy_gemm_cpu(x)\n"
        "except cpu_compat.CpuKernelUnavailable as e:\n"
        "    print('REFUSED', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    if "REAL" in r.stdout:
        pytest.skip("a real sgl_kernel imports here; the stand-in is inactive")
    assert "REFUSED" in r.stdout and "'sgl_kernel.fancy_gemm_cpu'" in r.stdout


def test_a_gpu_machine_gets_sgl_kernels_own_import_error_not_the_stand_in(monkeypatch):
    """Where a CUDA driver loads, a real sgl_kernel that fails to import is a broken install:
    its own error surfaces, instead of pure-torch stand-ins served to a GPU engine (or a later
    "use torch_native on CPU"). SGLang's CPU engine, asked for, still gets the stand-in."""
    from sgl_vericache.cpu import compat

    monkeypatch.setattr(compat, "_real_kernel_imports", lambda: False)
    monkeypatch.setattr(compat, "_cuda_driver_present", lambda: True)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert compat._Finder().find_spec("sgl_kernel") is None
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert compat._Finder().find_spec("sgl_kernel") is not None
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    monkeypatch.setattr(compat, "_cuda_driver_present", lambda: False)  # a CPU machine
    assert compat._Finder().find_spec("sgl_kernel") is not None


def test_prompt_queries_are_captured_per_request_and_layer():
    """A capturing prefill keeps each request's trailing prefill queries (for SnapKV/H2O),
    across chunked prefills, as many as its compressor reads, capped at MAX_CAPTURED_QUERIES."""
    from types import SimpleNamespace

    from sgl_vericache.sglang.attention import capture_queries as _capture_queries
    from sgl_vericache.spec.entry_sync import MAX_CAPTURED_QUERIES, layer_queries as _layer_queries

    captured = {}
    layer = SimpleNamespace(tp_q_head_num=3, qk_head_dim=4, layer_id=1)
    q = torch.arange(5 * 12, dtype=torch.float32).reshape(5, 12)  # 2 + 3 tokens, [tokens, H_q * D]
    every = [MAX_CAPTURED_QUERIES] * 2
    _capture_queries(captured, ["a", "b"], q, layer, SimpleNamespace(extend_seq_lens_cpu=[2, 3]), every)
    assert captured["a"][1].shape == (2, 3, 4)
    torch.testing.assert_close(captured["b"][1], q[2:].reshape(3, 3, 4))
    big = torch.randn(MAX_CAPTURED_QUERIES + 10, 12)
    _capture_queries(captured, ["b"], big, layer, SimpleNamespace(extend_seq_lens_cpu=[big.shape[0]]), every)
    kept = captured["b"][1]
    assert kept.shape[0] == MAX_CAPTURED_QUERIES
    torch.testing.assert_close(kept, big[-MAX_CAPTURED_QUERIES:].reshape(-1, 3, 4))
    # each kept tensor holds its own rows only, not the chunk it was cut from
    assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
    _capture_queries(captured, ["b"], q[:2], layer, SimpleNamespace(extend_seq_lens_cpu=[2]), every)  # a later chunk
    grown = captured["b"][1]
    assert grown.shape[0] == MAX_CAPTURED_QUERIES and grown.untyped_storage().nbytes() == kept.untyped_storage().nbytes()
    torch.testing.assert_close(grown, torch.cat([big[-MAX_CAPTURED_QUERIES + 2:], q[:2]]).reshape(-1, 3, 4))
    _capture_queries(captured, ["c"], big, layer, SimpleNamespace(extend_seq_lens_cpu=[big.shape[0]]), every)
    assert captured["c"][1].untyped_storage().nbytes() == kept.untyped_storage().nbytes()
    # a SnapKV request keeps its observation window (across chunks too), a dropper's nothing
    two = SimpleNamespace(extend_seq_lens_cpu=[big.shape[0] - 7, 7])
    _capture_queries(captured, ["w", "none"], big, layer, two, [32, 0])
    assert "none" not in captured
    torch.testing.assert_close(captured["w"][1], big[-39:-7].reshape(-1, 3, 4))
    _capture_queries(captured, ["w"], q, layer, SimpleNamespace(extend_seq_lens_cpu=[5]), [32])
    torch.testing.assert_close(captured["w"][1], torch.cat([big[-34:-7], q]).reshape(-1, 3, 4))
    per_layer = _layer_queries(captured["a"], num_layers=3)
    assert per_layer[0] is None and per_layer[1].shape == (2, 3, 4)


def test_a_prefill_keeps_the_prompt_queries_its_compressor_reads():
    """SnapKV reads its observation window (32 by default), H2O every query it is given (up
    to MAX_CAPTURED_QUERIES), the others none: a prefill keeps that many of each request on
    the device until its first round (before, 512 of every request in a batch with one such
    request: 128 MiB a request at Llama-3-8B's size)."""
    from types import SimpleNamespace

    from sgl_vericache.spec.entry_sync import MAX_CAPTURED_QUERIES
    from sgl_vericache.spec.round import Speculator

    spec = Speculator.__new__(Speculator)  # only its planner's plans are read
    spec.planner = SimpleNamespace(plan_arriving=lambda reqs: [SimpleNamespace(compressor=get_compressor(
        name, 4.0 if name != "kivi4" else None, **options)) for name, options in reqs])
    reqs = [("snapkv", {}), ("snapkv", {"window_size": 8}), ("h2o", {}), ("streamingllm", {}), ("kivi4", {})]
    assert spec.query_windows(reqs) == [32, 8, MAX_CAPTURED_QUERIES, 0, 0]


def test_capturing_prefills_keep_the_models_own_backend():
    """Capturing prompt queries does not put a wrapper in the model's way: the backend the
    model reaches is SGLang's own object (a model may test its class), its output is its own,
    the queries of extend forwards only are kept, and after the prefill, even one that
    raised, the backend is as it was (no instance attribute left behind)."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context, get_attn_backend

    from sgl_vericache.sglang.attention import capturing_queries

    class TritonLike(AttentionBackend):
        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            return q * 2 + (1 if kwargs.get("sinks") is not None else 0)

    def batch(mode):
        return SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: mode == "extend"),
                               extend_seq_lens_cpu=[2, 1])

    backend, captured = TritonLike(), {}
    layer = SimpleNamespace(tp_q_head_num=1, qk_head_dim=4, layer_id=0)
    q = torch.randn(3, 4)
    with forward_context(ForwardContext(attn_backend=backend)):
        with capturing_queries(backend, captured, ["a", "b"], [8, 8]):
            seen = get_attn_backend()
            assert seen is backend and type(seen) is TritonLike
            torch.testing.assert_close(seen.forward(q, None, None, layer, batch("extend"), sinks=q), q * 2 + 1)
            seen.forward(q + 1, None, None, layer, batch("decode"))  # not a prefill: nothing kept
        torch.testing.assert_close(captured["a"][0], q[:2].reshape(2, 1, 4))
        torch.testing.assert_close(captured["b"][0], q[2:].reshape(1, 1, 4))
        assert "forward" not in vars(backend)
        with pytest.raises(RuntimeError, match="boom"):
            with capturing_queries(backend, captured, ["c"], [8]):
                raise RuntimeError("boom")
        assert "forward" not in vars(backend) and "c" not in captured


@pytest.mark.parametrize("mode, tolerance", [("fp16", 2e-3), ("int8", 3e-2)])
def test_draft_weights_approximate_the_model_product(mode, tolerance):
    """The draft's cheaper weight copies give products close to the model's (relative
    error of the output), made once per weight; 'model' is the product itself."""
    from sgl_vericache.spec.draft_weights import DraftWeights

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g) * 0.05, torch.randn(96, generator=g)
    x = torch.randn(4, 64, generator=g)
    exact = torch.nn.functional.linear(x, w, b)
    dw = DraftWeights(mode)
    out = dw.linear(x, w, b)
    assert out.dtype == x.dtype and out.shape == exact.shape
    err = ((out - exact).norm() / exact.norm()).item()
    assert 0 < err < tolerance, err  # approximate, and not the exact product by accident
    first = dw.copied_bytes
    dw.linear(x, w, b)
    assert first == w.numel() * (2 if mode == "fp16" else 1) and dw.copied_bytes == first  # copied once
    assert torch.equal(DraftWeights("model").linear(x, w, b), exact)


def test_draft_weights_refuse_bad_modes_and_devices():
    from sgl_vericache.spec.draft_weights import DraftWeights

    with pytest.raises(ValueError, match="'int4' is not one of model, fp16, int8"):
        DraftWeights("int4")
    with pytest.raises(ValueError, match="int8 runs on CPU only"):
        DraftWeights("int8").check_device(torch.device("cuda"))
    # a 16-bit model's fp16 copy on a GPU: a second copy of every weight for nothing
    with pytest.raises(ValueError, match="fp16 on a bfloat16 model \\(device cuda:0\\) copies every weight"):
        DraftWeights("fp16").check_device(torch.device("cuda:0"), torch.bfloat16)
    DraftWeights("fp16").check_device(torch.device("cuda:0"), torch.float32)
    DraftWeights("fp16").check_device(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="--vericache-draft-weights .bf8. is not one of auto, model, fp16, int8"):
        VeriCacheConfig(draft_weights="bf8")
    assert parse_known(["--vericache-draft-weights", "int8"])[0].draft_weights == "int8"


def test_draft_weights_auto_is_fp16_for_small_products_of_fp32_models_on_cpus_only():
    from sgl_vericache.spec.draft_weights import AUTO_FP16_MAX_ROWS, DraftWeights, resolve_mode

    assert VeriCacheConfig().draft_weights == "auto"
    assert resolve_mode("auto", torch.float32) == ("fp16", AUTO_FP16_MAX_ROWS)
    assert resolve_mode("auto", torch.float32, "cuda:0") == ("model", None)  # measured on CPUs only
    assert resolve_mode("auto", torch.bfloat16) == ("model", None)
    assert resolve_mode("int8", torch.bfloat16) == ("int8", None)
    assert resolve_mode("fp16", torch.float32) == ("fp16", None)
    # above max_rows the product goes to the engine's own weight path, exactly
    calls = []

    def model_linear(x, w, b=None):
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, w, b)

    dw = DraftWeights("fp16", max_rows=2, model_linear=model_linear)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 8, generator=g)
    small, big = torch.randn(2, 8, generator=g), torch.randn(3, 8, generator=g)
    assert not torch.equal(dw.linear(small, w), torch.nn.functional.linear(small, w))  # the fp16 copy
    assert torch.equal(dw.linear(big, w), torch.nn.functional.linear(big, w)) and calls == [3]
    assert torch.equal(dw.linear(big[None], w), torch.nn.functional.linear(big[None], w)) and calls == [3, 1]


def test_a_full_kv_device_budget_brings_the_vericache_radix_backend_and_refuses_others():
    from sgl_vericache.sglang.server import apply_vericache_flags

    vc, rest = parse_known(["--vericache-full-device-budget", "0"])
    assert vc.full_device_budget == 0
    argv = apply_vericache_flags(vc, rest)
    assert argv[argv.index("--radix-cache-backend") + 1] == "vericache"
    assert apply_vericache_flags(vc, ["--radix-cache-backend=vericache"]).count("--radix-cache-backend") == 0
    with pytest.raises(ValueError, match="needs --radix-cache-backend vericache, not 'flexkv'"):
        apply_vericache_flags(vc, ["--radix-cache-backend", "flexkv"])
    with pytest.raises(ValueError, match="needs --page-size 1, not '16'"):
        apply_vericache_flags(vc, ["--page-size", "16"])
    off = parse_known([])[0]
    assert off.full_device_budget == -1 and "--radix-cache-backend" not in apply_vericache_flags(off, [])
    with pytest.raises(ValueError, match="full-device-budget -2 is out of range"):
        parse_known(["--vericache-full-device-budget", "-2"])
