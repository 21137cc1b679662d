"""Row-invariant weight products for ``--vericache-deterministic``.

Every matrix product with a weight runs on blocks of exactly ``ROW_BLOCK`` rows (the last
one zero-padded), so a row's result never depends on how many rows share the call (MKL's
results do, otherwise): a one-token decode step and a verify pass of draft_len + 1 tokens
give bit-equal rows. The SGLang seam (``sglang/linear.py``) runs every forward that
produces output logits or committed KV under ``row_invariant_mode()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_BLOCK = 16


def row_invariant_linear(x, weight, bias=None):
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    pad = (-m) % ROW_BLOCK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    out = torch.cat([F.linear(rows[i : i + ROW_BLOCK], weight, bias) for i in range(0, m + pad, ROW_BLOCK)])
    return out[:m].reshape(*lead, weight.shape[0])


class RowInvariantMatmul(TorchFunctionMode):
    """Routes weight products (F.linear, and matmul/mm against a 2-D right operand,
    as the lm_head does) through ``linear`` (``row_invariant_linear`` unless given)."""

    def __init__(self, linear=None):
        super().__init__()
        self.linear = linear or row_invariant_linear

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and not kwargs:
            return self.linear(*args)
        if func in (torch.matmul, torch.mm, torch.Tensor.matmul) and not kwargs and len(args) == 2:
            a, b = args
            if isinstance(b, torch.Tensor) and b.dim() == 2 and a.dim() >= 2:
                return self.linear(a, b.t())
        return func(*args, **kwargs)


def row_invariant_mode() -> RowInvariantMatmul:
    return RowInvariantMatmul()
