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


class WeightCopies:
    """Per-weight copies made from the model's weights (packed, fp16, int8), one per
    weight tensor, made on first use and all dropped when the weights are updated in place."""

    def __init__(self):
        self._copies: dict[int, tuple[torch.Tensor, object]] = {}  # id(weight) -> (weight, copy)
        self.nbytes = 0
        self._generation = weights_generation()

    def get(self, weight: torch.Tensor, make, nbytes: int):
        """The copy of ``weight``, made with ``make()`` (accounted as ``nbytes``) when missing."""
        if self._generation != weights_generation():
            self._copies.clear()
            self.nbytes = 0
            self._generation = weights_generation()
        hit = self._copies.get(id(weight))
        if hit is not None and hit[0] is weight:
            return hit[1]
        with torch.no_grad():
            copy = make()
        self._copies[id(weight)] = (weight, copy)
        self.nbytes += nbytes
        return copy


def packed_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear:
    """``x @ weight.T + bias`` with a prepacked copy of ``weight`` (made on first use and
    kept while the weight lives). Inputs it cannot serve go to ``F.linear`` unchanged."""

    def __init__(self):
        if not packed_linear_available():
            raise ValueError("--vericache-cpu-linear packed needs PyTorch built with oneDNN (mkldnn); "
                             "this build lacks it: use --vericache-cpu-linear torch")
        self._packed = WeightCopies()

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

    @property
    def packed_bytes(self) -> int:
        return self._packed.nbytes

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        return self._packed.get(weight, lambda: torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()),
                                weight.numel() * weight.element_size())
