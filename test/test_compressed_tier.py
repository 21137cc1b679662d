"""Compressed prefix entries in a storage tier (``mem_cache/compressed_tier.py``, its entry
format ``mem_cache/entry_format.py``): every compressor's entry survives encode / decode bit
for bit; a stored entry read back for another prefix, another compressor or with damaged
bytes is refused; the tier's writer and reader threads, its pending-bytes cap and a failing
store; and the compressed prefix cache spilling what it evicts (random sequences against a
reference: ``test_prefix_spill.py``). The end-to-end path (SGLang's file backend, drafting
from an entry read back) is in ``test_fetch_drafting.py``."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from sgl_vericache.mem_cache.compress import get_compressor
from sgl_vericache.mem_cache.compress.registry import available_compressors
from sgl_vericache.mem_cache.compressed_prefix import CompressedPrefixCache
from sgl_vericache.mem_cache import compressed_tier, entry_format
from sgl_vericache.mem_cache.compressed_tier import (CompressedTier, DictBlobStore, SpilledEntry, Throughput,
                                                     worth_reading)
from sgl_vericache.mem_cache.entry_format import (
    INDEX_RECORD_BYTES,
    MAGIC,
    CorruptEntryError,
    OtherFormatError,
    decode_entry,
    decode_index_record,
    encode_entry,
    encode_index_record,
    index_anchors,
    index_key,
    move_entry,
    storage_key,
)


def _same(a, b) -> bool:
    """Bit-identical layers: same class, same scalars, tensors equal byte for byte."""
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape:
                return False
            if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                return False
        elif x != y:
            return False
    return True


def _entry(name, tokens=48, layers=2, seed=0, **options):
    torch.manual_seed(seed)
    comp = get_compressor(name, None if name == "full" else 4.0, **options)
    out = []
    for _ in range(layers):
        k, v = torch.randn(tokens, 2, 8), torch.randn(tokens, 2, 8)
        q = torch.randn(8, 4, 8) if comp.needs_queries else None
        layer = comp.compress(k[: tokens - 5], v[: tokens - 5], q)
        out.append(comp.append(layer, k[tokens - 5 :], v[tokens - 5 :]))  # an entry that grew by append
    return comp, out


@pytest.mark.parametrize("name", available_compressors())
def test_every_compressor_entry_roundtrips_bit_identical(name):
    comp, layers = _entry(name)
    tokens = tuple(range(100, 148))
    data = encode_entry(tokens, layers, repr(comp))
    back = decode_entry(data, tokens, repr(comp))
    assert len(back) == len(layers)
    assert all(_same(a, b) for a, b in zip(layers, back))
    assert all(b.num_tokens == 48 for b in back)
    # and the draft attention over it answers the same
    q = torch.randn(1, 4, 8)
    extra = torch.randn(1, 2, 8)
    assert torch.equal(comp.attend(layers[0], q, 0.125, extra, extra), comp.attend(back[0], q, 0.125, extra, extra))


def test_a_stored_entry_is_refused_for_anything_but_its_own_prefix():
    comp, layers = _entry("kivi4")
    tokens = tuple(range(48))
    data = encode_entry(tokens, layers, "kivi4@4")
    with pytest.raises(CorruptEntryError, match="digest mismatch for a 48-token prefix"):
        decode_entry(data, tokens[:-1] + (7,), "kivi4@4")  # another prefix under a colliding key
    with pytest.raises(CorruptEntryError, match="digest mismatch"):
        decode_entry(data, tokens, "kivi2@8")  # another compressor
    for at in (0, 5, len(data) // 2, len(data) - 1):  # one flipped byte anywhere
        bad = bytearray(data)
        bad[at] ^= 0x40
        with pytest.raises(CorruptEntryError):
            decode_entry(bytes(bad), tokens, "kivi4@4")
    with pytest.raises(CorruptEntryError, match="digest mismatch"):
        decode_entry(data[:-3], tokens, "kivi4@4")  # a short read
    with pytest.raises(CorruptEntryError, match="shorter than an entry's header"):
        decode_entry(b"VCE1", tokens, "kivi4@4")
    with pytest.raises(CorruptEntryError, match="shorter than an entry's header"):
        decode_entry(None, tokens, "kivi4@4")
    names = {storage_key(encode_entry(tokens, layers, k)) for k in ("a", "b")}
    names.add(storage_key(encode_entry(tokens, _entry("kivi4", seed=1)[1], "a")))  # same prefix, other entry
    assert len(names) == 3 and all(n.startswith("vericache-c-") for n in names)


def test_an_entry_whose_tensors_are_not_fields_is_not_storable():
    from sgl_vericache.mem_cache.compress.base import CompressedLayer

    class Opaque(CompressedLayer):
        def __init__(self):
            super().__init__(3, 1, 1, torch.float32)
            self.t = torch.zeros(3)

        def tensors(self):
            return [self.t]

    with pytest.raises(TypeError, match="Opaque is not storable"):
        encode_entry((1, 2, 3), [Opaque()])


def test_move_entry_copies_and_keeps_values():
    _, layers = _entry("int8")
    moved = move_entry(layers, "cpu")
    assert all(_same(a, b) for a, b in zip(layers, moved))
    assert all(a is not b for a, b in zip(layers, moved))


class _Gate(DictBlobStore):
    """A store whose writes wait until released (a slow store), and that can fail."""

    def __init__(self):
        super().__init__()
        self.open = threading.Event()
        self.fail_puts = False
        self.fail_gets = False

    def put(self, key, data):
        self.open.wait(10)
        if self.fail_puts:
            raise OSError("disk full")
        return super().put(key, data)

    def get(self, key, nbytes):
        if self.fail_gets:
            raise ConnectionError("store unreachable")
        return super().get(key, nbytes)


def test_tier_spill_then_fetch_from_memory_then_from_the_store():
    store = _Gate()
    tier = CompressedTier(store)
    comp, layers = _entry("snapkv")
    tokens = tuple(range(48))
    stub = tier.spill(tokens, comp, layers)
    assert stub is not None and stub.num_tokens == 48 and stub.layers is not None
    # the write waits: a read is answered from the stub without I/O
    got = tier.fetch(tokens, stub).result(5)
    assert all(_same(a, b) for a, b in zip(layers, got))
    store.open.set()
    tier.drain()
    assert stub.layers is None and not stub.failed and stub.nbytes == len(store.blobs[stub.storage_key])
    got = tier.fetch(tokens, stub).result(5)
    assert all(_same(a, b) for a, b in zip(layers, got))
    c = tier.snapshot()
    assert (c["spilled_entries"], c["fetches"], c["fetches_from_memory"]) == (1, 1, 1)
    assert c["spilled_bytes"] == c["fetched_bytes"] == stub.nbytes > 0
    # gone from the store (its own eviction): a miss, counted
    store.blobs.clear()
    assert tier.fetch(tokens, stub).result(5) is None
    # damaged in the store: refused, counted
    store.blobs[stub.storage_key] = MAGIC + bytes(stub.nbytes)
    assert tier.fetch(tokens, stub).result(5) is None
    store.fail_gets = True
    assert tier.fetch(tokens, stub).result(5) is None
    c = tier.snapshot()
    assert (c["fetch_misses"], c["fetch_corrupt"], c["fetches"]) == (2, 1, 1)
    tier.close()


def test_throughput_weights_recent_transfers_and_ignores_empty_ones():
    speed = Throughput(weight=0.5)
    assert speed.seconds_for(100) is None
    speed.observe(0, 1.0)
    speed.observe(100, 0.0)
    assert speed.bytes_per_second is None and speed.transfers == 0
    speed.observe(1000, 1.0)
    assert speed.bytes_per_second == 1000 and speed.seconds_for(500) == 0.5
    speed.observe(3000, 1.0)
    assert speed.bytes_per_second == 2000 and speed.transfers == 2
    with pytest.raises(ValueError, match="weight 0"):
        Throughput(weight=0)


def test_worth_reading_compares_the_two_arrivals():
    unknown = Throughput()

    def measured(bps):
        t = Throughput()
        t.observe(int(bps), 1.0)
        return t

    # nothing measured: the sizes decide
    assert worth_reading(20, 100, unknown, unknown, 0.25)
    assert not worth_reading(30, 100, unknown, unknown, 0.25)
    # the tier's reads measured slower than its pages: an entry a fifth the size arrives at 0.4
    assert not worth_reading(20, 100, measured(50), measured(100), 0.25)
    assert worth_reading(20, 100, measured(50), measured(100), 0.5)
    # only one speed known: the other transfer is taken to go as fast (one store)
    assert worth_reading(20, 100, measured(50), unknown, 0.25) and not worth_reading(30, 100, unknown, measured(9), 0.25)
    # 1 always, 0 never; nothing to stream in leaves no time to draft in
    assert worth_reading(10**9, 1, measured(1), measured(10**9), 1.0)
    assert not worth_reading(0, 100, unknown, unknown, 0.0)
    assert not worth_reading(10, 0, unknown, unknown, 0.5) and worth_reading(0, 100, unknown, unknown, 0.1)


def test_tier_reads_teach_it_their_speed():
    tier = CompressedTier(DictBlobStore())
    comp, layers = _entry("kivi4")
    tokens = tuple(range(48))
    stub = tier.spill(tokens, comp, layers)
    tier.drain()
    assert tier.read_speed.bytes_per_second is None  # a write says nothing about reads
    assert tier.fetch(tokens, stub).result(5) is not None
    assert tier.read_speed.transfers == 1 and tier.read_speed.bytes_per_second > 0
    tier.close()


def _spilled(store, comp, entries):
    """A tier (an earlier process) writes ``entries`` ({tokens: layers}) to ``store`` and ends."""
    tier = CompressedTier(store)
    for tokens, layers in entries.items():
        tier.spill(tokens, comp, layers)
    tier.drain()
    counters = tier.snapshot()
    tier.close()
    return counters


def test_index_finds_entries_a_tier_of_another_process_wrote():
    """A fresh tier over the same store (a restarted engine) finds the longest entry whose
    tokens start the request's, through the index records; bit-identical layers."""
    store = DictBlobStore()
    comp, short = _entry("kivi4", tokens=100)
    _, long = _entry("kivi4", tokens=200, seed=1)
    _, tiny = _entry("kivi4", tokens=40, seed=2)
    conv = tuple(range(1000, 1300))
    written = _spilled(store, comp, {conv[:100]: short, conv[:200]: long, conv[:40]: tiny})
    assert written["spilled_entries"] == 3 and written["index_records"] == 2  # under 64 tokens: no record
    tier = CompressedTier(store)
    n, got = tier.find(conv[:260], comp).result(5)  # the next turn: 60 tokens more
    assert n == 200 and all(_same(a, b) for a, b in zip(long, got))
    # only entries longer than what the caller has; the shorter one when that is all there is
    assert tier.find(conv[:260], comp, longer_than=200).result(5) is None
    n, got = tier.find(conv[:150], comp).result(5)
    assert n == 100 and all(_same(a, b) for a, b in zip(short, got))
    # another compressor: nothing; the long entry's first 192 tokens and others after them: the
    # long entry is not read (its record's token digest differs), the short one is
    assert tier.find(conv[:260], get_compressor("kivi2", 4.0)).result(5) is None
    assert tier.snapshot()["fetches"] == 2
    n, _ = tier.find(conv[:192] + tuple(range(5000, 5060)), comp).result(5)
    c = tier.snapshot()
    assert n == 100 and c["fetches"] == 3 and c["index_hits"] == 3 and c["index_lookups"] == 5
    # the long entry gone from the store (its own eviction): the short one is found instead
    del store.blobs[decode_index_record(store.blobs[index_key(repr(comp), conv[:192])])[2]]
    n, _ = tier.find(conv[:260], comp).result(5)
    assert n == 100 and tier.snapshot()["fetch_misses"] == 1
    tier.close()


def test_index_lookup_asks_before_reading_and_survives_bad_records():
    store = _Gate()
    store.open.set()
    comp, layers = _entry("kivi4", tokens=130)
    conv = tuple(range(130))
    _spilled(store, comp, {conv: layers})
    tier = CompressedTier(store)
    asked = []
    assert tier.find(conv, comp, accept=lambda n, nbytes: asked.append((n, nbytes)) or False).result(5) is None
    entry_bytes = next(len(v) for k, v in store.blobs.items() if k.startswith("vericache-c-"))
    assert asked == [(130, entry_bytes)] and tier.snapshot()["fetches"] == 0 and tier.snapshot()["index_skipped"] == 1
    # a damaged record, a damaged entry, a store that fails: misses, never an exception
    name = index_key(repr(comp), conv[:128])
    record = store.blobs[name]
    store.blobs[name] = b"}" + record[1:]
    assert tier.find(conv, comp).result(5) is None
    store.blobs[name] = record
    key = next(k for k in store.blobs if k.startswith("vericache-c-"))
    good = store.blobs[key]
    store.blobs[key] = good[:-1] + bytes([good[-1] ^ 1])
    assert tier.find(conv, comp).result(5) is None and tier.snapshot()["fetch_corrupt"] == 1
    store.blobs[key] = good
    store.fail_gets = True
    assert tier.find(conv, comp).result(5) is None
    store.fail_gets = False
    assert tier.find(conv, comp).result(5)[0] == 130
    tier.close()


def test_index_records_and_anchors():
    tokens = tuple(range(70))
    record = encode_index_record(tokens, "vericache-c-" + "ab" * 16, 5000)
    assert len(record) == INDEX_RECORD_BYTES
    n, digest, key, nbytes = decode_index_record(record)
    assert (n, key, nbytes) == (70, "vericache-c-" + "ab" * 16, 5000) and len(digest) == 32
    for bad in (None, b"", record[:-1], b"x" * INDEX_RECORD_BYTES, record.replace(b'"n":70', b'"n":true'),
                record.replace(b"vericache-c-", b"elsewhere-c-"), record.replace(b'"n":70', b'"n":12')):
        assert decode_index_record(bad) is None, bad
    assert index_key("k", tokens[:64]) != index_key("k2", tokens[:64]) != index_key("k", tokens[1:65])
    # longest first, at most 9, none below 64 tokens, none that can only hold entries no longer than asked
    assert index_anchors(700) == [640, 576, 512, 448, 384, 320, 256, 192, 128]
    assert index_anchors(300, longer_than=200) == [256, 192] and index_anchors(63) == []
    assert index_anchors(130, longer_than=130) == [128] and index_anchors(130, longer_than=192) == []


def _resigned(data, tokens, key, edit):
    """``data`` with its header changed by ``edit`` and signed again: a digest-valid entry
    as another build of this format version would write it."""
    import json

    start = entry_format._PREFIX.size + entry_format._DIGEST
    _, header_len = entry_format._PREFIX.unpack_from(data)
    header = json.loads(data[start : start + header_len])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    body = new + data[start + header_len :]
    return entry_format._PREFIX.pack(MAGIC, len(new)) + entry_format._entry_digest(key, tokens, body) + body


def _stored(store, tokens, key, data):
    store.put("vericache-c-x", data)
    return SpilledEntry(len(tokens), key, nbytes=len(data), storage_key="vericache-c-x")


def test_an_entry_whose_fields_differ_from_this_builds_is_a_miss_not_decoded(monkeypatch, caplog):
    """Another build's layer class with a field more (or fewer) wrote a digest-valid entry:
    ``cls(**fields)`` raised TypeError into the Future, and the scheduler thread re-raised it.
    It is refused before any tensor is built, counted, and logged once."""
    import logging

    comp, layers = _entry("streamingllm")
    tokens, key = tuple(range(100, 148)), "('k',)"
    data = encode_entry(tokens, layers, key)
    extra = _resigned(data, tokens, key, lambda h: h["layers"][0]["fields"].update(sink_count={"value": 4}))
    fewer = _resigned(data, tokens, key, lambda h: h["layers"][1]["fields"].pop("positions"))
    built = []
    monkeypatch.setattr(entry_format, "_field", lambda spec, blob: built.append(spec))
    for forged, match in ((extra, r"fields \['sink_count'\] this build lacks"), (fewer, r"without \['positions'\]")):
        with pytest.raises(OtherFormatError, match=match):
            decode_entry(forged, tokens, key)
    assert built == []  # not decoded
    monkeypatch.undo()
    store = DictBlobStore()
    tier = CompressedTier(store)
    with caplog.at_level(logging.WARNING):
        for forged in (extra, fewer):
            assert tier.fetch(tokens, _stored(store, tokens, key, forged)).result(5) is None
    c = tier.snapshot()
    assert (c["fetch_other_format"], c["fetch_corrupt"], c["fetches"]) == (2, 0, 0)
    assert len([r for r in caplog.records if "another format" in r.getMessage()]) == 1  # logged once
    assert tier.fetch(tokens, _stored(store, tokens, key, data)).result(5) is not None  # this build's own: read
    tier.close()


def test_an_entry_of_another_format_version_is_a_miss_without_decoding(monkeypatch):
    """The magic names the format version, checked before the digest or the header; the
    index names carry it too, so a lookup never even reads another version's entries (the
    ones this build wrote before the version was added, format 1, among them)."""
    comp, layers = _entry("kivi4", tokens=100)
    tokens, key = tuple(range(100)), repr(comp)
    data = encode_entry(tokens, layers, key)
    digested = []
    monkeypatch.setattr(entry_format, "_entry_digest", lambda *a: digested.append(a))
    for magic in (b"VCE1", b"VCE3"):
        with pytest.raises(OtherFormatError, match=f"magic {magic!r}, this build reads {MAGIC!r}"):
            decode_entry(magic + data[4:], tokens, key)
    with pytest.raises(CorruptEntryError) as refused:
        decode_entry(b"ABCD" + data[4:], tokens, key)
    assert not isinstance(refused.value, OtherFormatError)  # not an entry at all: corrupt
    assert digested == []  # refused before its digest, let alone its header, was looked at
    monkeypatch.undo()
    store = DictBlobStore()
    tier = CompressedTier(store)
    assert tier.fetch(tokens, _stored(store, tokens, key, b"VCE1" + data[4:])).result(5) is None
    assert tier.snapshot()["fetch_other_format"] == 1 and tier.snapshot()["fetch_corrupt"] == 0
    # a build of another version wrote this entry and its index record: not found, not read
    monkeypatch.setattr(entry_format, "MAGIC", b"VCE3")
    _spilled(store, comp, {tokens: layers})
    monkeypatch.undo()
    assert tier.find(tokens, comp).result(5) is None
    c = tier.snapshot()
    assert c["index_probes"] == 1 and c["fetch_other_format"] == 1 and c["fetches"] == 0
    _spilled(store, comp, {tokens: layers})  # this version's: found
    assert tier.find(tokens, comp).result(5)[0] == 100
    tier.close()


def test_errors_on_the_reader_thread_are_misses_not_exceptions_in_the_future(monkeypatch):
    """Whatever fails while reading (decoding raising anything, an ``accept`` that raises),
    the Future the scheduler thread collects holds None, never an exception."""
    comp, layers = _entry("kivi4", tokens=70)
    tokens = tuple(range(70))
    store = DictBlobStore()
    _spilled(store, comp, {tokens: layers})
    tier = CompressedTier(store)

    def broken(*args):
        raise RuntimeError("a bug decoding")

    monkeypatch.setattr(compressed_tier, "decode_entry", broken)
    assert tier.find(tokens, comp).result(5) is None
    assert tier.snapshot()["fetch_corrupt"] == 1
    monkeypatch.undo()

    def accept(n, nbytes):
        raise ZeroDivisionError("no speed measured")

    future = tier.find(tokens, comp, accept=accept)
    assert future.exception(5) is None and future.result() is None
    assert tier.snapshot()["read_errors"] == 1
    assert tier.find(tokens, comp).result(5)[0] == 70
    tier.close()


def test_tier_failing_store_and_pending_cap():
    store = _Gate()
    store.fail_puts = True
    _, layers = _entry("int8")
    size = sum(l.nbytes() for l in layers)
    tier = CompressedTier(store, max_pending_bytes=2 * size)
    a = tier.spill((1,) * 48, "k", layers)
    b = tier.spill((2,) * 48, "k", layers)
    assert a is not None and b is not None
    assert tier.spill((3,) * 48, "k", layers) is None  # two entries' bytes already wait
    store.open.set()
    tier.drain()
    assert a.failed and b.failed and a.layers is None
    assert tier.fetch((1,) * 48, a).result(5) is None  # a failed write holds nothing
    c = tier.snapshot()
    assert (c["spill_failures"], c["spills_dropped"], c["spilled_entries"]) == (2, 1, 0)
    assert tier.spill((3,) * 48, "k", layers) is not None  # the cap is free again
    tier.close()


def test_prefix_cache_spills_what_it_evicts_and_finds_it_again():
    tier = CompressedTier(DictBlobStore())
    comp, layers = _entry("kivi4")
    size = sum(l.nbytes() for l in layers)
    cache = CompressedPrefixCache(size, spill=lambda t, k, l: tier.spill(t, k, l))
    a, b = tuple(range(48)), tuple(range(1, 49))
    assert cache.insert(a, comp, layers)
    assert cache.insert(b, comp, _entry("kivi4", seed=1)[1])  # a is evicted: spilled
    cache.check_integrity()
    assert (cache.num_entries, cache.num_spilled, cache.evicted) == (1, 1, 1)
    assert cache.match(a + (5,), comp) == (0, None)  # match sees resident entries only
    n, stub = cache.match_spilled(a + (5,), comp)
    assert n == 48 and stub.num_tokens == 48 and cache.spilled_hits == 1
    assert cache.match_spilled(b, comp) == (0, None)  # b is resident
    assert cache.match_spilled(a, "other") == (0, None)
    tier.drain()
    got = tier.fetch(a, stub).result(5)
    assert all(_same(x, y) for x, y in zip(layers, got))
    # filed again (promoted): resident, the stub replaced, b spilled in its turn
    assert cache.insert(a, comp, got)
    cache.check_integrity()
    assert cache.match(a, comp)[0] == 48 and cache.match_spilled(a, comp) == (0, None)
    assert cache.match_spilled(b, comp)[0] == 48
    # an entry larger than the whole budget goes to the tier directly
    big = tuple(range(200, 296))
    assert cache.insert(big, comp, _entry("kivi4", tokens=96)[1])
    assert cache.match_spilled(big, comp)[0] == 96 and cache.match(big, comp) == (0, None)
    cache.check_integrity()
    tier.close()


def test_blob_stores_over_sglang_file_backends(tmp_path):
    """The adapter finds a blob store under SGLang's fault injector (and VeriCache's page
    checksums) in the file backend and its throttled subclass; an entry written through it
    is a file beside the pages and reads back bit-identical; a backend that takes no blobs
    gives none."""
    import sys
    from pathlib import Path

    from sgl_vericache.cpu import compat as cpu_compat

    cpu_compat.install()
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheFile,
        HiCacheStorageConfig,
        HiCacheStorageFailureInjector,
    )

    from sgl_vericache.sglang.storage import blob_store as _blob_store

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
    from throttled_store import ThrottledFile

    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="m", extra_config={"file_storage_path": str(tmp_path / "f"),
                                                                "throttle_mb_per_s": 100})
    comp, layers = _entry("kivi2")
    tokens = tuple(range(48))
    for backend in (HiCacheFile(config), HiCacheStorageFailureInjector(ThrottledFile(config), 0.0, 0.0)):
        blobs = _blob_store(backend)
        assert type(blobs).__name__ == "FileBlobs"
        tier = CompressedTier(blobs)
        stub = tier.spill(tokens, comp, layers)
        tier.drain()
        assert not stub.failed and stub.nbytes > 0
        assert list((tmp_path / "f").glob(stub.storage_key + "*.bin"))
        got = tier.fetch(tokens, stub).result(10)
        assert got is not None and all(_same(a, b) for a, b in zip(layers, got))
        tier.close()
    inner = backend._backend
    assert inner.bytes_read >= stub.nbytes  # the read went through the throttle
    # an entry of 70 tokens has an index record: another tier on the same files finds it
    _, longer = _entry("kivi2", tokens=70)
    blobs = _blob_store(HiCacheFile(config))
    _spilled(blobs, comp, {tuple(range(70)): longer})
    tier = CompressedTier(_blob_store(HiCacheFile(config)))
    n, got = tier.find(tuple(range(75)), comp).result(10)
    assert n == 70 and all(_same(a, b) for a, b in zip(longer, got))
    assert tier.find(tuple(range(1, 75)), comp).result(10) is None  # no record: a quiet miss
    tier.close()
    assert _blob_store(object()) is None
