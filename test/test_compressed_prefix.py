"""The compressed prefix cache (``mem_cache/compressed_prefix.py``): random insert / match /
evict sequences against a reference model (a dict of token tuples with LRU ticks), with
``check_integrity()`` after every step; and real compressor entries reused by append."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_vericache.mem_cache.compress import get_compressor
from sgl_vericache.mem_cache.compress.base import CompressedLayer
from sgl_vericache.mem_cache.compress.rows import buffer_of, plain_copy
from sgl_vericache.mem_cache.compressed_prefix import CompressedPrefixCache

LAYERS = 2


class _Layer(CompressedLayer):
    """An entry of ``num_tokens`` tokens holding one tensor of 8 bytes a token."""

    def __init__(self, num_tokens):
        super().__init__(num_tokens, 1, 1, torch.float32)
        self.t = torch.zeros(num_tokens, 2)

    def tensors(self):
        return [self.t]


def _entry(n):
    return [_Layer(n) for _ in range(LAYERS)]


class Reference:
    """What the cache must answer: entries by (key, tokens), LRU by last insert or hit."""

    def __init__(self, budget):
        self.budget, self.items, self.clock = budget, {}, 0

    def nbytes(self):
        return sum(16 * len(t) for (_, t) in self.items)  # 8 bytes x LAYERS a token

    def insert(self, tokens, key):
        if not tokens or 16 * len(tokens) > self.budget:
            return False
        self.clock += 1
        self.items[(key, tokens)] = self.clock
        while self.nbytes() > self.budget:
            victim = min((k for k in self.items if k != (key, tokens)), key=self.items.get)
            del self.items[victim]
        return True

    def match(self, tokens, key):
        best = max((len(t) for (k, t) in self.items if k == key and tokens[: len(t)] == t), default=0)
        if best:
            self.clock += 1
            self.items[(key, tokens[:best])] = self.clock
        return best


tok_seq = st.lists(st.integers(0, 3), min_size=0, max_size=12).map(tuple)
ops = st.lists(st.tuples(st.sampled_from(["insert", "match", "evict"]), tok_seq, st.sampled_from(["a", "b"]),
                         st.integers(0, 400)), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, budget=st.integers(0, 600))
def test_random_sequences_match_the_reference(ops, budget):
    cache, ref = CompressedPrefixCache(budget), Reference(budget)
    for op, tokens, key, target in ops:
        if op == "insert":
            assert cache.insert(tokens, key, _entry(len(tokens))) == ref.insert(tokens, key)
        elif op == "match":
            n, layers = cache.match(tokens, key)
            assert n == ref.match(tokens, key), (tokens, key)
            assert (layers is None) == (n == 0)
            if layers is not None:
                assert len(layers) == LAYERS and all(l.num_tokens == n for l in layers)
        else:
            cache.evict(target)
            while ref.nbytes() > target:
                del ref.items[min(ref.items, key=ref.items.get)]
        cache.check_integrity()
        assert cache.nbytes == ref.nbytes() and cache.num_entries == len(ref.items)
    cache.evict(0)  # everything can go: nothing is locked, requests hold their own references
    cache.check_integrity()
    assert cache.nbytes == 0 and not cache.root.children


def test_split_keeps_entries_where_their_prefix_ends():
    cache = CompressedPrefixCache(10_000)
    assert cache.insert((1, 2, 3, 4), "a", _entry(4))
    assert cache.insert((1, 2), "a", _entry(2))  # splits the edge
    assert cache.insert((1, 2, 9), "b", _entry(3))
    cache.check_integrity()
    assert cache.match((1, 2, 3, 4, 5), "a")[0] == 4
    assert cache.match((1, 2, 3), "a")[0] == 2  # mid-edge: only the shorter entry fits
    assert cache.match((1, 2, 9, 9), "a")[0] == 2 and cache.match((1, 2, 9, 9), "b")[0] == 3
    assert cache.match((7,), "a") == (0, None)
    assert (cache.lookups, cache.hits, cache.hit_tokens) == (5, 4, 11)


def test_bad_inputs_are_refused_and_change_nothing():
    with pytest.raises(ValueError, match="budget -1 is invalid; accepted: bytes >= 0"):
        CompressedPrefixCache(-1)
    cache = CompressedPrefixCache(100)
    with pytest.raises(ValueError, match="an entry for 3 tokens has layers of 2 tokens"):
        cache.insert((1, 2, 3), "a", _entry(2))
    assert not cache.insert((1,) * 7, "a", _entry(7))  # 112 bytes > budget 100
    assert not cache.insert((), "a", [])
    cache.check_integrity()
    assert cache.nbytes == 0 and not cache.root.children


@pytest.mark.parametrize("name", ["streamingllm", "snapkv", "kivi4", "int8", "fp8", "quest", "full"])
def test_a_shared_entry_grows_by_append_without_changing_for_its_other_holders(name):
    """What the drafter does with a hit: append the request's own tokens to the shared
    entry. The shared entry (and what the cache returns next) is unchanged, and two
    requests extending it with different tokens each get what appending to a copy of it
    gives (the first grows it in its spare rows, rows.py; the second copies)."""
    torch.manual_seed(0)
    comp = get_compressor(name, 4.0)
    k, v = torch.randn(96, 2, 8), torch.randn(96, 2, 8)
    k2, v2 = torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    q = torch.randn(8, 4, 8)
    base = comp.compress(k[:64], v[:64], q if comp.needs_queries else None)
    before = [t.clone() for t in base.tensors()]
    plain = plain_copy(base)
    cache = CompressedPrefixCache(1 << 30)
    tokens = tuple(range(64))
    assert cache.insert(tokens, comp, [base])
    n, (hit,) = cache.match(tokens + (5, 6), comp)
    assert n == 64 and hit is base
    grown = comp.append(hit, k[64:72], v[64:72])  # fits the spare rows
    other = comp.append(cache.match(tokens, comp)[1][0], k2, v2)
    assert grown.num_tokens == 72 and other.num_tokens == 72
    for got, (kk, vv) in ((grown, (k[64:72], v[64:72])), (other, (k2, v2))):
        want = comp.append(plain, kk, vv)
        assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors())), name
    assert all(torch.equal(a, b) for a, b in zip(before, base.tensors()))
    assert cache.match(tokens, comp)[1][0] is base
    assert cache.match(tokens, get_compressor(name, 4.0)) == (0, None)  # entries are per compressor object


def test_an_entry_counts_the_spare_rows_it_keeps_alive():
    """Entries that grow in place hold spare rows past their end (compress/rows.py): the
    cache's budget counts them, each buffer once, so its bytes are what it keeps alive."""
    torch.manual_seed(0)
    comp = get_compressor("int8")
    layer = comp.compress(torch.randn(320, 2, 8), torch.randn(320, 2, 8))
    cache = CompressedPrefixCache(1 << 30)
    assert cache.insert(tuple(range(320)), comp, [layer, layer])  # one buffer a tensor, counted once
    held = sum(buffer_of(t).data.numel() * buffer_of(t).data.element_size() for t in layer.tensors())
    assert cache.nbytes == held == layer.nbytes() * (320 + 20) // 320  # 320 rows and 320 / 16 spare
    cache.check_integrity()
