"""GPU attention: Triton kernels that read a compressed KV entry where it lies (drafts) and
the full paged pool where it lies (verify).

    draft_attention_available(device)   may the drafter use the kernels on this device?
    draft_kernels_off(device)            if not, why (/server_info's vericache_kernels)
    turn_draft_kernels_off(exc)          a draft kernel failed: the dense torch path from now on
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

import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "SGL_VERICACHE_DRAFT_KERNELS"  # "0": the drafter keeps its dense torch path on CUDA too
VERIFY_DISABLE_ENV = "SGL_VERICACHE_VERIFY_KERNEL"  # "0": verify attention keeps its torch path on CUDA too
# bf16 products (tl.dot, mma) need sm_80, and Triton's support for older GPUs has been cut back
MIN_CAPABILITY = (8, 0)
MAX_DRAFT_HEAD_DIM = 256  # the largest head the draft launches have been sized for (verify.MAX_HEAD_DIM too)

# why the draft kernels / the verify kernel were turned off in this process (a kernel failed:
# turn_draft_kernels_off, turn_verify_kernel_off), or None
_draft_failure: Optional[str] = None
_verify_failure: Optional[str] = None


def draft_attention_available(device: torch.device | str) -> bool:
    """True where the drafter should run its attention on these kernels (``draft_kernels_off``
    names no reason). On CPU always False (the CPU path stays the torch one; tests reach the
    kernels there through Triton's interpreter)."""
    return draft_kernels_off(device) is None


def draft_kernels_off(device: torch.device | str) -> Optional[str]:
    """Why draft attention keeps its dense torch path on ``device`` (/server_info shows it),
    or None where it runs on the kernels: a CUDA device of compute capability 8.0 or newer,
    not ROCm, with Triton importable, unless SGL_VERICACHE_DRAFT_KERNELS=0 or a kernel has
    failed in this process (``turn_draft_kernels_off``)."""
    return _draft_failure or _kernels_off(device, DISABLE_ENV, "draft")


def draft_kernels_failed() -> Optional[str]:
    """The failure that turned the draft kernels off in this process, or None."""
    return _draft_failure


def turn_draft_kernels_off(exc: BaseException, when: str = "a draft kernel failed") -> None:
    """A draft kernel failed to compile or launch (``exc``; or the warm-up did): every draft
    round of this process from now on, in every store and sliding-window round, takes the
    dense torch path. Such a failure is a property of the GPU and Triton, so trying again
    would fail again; under tensor parallelism identical GPUs fail alike, and the ranks'
    heads are summed all the same. Drafts only propose, so the output stays exact. The first
    failure is kept (``draft_kernels_off`` names it) and logged with its traceback."""
    global _draft_failure
    if _draft_failure is None:
        _draft_failure = _reason(exc, when)
        logger.warning("VeriCache: %s; drafts run on the dense torch path from now on", _draft_failure,
                       exc_info=exc)


def verify_kernel_failed() -> Optional[str]:
    """The failure that turned the verify kernel off in this process, or None."""
    return _verify_failure


def turn_verify_kernel_off(exc: BaseException, when: str = "the verify kernel failed") -> None:
    """The verify kernel failed to compile or launch: verify attention takes its per-request
    torch path in this process from now on (``verify_kernel_off`` names why); logged once."""
    global _verify_failure
    if _verify_failure is None:
        _verify_failure = _reason(exc, when)
        logger.error("VeriCache: %s; verify attention runs per request in torch from now on", _verify_failure,
                     exc_info=exc)


def _reason(exc: BaseException, when: str) -> str:
    return " ".join(f"{when}: {type(exc).__name__}: {exc}".split())[:300]


def launch_failed(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a kernel launch, is a failure the torch path stands in for:
    Triton's own errors (compile, out of resources, ptxas: ``TritonError``) and the
    driver's as Triton's launcher raises them ("Triton Error [CUDA]: ..."); never running
    out of device memory (torch's or the driver's), which the round handles itself
    (spec/round.py lets the compressed entries go), nor any other error, a bug to surface."""
    text = str(exc)
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower():
        return False
    from triton.errors import TritonError  # imported already: a kernel was launched

    return isinstance(exc, TritonError) or (isinstance(exc, RuntimeError) and text.startswith("Triton Error"))


def draft_head_dim(head_dim: int) -> bool:
    """The draft decode kernels read heads of this size: a power of two from 16 to 256 (a
    larger head's fp32 accumulators and tiles have never been compiled; it drafts on torch)."""
    return 16 <= head_dim <= MAX_DRAFT_HEAD_DIM and head_dim & (head_dim - 1) == 0


def verify_kernel_available(device: torch.device | str) -> bool:
    """True where verify attention should run on its Triton kernel (verify.py): the same
    devices as the drafts' (``verify_kernel_off`` names no reason). On CPU always False."""
    return verify_kernel_off(device) is None


def verify_kernel_off(device: torch.device | str) -> Optional[str]:
    """Why verify attention keeps its torch path on ``device``, or None (as
    ``draft_kernels_off``, switched off by SGL_VERICACHE_VERIFY_KERNEL=0, or by a failure of
    the kernel in this process: ``turn_verify_kernel_off``)."""
    return _verify_failure or _kernels_off(device, VERIFY_DISABLE_ENV, "verify")


def _kernels_off(device: torch.device | str, disable_env: str, what: str) -> Optional[str]:
    device = torch.device(device)
    if device.type != "cuda":
        return f"{what} attention runs on torch here"
    if os.environ.get(disable_env, "1") == "0":
        return f"{disable_env}=0"
    if torch.version.hip:  # ROCm calls its devices "cuda" too
        return f"ROCm (HIP {torch.version.hip}): the kernels decode with inline NVIDIA PTX"
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        return (f"compute capability {capability[0]}.{capability[1]}: the kernels need "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (bf16 tensor cores)")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None
