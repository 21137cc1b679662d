"""Pure-torch implementations of the ``sgl_kernel`` CPU ops that SGLang's CPU engine calls
on our code paths (served by ``cpu_compat`` when no usable sgl_kernel is installed).

Each op follows the signature and in-place semantics of the op of the same name in
SGLang's CPU kernel build (``sgl-kernel/csrc/cpu``) and of its Triton/CUDA twin.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np
import torch


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    x = input.float()
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(rmsnorm(residual, weight, eps))


def silu_and_mul(input, out=None, enable_pdl=None):
    d = input.shape[-1] // 2
    y = torch.nn.functional.silu(input[..., :d]) * input[..., d:]
    if out is None:
        return y
    out.copy_(y)
    return out


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every KV buffer (given by its base address and row size in bytes), copy the
    rows at ``src_loc`` onto the rows at ``tgt_loc``."""
    # data_ptrs: [n_buffers] uint64 addresses; strides: [n_buffers] row bytes
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64).numpy()
    tgt = tgt_loc.to(torch.int64).numpy()
    rows = int(max(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buf = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        view = np.frombuffer(buf, dtype=np.uint8).reshape(rows, int(stride))
        view[tgt] = view[src]


OPS: dict[str, Callable] = {
    "rmsnorm": rmsnorm,
    "fused_add_rmsnorm": fused_add_rmsnorm,
    "silu_and_mul": silu_and_mul,
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
}
