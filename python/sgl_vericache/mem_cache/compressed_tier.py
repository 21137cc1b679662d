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

Encoding: a magic naming the format version (``FORMAT_VERSION``), a JSON header (the layer
classes, their fields: scalars, each tensor's dtype, shape and byte range), the tensors'
raw bytes, and a BLAKE2b digest over the format, the entry's compressor key, its token ids,
the header and the bytes. No pickle: a stored entry is data, never code. A read whose
digest does not match (corrupt bytes, a short read, another prefix's entry under a
colliding key) is a miss, counted, never an entry. A shared or persistent store also holds
other builds' entries: one of another format version, or whose layers have other fields
than this build's classes, is a miss that is not decoded, and index records are named per
format version, so another version's entries are not even read. Any other error decoding
an entry is a miss as well: nothing a store holds reaches the scheduler as an exception.

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

import dataclasses
import hashlib
import json
import logging
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Hashable, Optional, Protocol, Sequence

import torch

from sgl_vericache.mem_cache.compress import CompressedLayer

logger = logging.getLogger(__name__)

# The entry format: bump it whenever the encoding or a stored layer class's fields (their
# names or meaning) change, so that builds sharing a store never decode each other's entries.
# 1: entries written before the version was part of the digest and the index names.
FORMAT_VERSION = 2
MAGIC = b"VCE" + str(FORMAT_VERSION).encode()
_MAGIC_FAMILY = b"VCE"  # every format version's magic starts so
_DIGEST = 16
_PREFIX = struct.Struct("<4sI")  # magic, header length
assert len(MAGIC) == 4


class CorruptEntryError(ValueError):
    """Stored bytes that are not a valid entry for the prefix asked for."""


class OtherFormatError(CorruptEntryError):
    """An entry written in another format (another version, or layer fields this build's
    classes do not have): another build's, never decoded."""


class BlobStore(Protocol):
    def put(self, key: str, data: bytes) -> bool: ...

    def get(self, key: str, nbytes: int) -> Optional[bytes]: ...


# ---------------------------------------------------------------------- encoding


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _layer_classes() -> dict[str, type]:
    from sgl_vericache.mem_cache.compress.registry import available_compressors, compressor_class

    for name in available_compressors():  # imports every built-in method's layer classes
        compressor_class(name)
    out, stack = {}, [CompressedLayer]
    while stack:
        cls = stack.pop()
        out[_class_name(cls)] = cls
        stack.extend(cls.__subclasses__())
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptEntryError(f"unknown dtype {name!r}")
    return dtype


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def _entry_digest(key: str, tokens: Sequence[int], body) -> bytes:
    """The format version, compressor key, token ids and header + bytes, in one digest: an
    entry of another version is also named differently (``storage_key``)."""
    return hashlib.blake2b(MAGIC + key.encode() + b"\0" + _tokens_bytes(tokens) + bytes(body),
                           digest_size=_DIGEST).digest()


def encode_entry(tokens: Sequence[int], layers: Sequence[CompressedLayer], key: str = "") -> bytes:
    """The bytes a storage tier holds for the entry of ``tokens`` (one layer per model
    layer) made by the compressor ``key`` names (``repr`` of the cache's key)."""
    blobs, described, offset = [], [], 0
    for layer in layers:
        fields, stored = {}, []
        for f in dataclasses.fields(layer) if dataclasses.is_dataclass(layer) else ():
            value = getattr(layer, f.name)
            if isinstance(value, torch.Tensor):
                raw = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                fields[f.name] = {"tensor": str(value.dtype), "shape": list(value.shape), "at": offset, "n": len(raw)}
                blobs.append(raw)
                stored.append(value)
                offset += len(raw)
            elif isinstance(value, torch.dtype):
                fields[f.name] = {"dtype": str(value)}
            elif value is None or isinstance(value, (bool, int, float, str)):
                fields[f.name] = {"value": value}
            else:
                raise TypeError(f"{type(layer).__name__}.{f.name} is a {type(value).__name__}: not storable")
        if not dataclasses.is_dataclass(layer) or len(stored) != len(layer.tensors()):
            raise TypeError(f"{type(layer).__name__} is not storable: its tensors are not all dataclass fields")
        described.append({"class": _class_name(type(layer)), "fields": fields})
    header = json.dumps({"num_tokens": len(tokens), "layers": described}, separators=(",", ":")).encode()
    body = header + b"".join(blobs)
    return _PREFIX.pack(MAGIC, len(header)) + _entry_digest(key, tokens, body) + body


def decode_entry(data: bytes, tokens: Sequence[int], key: str = "") -> tuple[CompressedLayer, ...]:
    """The layers ``encode_entry(tokens, layers, key)`` wrote, on the CPU;
    ``CorruptEntryError`` for anything else (other tokens or compressor, flipped or missing
    bytes, a header that does not describe layers), ``OtherFormatError`` before any
    decoding for an entry of another format (version, layer class or fields)."""
    header, blob = _verified(data, tokens, key)
    classes = _layer_classes()
    try:
        described = [(_layer_class(d, classes), d["fields"]) for d in header["layers"]]
        layers = tuple(cls(**{name: _field(spec, blob) for name, spec in fields.items()}) for cls, fields in described)
    except CorruptEntryError:
        raise
    except Exception as e:  # a digest-valid header this code cannot build layers from
        raise CorruptEntryError(f"undecodable entry: {type(e).__name__}: {e}") from e
    if any(layer.num_tokens != len(tokens) for layer in layers):
        raise CorruptEntryError(f"layers do not represent {len(tokens)} tokens")
    return layers


def _verified(data, tokens: Sequence[int], key: str):
    """(header, tensor bytes) of an entry of this format whose digest matches."""
    start = _PREFIX.size + _DIGEST
    if data is None or len(data) < start:
        raise CorruptEntryError(f"{0 if data is None else len(data)} bytes: shorter than an entry's header")
    magic, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        error = OtherFormatError if magic.startswith(_MAGIC_FAMILY) else CorruptEntryError
        raise error(f"magic {magic!r}, this build reads {MAGIC!r} (format version {FORMAT_VERSION})")
    body = memoryview(data)[start:]
    if _entry_digest(key, tokens, body) != data[_PREFIX.size:start]:
        raise CorruptEntryError(f"digest mismatch for a {len(tokens)}-token prefix of {key or 'no key'} "
                                f"({len(data)} bytes)")
    try:
        header = json.loads(bytes(body[:header_len]))
    except ValueError as e:
        raise CorruptEntryError(f"unreadable header: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("layers"), list):
        raise CorruptEntryError("the header describes no layers")
    return header, body[header_len:]


def _layer_class(described: dict, classes: dict) -> type:
    """The class of a described layer, if this build's has exactly the fields it names."""
    name, fields = described["class"], described["fields"]
    cls = classes.get(name)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise OtherFormatError(f"unknown layer class {name!r}")
    own = {f.name for f in dataclasses.fields(cls)}
    if set(fields) != own:
        raise OtherFormatError(f"{name} stored with fields {sorted(set(fields) - own)} this build lacks and "
                               f"without {sorted(own - set(fields))}")
    return cls


def _field(spec: dict, blob):
    """One stored field's value: a CPU tensor from its byte range, a dtype or a scalar."""
    if "tensor" in spec:
        dtype, shape = _dtype(spec["tensor"]), spec["shape"]
        raw = blob[spec["at"] : spec["at"] + spec["n"]]
        t = torch.empty(shape, dtype=dtype)
        if len(raw) != t.numel() * t.element_size():
            raise CorruptEntryError(f"{len(raw)} bytes for a {shape} {dtype} field")
        if len(raw):
            t.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        return t
    if "dtype" in spec:
        return _dtype(spec["dtype"])
    return spec["value"]


def move_entry(layers: Sequence[CompressedLayer], device) -> tuple[CompressedLayer, ...]:
    """The entry with every tensor on ``device`` (the layers themselves are values: copies)."""
    def moved(layer):
        changes = {f.name: getattr(layer, f.name).to(device) for f in dataclasses.fields(layer)
                   if isinstance(getattr(layer, f.name), torch.Tensor)}
        return dataclasses.replace(layer, **changes)

    return tuple(moved(layer) for layer in layers)


def storage_key(data: bytes) -> str:
    """Where an encoded entry lives in the tier: named by its digest (which covers the
    compressor key, the token ids and the bytes), so two different entries for one prefix
    (made along different paths) never share a name, and a name never needs rewriting."""
    return "vericache-c-" + bytes(data[_PREFIX.size : _PREFIX.size + _DIGEST]).hex()


INDEX_ANCHOR = 64  # index records name prefixes of a multiple of this many tokens
INDEX_RECORD_BYTES = 256  # fixed, so a reader knows how many bytes to ask the store for
MAX_INDEX_PROBES = 9  # anchors ``find`` tries per lookup, longest first (9: 512 tokens back)


def index_key(key: str, tokens: Sequence[int]) -> str:
    """The name of the index record for entries of compressor ``key`` (its repr) whose
    first ``len(tokens)`` tokens (a multiple of ``INDEX_ANCHOR``) are ``tokens``, in this
    format version (``find`` never reads another version's entries)."""
    digest = hashlib.blake2b(MAGIC + key.encode() + b"\0" + _tokens_bytes(tokens), digest_size=_DIGEST).hexdigest()
    return "vericache-i-" + digest


def tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.blake2b(_tokens_bytes(tokens), digest_size=_DIGEST).hexdigest()


def encode_index_record(tokens: Sequence[int], entry_key: str, nbytes: int) -> bytes:
    """The index record for the stored entry ``entry_key`` (``nbytes``) of ``tokens``."""
    body = json.dumps({"n": len(tokens), "t": tokens_digest(tokens), "key": entry_key, "nbytes": nbytes},
                      separators=(",", ":")).encode()
    assert len(body) <= INDEX_RECORD_BYTES, body
    return body.ljust(INDEX_RECORD_BYTES, b" ")


def decode_index_record(data: Optional[bytes]) -> Optional[tuple[int, str, str, int]]:
    """(entry tokens, digest of those tokens, entry storage key, entry bytes) of an index
    record; None for anything that is not one (missing, short, damaged)."""
    if not data or len(data) != INDEX_RECORD_BYTES:
        return None
    try:
        record = json.loads(bytes(data).decode())
        n, digest, key, nbytes = record["n"], record["t"], record["key"], record["nbytes"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    if not (isinstance(n, int) and isinstance(nbytes, int) and isinstance(key, str) and isinstance(digest, str)) \
            or isinstance(n, bool) or n < INDEX_ANCHOR \
            or nbytes <= _PREFIX.size + _DIGEST or not key.startswith("vericache-c-"):
        return None
    return n, digest, key, nbytes


def index_anchors(num_tokens: int, longer_than: int = 0) -> list[int]:
    """The prefix lengths ``find`` probes for ``num_tokens`` tokens, longest first: the
    multiples of ``INDEX_ANCHOR`` up to ``num_tokens`` whose entries can be longer than
    ``longer_than`` (an entry is at least as long as its anchor), at most ``MAX_INDEX_PROBES``."""
    top = num_tokens // INDEX_ANCHOR * INDEX_ANCHOR
    low = max(INDEX_ANCHOR, longer_than // INDEX_ANCHOR * INDEX_ANCHOR)
    return list(range(top, low - 1, -INDEX_ANCHOR))[:MAX_INDEX_PROBES]


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


