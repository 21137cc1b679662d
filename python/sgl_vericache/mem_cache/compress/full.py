"""The identity compressor: the uncompressed baseline (ratio 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import CompressedLayer, KVCompressor, check_append, check_kv, full_nbytes
from .registry import register_compressor
from .rows import append_rows


@dataclass
class DenseLayer(CompressedLayer):
    k: torch.Tensor  # [T, H, D]
    v: torch.Tensor  # [T, H, D]

    def tensors(self):
        return (self.k, self.v)


@register_compressor("full")
class FullCompressor(KVCompressor):
    """Keeps the KV as it is: drafting over it reproduces full-KV decoding (up to the
    kernels), which makes it the reference other methods are measured against."""

    name = "full"
    grows_in_place = True

    def compress(self, k, v, queries=None):
        check_kv(k, v)
        # a copy with spare rows (k[:0] has none: append_rows copies), for appends to grow into
        return DenseLayer(k.shape[0], k.shape[1], k.shape[2], k.dtype, append_rows(k[:0], k), append_rows(v[:0], v))

    def append(self, layer, k, v, queries=None):
        check_append(layer, k, v)
        return DenseLayer(layer.num_tokens + k.shape[0], layer.num_kv_heads, layer.head_dim, layer.dtype,
                          append_rows(layer.k, k), append_rows(layer.v, v))

    def materialize(self, layer):
        positions = torch.arange(layer.num_tokens, device=layer.k.device)[:, None]
        return layer.k, layer.v, positions.expand(-1, layer.num_kv_heads)

    def stable_rows(self, old, new):
        return old.num_tokens  # append only adds rows

    def nbytes_for(self, num_tokens, num_kv_heads, head_dim, dtype):
        return full_nbytes(num_tokens, num_kv_heads, head_dim, dtype)
