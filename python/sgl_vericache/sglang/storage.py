"""HiCache storage tiers: page checksums, and blobs (compressed entries) beside the pages.

Touches ``StorageBackendFactory.create_backend`` (every storage backend SGLang creates is
wrapped in a checksummed ``HiCacheStorage`` when ``--vericache-tier-checksums`` is on),
``HiCacheFile`` and Mooncake's ``MooncakeStore`` (their page files / store objects hold the
digests, and VeriCache's compressed entries as blobs), ``HiCacheStorageFailureInjector``
(seen through, to find the real backend).
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage, HiCacheStorageFailureInjector

from sgl_vericache.sglang.runtime import Runtime, patch

logger = logging.getLogger(__name__)


def install_tier_checksums(runtime: Runtime) -> None:
    """Wrap every HiCache storage backend SGLang creates (``--hicache-storage-backend``) in
    the checksummed storage when the VeriCache config asks for it (``--vericache-tier-
    checksums``, on by default): pages carry digests, and a page read back wrong is a miss."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from sgl_vericache.config import VeriCacheConfig

    def make(create):
        def create_backend(cls, backend_name, storage_config, mem_pool_host, **kwargs):
            backend = create(cls, backend_name, storage_config, mem_pool_host, **kwargs)
            vc = VeriCacheConfig.from_env()
            if vc is None or not vc.tier_checksums:
                return backend
            return checked_storage(backend_name, backend, storage_config)

        return create_backend

    patch(StorageBackendFactory, "create_backend", runtime, make)


def storage_blobs(runtime: Runtime):
    """A ``BlobStore`` over the HiCache storage tier SGLang runs in this process (for
    compressed entries), or None: no storage tier, or one VeriCache cannot write blobs to."""
    tree = next(iter(runtime.radix_caches), None) or next(iter(runtime.storage_trees), None)
    backend = getattr(getattr(tree, "cache_controller", None), "storage_backend", None)
    blobs = blob_store(backend) if backend is not None else None
    if blobs is None and backend is not None:
        logger.info("VeriCache: compressed entries stay on the device: the storage backend %s takes no blobs",
                    type(backend).__name__)
    return blobs


def checked_storage(backend_name, backend, storage_config):
    """``backend`` (a HiCacheStorage) behind digest checks kept in the same tier. Supported:
    SGLang's ``file`` backend (digests as files beside the pages) and ``mooncake`` (digests
    as store objects); any other backend is refused with the way out."""
    from sgl_vericache.mem_cache.tier_integrity import FileDigests, KeyValueDigests, PageVerifier, TierStats

    core = backend._backend if isinstance(backend, HiCacheStorageFailureInjector) else backend
    if isinstance(core, HiCacheFile):
        digests, zero_copy = FileDigests(core.file_path, core._get_suffixed_key), False
    elif type(core).__name__ == "MooncakeStore" and isinstance(getattr(core, "mha_suffix", None), str):
        suffix = core.mla_suffix if core.is_mla_backend else core.mha_suffix
        digests = KeyValueDigests(core.store, lambda key: f"{core._tag_keys([key])[0]}_{suffix}_vcsum")
        zero_copy = True
    else:
        raise ValueError(
            f"--vericache-tier-checksums supports the 'file' and 'mooncake' HiCache storage backends "
            f"(mooncake without head splitting), not {backend_name!r}; pass --no-vericache-tier-checksums "
            f"to use {backend_name!r} without page checksums")
    stats = TierStats(bool(getattr(storage_config, "enable_storage_metrics", False)))
    return ChecksummedStorage(backend, PageVerifier(digests, stats, backend_name), zero_copy)



class ChecksummedStorage(HiCacheStorage):
    """A HiCache storage backend whose pages are verified on the way back. SGLang's
    cache controller calls either the generic page API (``batch_set`` / ``batch_get``
    with page tensors: the file backend) or the zero-copy one (``batch_set_v1`` /
    ``batch_get_v1`` with host-pool indices: Mooncake); both are checked. A call that
    raises (store unreachable, I/O error) is counted and answered as a miss."""

    def __init__(self, inner, verifier, zero_copy):
        self.inner = inner
        self.verifier = verifier
        self.stats = verifier.stats
        self.zero_copy = zero_copy

    def __getattr__(self, name):  # anything else (metrics, layout queries) as the backend has it
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _guard(self, what, miss, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:
            self.stats.add("errors")
            logger.warning("VeriCache: %s %s failed (%s: %s); treated as a miss", self.verifier.tier, what,
                           type(exc).__name__, exc)
            return miss

    # registration and housekeeping go straight through
    def register_mem_pool_host(self, mem_pool_host):
        self.mem_pool_host = mem_pool_host
        self.inner.register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        self.inner.register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self):
        self.inner.on_host_pools_registered()

    def clear(self):
        return self.inner.clear()

    def get_stats(self):
        return self.inner.get_stats()

    def close(self):
        if hasattr(self.inner, "close"):
            self.inner.close()

    # existence: only pages that are there and carry a digest
    def exists(self, key):
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys, extra_info=None):
        present = self._guard("exists", 0, self.inner.batch_exists, keys, extra_info)
        return self._guard("digest lookup", 0, self.verifier.checkable, keys, present)

    # generic page API (page tensors)
    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        existed = self._existing(keys)
        ok = self._guard("write", False, self.inner.batch_set, keys, values, target_locations, target_sizes)
        if not ok:
            return False
        return all(self._guard("digest write", [False], self.verifier.record, keys, values,
                               [True] * len(keys), existed))

    def set(self, key, value=None, target_location=None, target_sizes=None):
        return self.batch_set([key], [value], target_location, target_sizes)

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        pages = self._guard("read", None, self.inner.batch_get, keys, target_locations, target_sizes)
        if not isinstance(pages, list):
            return [None] * len(keys)
        good = self._guard("verify", [False] * len(keys), self.verifier.verify, keys, pages,
                           [p is not None for p in pages])
        return [p if g else None for p, g in zip(pages, good)]

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location], target_sizes)[0]

    # zero-copy API (host-pool indices)
    def _host_pages(self, keys, host_indices):
        pool = self.mem_pool_host
        return [pool.get_data_page(int(host_indices[i * pool.page_size]), flat=True) for i in range(len(keys))]

    def _existing(self, keys):
        """Per key: already in the tier? (Backends skip writing such a page, so its
        stored bytes, and its digest, are the earlier writer's.)"""
        return [self._guard("exists", 0, self.inner.batch_exists, [key]) == 1 for key in keys]

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        existed = self._existing(keys)
        stored = self._guard("write", [False] * len(keys), self.inner.batch_set_v1, keys, host_indices,
                             extra_info)
        return self._guard("digest write", [False] * len(keys), self.verifier.record, keys,
                           self._host_pages(keys, host_indices), stored, existed)

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        loaded = self._guard("read", [False] * len(keys), self.inner.batch_get_v1, keys, host_indices,
                             extra_info)
        return self._guard("verify", [False] * len(keys), self.verifier.verify, keys,
                           self._host_pages(keys, host_indices), loaded)

    # v2 (side pools of hybrid models): passed through unverified; dense models use none
    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        return self.inner.batch_exists_v2(keys, pool_transfers, extra_info)

    def batch_get_v2(self, transfers, extra_info=None):
        return self.inner.batch_get_v2(transfers, extra_info)

    def batch_set_v2(self, transfers, extra_info=None):
        return self.inner.batch_set_v2(transfers, extra_info)


class FileBlobs:
    """Blobs in SGLang's file storage backend (a file each, beside its pages; reads through
    the backend's ``batch_get``, so a throttled subclass throttles them too)."""

    def __init__(self, backend):
        self.backend = backend

    def put(self, key, data):
        return bool(self.backend.set(key, torch.frombuffer(bytearray(data), dtype=torch.uint8)))

    def get(self, key, nbytes):
        if nbytes <= 0 or not self.backend.exists(key):  # index probes miss often: no warning for each
            return None
        (page,) = self.backend.batch_get([key], [torch.empty(nbytes, dtype=torch.uint8)])
        return None if page is None else page.numpy().tobytes()


class MooncakeBlobs:
    """Blobs in Mooncake's store (``put`` / ``get`` of bytes, beside SGLang's zero-copy pages)."""

    def __init__(self, store):
        self.store = store

    def put(self, key, data):  # keys name their content (a digest): one already there is this entry
        return self.store.put(key, data) == 0 or self.store.is_exist(key) == 1

    def get(self, key, nbytes):
        data = self.store.get(key)
        return data or None


def blob_store(backend):
    """A ``BlobStore`` over SGLang's storage backend ``backend`` (file or Mooncake, under
    VeriCache's page checksums or SGLang's fault injector), or None for other backends."""
    core = backend
    for _ in range(4):  # under VeriCache's page checksums and SGLang's fault injector
        if isinstance(core, HiCacheStorageFailureInjector):
            core = core._backend
        elif isinstance(core, ChecksummedStorage):
            core = core.inner
        else:
            break
    if isinstance(core, HiCacheFile):
        return FileBlobs(core)
    if type(core).__name__ == "MooncakeStore" and hasattr(getattr(core, "store", None), "put"):
        return MooncakeBlobs(core.store)
    return None
