"""The token droppers (StreamingLLM, SnapKV, H2O): which tokens they keep, how they choose
them (kept_rows, against the sorts it replaced; attention_mass, against a loop), and
StreamingLLM's appends against compress. CPU, a second."""

import math

import pytest
import torch

from sgl_vericache.mem_cache.compress import get_compressor
from sgl_vericache.mem_cache.compress.drop import attention_mass, gather_tokens, kept_rows
from test_compressors import _axis_queries, _spiky_keys, make_kv


@pytest.mark.parametrize(
    "num_tokens, ratio, sinks, expected",
    [
        (20, 4, 4, [0, 1, 2, 3, 19]),
        (20, 2, 2, [0, 1] + list(range(12, 20))),
        (20, 1, 4, list(range(20))),
    ],
)
def test_streamingllm_keeps_sinks_and_window(num_tokens, ratio, sinks, expected):
    comp = get_compressor("streamingllm", ratio, num_sinks=sinks, min_budget=sinks)
    k, v = make_kv(num_tokens)
    layer = comp.compress(k, v)
    assert layer.positions[:, 0].tolist() == expected and layer.positions[:, 1].tolist() == expected
    assert torch.equal(layer.k, k[expected])


def test_streamingllm_append_evicts_out_of_the_window():
    comp = get_compressor("streamingllm", 4, num_sinks=4, min_budget=4)
    k, v = make_kv(24)
    layer = comp.append(comp.compress(k[:20], v[:20]), k[20:], v[20:])
    assert layer.positions[:, 0].tolist() == [0, 1, 2, 3, 22, 23]  # budget ceil(24 / 4) = 6
    assert torch.equal(layer.v, v[[0, 1, 2, 3, 22, 23]])


def test_snapkv_keeps_window_and_top_votes_per_head():
    k, v = _spiky_keys(100, [(5, 0, 3.0), (40, 0, 3.0), (60, 1, 3.0), (70, 1, 3.0)], num_heads=2)
    comp = get_compressor("snapkv", 10, window_size=8, kernel_size=1, min_budget=0)
    layer = comp.compress(k, v, _axis_queries(8, num_heads=4))
    window = list(range(92, 100))
    assert layer.positions[:, 0].tolist() == [5, 40] + window
    assert layer.positions[:, 1].tolist() == [60, 70] + window
    assert torch.equal(layer.k[:, 0], k[[5, 40] + window, 0])


def test_snapkv_pooling_keeps_neighbours():
    k, v = _spiky_keys(100, [(5, 0, 3.0), (40, 0, 3.0)])
    comp = get_compressor("snapkv", 7, window_size=8, kernel_size=3, min_budget=0)  # budget 14 of 98
    layer = comp.compress(k[:98], v[:98], _axis_queries(8))
    assert layer.positions[:, 0].tolist() == [4, 5, 6, 39, 40, 41] + list(range(90, 98))


def test_h2o_keeps_heavy_hitters_and_recent():
    k, v = _spiky_keys(60, [(3, 0, 3.0), (10, 0, 2.5)])
    comp = get_compressor("h2o", 6, min_budget=0)  # budget 10: 5 recent + 5 heavy
    layer = comp.compress(k, v, _axis_queries(60))  # all prompt queries
    kept = layer.positions[:, 0].tolist()
    assert len(kept) == 10 and {3, 10} <= set(kept) and kept[-5:] == list(range(55, 60))
    scores = attention_mass(_axis_queries(60), k, 1 / math.sqrt(8))[:, 0]
    assert torch.equal(layer.scores[:, 0], scores[kept])
    heavy = [p for p in kept if p < 55]
    assert scores[heavy].min() >= scores[:55][~torch.isin(torch.arange(55), torch.tensor(heavy))].max()


def test_h2o_append_updates_scores_and_evicts_the_lowest():
    k, v = _spiky_keys(64, [(3, 0, 3.0), (10, 0, 2.5), (62, 0, 3.0)])
    comp = get_compressor("h2o", 8, min_budget=0)  # budget 8 at 60 tokens, 8 at 64
    layer = comp.compress(k[:60], v[:60], _axis_queries(60))
    assert 62 not in layer.positions[:, 0].tolist()
    grown = comp.append(layer, k[60:], v[60:], _axis_queries(4))
    kept = grown.positions[:, 0].tolist()
    assert len(kept) == 8 and {3, 10, 62} <= set(kept) and kept[-4:] == [60, 61, 62, 63]
    old = {p: s for p, s in zip(layer.positions[:, 0].tolist(), layer.scores[:, 0].tolist())}
    new = dict(zip(kept, grown.scores[:, 0].tolist()))
    assert new[3] > old[3] and new[10] > old[10]  # the new queries attend there too
    # without queries the appended tokens score 0 and are the first to go once they age
    quiet = comp.append(layer, k[60:], v[60:])
    assert set(quiet.positions[:, 0].tolist()) >= {3, 10}


def _sorted_kept_rows(rank, budget):
    """What the scored droppers kept before kept_rows: a stable descending sort's first
    ``budget`` rows of each column, re-sorted into row order."""
    order = torch.sort(rank, dim=0, descending=True, stable=True).indices[:budget]
    return torch.sort(order, dim=0).values


@pytest.mark.parametrize("values", ["normal", "ties", "infinities", "zeros", "nan"])
def test_kept_rows_are_the_sorts_rows(values):
    gen = torch.Generator().manual_seed(7)
    for trial in range(300):
        rows = 1 + int(torch.randint(0, 200, (1,), generator=gen))
        heads = 1 + int(torch.randint(0, 5, (1,), generator=gen))
        budget = 1 + int(torch.randint(0, rows, (1,), generator=gen))
        rank = torch.randn(rows, heads, generator=gen)
        if values == "ties":
            rank = torch.randint(0, 3, (rows, heads), generator=gen).float()
        elif values == "infinities":  # protected rows rank +inf; an overflowed score -inf
            rank[torch.rand(rows, heads, generator=gen) < 0.3] = float("inf")
            rank[torch.rand(rows, heads, generator=gen) < 0.2] = float("-inf")
            rank[torch.rand(rows, heads, generator=gen) < 0.2] = torch.finfo(torch.float32).min  # not -inf's tie
        elif values == "zeros":  # generated tokens score 0 (and -0.0 ties with it)
            rank[torch.rand(rows, heads, generator=gen) < 0.4] = 0.0
            rank[torch.rand(rows, heads, generator=gen) < 0.2] = -0.0
        kept = kept_rows(rank, budget)
        assert kept.shape == (budget, heads)
        if values == "nan":  # ranked as +inf: kept before every finite row
            rank[torch.rand(rows, heads, generator=gen) < 0.1] = float("nan")
            kept = kept_rows(rank, budget)
            rank = rank.nan_to_num(nan=float("inf"))
        assert torch.equal(kept, _sorted_kept_rows(rank, budget)), (trial, rank, budget)


@pytest.mark.parametrize("num_q,q_heads,kv_heads,num_keys", [(32, 9, 3, 300), (7, 4, 4, 50), (60, 4, 1, 60),
                                                          (300, 6, 3, 400)])  # 300: two chunks of queries
def test_attention_mass_is_each_keys_summed_attention(num_q, q_heads, kv_heads, num_keys):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(num_q, q_heads, 16, generator=gen)
    k = torch.randn(num_keys, kv_heads, 16, generator=gen)
    expected = torch.zeros(num_keys, kv_heads, dtype=torch.float64)
    group = q_heads // kv_heads
    for i in range(num_q):  # query i is token num_keys - num_q + i: it sees the keys up to itself
        seen = num_keys - num_q + i + 1
        for h in range(q_heads):
            logits = (k[:seen, h // group].double() @ q[i, h].double()) * 0.25
            expected[:seen, h // group] += torch.softmax(logits, 0)
    mass = attention_mass(q, k, 0.25)
    assert mass.shape == (num_keys, kv_heads) and mass.dtype == torch.float32
    torch.testing.assert_close(mass.double(), expected, rtol=1e-5, atol=1e-6)


def test_gather_tokens_reads_each_heads_rows():
    x = torch.randn(50, 3, 4, 2)
    index = torch.stack([torch.randperm(50)[:20].sort().values for _ in range(3)], 1)
    expected = torch.stack([x[index[:, h], h] for h in range(3)], 1)
    assert torch.equal(gather_tokens(x, index), expected)
    assert torch.equal(gather_tokens(x[..., 0, 0], index), expected[..., 0, 0])
    assert torch.equal(gather_tokens(x.transpose(2, 3), index), expected.transpose(2, 3))  # not contiguous


def test_streamingllm_appends_of_any_size_keep_what_compress_keeps():
    """Appends short of the window (the one-copy path: sinks from the entry, the new rows
    whole) and past it (the new rows cut), from empty and from a kept window."""
    gen = torch.Generator().manual_seed(11)

    def draw(n):
        return int(torch.randint(0, n, (1,), generator=gen))

    for _ in range(200):
        sinks = draw(7)
        comp = get_compressor("streamingllm", [1.5, 2.0, 4.0, 8.0][draw(4)], num_sinks=sinks,
                              min_budget=sinks + draw(30))
        total = 1 + draw(300)
        k, v = make_kv(total)
        start = draw(total + 1)
        layer = comp.compress(k[:start], v[:start])
        while start < total:
            step = [1, 2, 8, 30, 200][draw(5)]
            layer = comp.append(layer, k[start : start + step], v[start : start + step])
            start += step
        whole = comp.compress(k, v)
        assert all(torch.equal(a, b) for a, b in zip(whole.tensors(), layer.tensors())), comp.options


def test_streamingllm_appends_find_their_ends_without_reading_positions():
    """StreamingLLM's append counts the sinks and window it keeps from token counts alone
    (no read of the positions from the device: a wait per layer and request every round on a
    GPU), the same ends as searching the positions, over growing entries, ratios, sinks and
    appends of every size; an entry of another shape falls back to the search."""
    from sgl_vericache.mem_cache.compress.drop import KeptTokensLayer

    for ratio, sinks, min_budget in ((4.0, 4, 8), (2.0, 1, 3), (8.0, 16, 32), (1.5, 0, 2)):
        comp = get_compressor("streamingllm", ratio, num_sinks=sinks, min_budget=min_budget)
        layer = comp.compress(*make_kv(0))
        for step, added in enumerate([1, 3, 7, 1, 30, 2, 64, 5, 1, 100, 17] * 2):
            positions = torch.cat([layer.positions[:, 0], torch.arange(layer.num_tokens, layer.num_tokens + added)])
            want = comp.kept_ends(positions, layer.num_tokens + added)
            assert comp.appended_ends(layer, added) == want, (ratio, sinks, step, added)
            layer = comp.append(layer, *make_kv(added))
            kept = layer.positions[:, 0]
            assert kept.shape[0] == comp.budget(layer.num_tokens) and bool((kept[1:] > kept[:-1]).all())
    odd = KeptTokensLayer(10, 2, 16, torch.float32, torch.zeros(3, 2, 16), torch.zeros(3, 2, 16),
                          torch.tensor([[0, 0], [5, 5], [9, 9]], dtype=torch.int32), None)
    assert get_compressor("streamingllm", 4.0, min_budget=8).appended_ends(odd, 1) is None
