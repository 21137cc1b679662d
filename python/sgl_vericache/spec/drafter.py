"""Per-request compressed KV for drafting (no SGLang imports).

The store keeps, for every running request and layer, a ``CompressedLayer`` that is a
compression of the request's *verified* KV: before each draft round ``sync`` compresses
(first time) or appends (later) the verified tokens it has not seen yet, reading them from
the full KV through a callback. During the round, the draft tokens' own K/V (computed from
approximate hidden states) go to a per-round provisional buffer, never into the entry;
``begin_round`` discards them. So the compressed cache is always a compression of the
true cache, and provisional KV never reaches either cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

import torch

from sgl_vericache.mem_cache.compress import CompressedLayer, KVCompressor, causal_attention, full_nbytes

# (layer_id, start, end) -> (k, v), each [end - start, H_kv, D]: verified KV of a request
ReadKV = Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _RequestEntry:
    compressor: KVCompressor
    layers: list[Optional[CompressedLayer]]
    cached_len: int = 0  # verified tokens represented by every layer's entry
    # provisional KV of the current round, per layer: list of [1, H_kv, D] tensors
    draft_k: list[list[torch.Tensor]] = field(default_factory=list)
    draft_v: list[list[torch.Tensor]] = field(default_factory=list)
    # per layer, the entry as dense (k, v), materialized once per round for methods whose
    # draft attention is plain attention over it (all but query-aware page selection)
    dense: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)


class CompressedKVStore:
    def __init__(self, compressor: KVCompressor, num_layers: int):
        self.compressor = compressor
        self.num_layers = num_layers
        self._entries: dict[Hashable, _RequestEntry] = {}
        self.tokens_compressed = 0  # counters for metrics
        self.tokens_appended = 0

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._entries

    def cached_len(self, rid: Hashable) -> int:
        entry = self._entries.get(rid)
        return 0 if entry is None else entry.cached_len

    def sync(
        self,
        rid: Hashable,
        verified_len: int,
        read_kv: ReadKV,
        compressor: Optional[KVCompressor] = None,
        queries: Optional[list[torch.Tensor]] = None,  # per layer [W, H_q, D]: last prompt queries
    ) -> None:
        """Bring the request's entry up to ``verified_len`` verified tokens. ``compressor``
        (default: the store's) is fixed for the entry's lifetime; ``queries`` feed the
        query-aware methods (SnapKV, H2O) when the entry is first built."""
        compressor = compressor or self.compressor
        entry = self._entries.get(rid)
        if entry is not None and (entry.cached_len > verified_len or entry.compressor is not compressor):
            # The request went back (retraction / recompute): rebuild from scratch.
            self.release(rid)
            entry = None
        if entry is None:
            entry = self._entries[rid] = _RequestEntry(compressor, layers=[None] * self.num_layers)
        start = entry.cached_len
        if verified_len > start:
            for layer_id in range(self.num_layers):
                k, v = read_kv(layer_id, start, verified_len)
                old = entry.layers[layer_id]
                if old is None:
                    q = None if queries is None else queries[layer_id]
                    entry.layers[layer_id] = compressor.compress(k, v, q if compressor.needs_queries else None)
                else:
                    entry.layers[layer_id] = compressor.append(old, k, v)
            if start == 0:
                self.tokens_compressed += verified_len
            else:
                self.tokens_appended += verified_len - start
            entry.cached_len = verified_len
        self._reset_round(entry)

    def _reset_round(self, entry: _RequestEntry) -> None:
        entry.draft_k = [[] for _ in range(self.num_layers)]
        entry.draft_v = [[] for _ in range(self.num_layers)]
        entry.dense = [None] * self.num_layers

    def attend(
        self,
        rid: Hashable,
        layer_id: int,
        q: torch.Tensor,  # [1, H_q, D] this draft step's query
        k_new: torch.Tensor,  # [1, H_kv, D] provisional KV of the token being drafted from
        v_new: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # [1, H_q, D]
        entry = self._entries[rid]
        entry.draft_k[layer_id].append(k_new)
        entry.draft_v[layer_id].append(v_new)
        k_extra = torch.cat(entry.draft_k[layer_id])
        v_extra = torch.cat(entry.draft_v[layer_id])
        layer = entry.layers[layer_id]
        if layer is None:  # nothing verified yet (empty prompt): attend to the draft only
            layer = entry.compressor.compress(k_extra[:0], v_extra[:0])
        if type(entry.compressor).attend is not KVCompressor.attend:
            return entry.compressor.attend(layer, q, scale, k_extra, v_extra)
        # Same math as KVCompressor.attend, without re-materializing every draft step.
        if entry.dense[layer_id] is None:
            k, v, _ = entry.compressor.materialize(layer)
            entry.dense[layer_id] = (k, v)
        k, v = entry.dense[layer_id]
        return causal_attention(q, k, v, scale, k_extra, v_extra)

    def release(self, rid: Hashable) -> None:
        self._entries.pop(rid, None)

    def release_all_but(self, live_rids) -> None:
        for rid in [r for r in self._entries if r not in live_rids]:
            self.release(rid)

    def clear(self) -> None:
        self._entries.clear()

    def nbytes(self) -> int:
        return sum(l.nbytes() for e in self._entries.values() for l in e.layers if l is not None)

    def full_nbytes(self) -> int:
        total = 0
        for entry in self._entries.values():
            for layer in entry.layers:
                if layer is not None:
                    total += full_nbytes(layer.num_tokens, layer.num_kv_heads, layer.head_dim, layer.dtype)
        return total

    def check_integrity(self) -> None:
        for rid, entry in self._entries.items():
            assert len(entry.layers) == self.num_layers, rid
            for layer in entry.layers:
                if entry.cached_len:
                    assert layer is not None and layer.num_tokens == entry.cached_len, (rid, entry.cached_len)
                    layer.check_integrity()
