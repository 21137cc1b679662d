"""How much of SGLang's KV budget VeriCache keeps for its own memory (no SGLang imports).

SGLang sizes its KV pool from what ``--mem-fraction-static`` leaves after the weights, and
gives every byte of it to full KV. VeriCache then holds, on the same device, each drafting
request's compressed entry, the compressed prefix cache and, on the dense draft path (CPU;
CUDA for a head dim the kernels do not read), the round's dense draft buffers. Left
unreserved, a full pool meets them as an out-of-memory error mid-round (which
``spec.round`` survives by decoding plainly for a while: slower, never wrong).

The running requests' full KV is at most the pool's, so with ``P`` bytes of pool, entries
take at most about ``e * P`` and the dense buffers ``d * P``, where ``e`` is the compressor's
bytes per full-KV byte (at a ``REFERENCE_TOKENS``-token request: a quantizer's
full-precision residual window weighs more in a short one; with the spare rows that an
entry growing in place holds, a sixteenth more) and ``d`` the share of its rows
a dense buffer holds (``plan.draft_kv_fraction``). A budget ``B`` is then split as
``B = prefix cache + P * (1 + e + d)``.

Not counted: buffer padding to the round's longest request and the draft passes'
activations (small beside the KV); a request choosing another compressor than the server's
(``vericache_compressor``); requests whose full KV is parked in host memory
(``--vericache-full-device-budget``), whose entries stay on the device. Those are what the
out-of-memory fallback is for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sgl_vericache.mem_cache.compress import KVCompressor, full_nbytes
from sgl_vericache.mem_cache.compress.rows import spare_rows
from sgl_vericache.spec.plan import draft_kv_fraction

REFERENCE_TOKENS = 4096  # the request length entries are sized at (see the module's docstring)


class DraftMemoryError(ValueError):
    """The budget cannot hold VeriCache's reserve and any KV pool; names the flags to change."""


@dataclass(frozen=True)
class DraftMemoryPlan:
    budget_bytes: int  # what SGLang would have given its KV pool
    pool_bytes: int  # what it gets with VeriCache's reserve taken out
    entry_fraction: float  # e: compressed entry bytes per full-KV byte
    buffer_fraction: float  # d: dense draft buffer bytes per full-KV byte (0 on the kernels)
    prefix_cache_bytes: int  # the compressed prefix cache's budget
    compressors: tuple[str, ...]  # what e was taken from

    @property
    def reserved_bytes(self) -> int:
        return self.budget_bytes - self.pool_bytes

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "pool_bytes": self.pool_bytes,
                "reserved_bytes": self.reserved_bytes, "entry_fraction": round(self.entry_fraction, 4),
                "buffer_fraction": round(self.buffer_fraction, 4), "prefix_cache_bytes": self.prefix_cache_bytes,
                "compressors": list(self.compressors)}

    def describe(self) -> str:
        gib = 1 << 30
        return (f"KV pool budget {self.budget_bytes / gib:.2f} GiB -> {self.pool_bytes / gib:.2f} GiB: "
                f"{self.reserved_bytes / gib:.2f} GiB kept for compressed entries "
                f"({'/'.join(self.compressors)}: {self.entry_fraction:.3f} of the full KV), dense draft buffers "
                f"({self.buffer_fraction:.3f}) and the compressed prefix cache "
                f"({self.prefix_cache_bytes >> 20} MiB)")


def entry_fraction(compressor: KVCompressor, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> float:
    """Compressed entry bytes per full-KV byte of a ``REFERENCE_TOKENS``-token request,
    with the spare rows of a method whose entries grow in place (``mem_cache.compress.rows``)."""
    full = full_nbytes(REFERENCE_TOKENS, num_kv_heads, head_dim, dtype)
    held = REFERENCE_TOKENS + (spare_rows(REFERENCE_TOKENS) if compressor.grows_in_place else 0)
    return compressor.nbytes_for(held, num_kv_heads, head_dim, dtype) / full


def plan_draft_memory(budget_bytes: int, compressors: Sequence[KVCompressor], num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, prefix_cache_bytes: int, dense_buffers: bool) -> DraftMemoryPlan:
    """Split ``budget_bytes`` between SGLang's KV pool and VeriCache's reserve, for entries
    of the costliest of ``compressors`` (the server's: both candidates of ``auto``)."""
    if budget_bytes < 0 or prefix_cache_bytes < 0 or not compressors:
        raise ValueError(f"budget {budget_bytes}, prefix cache {prefix_cache_bytes}, compressors "
                         f"{list(compressors)}: accepted: bytes >= 0 and at least one compressor")
    e = max(entry_fraction(c, num_kv_heads, head_dim, dtype) for c in compressors)
    d = max(draft_kv_fraction(c) for c in compressors) if dense_buffers else 0.0
    pool = int((budget_bytes - prefix_cache_bytes) / (1.0 + e + d))
    if pool <= 0:
        raise DraftMemoryError(
            f"VeriCache's compressed prefix cache ({prefix_cache_bytes >> 20} MiB, --vericache-compressed-cache-mb) "
            f"leaves nothing of the {budget_bytes / (1 << 20):.0f} MiB KV budget for SGLang's KV pool; accepted: "
            "a smaller --vericache-compressed-cache-mb (0 turns the cache off) or a larger --mem-fraction-static")
    return DraftMemoryPlan(budget_bytes, pool, e, d, prefix_cache_bytes, tuple(c.name for c in compressors))
