"""The compressed prefix cache with a storage tier behind it (``mem_cache/compressed_prefix.py``
with a ``spill`` function, the tier's role played without threads): random insert / match /
match_spilled / evict sequences against a reference that keeps the evicted entries' keys (at
most ``max_spilled``, the least recently used dropped first), with ``check_integrity()`` after
every step. The tier itself: ``test_compressed_tier.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_vericache.mem_cache.compressed_prefix import CompressedPrefixCache
from sgl_vericache.mem_cache.compressed_tier import SpilledEntry


class Reference:
    """Resident entries with LRU ticks, and spilled ones (keys only, at most ``max_spilled``,
    the least recently used dropped first). Entries are 16 bytes a token."""

    def __init__(self, budget, max_spilled):
        self.budget, self.max_spilled = budget, max_spilled
        self.resident, self.spilled, self.clock = {}, {}, 0

    def nbytes(self):
        return sum(16 * len(t) for (_, t) in self.resident)

    def _tick(self):
        self.clock += 1
        return self.clock

    def _spill(self, item, tick):
        if self.max_spilled:
            self.spilled[item] = tick
        while len(self.spilled) > self.max_spilled:
            del self.spilled[min(self.spilled, key=self.spilled.get)]

    def insert(self, tokens, key):
        if not tokens:
            return False
        item = (key, tokens)
        if 16 * len(tokens) > self.budget and not self.max_spilled:
            return False  # refused: whatever was filed under it stays
        self.resident.pop(item, None)
        self.spilled.pop(item, None)
        if 16 * len(tokens) > self.budget:
            self._spill(item, self._tick())
            return True
        self.resident[item] = self._tick()
        self.evict(self.budget)
        return True

    def evict(self, target):
        while self.nbytes() > target:
            victim = min(self.resident, key=self.resident.get)
            self._spill(victim, self.resident.pop(victim))

    def _best(self, table, tokens, key):
        return max((len(t) for (k, t) in table if k == key and tokens[: len(t)] == t), default=0)

    def match(self, tokens, key):
        best = self._best(self.resident, tokens, key)
        if best:
            self.resident[(key, tokens[:best])] = self._tick()
        return best

    def match_spilled(self, tokens, key):
        best = self._best(self.spilled, tokens, key)
        if best:
            self.spilled[(key, tokens[:best])] = self._tick()
        return best


class _Layer(dataclasses.make_dataclass("_LayerBase", [("t", torch.Tensor)],
                                        bases=(__import__("sgl_vericache.mem_cache.compress.base",
                                                          fromlist=["CompressedLayer"]).CompressedLayer,))):
    def tensors(self):
        return [self.t]


def _layers(n):
    return [_Layer(n, 1, 1, torch.float32, torch.full((n, 2), float(n))) for _ in range(2)]  # 16 bytes a token


tok_seq = st.lists(st.integers(0, 3), min_size=0, max_size=12).map(tuple)
ops = st.lists(st.tuples(st.sampled_from(["insert", "match", "spilled", "evict"]), tok_seq,
                         st.sampled_from(["a", "b"]), st.integers(0, 400)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, budget=st.integers(0, 400), max_spilled=st.integers(0, 4))
def test_random_sequences_with_a_tier_match_the_reference(ops, budget, max_spilled):
    stubs = []

    def spill(tokens, key, layers):  # the tier's role, without threads: a stub carrying the entry
        stub = SpilledEntry(len(tokens), repr(key), layers=tuple(layers))
        stubs.append(stub)
        return stub

    cache, ref = CompressedPrefixCache(budget, spill=spill, max_spilled=max_spilled), Reference(budget, max_spilled)
    for op, tokens, key, target in ops:
        if op == "insert":
            assert cache.insert(tokens, key, _layers(len(tokens))) == ref.insert(tokens, key)
        elif op == "match":
            n, layers = cache.match(tokens, key)
            assert n == ref.match(tokens, key), (tokens, key)
            assert layers is None or all(l.num_tokens == n for l in layers)
        elif op == "spilled":
            n, stub = cache.match_spilled(tokens, key)
            assert n == ref.match_spilled(tokens, key), (tokens, key)
            assert (stub is None) == (n == 0)
            if stub is not None:  # the stub is the entry evicted for exactly that prefix
                assert stub.num_tokens == n and stub.key == repr(key)
                assert all(torch.equal(l.t, torch.full((n, 2), float(n))) for l in stub.layers)
        else:
            cache.evict(target)
            ref.evict(target)
        cache.check_integrity()
        assert cache.nbytes == ref.nbytes() and cache.num_entries == len(ref.resident)
        assert cache.num_spilled == len(ref.spilled)
    cache.clear()
    cache.check_integrity()
    assert cache.num_spilled == 0 and not cache.root.children


def test_bad_max_spilled_is_refused():
    with pytest.raises(ValueError, match="max_spilled -1 is invalid; accepted: an int >= 0"):
        CompressedPrefixCache(10, spill=lambda *a: None, max_spilled=-1)
