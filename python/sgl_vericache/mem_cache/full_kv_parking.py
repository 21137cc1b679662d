"""Full KV parked in host memory while a request only drafts, loaded back layer by layer
while the drafts of the round it verifies in run.

Drafting reads a request's compressed entry only; its full KV is needed at verify. With a
device budget for full KV (``--vericache-full-device-budget``), the worker parks the
request-owned part of a running request's full KV at the start of a round it does not
verify in (copied to host memory, its device slots freed) and, at the start of the round it
verifies in, allocates slots again and starts copying it back on a background thread (CPU)
or a side stream (CUDA), one layer at a time, while the drafts run. Verify waits per layer:
the attention of layer l starts once layer l is back.

Which part: the tokens a request owns (``[cache_protected_len, committed)``, in practice
what it generated); its prompt is owned by SGLang's radix tree, shared with other requests
and locked while the request runs, so it stays on the device. Verifies are staggered: a
round verifies only the requests whose own full KV fits in the budget (those that waited
longest first); the others draft and stay parked. So at most about the budget comes back
per round, and ``reserve_limit`` caps what parked requests hold reserved meanwhile.

Where parked KV lives: SGLang's HiCache host pool when the engine has one
(``HostPoolStore``: its slots, its device<->host copy kernels), else tensors of its own
(``TensorStore``, pinned on CUDA); a request that does not fit in the host pool falls back
to tensors. The class knows nothing else of SGLang: it is given the pool's per-layer
buffers, the request-to-slot table, and alloc / free callables. ``reserved_tokens`` is what parked
requests may take back at once (all of it, or with ``reserve_limit`` set, at most
``max(reserve_limit, the largest parked request)``: one round's loads); the adapter
subtracts it from the allocator's available size so the scheduler never promises those
slots to anyone else.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


class TensorStore:
    """Parked KV in host tensors of its own, one per layer (pinned when the device is CUDA)."""

    name = "tensors"

    def __init__(self, key_buffer, value_buffer, num_layers, pin: bool):
        self.key_buffer, self.value_buffer, self.num_layers, self.pin = key_buffer, value_buffer, num_layers, pin

    def put(self, slots: torch.Tensor):
        keys = [_to_host(self.key_buffer(layer)[slots], self.pin) for layer in range(self.num_layers)]
        values = [_to_host(self.value_buffer(layer)[slots], self.pin) for layer in range(self.num_layers)]
        return keys, values

    def prepare_load(self, handle, slots: torch.Tensor):
        """What ``load_layer`` reads to put the parked KV into device slots ``slots``."""
        return handle, slots

    def load_layer(self, plan, layer: int) -> None:
        (keys, values), slots = plan
        device = self.key_buffer(layer).device
        self.key_buffer(layer)[slots] = keys[layer].to(device, non_blocking=True)
        self.value_buffer(layer)[slots] = values[layer].to(device, non_blocking=True)

    def drop(self, handle) -> None:
        pass

    def tokens(self, handle) -> int:
        return handle[0][0].shape[0]


# (host indices, device indices) -> the same indices where a host pool's copies read them
Placement = Callable[[torch.Tensor, torch.Tensor], tuple]


def _as_given(host_indices: torch.Tensor, device_indices: torch.Tensor) -> tuple:
    return host_indices, device_indices


class HostPoolStore:
    """Parked KV in SGLang's HiCache host pool (``MHATokenToKVPoolHost``): slots from its
    allocator, copies by its own backup / per-layer load kernels. The host pool's allocator
    hands out host indices in CPU memory; its copies want them where its io backend reads
    them (on the GPU for its kernels; for direct copies the device indices on the host, in
    host order): ``place_backup`` / ``place_load`` put them there, as SGLang's cache
    controller does before each of its own copies (``sglang.hicache.parking_host_pool``)."""

    name = "host_pool"

    def __init__(self, host_pool, device_pool, io_backend: str, place_backup: Placement = _as_given,
                 place_load: Placement = _as_given, backup_stream=None):
        self.host_pool, self.device_pool, self.io_backend = host_pool, device_pool, io_backend
        self.place_backup, self.place_load = place_backup, place_load
        # CUDA: the stream HiCache's own write-backs run on. A page_first pool's staged
        # write-back kernel goes through staging buffers the pool keeps, one pair for every
        # caller: a backup on another stream could overwrite them while HiCache's is in flight
        # (a cached prefix, or the parked KV, would be copied wrong). Ours queue behind its.
        self.backup_stream = backup_stream

    def put(self, slots: torch.Tensor):
        """Copy the KV at device ``slots`` into new host-pool slots; returns them (None: the
        host pool is full). The copy has finished when this returns."""
        host_slots = self.host_pool.alloc(len(slots))
        if host_slots is None:
            return None
        host, device = self.place_backup(host_slots, slots)
        stream = self.backup_stream
        if stream is None:
            self.host_pool.backup_from_device_all_layer(self.device_pool, host, device, self.io_backend)
            return host_slots
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # after what the forwards wrote
        with torch.cuda.stream(stream):
            self.host_pool.backup_from_device_all_layer(self.device_pool, host, device, self.io_backend)
        stream.synchronize()
        return host_slots

    def prepare_load(self, handle, slots: torch.Tensor):
        return self.place_load(handle, slots)

    def load_layer(self, plan, layer: int) -> None:
        host, device = plan
        self.host_pool.load_to_device_per_layer(self.device_pool, host, device, layer, self.io_backend)

    def drop(self, handle) -> None:
        self.host_pool.free(handle)

    def tokens(self, handle) -> int:
        return len(handle)


@dataclass
class _Parked:
    start: int  # row positions [start, start + n) are parked
    n: int
    store: object  # TensorStore / HostPoolStore
    handle: object


@dataclass
class _Load:
    """One round's loads: every parked request of the batch, copied layer by layer."""

    rids: list
    num_layers: int
    # (rid, what the store's load_layer reads): held until finish(). On CUDA the copies run on
    # a side stream after start_loads returns; a device tensor they index with that was freed
    # sooner would go back to the main stream's allocator and be overwritten by its next
    # kernels while the copies still read it. finish() makes the main stream wait for the
    # last copy before letting go, so what reuses the memory then runs after them.
    plans: list = field(default_factory=list)
    done: list = field(default_factory=list)  # CPU: threading.Event per layer; CUDA: torch.cuda.Event
    started: Optional[object] = None  # CUDA: a timing event recorded on the side stream before the copies
    error: list = field(default_factory=list)
    thread: Optional[threading.Thread] = None


@dataclass
class ParkingStats:
    parks: int = 0
    parks_in_host_pool: int = 0
    loads: int = 0
    parked_tokens: int = 0
    loaded_tokens: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    # verify's wait for layers still loading (CUDA: the host's, near 0: the wait is the GPU's)
    wait_seconds: float = 0.0
    # the copies themselves (background; CUDA: GPU time from the side stream's timing events,
    # counted once they have completed, at a later finish() when not yet)
    load_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(vars(self))


class ParkingError(RuntimeError):
    pass


class FullKVParking:
    def __init__(self, key_buffer: Callable[[int], torch.Tensor], value_buffer: Callable[[int], torch.Tensor],
                 num_layers: int, req_to_token: torch.Tensor, alloc: Callable[[int], Optional[torch.Tensor]],
                 free: Callable[[torch.Tensor], None], make_room: Callable[[int], None] = lambda n: None,
                 host_pool: Optional[HostPoolStore] = None):
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        self.num_layers = num_layers
        self.req_to_token = req_to_token
        self.alloc, self.free, self.make_room = alloc, free, make_room
        self.device = key_buffer(0).device
        self.on_cuda = self.device.type == "cuda"
        self.parked: dict = {}  # rid -> _Parked
        self.load: Optional[_Load] = None
        self.stats = ParkingStats()
        self._stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.tensors = TensorStore(key_buffer, value_buffer, num_layers, pin=self.on_cuda)
        self.host_pool = host_pool
        self.reserve_limit: Optional[int] = None  # tokens one round loads at most (None: all parked)
        self._timings: list = []  # CUDA: (start, end) timing events of finished loads, not yet read

    # -- bookkeeping ----------------------------------------------------------------------
    @property
    def reserved_tokens(self) -> int:
        sizes = [p.n for p in self.parked.values()]
        total = sum(sizes)
        if self.reserve_limit is None or not sizes:
            return total
        return min(total, max(self.reserve_limit, max(sizes)))

    def is_parked(self, rid) -> bool:
        return rid in self.parked

    def _bytes(self, n: int) -> int:
        k, v = self.key_buffer(0), self.value_buffer(0)
        per_token = k[0].numel() * k.element_size() + v[0].numel() * v.element_size()
        return n * per_token * self.num_layers

    # -- park -----------------------------------------------------------------------------
    def park(self, rid, row: int, start: int, end: int) -> int:
        """Copy row positions [start, end) of every layer to the host and free their device
        slots. Returns the tokens parked (0 when there is nothing to park)."""
        if self.load is not None and rid in self.load.rids:
            raise ParkingError(f"request {rid!r} is still loading")
        if rid in self.parked:
            raise ParkingError(f"request {rid!r} is already parked")
        n = end - start
        if n <= 0:
            return 0
        slots = self.req_to_token[row, start:end].to(torch.int64)
        store, handle = self.host_pool, None
        if store is not None:
            handle = store.put(slots)
        if handle is None:  # no host pool, or it is full
            store, handle = self.tensors, self.tensors.put(slots)
        else:
            self.stats.parks_in_host_pool += 1
        if self.on_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.free(slots)
        self.parked[rid] = _Parked(start, n, store, handle)
        self.stats.parks += 1
        self.stats.parked_tokens += n
        self.stats.bytes_to_host += self._bytes(n)
        return n

    # -- load back --------------------------------------------------------------------------
    def start_loads(self, rows: dict) -> int:
        """Give every parked request in ``rows`` (rid -> req_to_token row) new device slots,
        write them into its row, and start copying its KV back, layer by layer. Returns the
        tokens being loaded. Waits for an earlier round's loads first."""
        self.finish()
        rids = [rid for rid in rows if rid in self.parked]
        if not rids:
            return 0
        targets = []
        try:
            for rid in rids:
                targets.append((rid, self._alloc(self.parked[rid].n, rid).to(torch.int64)))
        except ParkingError:
            for _, slots in targets:  # all or nothing: every request stays parked
                self.free(slots)
            raise
        for rid, slots in targets:
            parked = self.parked[rid]
            self.req_to_token[rows[rid], parked.start:parked.start + parked.n] = slots.to(self.req_to_token.dtype)
        load = _Load(rids, self.num_layers)
        load.plans = [(rid, self.parked[rid].store.prepare_load(self.parked[rid].handle, slots))
                      for rid, slots in targets]
        n = sum(self.parked[rid].n for rid in rids)
        self.stats.loads += len(rids)
        self.stats.loaded_tokens += n
        self.stats.bytes_to_device += self._bytes(n)
        if self.on_cuda:
            self._load_on_stream(load)
        else:
            load.done = [threading.Event() for _ in range(self.num_layers)]
            load.thread = threading.Thread(target=self._load_on_thread, args=(load,), daemon=True,
                                           name="vericache-full-kv-load")
            load.thread.start()
        self.load = load
        return n

    def _alloc(self, n: int, rid) -> torch.Tensor:
        slots = self.alloc(n)
        if slots is None:
            self.make_room(n)
            slots = self.alloc(n)
        if slots is None:
            raise ParkingError(f"no device slots for {n} tokens of parked request {rid!r}")
        return slots

    def _copy_layer(self, layer: int, plans) -> None:
        for rid, plan in plans:
            self.parked[rid].store.load_layer(plan, layer)

    def _load_on_thread(self, load: _Load) -> None:
        t0 = time.perf_counter()
        try:
            for layer in range(self.num_layers):
                self._copy_layer(layer, load.plans)
                load.done[layer].set()
        except BaseException as exc:  # surfaced to the waiting verify, never swallowed
            load.error.append(exc)
            for event in load.done:
                event.set()
        finally:
            self.stats.load_seconds += time.perf_counter() - t0

    def _load_on_stream(self, load: _Load) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            load.started = torch.cuda.Event(enable_timing=True)
            load.started.record(self._stream)
            for layer in range(self.num_layers):
                self._copy_layer(layer, load.plans)
                event = torch.cuda.Event(enable_timing=layer == self.num_layers - 1)
                event.record(self._stream)
                load.done.append(event)

    def _count_copy_times(self) -> None:
        """CUDA: add the GPU time of finished loads whose copies have completed."""
        pending = []
        for start, end in self._timings:
            if end.query():
                self.stats.load_seconds += start.elapsed_time(end) / 1e3
            else:
                pending.append((start, end))
        self._timings = pending

    def wait_layer(self, layer: int) -> None:
        """Before layer ``layer`` reads full KV: wait until this round's loads have it."""
        load = self.load
        if load is None:
            return
        t0 = time.perf_counter()
        if self.on_cuda:
            torch.cuda.current_stream(self.device).wait_event(load.done[layer])
        else:
            load.done[layer].wait()
        self.stats.wait_seconds += time.perf_counter() - t0
        if load.error:
            raise ParkingError(f"loading parked full KV failed: {load.error[0]!r}") from load.error[0]

    def finish(self) -> None:
        """Wait for the loads in flight, then drop their host copies."""
        load, self.load = self.load, None
        if load is None:
            return
        if load.thread is not None:
            load.thread.join()
        elif self.on_cuda:
            torch.cuda.current_stream(self.device).wait_event(load.done[-1])
            if any(getattr(self.parked.get(rid), "store", None) is self.host_pool for rid in load.rids):
                # HiCache's host pool hands freed slots out again at once, to writers no CUDA
                # stream orders (its storage prefetch, on a thread): the copies must be done.
                load.done[-1].synchronize()
            self._timings.append((load.started, load.done[-1]))
            self._count_copy_times()
        for rid in load.rids:
            self._drop(rid)
        if load.error:
            raise ParkingError(f"loading parked full KV failed: {load.error[0]!r}") from load.error[0]

    def load_now(self, rid, row: int) -> int:
        """Bring one request's KV back before anything else reads its row (it finishes or
        is preempted while parked). Returns the tokens loaded."""
        if rid not in self.parked:
            return 0
        n = self.start_loads({rid: row})
        self.finish()
        return n

    def _drop(self, rid) -> None:
        parked = self.parked.pop(rid, None)
        if parked is not None:
            parked.store.drop(parked.handle)

    def discard(self, rid) -> None:
        self._drop(rid)

    def check_integrity(self) -> None:
        if self.load is not None:
            missing = [rid for rid in self.load.rids if rid not in self.parked]
            if missing:
                raise AssertionError(f"loading requests without a parked copy: {missing[:4]}")
        for rid, parked in self.parked.items():
            if parked.store.tokens(parked.handle) != parked.n:
                raise AssertionError(f"parked copy of {rid!r} holds {parked.store.tokens(parked.handle)} tokens, "
                                     f"not {parked.n}")


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    if t.device.type == "cpu":
        return t.clone() if t._base is not None else t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    out.copy_(t, non_blocking=True)
    return out
