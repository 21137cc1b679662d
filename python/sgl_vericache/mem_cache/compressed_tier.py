"""Compressed prefix entries in a storage tier (no SGLang imports).

The compressed prefix cache (``compressed_prefix.py``) keeps entries within a device byte
budget. With a storage tier behind it, an entry it evicts is not lost: it is encoded and
written to the tier (SGLang's HiCache file backend, Mooncake's store, ...) on a writer
thread, and the cache keeps a stub in its place (the token path, the storage key, the
encoded size). A request whose prefix the device no longer holds (its full KV streaming
in from the same tier) reads the stub's entry back on a reader thread -- several times
smaller than the full KV, so it arrives first -- and drafts from it meanwhile: the paper's
remote prefix reuse. Until the write finished the stub keeps the entry itself, and a read
then needs no I/O.

Entries are stored in a format of their own (``entry_format.py``: no pickle, a digest over
the format version, the compressor key, the token ids and the bytes). A read whose digest
does not match, an entry of another format version or of other layer fields, or any other
error decoding it is a miss, counted, never an entry: nothing a store holds reaches the
scheduler as an exception.

Entries outlive the process that wrote them: next to each entry of at least
``INDEX_ANCHOR`` tokens the tier writes a small index record, named by the compressor key and
the entry's first ``INDEX_ANCHOR``-multiple of tokens, that says which entry (and how long) to
read. ``find`` probes those names for a request's tokens, longest first, so an engine started
later (or another one on the same store) drafts from entries it never held in memory. Index
records are written once (stores keep the first value under a name); one that points at an
entry that is gone, or not a prefix of the request, is a miss like any other.

Reading an entry back is worth it only when it lands well before the full prefix: the
drafts are made in the time left between the two. ``worth_reading`` estimates both
arrivals from their sizes and each transfer's measured speed (``Throughput``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Hashable, Optional, Protocol, Sequence

from sgl_vericache.mem_cache.compress import CompressedLayer
from sgl_vericache.mem_cache.entry_format import (INDEX_ANCHOR, INDEX_RECORD_BYTES, OtherFormatError, decode_entry,
                                                   decode_index_record, encode_entry, encode_index_record,
                                                   index_anchors, index_key, move_entry, storage_key, tokens_digest)

logger = logging.getLogger(__name__)


class BlobStore(Protocol):
    def put(self, key: str, data: bytes) -> bool: ...

    def get(self, key: str, nbytes: int) -> Optional[bytes]: ...


# ---------------------------------------------------------------------- when to read

class Throughput:
    """How fast one kind of transfer has been going (bytes per second, an exponentially
    weighted mean over the transfers seen: the recent ones count most), to estimate how
    long the next one takes. Unknown (None) until a transfer was seen."""

    def __init__(self, weight: float = 0.3):
        if not 0 < weight <= 1:
            raise ValueError(f"weight {weight!r} must be in (0, 1]")
        self.weight = weight
        self.bytes_per_second: Optional[float] = None
        self.transfers = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not seconds > 0:  # nothing moved, or a clock that did not move: no information
            return
        speed = nbytes / seconds
        old = self.bytes_per_second
        self.bytes_per_second = speed if old is None else (1 - self.weight) * old + self.weight * speed
        self.transfers += 1

    def seconds_for(self, nbytes: int) -> Optional[float]:
        return None if self.bytes_per_second is None else nbytes / self.bytes_per_second


def worth_reading(entry_bytes: int, full_bytes: int, entry_speed: Throughput, full_speed: Throughput,
                  fraction: float) -> bool:
    """Whether a compressed entry of ``entry_bytes`` read from the tier is expected to arrive
    within ``fraction`` of the time the prefix's ``full_bytes`` of full KV take to stream in
    (so that most of that time is left to draft in). Each arrival is estimated from its own
    measured speed; a speed not measured yet is taken to be the other's (both come from one
    store), and with neither the sizes are compared. ``fraction`` 1 reads always, 0 never."""
    if fraction >= 1:
        return True
    if fraction <= 0 or full_bytes <= 0:  # never, or nothing streams in: no time to draft in
        return False
    if entry_bytes <= 0:
        return True
    e_bps, f_bps = entry_speed.bytes_per_second, full_speed.bytes_per_second
    e_bps, f_bps = e_bps or f_bps or 1.0, f_bps or e_bps or 1.0
    return entry_bytes / e_bps <= fraction * (full_bytes / f_bps)


# ---------------------------------------------------------------------- the tier


@dataclass(eq=False)
class SpilledEntry:
    """The stub the compressed prefix cache keeps for an entry it sent to the tier."""

    num_tokens: int
    key: str  # repr of the compressor key: part of the digest
    nbytes: int = 0  # encoded size, once written
    layers: Optional[tuple] = None  # the entry itself until its write finished (reads need no I/O)
    failed: bool = False  # the write did not happen: the stub holds nothing
    storage_key: str = ""  # the stored entry's name, once written


class CompressedTier:
    """Writes evicted compressed entries to a ``BlobStore`` and reads them back, each on a
    thread of its own so neither waits behind the other. ``spill`` and ``fetch`` are called
    from the scheduler thread and never block on I/O."""

    def __init__(self, store: BlobStore, max_pending_bytes: int = 256 << 20):
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="vericache-tier-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="vericache-tier-read")
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self.counters = dict.fromkeys(
            ("spilled_entries", "spilled_bytes", "spill_failures", "spills_dropped", "fetches", "fetched_bytes",
             "fetch_seconds", "fetch_misses", "fetch_corrupt", "fetch_other_format", "fetches_from_memory",
             "index_records", "index_failures", "index_lookups", "index_probes", "index_hits", "index_skipped",
             "read_errors"), 0)
        self.read_speed = Throughput()  # of reads (store get + decode), for ``worth_reading``
        self._logged = set()  # the kinds of failed read logged at warning level (once each)

    def _count(self, name: str, n=1) -> None:
        with self._lock:
            self.counters[name] += n

    def _failed(self, counter: str, what: str, error: Exception) -> None:
        """A read that failed (a miss): counted; logged at warning level the first time per
        kind (a store full of another build's entries must not flood the log), then at debug."""
        with self._lock:
            self.counters[counter] += 1
            first = counter not in self._logged
            self._logged.add(counter)
        logger.log(logging.WARNING if first else logging.DEBUG, "VeriCache: %s (%s: %s); treated as a miss%s", what,
                   type(error).__name__, error, ", later ones are logged at debug level" if first else "")

    def snapshot(self) -> dict:
        """The counters, consistent with one another (the threads update them under a lock)."""
        with self._lock:
            return dict(self.counters)

    # -------------------------------------------------------------- write

    def spill(self, tokens: Sequence[int], key: Hashable, layers: Sequence[CompressedLayer]) -> Optional[SpilledEntry]:
        """Start writing the entry of ``tokens`` for ``key``; the stub, or None when too many
        bytes are already waiting to be written (the entry is then dropped, as without a tier)."""
        tokens, layers = tuple(tokens), tuple(layers)
        size = sum(layer.nbytes() for layer in layers)
        with self._lock:
            if self._pending_bytes + size > self.max_pending_bytes:
                self.counters["spills_dropped"] += 1
                return None
            self._pending_bytes += size
        if any(t.device.type != "cpu" for layer in layers for t in layer.tensors()):
            layers = move_entry(layers, "cpu")  # here, on the scheduler's stream, not on the writer thread
        name = repr(key)
        stub = SpilledEntry(len(tokens), name, layers=layers)
        self._writer.submit(self._write, stub, tokens, size)
        return stub

    def _write(self, stub: SpilledEntry, tokens: tuple, size: int) -> None:
        try:
            data = encode_entry(tokens, stub.layers, stub.key)
            stub.storage_key = storage_key(data)
            ok = bool(self.store.put(stub.storage_key, data))
        except Exception as e:  # a store that raises is a store that failed this write
            logger.warning("VeriCache: writing a compressed entry to the storage tier failed: %s", e)
            ok, data = False, b""
        stub.nbytes = len(data)
        if ok and len(tokens) >= INDEX_ANCHOR:
            self._write_index(stub, tokens)
        stub.failed = not ok
        stub.layers = None
        with self._lock:
            self._pending_bytes -= size
            self.counters["spilled_entries" if ok else "spill_failures"] += 1
            self.counters["spilled_bytes"] += len(data) if ok else 0

    def _write_index(self, stub: SpilledEntry, tokens: tuple) -> None:
        """The record that lets ``find`` (in any process) come to this entry from its tokens."""
        name = index_key(stub.key, tokens[: len(tokens) // INDEX_ANCHOR * INDEX_ANCHOR])
        try:
            ok = bool(self.store.put(name, encode_index_record(tokens, stub.storage_key, stub.nbytes)))
        except Exception as e:
            logger.warning("VeriCache: writing a compressed entry's index record failed: %s", e)
            ok = False
        self._count("index_records" if ok else "index_failures")

    # -------------------------------------------------------------- read

    def fetch(self, tokens: Sequence[int], stub: SpilledEntry) -> "Future[Optional[tuple]]":
        """The entry behind ``stub`` (CPU tensors; ``move_entry`` them where they are used),
        or None if the tier no longer has it or its bytes are not that entry."""
        layers = stub.layers
        if layers is not None:  # still being written: no I/O
            self._count("fetches_from_memory")
            done: Future = Future()
            done.set_result(layers)
            return done
        if stub.failed:
            done = Future()
            done.set_result(None)
            return done
        return self._reader.submit(self._contained, self._read, tuple(tokens), stub)

    def find(self, tokens: Sequence[int], key: Hashable, longer_than: int = 0,
             accept=None) -> "Future[Optional[tuple[int, tuple]]]":
        """The longest entry for ``key`` over a prefix of ``tokens`` longer than
        ``longer_than`` that the store's index records know (written by this process or by
        any other on the same store), read back on the reader thread: (its length, its
        layers on the CPU), or None. ``accept(num_tokens, nbytes)``, asked before the entry
        itself is read, can turn it down (it is then not read; counted as skipped)."""
        return self._reader.submit(self._contained, self._find, tuple(tokens), repr(key), longer_than, accept)

    def _contained(self, read, *args):
        """What the reader thread runs: an error there (a bug, an ``accept`` that raised) is a
        miss, so the Future the scheduler thread collects never carries an exception."""
        try:
            return read(*args)
        except Exception as e:
            self._failed("read_errors", "reading a compressed entry from the storage tier failed", e)
            return None

    def _find(self, tokens: tuple, name: str, longer_than: int, accept) -> Optional[tuple[int, tuple]]:
        self._count("index_lookups")
        for anchor in index_anchors(len(tokens), longer_than):
            self._count("index_probes")
            try:
                record = decode_index_record(self.store.get(index_key(name, tokens[:anchor]), INDEX_RECORD_BYTES))
            except Exception as e:
                logger.warning("VeriCache: reading an index record from the storage tier failed: %s", e)
                record = None
            if record is None:
                continue
            n, digest, entry_key, nbytes = record
            if not anchor <= n <= len(tokens) or n <= longer_than or digest != tokens_digest(tokens[:n]):
                continue  # past these tokens, no longer than what the caller has, or another prefix
            if accept is not None and not accept(n, nbytes):
                self._count("index_skipped")
                return None
            layers = self._read(tokens[:n], SpilledEntry(n, name, nbytes=nbytes, storage_key=entry_key))
            if layers is None:  # gone, or damaged: a shorter one may be there
                continue
            self._count("index_hits")
            return n, layers
        return None

    def _read(self, tokens: tuple, stub: SpilledEntry) -> Optional[tuple]:
        t0 = time.perf_counter()
        try:
            data = self.store.get(stub.storage_key, stub.nbytes)
        except Exception as e:
            logger.warning("VeriCache: reading a compressed entry from the storage tier failed: %s", e)
            data = None
        if not data:
            self._count("fetch_misses")
            return None
        try:
            layers = decode_entry(data, tokens, stub.key)
        except OtherFormatError as e:
            self._failed("fetch_other_format", "a compressed entry in the storage tier is of another format "
                         "(another build's), not decoded", e)
            return None
        except Exception as e:  # corrupt, or any error decoding it: never the scheduler's
            self._failed("fetch_corrupt", "a compressed entry read from the storage tier is corrupt", e)
            return None
        seconds = time.perf_counter() - t0
        with self._lock:
            self.counters["fetches"] += 1
            self.counters["fetched_bytes"] += len(data)
            self.counters["fetch_seconds"] += seconds
            self.read_speed.observe(len(data), seconds)
        return layers

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every write started so far finished (tests, shutdown)."""
        self._writer.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)


class DictBlobStore:
    """A ``BlobStore`` in this process's memory (unit tests; a tier for nothing else)."""

    def __init__(self):
        self.blobs: dict[str, bytes] = {}

    def put(self, key: str, data: bytes) -> bool:
        self.blobs[key] = bytes(data)
        return True

    def get(self, key: str, nbytes: int) -> Optional[bytes]:
        return self.blobs.get(key)


