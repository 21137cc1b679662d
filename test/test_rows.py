"""Entry tensors growing in their spare rows (mem_cache/compress/rows.py) and the
compressors that use them: every result equals torch.cat, every earlier tensor keeps its
rows, in place only from the frontier, bounded spare memory. No engine here."""

from __future__ import annotations

import threading

import pytest
import torch

from sgl_vericache.mem_cache.compress import available_compressors, get_compressor
from sgl_vericache.mem_cache.compress.rows import (MIN_SPARE_ROWS, SPARE_DIVISOR, RowBuffer, append_rows, buffer_of,
                                                   plain_copy, spare_rows)


def _rows(n: int, gen: torch.Generator, dtype=torch.float32, shape=(3, 4)) -> torch.Tensor:
    x = torch.randn(n, *shape, generator=gen)
    return x.to(dtype) if dtype != torch.uint8 else (x * 40).to(torch.int16).to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8,
                                   torch.float8_e4m3fn])
def test_a_chain_of_appends_equals_cat_and_grows_in_place(dtype):
    gen = torch.Generator().manual_seed(1)
    t = append_rows(_rows(0, gen, dtype), _rows(5, gen, dtype))
    expect = t.clone()
    reallocations = 0
    for step in range(300):
        new = _rows(int(torch.randint(0, 9, (), generator=gen)), gen, dtype)
        grown = append_rows(t, new)
        expect = torch.cat([expect, new])
        assert grown.view(torch.uint8).equal(expect.view(torch.uint8)), step
        if grown.data_ptr() != t.data_ptr():
            reallocations += 1
        t = grown
        buf = buffer_of(t)
        assert buf is not None and buf.frontier == t.shape[0]
        assert buf.data.shape[0] <= t.shape[0] + spare_rows(t.shape[0])  # the spare memory bound
    # 5 -> ~1200 rows: a copy each time the rows grew by a sixteenth (16 spare rows at least)
    assert 1 <= reallocations <= 40, reallocations


def test_earlier_tensors_keep_their_rows_and_a_branch_copies():
    gen = torch.Generator().manual_seed(2)
    base = append_rows(torch.empty(0, 3, 4), _rows(40, gen))
    snapshot = base.clone()
    left = append_rows(base, _rows(3, gen))  # from the frontier: in place
    assert left.data_ptr() == base.data_ptr() and base.shape[0] == 40 and base.equal(snapshot)
    left_rows = left.clone()
    right_new = _rows(3, gen)
    right = append_rows(base, right_new)  # base is behind the frontier now: a copy
    assert right.data_ptr() != base.data_ptr()
    assert right.equal(torch.cat([snapshot, right_new])) and left.equal(left_rows) and base.equal(snapshot)
    # each branch grows on: left in place in its buffer, right in its own
    more = _rows(2, gen)
    assert append_rows(left, more).data_ptr() == left.data_ptr()
    assert append_rows(right, more).data_ptr() == right.data_ptr()
    assert left.equal(left_rows) and base.equal(snapshot)


def test_tensors_it_did_not_return_are_copied_and_never_written():
    gen = torch.Generator().manual_seed(3)
    grown = append_rows(torch.empty(0, 3, 4), _rows(30, gen))
    plain = _rows(30, gen)
    for old in (plain, grown[:20], grown.clone(), grown.detach(), grown[:, :, :2].contiguous()):
        before = old.clone()
        new = _rows(4, gen, shape=tuple(old.shape[1:]))
        out = append_rows(old, new)
        assert out.equal(torch.cat([before, new])) and old.equal(before)
        assert out.data_ptr() != old.data_ptr()
    assert buffer_of(grown).frontier == 30  # none of them took grown's spare rows


def test_inference_mode_grows_in_place_too():
    """SGLang's scheduler runs under torch.inference_mode, where a view records no base."""
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        t = append_rows(torch.empty(0, 3, 4), _rows(50, gen))
        grown = append_rows(t, _rows(2, gen))
    assert grown.data_ptr() == t.data_ptr() and grown.is_inference()


def test_rows_that_do_not_fit_name_both_layouts():
    with pytest.raises(ValueError, match=r"rows \(3, 5\) torch.float32 on cpu do not fit \(3, 4\) torch.float32 .*"
                                         r"accepted: the same row shape, dtype and device"):
        append_rows(torch.zeros(2, 3, 4), torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="torch.float16 on cpu do not fit"):
        append_rows(torch.zeros(2, 3, 4), torch.zeros(1, 3, 4, dtype=torch.float16))


def test_one_claim_wins_among_threads_appending_from_the_same_rows():
    buf = RowBuffer(torch.zeros(100, 2), 10)
    view = buf.view(10)
    wins = []
    barrier = threading.Barrier(8)

    def claim():
        barrier.wait()
        wins.append(buf.claim(view, 5))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(wins) == [False] * 7 + [True] and buf.frontier == 15


def test_spare_rows_is_a_sixteenth_with_a_floor():
    assert spare_rows(0) == MIN_SPARE_ROWS and spare_rows(32768) == 32768 // SPARE_DIVISOR == 2048


GROWING = [n for n in available_compressors() if get_compressor(n).grows_in_place]


def test_the_methods_that_grow_in_place():
    assert sorted(GROWING) == ["fp8", "full", "h2o", "int8", "kivi2", "kivi4", "quest", "snapkv"], GROWING


@pytest.mark.parametrize("name", GROWING)
def test_entries_stay_values_when_grown_in_place_and_branched(name):
    """A chain of appends grows the entry's tensors in place (the droppers: joins the new
    tokens to the kept ones there before choosing); an entry appended to twice (a kept old
    entry, a prefix shared by two requests) gives two entries that each equal what
    appending with copies gives, and every earlier entry materializes as it did."""
    comp = get_compressor(name, group_size=8, residual_length=16) if name.startswith("kivi") else get_compressor(name)
    gen = torch.Generator().manual_seed(5)
    kv = lambda n: (torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen))  # noqa: E731
    queries = torch.randn(8, 4, 16, generator=gen) if comp.needs_queries else None
    entry = comp.compress(*kv(60), queries)
    history = [(entry, [t.clone() for t in comp.materialize(entry)[:2]])]
    in_place = 0
    for step in range(40):
        k, v = kv(int(torch.randint(1, 7, (), generator=gen)))
        before = entry.tensors()[0]
        frontier = buffer_of(before).frontier if buffer_of(before) is not None else None
        grown = comp.append(entry, k, v)
        main = grown.tensors()[0]
        in_place += main.data_ptr() == before.data_ptr() and main.shape[0] > before.shape[0]
        # a dropper's join: the new rows went into the old entry's spare rows
        in_place += frontier == before.shape[0] and buffer_of(before).frontier == before.shape[0] + k.shape[0] \
            and main.data_ptr() != before.data_ptr()
        if step % 5 == 4:  # a branch from an entry two steps back
            old, _ = history[-3]
            branch = comp.append(old, k, v)
            reference = comp.append(plain_copy(old), k, v)  # plain tensors: every row copied
            for got, want in zip(comp.materialize(branch)[:2], comp.materialize(reference)[:2]):
                assert got.equal(want), (name, step)
        entry = grown
        history.append((entry, [t.clone() for t in comp.materialize(entry)[:2]]))
    for old, rows in history:
        for got, want in zip(comp.materialize(old)[:2], rows):
            assert got.equal(want), name
    assert in_place >= 10, (name, in_place)


@pytest.mark.parametrize("name", GROWING)
def test_random_branching_appends_match_appends_to_copies(name):
    """Entries appended to in a random order, each from any earlier entry (requests sharing
    cached prefixes, old entries kept and extended again), against the same appends made to
    copies with no spare rows: every entry's tensors equal at the end, when all are alive."""
    comp = get_compressor(name, group_size=4, residual_length=8) if name.startswith("kivi") else get_compressor(name)
    gen = torch.Generator().manual_seed(6)
    queries = torch.randn(8, 4, 16, generator=gen) if comp.needs_queries else None
    first = comp.compress(torch.randn(40, 2, 16, generator=gen), torch.randn(40, 2, 16, generator=gen), queries)
    grown, copied = [first], [plain_copy(first)]
    assert all(buffer_of(t) is None for t in copied[0].tensors())  # the reference grows nothing in place
    for _ in range(150):
        parent = int(torch.randint(0, len(grown), (), generator=gen)) if torch.rand((), generator=gen) < 0.3 \
            else len(grown) - 1 - int(torch.randint(0, min(3, len(grown)), (), generator=gen))
        n = int(torch.randint(1, 12, (), generator=gen))
        k, v = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)
        grown.append(comp.append(grown[parent], k, v))
        copied.append(comp.append(plain_copy(copied[parent]), k, v))
    for i, (a, b) in enumerate(zip(grown, copied)):
        assert a.num_tokens == b.num_tokens
        assert all(x.equal(y) for x, y in zip(a.tensors(), b.tensors())), (name, i)
