"""Dense fp32 weight products for the CPU engine through oneDNN's prepacked weights.

SGLang's CPU engine multiplies by its weights with ``F.linear`` (MKL sgemm on the plain
row-major weight) unless the sgl_kernel CPU build is installed, which prepacks weights for
its own GEMM (``weight_packed_linear``). We do the same with what ships in PyTorch: each
weight is reordered once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``)
and multiplied with ``mkldnn._linear_pointwise``. Measured on this 2-core AVX2 EPYC over
SmolLM2-135M's 121 products (``benchmark/bench_cpu_linear.py``): 1.1-2.5x faster than
``F.linear`` at 1-68 rows (the decode, draft and verify shapes), equal within fp32
rounding (max abs error ~4e-6 on unit-scale inputs). It costs one more copy of every
weight it packs.

It serves every forward of the engine (prefill, decode, draft, verify), speculation on or
off, so both arms of a comparison run the same kernels. Deterministic mode keeps
``F.linear`` (its row-invariant blocks are built on it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

_generation = 0  # bumped whenever SGLang updates the model's weights in place


def weights_updated() -> None:
    """The model's weights changed in place: every copy made from them is stale."""
    global _generation
    _generation += 1


def weights_generation() -> int:
    return _generation


def packed_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear:
    """``x @ weight.T + bias`` with a prepacked copy of ``weight`` (made on first use and
    kept while the weight lives). Inputs it cannot serve go to ``F.linear`` unchanged."""

    def __init__(self):
        if not packed_linear_available():
            raise ValueError("--vericache-cpu-linear packed needs PyTorch built with oneDNN (mkldnn); "
                             "this build lacks it: use --vericache-cpu-linear torch")
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, packed)
        self.packed_bytes = 0
        self._generation = weights_generation()

    @staticmethod
    def serves(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
        return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
                and weight.dim() == 2 and weight.device.type == "cpu" and not weight.requires_grad
                and x.shape[-1] == weight.shape[1] and x.numel() > 0
                and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu")))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.serves(x, weight, bias):
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self._pack(weight), bias, "none", [], "")
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        if self._generation != weights_generation():  # weights updated in place: repack
            self._packed.clear()
            self.packed_bytes = 0
            self._generation = weights_generation()
        hit = self._packed.get(id(weight))
        if hit is not None and hit[0] is weight:
            return hit[1]
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self._packed[id(weight)] = (weight, packed)
        self.packed_bytes += weight.numel() * weight.element_size()
        return packed
