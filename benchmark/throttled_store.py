"""SGLang's ``file`` HiCache storage backend read at a set bandwidth: a remote tier on one
machine, for tests and benchmarks of remote prefix reuse.

Local files come back in milliseconds, so nothing would ever wait for them; a store across
a network does. This backend reads pages as ``HiCacheFile`` does, then sleeps until the
read took ``latency_ms + bytes / throttle_mb_per_s``. Writes are not slowed (SGLang writes
through in the background). Use it through SGLang's ``dynamic`` storage backend, with this
folder on the scheduler's ``sys.path``::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "throttled_file", "module_path": "throttled_store",
      "class_name": "ThrottledFile", "file_storage_path": "/tmp/kv",
      "throttle_mb_per_s": 20, "throttle_latency_ms": 5}'

It is a ``HiCacheFile``, so VeriCache's page checksums work on it as on ``file``.
"""

from __future__ import annotations

import time

from sglang.srt.mem_cache.hicache_storage import HiCacheFile


class ThrottledFile(HiCacheFile):
    def __init__(self, storage_config, kwargs=None):
        super().__init__(storage_config)  # the folder: extra_config's file_storage_path
        extra = storage_config.extra_config or {}
        self.mb_per_s = float(extra.get("throttle_mb_per_s", 0))
        self.latency_s = float(extra.get("throttle_latency_ms", 0)) / 1e3
        if self.mb_per_s < 0 or self.latency_s < 0:
            raise ValueError(f"throttle_mb_per_s {self.mb_per_s!r} and throttle_latency_ms "
                             f"{self.latency_s * 1e3!r} must be >= 0 (0: no limit)")
        self.bytes_read = 0
        self.seconds_throttled = 0.0

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        t0 = time.perf_counter()
        pages = super().batch_get(keys, target_locations, target_sizes)
        nbytes = sum(p.numel() * p.element_size() for p in pages or () if p is not None)
        self.bytes_read += nbytes
        want = self.latency_s + (nbytes / (self.mb_per_s * 1e6) if self.mb_per_s else 0.0)
        wait = want - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
            self.seconds_throttled += wait
        return pages
