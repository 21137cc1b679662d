"""The `vericache` radix cache backend: SGLang's UnifiedRadixCache with ``check_integrity()``,
driven directly (no engine) by random insert / match / lock / unlock / evict sequences and
checked against a reference model of which token prefixes own which KV slots."""

from __future__ import annotations

from array import array

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

POOL = 96


@pytest.fixture(scope="module")
def parts():
    from sgl_vericache.cpu import compat as cpu_compat

    cpu_compat.install()
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from sgl_vericache.sglang.radix import CacheIntegrityError, VeriCacheRadixCache

    def make():
        kv = MHATokenToKVPool(POOL, 1, torch.float32, 1, 4, 1, "cpu", False, start_layer=0, end_layer=1)
        alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", kv, False)
        params = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(4, 256, "cpu", False),
                                 token_to_kv_pool_allocator=alloc, page_size=1,
                                 tree_components=(ComponentType.FULL,))
        return VeriCacheRadixCache(params), alloc

    key = lambda tokens: RadixKey(array("q", tokens))  # noqa: E731
    return make, key, InsertParams, MatchPrefixParams, EvictParams, CacheIntegrityError


class Model:
    """The cache under test plus what must hold: every prefix the tree holds maps to the
    slots it was inserted with; locked prefixes survive eviction; slots are conserved."""

    def __init__(self, parts):
        make, self.key, self.Insert, self.Match, self.Evict, _ = parts
        self.cache, self.alloc = make()
        self.slots: dict[tuple, int] = {}  # token prefix -> KV slot of its last token, while inserted
        self.locks: list[tuple[object, tuple]] = []  # (TreeLock, locked token prefix)

    def match(self, tokens):
        result = self.cache.match_prefix(self.Match(key=self.key(list(tokens))))
        n = result.device_prefix_len
        got = self.cache.path_device_indices(result.last_device_node)[:n].tolist() if n else []
        return n, result.last_device_node, got

    def check_match(self, tokens):
        n, _, got = self.match(tokens)
        for i in range(n):  # a prefix the tree returns was inserted, with these very slots
            assert self.slots.get(tuple(tokens[: i + 1])) == got[i], (tokens, i)
        for _, locked in self.locks:  # a locked prefix is always found whole
            if tuple(tokens[: len(locked)]) == locked:
                assert n >= len(locked), (tokens, locked, n)
        return n

    def insert(self, tokens):
        value = self.alloc.alloc(len(tokens))
        if value is None:
            self.cache.evict(self.Evict(num_tokens=len(tokens)))
            value = self.alloc.alloc(len(tokens))
            if value is None:
                return
        n_before = self.check_match(tokens)
        result = self.cache.insert(self.Insert(key=self.key(list(tokens)), value=value))
        assert result.prefix_len == n_before  # the cache frees our duplicates of value[:prefix_len]
        for i in range(result.prefix_len, len(tokens)):
            self.slots[tuple(tokens[: i + 1])] = int(value[i])

    def lock(self, tokens):
        n, node, _ = self.match(tokens)
        if n:
            self.locks.append((self.cache.lock(node), tuple(tokens[:n])))

    def unlock(self, which):
        if self.locks:
            lock, _ = self.locks.pop(which % len(self.locks))
            self.cache.unlock(lock)

    def evict(self, n):
        self.cache.evict(self.Evict(num_tokens=n))
        present = {}
        for prefix, slot in self.slots.items():  # forget what the tree no longer holds
            if self.match(prefix)[0] == len(prefix):
                present[prefix] = slot
        self.slots = present


tokens = st.lists(st.integers(0, 3), min_size=1, max_size=12)  # 4 token ids: many shared prefixes
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), tokens), st.tuples(st.just("match"), tokens), st.tuples(st.just("lock"), tokens),
    st.tuples(st.just("unlock"), st.integers(0, 7)), st.tuples(st.just("evict"), st.integers(1, 40))),
    min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_random_operations_keep_the_cache_consistent(parts, ops):
    model = Model(parts)
    for op, arg in ops:
        if op == "match":
            model.check_match(arg)
        else:
            getattr(model, op)(arg)
        model.cache.check_integrity()
    while model.locks:
        model.unlock(0)
    model.cache.check_integrity()
    model.evict(POOL)
    report = model.cache.check_integrity()
    assert report["device_tree_tokens"] == 0 and model.alloc.available_size() == model.alloc.size  # nothing leaked


def test_integrity_check_finds_corruption(parts):
    """Negative controls: each kind of damage is reported."""
    *_, CacheIntegrityError = parts
    model = Model(parts)
    model.insert([1, 2, 3, 4])
    model.insert([1, 2, 7, 7, 7])
    assert model.cache.check_integrity()["device_tree_tokens"] == 7
    _, _, slots = model.match([1, 2, 3, 4])
    model.alloc.free(torch.tensor(slots[2:3]))  # a slot the tree still holds goes back to the free list
    with pytest.raises(CacheIntegrityError, match="tree pages are on the free list"):
        model.cache.check_integrity()

    model = Model(parts)
    model.insert([5, 6])
    model.alloc.alloc(3)  # slots taken and never given to the tree nor freed: a leak
    with pytest.raises(CacheIntegrityError, match="in tree .* free != pool"):
        model.cache.check_integrity()


def test_a_release_without_a_checkpoint_leaves_no_flag_behind(parts, monkeypatch):
    """A retraction or a priority preemption releases a request's row without a checkpoint.
    The flag its release set (the next checkpoint is the release's insert) must go with the
    release: else, under a full-KV device budget, the request's first publish after it
    resumes was inserted and locked in the tree instead of staying its own parkable KV."""
    from types import SimpleNamespace as N

    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    make, *_ = parts
    cache, _ = make()
    cache.prompts_owned = True  # --vericache-full-device-budget
    inserted = []
    monkeypatch.setattr(UnifiedRadixCache, "checkpoint", lambda self, req, *, up_to, **kw: inserted.append(up_to))
    req = N(rid="r", session=None, session_id=None, finished=lambda: False, kv=N(req_pool_idx=0))
    assert cache.claim_kv_row(req) is False
    assert req.vericache_releasing  # a checkpoint now would be the release's insert
    cache.on_release(req, checkpointed=False)
    assert "vericache_releasing" not in req.__dict__
    cache.checkpoint(req, up_to=100)  # the resumed request's publish after its prefill
    assert inserted == []  # its prompt stays its own
    cache.claim_kv_row(req)
    cache.checkpoint(req, up_to=120)  # a release that does checkpoint (it finished) inserts
    assert inserted == [120]
