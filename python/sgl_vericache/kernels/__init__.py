"""GPU attention: Triton kernels that read a compressed KV entry where it lies (drafts) and
the full paged pool where it lies (verify).

    draft_attention_available(device)   may the drafter use the kernels on this device?
    draft_head_dim(head_dim)             do the draft kernels read heads of this size?
    ops.decode_attention(packed, q, ...) one launch: a batch of rows over packed entries
    verify_kernel_available(device)      may verify attention use its kernel on this device?
    verify.verify_attention(q, ...)      one launch: a round's verify block over the full paged pool
    packing.pack(compressor, layers)     several requests' entries of one layer, end to end or in place
    draft_round.KernelDraftRound         CompressedKVStore's round on the kernels

Kernels (Triton, each checked against its torch twin ``compressor.attend`` by
test/kernel_checks.py): split-KV decode over dense kept tokens (StreamingLLM, SnapKV, H2O,
full; or a paged pool through a token table), over KIVI int4/int2 packed codes with
per-channel key / per-token value scales and the full-precision window, over int8 and fp8
codes with their scales; Quest's page bounds and its attention over the chosen pages; a
split merge; verify attention of a round's block of tokens over the full paged pool (its
twin: the verify backend's torch path, sglang/attention.py). Importing this package imports
neither triton nor CUDA: the submodules do.
"""

from __future__ import annotations

import os

import torch

DISABLE_ENV = "SGL_VERICACHE_DRAFT_KERNELS"  # "0": the drafter keeps its dense torch path on CUDA too
VERIFY_DISABLE_ENV = "SGL_VERICACHE_VERIFY_KERNEL"  # "0": verify attention keeps its torch path on CUDA too


def draft_attention_available(device: torch.device | str) -> bool:
    """True where the drafter should run its attention on these kernels: a CUDA device with
    Triton importable, unless SGL_VERICACHE_DRAFT_KERNELS=0. On CPU always False (the CPU
    path stays the torch one; tests reach the kernels there through Triton's interpreter)."""
    return _kernels_on(device, DISABLE_ENV)


def draft_head_dim(head_dim: int) -> bool:
    """The draft decode kernels read heads of this size: a power of two from 16 up."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def verify_kernel_available(device: torch.device | str) -> bool:
    """True where verify attention should run on its Triton kernel (verify.py): a CUDA
    device with Triton importable, unless SGL_VERICACHE_VERIFY_KERNEL=0. On CPU always False."""
    return _kernels_on(device, VERIFY_DISABLE_ENV)


def _kernels_on(device: torch.device | str, disable_env: str) -> bool:
    if torch.device(device).type != "cuda" or os.environ.get(disable_env, "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
