"""Storage-tier faults: a page that comes back corrupt or torn, a page without a digest, and a
store that raises (unreachable) are all misses, never wrong KV (``tier_integrity`` and the
checked storage wrapper, over SGLang's real file backend and a real Mooncake store).
End to end (exact output with corrupt files, a slow store and timed-out prefetches) is in
``test_tiers.py``."""

from __future__ import annotations

import os

import pytest
import torch

from test_tiers import _bits, _pools, _storage_config, cpu_hicache, mooncake_master  # noqa: F401 (fixtures)


def _checked(name, inner):
    from sgl_vericache.sglang.storage import checked_storage

    return checked_storage(name, inner, _storage_config({}))


def _file_store(path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    return HiCacheFile(_storage_config({}), file_path=str(path))


def _host_pages(n_pages=4, page_size=4):
    device, host = _pools("page_first", page_size=page_size)
    slots = host.alloc(n_pages * page_size)
    host.backup_from_device_all_layer(device, slots, torch.arange(8, 8 + n_pages * page_size), "kernel")
    pages = [host.get_data_page(int(slots[i * page_size]), flat=True).clone() for i in range(n_pages)]
    return host, slots, pages


def _page_file(store, key):
    return os.path.join(store.file_path, store._get_suffixed_key(key) + ".bin")


def test_file_tier_corrupt_and_torn_pages_are_misses(cpu_hicache, tmp_path):
    host, _, pages = _host_pages()
    keys = [f"page-{i}" for i in range(len(pages))]
    writer = _checked("file", _file_store(tmp_path))
    assert writer.batch_set(keys, pages)
    assert writer.stats.totals["pages_written"] == 4

    # Another engine over the same directory trusts these pages: the digests live in the tier.
    reader = _checked("file", _file_store(tmp_path))
    assert reader.batch_exists(keys) == 4
    got = reader.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(_bits(g), _bits(p)) for g, p in zip(got, pages))

    # Flip one bit in page 2's file: the page and everything after it become misses.
    path = _page_file(reader.inner, keys[2])
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(path, "wb").write(bytes(raw))
    got = reader.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert [g is not None for g in got] == [True, True, False, False]
    assert reader.stats.totals["pages_corrupt"] == 1
    # Negative control: SGLang's backend alone returns the corrupt page as a success.
    plain = reader.inner.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert plain[2] is not None and not torch.equal(_bits(plain[2]), _bits(pages[2]))

    # A torn (short) file: SGLang's backend raises; the wrapper answers a miss.
    open(_page_file(reader.inner, keys[1]), "wb").write(raw[:100])
    with pytest.raises(IOError):
        reader.inner.batch_get(keys[:2], [host.get_dummy_flat_data_page() for _ in keys[:2]])
    assert reader.batch_get(keys[:2], [host.get_dummy_flat_data_page() for _ in keys[:2]]) == [None, None]
    assert reader.stats.totals["errors"] == 1


def test_file_tier_page_without_digest_is_not_offered(cpu_hicache, tmp_path):
    _, _, pages = _host_pages()
    keys = [f"page-{i}" for i in range(len(pages))]
    store = _checked("file", _file_store(tmp_path))
    assert store.batch_set(keys[:2], pages[:2])
    assert store.inner.batch_set(keys[2:], pages[2:])  # written by an engine without checksums
    assert store.inner.batch_exists(keys) == 4
    assert store.batch_exists(keys) == 2


def test_rewriting_an_existing_page_keeps_its_digest(cpu_hicache, tmp_path):
    """Backends skip writing a page that is already stored; its digest must stay the one of
    the stored bytes, not of the (possibly bit-different) page offered the second time."""
    host, _, pages = _host_pages(n_pages=1)
    store = _checked("file", _file_store(tmp_path))
    assert store.batch_set(["p"], pages)
    other = pages[0].clone()
    other[0] += 1.0
    assert store.batch_set(["p"], [other])
    got = store.batch_get(["p"], [host.get_dummy_flat_data_page()])
    assert got[0] is not None and torch.equal(_bits(got[0]), _bits(pages[0]))


class _Unreachable:
    """A storage backend whose every call fails as a dead remote store's client would."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise ConnectionError("store at 10.0.0.1:50051 unreachable")

        return fail


def test_unreachable_store_is_a_miss_not_an_error(cpu_hicache, tmp_path):
    from sgl_vericache.mem_cache.tier_integrity import FileDigests, PageVerifier, TierStats
    from sgl_vericache.sglang.storage import ChecksummedStorage

    host, slots, pages = _host_pages()
    keys = [f"page-{i}" for i in range(len(pages))]
    verifier = PageVerifier(FileDigests(str(tmp_path), str), TierStats(), "remote")
    store = ChecksummedStorage(_Unreachable(), verifier, zero_copy=True)
    store.mem_pool_host = host
    assert store.batch_exists(keys) == 0
    assert store.batch_set(keys, pages) is False
    assert store.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None] * 4
    assert store.batch_set_v1(keys, slots) == [False] * 4
    assert store.batch_get_v1(keys, slots) == [False] * 4
    assert store.stats.totals["errors"] >= 5
    assert store.stats.totals["pages_written"] == 0


def _checked_mooncake(master):
    """Two host pages, and SGLang's MooncakeStore on ``master`` behind the checked wrapper."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    host, slots, _ = _host_pages(n_pages=2)
    inner = MooncakeStore(_storage_config(master.extra_config(64 << 20)), host)
    store = _checked("mooncake", inner)
    store.register_mem_pool_host(host)
    return host, slots, inner, store


def test_mooncake_tier_corrupt_object_is_a_miss(cpu_hicache, mooncake_master):
    """A real Mooncake store: pages written through the checked wrapper come back verified; an
    object replaced in the store by other bytes of the same size is detected."""
    host, slots, inner, store = _checked_mooncake(mooncake_master)
    keys = ["integrity-a", "integrity-b"]
    assert store.batch_set_v1(keys, slots) == [True, True]
    assert store.batch_exists(keys + ["integrity-c"]) == 2
    other = host.alloc(slots.numel())
    assert store.batch_get_v1(keys, other) == [True, True]
    assert store.stats.totals["pages_read"] == 2

    # Replace page b's K object in the store with other bytes of the same size.
    name = f"{inner._tag_keys(['integrity-b'])[0]}_{inner.mha_suffix}_k"
    size = len(inner.store.get(name))
    assert size > 0 and inner.store.remove(name, force=True) == 0
    assert inner.store.put(name, bytes(size)) == 0
    third = host.alloc(slots.numel())
    assert inner.batch_get_v1(keys, third) == [True, True]  # negative control: Mooncake says fine
    assert store.batch_get_v1(keys, third) == [True, False]
    assert store.stats.totals["pages_corrupt"] == 1


def test_mooncake_master_gone_is_a_miss(cpu_hicache, tmp_path):
    """The store's master stops after pages were written (the remote tier is unreachable):
    lookups and reads answer misses promptly instead of raising or hanging."""
    import time

    from test_tiers import MooncakeMaster, mooncake_installed

    if not mooncake_installed():
        pytest.skip("Mooncake is not installed (the tiers extra of scripts/setup.sh)")
    master = MooncakeMaster(tmp_path)  # installed: a store that does not import fails here
    try:
        host, slots, _, store = _checked_mooncake(master)
        keys = ["gone-a", "gone-b"]
        assert store.batch_set_v1(keys, slots) == [True, True]
    finally:
        master.stop()
    t0 = time.monotonic()
    assert store.batch_exists(keys) == 0
    assert store.batch_get_v1(keys, host.alloc(slots.numel())) == [False, False]
    assert time.monotonic() - t0 < 60


def test_backend_without_digest_support_is_refused(cpu_hicache):
    class Nixl:
        pass

    with pytest.raises(ValueError, match="not 'nixl'; pass --no-vericache-tier-checksums"):
        _checked("nixl", Nixl())


def test_compressed_entries_in_a_real_mooncake_store(cpu_hicache, mooncake_master):
    """VeriCache's compressed prefix entries written to Mooncake's store (beside SGLang's
    pages, through the checked wrapper the engine runs) come back bit-identical; written
    twice, still one entry; a second tier on the store (another process) finds it through
    its index record; an object replaced by other bytes, or removed, is a miss."""
    from sgl_vericache.mem_cache.compress import get_compressor
    from sgl_vericache.mem_cache.compressed_tier import CompressedTier
    from sgl_vericache.sglang.storage import blob_store as _blob_store

    _, _, inner, store = _checked_mooncake(mooncake_master)
    blobs = _blob_store(store)
    assert type(blobs).__name__ == "MooncakeBlobs"
    torch.manual_seed(0)
    comp = get_compressor("kivi4", 4.0)
    layers = [comp.compress(torch.randn(70, 2, 8), torch.randn(70, 2, 8)) for _ in range(2)]
    tokens = tuple(range(70))
    tier = CompressedTier(blobs)
    try:
        stub = tier.spill(tokens, comp, layers)
        again = tier.spill(tokens, comp, layers)  # the same entry evicted twice: same name
        tier.drain()
        assert not stub.failed and not again.failed and stub.storage_key == again.storage_key
        assert inner.store.is_exist(stub.storage_key) == 1
        got = tier.fetch(tokens, stub).result(10)
        assert got is not None
        for a, b in zip(layers, got):
            assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
        other = CompressedTier(blobs)
        try:
            n, found = other.find(tokens + (7, 8), comp).result(10)
            assert n == 70 and all(torch.equal(x, y) for a, b in zip(layers, found)
                                   for x, y in zip(a.tensors(), b.tensors()))
            assert other.find(tuple(range(1, 80)), comp).result(10) is None  # another prefix: no record
        finally:
            other.close()
        assert inner.store.remove(stub.storage_key, force=True) == 0
        assert inner.store.put(stub.storage_key, bytes(stub.nbytes)) == 0
        assert tier.fetch(tokens, stub).result(10) is None
        assert inner.store.remove(stub.storage_key, force=True) == 0
        assert tier.fetch(tokens, stub).result(10) is None
        c = tier.snapshot()
        assert (c["spilled_entries"], c["fetches"], c["fetch_corrupt"], c["fetch_misses"]) == (2, 1, 1, 1), c
    finally:
        tier.close()
