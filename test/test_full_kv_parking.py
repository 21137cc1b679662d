"""Full KV parked on the host between verify rounds (``mem_cache/full_kv_parking.py``), on
plain tensors: a per-layer pool, a request-to-slot table and a free-list allocator."""

from __future__ import annotations

import threading

import pytest
import torch

from sgl_vericache.mem_cache.full_kv_parking import FullKVParking, ParkingError

LAYERS, HEADS, DIM, SLOTS = 3, 2, 4, 64


class Pool:
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.k = [torch.randn(SLOTS, HEADS, DIM, generator=g) for _ in range(LAYERS)]
        self.v = [torch.randn(SLOTS, HEADS, DIM, generator=g) for _ in range(LAYERS)]
        self.free_slots = list(range(1, SLOTS))  # slot 0 is padding, as in SGLang
        self.req_to_token = torch.zeros(4, 32, dtype=torch.int32)

    def alloc(self, n):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots):
        self.free_slots.extend(slots.tolist())

    def parking(self, **kw):
        return FullKVParking(lambda l: self.k[l], lambda l: self.v[l], LAYERS, self.req_to_token,
                             self.alloc, self.free, **kw)

    def fill_row(self, row, n):
        self.req_to_token[row, :n] = self.alloc(n).to(torch.int32)

    def row_kv(self, row, start, end):
        slots = self.req_to_token[row, start:end].to(torch.int64)
        return [(self.k[l][slots].clone(), self.v[l][slots].clone()) for l in range(LAYERS)]


def test_park_then_load_is_bit_identical_and_frees_then_retakes_slots():
    pool = Pool()
    pool.fill_row(0, 20)
    before = pool.row_kv(0, 5, 20)
    prefix_slots = pool.req_to_token[0, :5].clone()
    free_before = len(pool.free_slots)
    parking = pool.parking()
    assert parking.park("a", 0, 5, 20) == 15
    assert len(pool.free_slots) == free_before + 15 and parking.reserved_tokens == 15
    # the freed slots are reused by someone else and overwritten
    other = pool.alloc(len(pool.free_slots))
    for l in range(LAYERS):
        pool.k[l][other] = 0.0
        pool.v[l][other] = 0.0
    pool.free(other)
    assert parking.start_loads({"a": 0}) == 15
    for layer in range(LAYERS):
        parking.wait_layer(layer)
    parking.finish()
    after = pool.row_kv(0, 5, 20)
    for (k0, v0), (k1, v1) in zip(before, after):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert torch.equal(pool.req_to_token[0, :5], prefix_slots), "the tree-owned prefix is not touched"
    assert not parking.is_parked("a") and parking.reserved_tokens == 0
    s = parking.stats
    assert (s.parks, s.loads, s.parked_tokens, s.loaded_tokens) == (1, 1, 15, 15)
    assert s.bytes_to_host == s.bytes_to_device == 15 * LAYERS * 2 * HEADS * DIM * 4


def test_verify_waits_for_its_layer_only():
    pool = Pool()
    pool.fill_row(1, 10)
    parking = pool.parking()
    parking.park("r", 1, 0, 10)
    gate = threading.Event()
    copied = []
    original = parking._copy_layer

    def slow_copy(layer, targets):
        if layer == 1:
            gate.wait(5)
        original(layer, targets)
        copied.append(layer)

    parking._copy_layer = slow_copy
    parking.start_loads({"r": 1, "not-parked": 2})
    parking.wait_layer(0)  # returns while layer 1 is held back
    assert copied == [0]
    gate.set()
    parking.wait_layer(2)
    assert copied == [0, 1, 2]
    parking.finish()


def test_only_parked_requests_load_and_a_second_round_waits_for_the_first():
    pool = Pool()
    pool.fill_row(0, 8)
    pool.fill_row(1, 8)
    parking = pool.parking()
    parking.park("a", 0, 2, 8)
    assert parking.start_loads({"b": 1}) == 0 and parking.load is None
    assert parking.start_loads({"a": 0, "b": 1}) == 6
    parking.park("b", 1, 0, 8)  # b was not loading: fine
    with pytest.raises(ParkingError, match="still loading"):
        parking.park("a", 0, 2, 8)
    assert parking.start_loads({"a": 0, "b": 1}) == 8  # finishes a's load first, then loads b
    parking.finish()
    assert parking.parked == {}


def test_errors_name_the_request():
    pool = Pool()
    pool.fill_row(0, 8)
    parking = pool.parking()
    parking.park("a", 0, 0, 8)
    with pytest.raises(ParkingError, match="'a' is already parked"):
        parking.park("a", 0, 0, 8)
    pool.alloc(len(pool.free_slots))  # the pool is full
    room = []
    parking.make_room = room.append
    with pytest.raises(ParkingError, match="no device slots for 8 tokens of parked request 'a'"):
        parking.start_loads({"a": 0})
    assert room == [8], "it asked for room (tree eviction) before giving up"
    assert parking.is_parked("a"), "a failed load keeps the host copy"


def test_a_failed_copy_reaches_the_verify_that_waits():
    pool = Pool()
    pool.fill_row(0, 4)
    parking = pool.parking()
    parking.park("a", 0, 0, 4)

    def broken(layer, targets):
        raise OSError("device lost")

    parking._copy_layer = broken
    parking.start_loads({"a": 0})
    with pytest.raises(ParkingError, match="device lost"):
        parking.wait_layer(0)
    with pytest.raises(ParkingError, match="device lost"):
        parking.finish()


def test_load_now_and_nothing_to_park():
    pool = Pool()
    pool.fill_row(0, 6)
    before = pool.row_kv(0, 0, 6)
    parking = pool.parking()
    assert parking.park("a", 0, 6, 6) == 0 and not parking.is_parked("a")
    parking.park("a", 0, 0, 6)
    assert parking.load_now("a", 0) == 6 and parking.load_now("a", 0) == 0
    after = pool.row_kv(0, 0, 6)
    assert all(torch.equal(k0, k1) and torch.equal(v0, v1) for (k0, v0), (k1, v1) in zip(before, after))
    parking.check_integrity()


def test_a_round_that_cannot_get_slots_for_every_parked_request_takes_none():
    pool = Pool()
    pool.fill_row(0, 10)
    pool.fill_row(1, 10)
    parking = pool.parking()
    parking.park("a", 0, 0, 10)
    parking.park("b", 1, 0, 10)
    pool.alloc(len(pool.free_slots) - 15)  # room for a, not for b too
    free_before = sorted(pool.free_slots)
    with pytest.raises(ParkingError, match="'b'"):
        parking.start_loads({"a": 0, "b": 1})
    assert sorted(pool.free_slots) == free_before and parking.is_parked("a") and parking.is_parked("b")
    assert parking.load is None and parking.stats.loads == 0


def test_reservation_is_one_rounds_loads_with_a_limit():
    """Staggered verifies load at most the budget (or one request larger than it) per round,
    so that is what parked requests keep reserved; without a limit, everything parked."""
    pool = Pool()
    for row, n in ((0, 10), (1, 6), (2, 4)):
        pool.fill_row(row, n)
    parking = pool.parking()
    for rid, row, n in (("a", 0, 10), ("b", 1, 6), ("c", 2, 4)):
        parking.park(rid, row, 0, n)
    assert parking.reserved_tokens == 20
    parking.reserve_limit = 12
    assert parking.reserved_tokens == 12
    parking.reserve_limit = 0  # one request at a time: the largest
    assert parking.reserved_tokens == 10
    parking.start_loads({"a": 0})
    parking.finish()
    assert parking.reserved_tokens == 6
    parking.reserve_limit = 100
    assert parking.reserved_tokens == 10  # never more than what is parked
