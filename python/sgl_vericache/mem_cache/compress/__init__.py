"""KV compressors behind one interface (see base.py for shapes and semantics).

    comp = get_compressor("kivi4")                 # or "snapkv", ratio=4, window_size=32
    entry = comp.compress(k, v, queries)           # k, v: [T, H_kv, D]
    entry = comp.append(entry, k_new, v_new, q_new)
    out = comp.attend(entry, q, scale, k_extra, v_extra)   # [S, H_q, D]
    comp.achieved_ratio(entry)
"""

from .base import CompressedLayer, CompressorConfig, KVCompressor, OptionSpec, attention, causal_attention, full_nbytes
from .registry import (
    available_compressors,
    build_compressor,
    compressor_class,
    get_compressor,
    parse_options,
    register_compressor,
)

__all__ = [
    "CompressedLayer",
    "CompressorConfig",
    "KVCompressor",
    "OptionSpec",
    "attention",
    "available_compressors",
    "build_compressor",
    "causal_attention",
    "compressor_class",
    "full_nbytes",
    "get_compressor",
    "parse_options",
    "register_compressor",
]
