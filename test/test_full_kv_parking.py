"""Full KV parked on the host between verify rounds (``mem_cache/full_kv_parking.py``), on
plain tensors: a per-layer pool, a request-to-slot table and a free-list allocator.

The CUDA path (pinned host copies, loads on a side stream, an event per layer) has tests of
its own, marked ``gpu``; nothing here imports SGLang, so ``scripts/gpu_check.sh`` runs this
file on a bare GPU machine, as a script where pytest is missing."""

from __future__ import annotations

import gc
import threading
import weakref

import torch

try:
    import pytest
except ImportError:  # a bare GPU machine without pytest runs the GPU tests as a script
    pytest = None

from sgl_vericache.mem_cache.full_kv_parking import FullKVParking, ParkingError

LAYERS, HEADS, DIM, SLOTS = 3, 2, 4, 64


class Pool:
    def __init__(self, device="cpu"):
        g = torch.Generator().manual_seed(0)
        self.device = torch.device(device)
        self.k = [torch.randn(SLOTS, HEADS, DIM, generator=g).to(device) for _ in range(LAYERS)]
        self.v = [torch.randn(SLOTS, HEADS, DIM, generator=g).to(device) for _ in range(LAYERS)]
        self.free_slots = list(range(1, SLOTS))  # slot 0 is padding, as in SGLang
        self.req_to_token = torch.zeros(4, 32, dtype=torch.int32, device=device)
        self.handed = []  # a weak reference to every slot tensor alloc returned

    def alloc(self, n):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        slots = torch.tensor(out, dtype=torch.int64, device=self.device)
        self.handed.append(weakref.ref(slots))
        return slots

    def free(self, slots):
        self.free_slots.extend(slots.tolist())

    def parking(self, **kw):
        return FullKVParking(lambda l: self.k[l], lambda l: self.v[l], LAYERS, self.req_to_token,
                             self.alloc, self.free, **kw)

    def fill_row(self, row, n):
        self.req_to_token[row, :n] = self.alloc(n).to(torch.int32)

    def overwrite_free_slots(self, reverse=False):
        """Someone else takes every free slot, writes zeros there and frees them again (in
        reverse: the next alloc hands out other slots than the last)."""
        other = self.alloc(len(self.free_slots))
        for l in range(LAYERS):
            self.k[l][other] = 0.0
            self.v[l][other] = 0.0
        self.free(other.flip(0) if reverse else other)

    def row_kv(self, row, start, end):
        slots = self.req_to_token[row, start:end].to(torch.int64)
        return [(self.k[l][slots].clone(), self.v[l][slots].clone()) for l in range(LAYERS)]



def _load(parking, rows) -> int:
    """A round's loads, verify waiting for each layer, then finished."""
    n = parking.start_loads(rows)
    for layer in range(LAYERS):
        parking.wait_layer(layer)
    parking.finish()
    return n


def _same(a, b) -> bool:
    return all(torch.equal(k0, k1) and torch.equal(v0, v1) for (k0, v0), (k1, v1) in zip(a, b))


def test_park_then_load_is_bit_identical_and_frees_then_retakes_slots():
    pool = Pool()
    pool.fill_row(0, 20)
    before = pool.row_kv(0, 5, 20)
    prefix_slots = pool.req_to_token[0, :5].clone()
    free_before = len(pool.free_slots)
    parking = pool.parking()
    assert parking.park("a", 0, 5, 20) == 15
    assert len(pool.free_slots) == free_before + 15 and parking.reserved_tokens == 15
    pool.overwrite_free_slots()  # the freed slots are reused by someone else and overwritten
    assert _load(parking, {"a": 0}) == 15
    assert _same(before, pool.row_kv(0, 5, 20))
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


def test_a_load_holds_the_slots_its_copies_write_until_finish():
    """On CUDA the copies are queued on a side stream and run after start_loads returns: a
    slot tensor they index with, freed meanwhile, would go back to the main stream's allocator
    and be overwritten by its next kernels while they still read it (the KV would land in
    other requests' slots). So the load holds every such tensor until finish(), by which
    time the main stream waits for the copies. Checked here on the CPU path: the copy
    thread is done and has let go of its arguments, the load still holds them."""
    pool = Pool()
    pool.fill_row(0, 8)
    parking = pool.parking()
    parking.park("a", 0, 0, 8)
    pool.handed.clear()
    parking.start_loads({"a": 0})
    parking.load.thread.join()
    gc.collect()
    assert len(pool.handed) == 1 and pool.handed[0]() is not None, "the load let go of its slots early"
    parking.finish()
    gc.collect()
    assert pool.handed[0]() is None, "finish() keeps the slots alive for ever"


def _gpu(test):
    return pytest.mark.gpu(test) if pytest is not None else test


@_gpu
def test_gpu_park_and_load_on_a_side_stream_is_bit_identical():
    """The CUDA path itself: pinned host copies on park, the load on a side stream with an
    event per layer, verify waiting layer by layer; the KV comes back bit-identical into other
    slots, and the slots the request held are overwritten meanwhile by someone else."""
    pool = Pool("cuda")
    pool.fill_row(0, 20)
    pool.fill_row(1, 6)
    before = pool.row_kv(0, 5, 20)
    neighbour = pool.row_kv(1, 0, 6)
    parking = pool.parking()
    assert parking.on_cuda and parking.park("a", 0, 5, 20) == 15
    keys, _ = parking.parked["a"].handle
    assert keys[0].is_pinned() and keys[0].device.type == "cpu"
    pool.overwrite_free_slots(reverse=True)  # the request gets slots other than the ones it had
    assert _load(parking, {"a": 0}) == 15
    assert _same(before, pool.row_kv(0, 5, 20))
    assert _same(neighbour, pool.row_kv(1, 0, 6)), "a load wrote into another request's slots"
    assert parking.load is None and not parking.is_parked("a")


@_gpu
def test_gpu_a_delayed_side_stream_still_writes_the_right_slots():
    """The race the held slots prevent: the side stream is held back (a sleep queued on it
    before the load), so its copies run only after start_loads has returned and the main
    stream has gone on allocating and writing small int64 tensors (slot 0 is SGLang's
    padding). Had the load let go of its slot tensors, the main stream would reuse their
    memory and the copies would scatter the KV to slot 0."""
    pool = Pool("cuda")
    pool.fill_row(0, 24)
    before = pool.row_kv(0, 0, 24)
    parking = pool.parking()
    parking.park("a", 0, 0, 24)
    padding = [(pool.k[l][0].clone(), pool.v[l][0].clone()) for l in range(LAYERS)]
    with torch.cuda.stream(parking._stream):
        torch.cuda._sleep(50_000_000)  # ~25-50 ms of GPU clock: the main stream runs ahead
    parking.start_loads({"a": 0})
    scribbles = [torch.zeros(24, dtype=torch.int64, device="cuda") for _ in range(64)]
    for layer in range(LAYERS):
        parking.wait_layer(layer)
    parking.finish()
    del scribbles
    assert _same(before, pool.row_kv(0, 0, 24)), "the delayed load wrote the wrong slots"
    for l, (k, v) in enumerate(padding):
        assert torch.equal(pool.k[l][0], k) and torch.equal(pool.v[l][0], v), "slot 0 was written"


class _HostPool:
    """A stand-in for HiCache's host pool (``MHATokenToKVPoolHost``): pinned per-layer
    buffers, consecutive slots from a free list, per-layer loads that read the pinned slots
    themselves asynchronously; ``free`` zeroes the slots on the host at once, as SGLang's
    storage prefetch may write a reused slot from its thread, ordered by no CUDA stream."""

    def __init__(self):
        self.k = [torch.zeros(SLOTS, HEADS, DIM).pin_memory() for _ in range(LAYERS)]
        self.v = [torch.zeros(SLOTS, HEADS, DIM).pin_memory() for _ in range(LAYERS)]
        self.next = 0

    def alloc(self, n):
        start, self.next = self.next, self.next + n
        return torch.arange(start, start + n)

    def free(self, host):
        for buf in (*self.k, *self.v):
            buf[host] = 0.0

    def backup_from_device_all_layer(self, device_pool, host, device, io_backend):
        for l in range(LAYERS):
            self.k[l][host] = device_pool.k[l][device].cpu()
            self.v[l][host] = device_pool.v[l][device].cpu()

    def load_to_device_per_layer(self, device_pool, host, device, layer, io_backend):
        lo, hi = int(host[0]), int(host[-1]) + 1  # a view of the pinned slots: the copy reads them late
        device_pool.k[layer][device] = self.k[layer][lo:hi].to(device_pool.device, non_blocking=True)
        device_pool.v[layer][device] = self.v[layer][lo:hi].to(device_pool.device, non_blocking=True)


@_gpu
def test_gpu_host_pool_slots_are_freed_only_after_their_copies_ran():
    """Parked in the host pool, the load's copies read its pinned slots on the side stream;
    ``finish`` frees the slots, and the pool may hand them to a writer no stream orders. With
    the side stream held back, the copies run after ``finish`` returned unless it waits for
    them: before it did, they loaded the zeros the next writer left."""
    from sgl_vericache.mem_cache.full_kv_parking import HostPoolStore

    pool = Pool("cuda")
    pool.fill_row(0, 24)
    before = pool.row_kv(0, 0, 24)
    parking = pool.parking(host_pool=HostPoolStore(_HostPool(), pool, "direct"))
    parking.park("a", 0, 0, 24)
    assert parking.stats.parks_in_host_pool == 1
    with torch.cuda.stream(parking._stream):
        torch.cuda._sleep(50_000_000)  # ~25-50 ms of GPU clock: the host runs ahead
    parking.start_loads({"a": 0})
    for layer in range(LAYERS):
        parking.wait_layer(layer)
    parking.finish()
    torch.cuda.synchronize()
    assert _same(before, pool.row_kv(0, 0, 24)), "the load read host slots freed (and rewritten) before it ran"
    assert 0 < parking.stats.load_seconds < 1.0, parking.stats  # the copies' GPU time, from their events


class _StagedHostPool(_HostPool):
    """A host pool whose backups go through one pair of device staging buffers, as SGLang's
    page_first pool's staged write-back kernel does: the buffers are the pool's, shared by
    every caller, and the kernel's copy to the host reads them on the caller's stream."""

    def __init__(self):
        super().__init__()
        self.staging = torch.zeros(SLOTS, HEADS, DIM, device="cuda")

    def backup_from_device_all_layer(self, device_pool, host, device, io_backend):
        lo, hi, n = int(host[0]), int(host[-1]) + 1, len(device)
        for l in range(LAYERS):
            for src, dst in ((device_pool.k[l], self.k[l]), (device_pool.v[l], self.v[l])):
                self.staging[:n] = src[device]
                dst[lo:hi].copy_(self.staging[:n], non_blocking=True)


@_gpu
def test_gpu_host_pool_backups_queue_behind_hicaches_own_write_backs():
    """A park into HiCache's host pool runs its backup on HiCache's device-to-host stream:
    on the current stream it overwrote the pool's staging buffers while a HiCache write-back
    that had filled them was still copying them out (the cached prefix got the parked KV)."""
    from sgl_vericache.mem_cache.full_kv_parking import HostPoolStore

    pool = Pool("cuda")
    pool.fill_row(0, 24)
    before = pool.row_kv(0, 0, 24)
    host, d2h = _StagedHostPool(), torch.cuda.Stream()
    parking = pool.parking(host_pool=HostPoolStore(host, pool, "kernel", backup_stream=d2h))
    cached = torch.zeros(24, HEADS, DIM).pin_memory()  # HiCache's own write-back of some prefix
    with torch.cuda.stream(d2h):
        host.staging[:24] = 7.0
        torch.cuda._sleep(50_000_000)  # ~25-50 ms of GPU clock: the park is issued meanwhile
        cached.copy_(host.staging[:24], non_blocking=True)
    parking.park("a", 0, 0, 24)
    torch.cuda.synchronize()
    assert bool((cached == 7.0).all()), "the park overwrote the staging buffers under HiCache's write-back"
    parking.start_loads({"a": 0})
    for layer in range(LAYERS):
        parking.wait_layer(layer)
    parking.finish()
    torch.cuda.synchronize()
    assert _same(before, pool.row_kv(0, 0, 24))


if __name__ == "__main__":  # without pytest (a bare GPU machine): the GPU tests, and two CPU ones that need no pytest
    cpu = (test_park_then_load_is_bit_identical_and_frees_then_retakes_slots,
           test_a_load_holds_the_slots_its_copies_write_until_finish)
    gpu = [test for name, test in list(globals().items()) if name.startswith("test_gpu_")]
    for test in (*cpu, *(gpu if torch.cuda.is_available() else ())):
        test()
        print("passed", test.__name__)
    if not torch.cuda.is_available():
        print(f"skipped {len(gpu)} GPU tests: no CUDA device")
