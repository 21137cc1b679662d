"""Integrity of KV pages in remote tiers (no SGLang imports).

A storage tier (a shared directory, a Mooncake store) can lose a page, hold a torn or
bit-flipped one, be slow, or be unreachable. SGLang's HiCache already treats a page that is
missing, or a call that fails, as a miss (the prefix is recomputed). What it cannot see is
a page that comes back *wrong*: the bytes load without error and the model silently attends
over corrupt KV, so the output is no longer what the full cache would give.

``PageVerifier`` closes that gap. When a page is written, a 16-byte BLAKE2b digest of its
bytes is stored beside it, in the same tier (``FileDigests`` for a directory,
``KeyValueDigests`` for a key-value store such as Mooncake), so any engine reading the tier
can check it. When pages are read back, each one is hashed again; the first page whose
digest is missing or different ends the usable prefix, exactly like a miss, and the rest is
recomputed. Digests are written after their page and only for pages the writer actually
stored, so a reader never trusts a page it cannot check.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import uuid
from typing import Callable, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

DIGEST_BYTES = 16


def page_digest(page: torch.Tensor) -> bytes:
    """BLAKE2b-128 of a page's raw bytes (any dtype; host memory)."""
    data = page.detach().contiguous().view(torch.uint8).numpy()
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


class FileDigests:
    """Digests as small files in the tier's directory: ``<dir>/<name(key)>.vcsum``, written
    atomically (temp file + rename)."""

    def __init__(self, directory: str, name: Callable[[str], str]):
        self.directory = directory
        self.name = name

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, self.name(key) + ".vcsum")

    def put(self, key: str, digest: bytes) -> bool:
        tmp = os.path.join(self.directory, f".{uuid.uuid4().hex}.vcsum.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(digest)
            os.replace(tmp, self._path(key))
            return True
        except OSError as exc:
            logger.warning("VeriCache: could not write the digest of page %s: %s", key, exc)
            try:
                os.remove(tmp)
            except OSError:
                pass
            return False

    def get(self, key: str) -> Optional[bytes]:
        try:
            with open(self._path(key), "rb") as f:
                data = f.read(DIGEST_BYTES + 1)
        except OSError:
            return None
        return data if len(data) == DIGEST_BYTES else None


class KeyValueDigests:
    """Digests as objects in a key-value store whose client has ``put(key, bytes) -> int``
    (0 = stored) and ``get(key) -> bytes`` (empty when absent), as Mooncake's store does."""

    def __init__(self, store, name: Callable[[str], str]):
        self.store = store
        self.name = name

    def put(self, key: str, digest: bytes) -> bool:
        name = self.name(key)
        if self.store.put(name, digest) == 0:
            return True
        # An object of that name may already exist (a store may refuse to overwrite):
        # keep it only if it is this digest.
        return self.get(key) == digest

    def get(self, key: str) -> Optional[bytes]:
        data = self.store.get(self.name(key))
        return bytes(data) if data is not None and len(data) == DIGEST_BYTES else None


class TierStats:
    """Counters of one storage tier; Prometheus counters (``vericache:tier_*``) too when
    metrics are on."""

    NAMES = {
        "pages_written": "KV pages written to the storage tier with a digest",
        "pages_read": "KV pages read back from the storage tier and verified",
        "pages_corrupt": "KV pages read back whose bytes did not match their digest (recomputed)",
        "pages_unverifiable": "KV pages found without a digest (treated as missing)",
        "bytes_written": "Bytes of KV written to the storage tier",
        "bytes_read": "Bytes of verified KV read from the storage tier",
        "errors": "Storage tier calls that raised (unreachable or failing store; treated as misses)",
    }
    _prom: dict = {}
    _prom_lock = threading.Lock()

    def __init__(self, enable_metrics: bool = False):
        self.totals = {name: 0 for name in self.NAMES}
        self._lock = threading.Lock()
        self._metrics = enable_metrics
        if enable_metrics:
            with TierStats._prom_lock:
                if not TierStats._prom:  # one set per process (Prometheus names are global)
                    from prometheus_client import Counter

                    for name, doc in self.NAMES.items():
                        TierStats._prom[name] = Counter(f"vericache:tier_{name}", doc)

    def add(self, name: str, value: int = 1) -> None:
        if not value:
            return
        with self._lock:
            self.totals[name] += value
        if self._metrics:
            TierStats._prom[name].inc(value)


class PageVerifier:
    """Digest bookkeeping for one tier: ``record`` after pages are written, ``verify``
    after pages are read, ``checkable`` to cut an existence answer to pages with digests."""

    def __init__(self, digests, stats: TierStats, tier: str):
        self.digests = digests
        self.stats = stats
        self.tier = tier

    def record(self, keys: Sequence[str], pages: Sequence[torch.Tensor], stored: Sequence[bool],
               already_there: Sequence[bool]) -> list[bool]:
        """Write the digest of every page stored now; a page that was already in the tier
        keeps its digest (its bytes are the ones that digest describes). A page whose digest
        cannot be written is reported as not stored."""
        out = []
        for key, page, ok, existed in zip(keys, pages, stored, already_there):
            if ok and not existed:
                ok = self.digests.put(key, page_digest(page))
                if ok:
                    self.stats.add("pages_written")
                    self.stats.add("bytes_written", page.numel() * page.element_size())
            out.append(bool(ok))
        return out

    def verify(self, keys: Sequence[str], pages: Sequence[Optional[torch.Tensor]],
               loaded: Sequence[bool]) -> list[bool]:
        """Per page, True while every page so far loaded and matches its digest; from the
        first failure on, False (a prefix cache can only use a contiguous prefix)."""
        out, good = [], True
        for key, page, ok in zip(keys, pages, loaded):
            if good and ok:
                expected = self.digests.get(key)
                if expected is None:
                    self.stats.add("pages_unverifiable")
                    logger.warning("VeriCache: %s page %s has no digest; recomputing it", self.tier, key)
                    good = False
                elif page_digest(page) != expected:
                    self.stats.add("pages_corrupt")
                    logger.warning("VeriCache: %s page %s does not match its digest (corrupt); recomputing it",
                                   self.tier, key)
                    good = False
                else:
                    self.stats.add("pages_read")
                    self.stats.add("bytes_read", page.numel() * page.element_size())
            else:
                good = False
            out.append(good)
        return out

    def checkable(self, keys: Sequence[str], present: int) -> int:
        """How many of the first ``present`` keys also have a digest (leading run)."""
        for i in range(present):
            if self.digests.get(keys[i]) is None:
                return i
        return present
