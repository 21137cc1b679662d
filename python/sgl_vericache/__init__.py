"""sgl_vericache: SGLang with VeriCache speculative decoding.

A compressed KV cache drafts tokens; the full KV cache (host memory or a remote store)
verifies them, so output token ids equal those of uncompressed decoding.
"""

__version__ = "0.1.0"
