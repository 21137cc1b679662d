"""Reduced-precision weight products for the draft passes (no SGLang imports).

A draft step reads every weight of the model, as a decode step does; at small batch on a
CPU those reads, not the KV, are most of the step (profiled: ~60% of a draft step at 2k
context x batch 4 is the linear layers and the lm_head, fp32). Drafting only proposes
tokens, and the verify pass runs the model's own weights over the full KV, so the draft
may multiply by a cheaper copy of the weights: the output is unchanged (token-identical
under greedy and seeded sampling, distribution-exact under rejection sampling, whose q is
the draft's own distribution), only the acceptance rate can move.

Modes (``--vericache-draft-weights``):
  auto    for an fp32 model on a CPU: the fp16 copy for products of at most
          AUTO_FP16_MAX_ROWS rows (a draft batch of 1-2 requests) and the model's own weights
          above, where the fp16 kernel on a CPU without native fp16 loses
          (benchmark/bench_cpu_linear.py: fp16 2.7x F.linear at 1 row, even with oneDNN-packed
          fp32 at 4, 0.78x at 8, 0.22x at 68); for any other model or device: model (the
          default; measured on CPUs only, and a GPU's copy would sit outside the memory SGLang
          sized its KV pool around)
  model   the model's weights as they are (no copy), through the engine's own weight path
  fp16    an fp16 copy; products in fp16, results cast back (half the bytes of fp32)
  int8    per-output-channel symmetric int8 copy, activations quantized per call
          (PyTorch's dynamic-quantized linear, fbgemm/x86 engine; a quarter of the bytes)

Copies are made on first use, one per weight tensor, and kept for the process's life.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from sgl_vericache.cpu.linear import WeightCopies

DRAFT_WEIGHT_MODES = ("model", "fp16", "int8")
_INT8_ENGINES = ("x86", "fbgemm")


AUTO_FP16_MAX_ROWS = 2  # auto drafts with the fp16 copy up to this many rows per product


def resolve_mode(mode: str, model_dtype: torch.dtype, device="cpu") -> tuple[str, Optional[int]]:
    """(mode, max_rows): ``auto`` is fp16 up to AUTO_FP16_MAX_ROWS rows for an fp32 model on
    a CPU (measured there: the same acceptance as fp32 weights), else the model's own; an
    explicit mode applies to every product (max_rows None)."""
    if mode != "auto":
        return mode, None
    on_cpu = torch.device(device).type == "cpu"
    return ("fp16", AUTO_FP16_MAX_ROWS) if model_dtype == torch.float32 and on_cpu else ("model", None)


class DraftWeights:
    """``max_rows``: products with more rows use ``model_linear`` (the engine's own weight
    product, e.g. ``cpu.linear.PackedLinear.linear``) instead of the copy."""

    def __init__(self, mode: str, max_rows: Optional[int] = None, model_linear: Callable = F.linear):
        if mode not in DRAFT_WEIGHT_MODES:
            raise ValueError(f"draft weights {mode!r} is not one of {', '.join(DRAFT_WEIGHT_MODES)} "
                             "(resolve 'auto' with resolve_mode first)")
        self.mode = mode
        self.max_rows = max_rows
        self.model_linear = model_linear
        self._copies = WeightCopies()

    def check_device(self, device: torch.device, model_dtype: torch.dtype = torch.float32) -> None:
        """Refuse a mode this device cannot run, or one that buys nothing there, naming what
        would work."""
        if self.mode == "fp16" and torch.device(device).type != "cpu" and model_dtype in (torch.float16,
                                                                                          torch.bfloat16):
            raise ValueError(f"--vericache-draft-weights fp16 on a {str(model_dtype).removeprefix('torch.')} model "
                             f"(device {device}) copies every weight for products as wide as the model's own: "
                             "use model")
        if self.mode == "int8":
            if torch.device(device).type != "cpu":
                raise ValueError(f"--vericache-draft-weights int8 runs on CPU only (device {device}); "
                                 "use fp16 or model")
            engines = torch.backends.quantized.supported_engines
            if not any(e in engines for e in _INT8_ENGINES):
                raise ValueError(f"--vericache-draft-weights int8 needs PyTorch's x86/fbgemm quantized engine; "
                                 f"this build has {engines}: use fp16 or model")

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x @ weight.T + bias with this mode's copy of ``weight`` ([out, in]); x [..., in]."""
        if (self.mode == "model" or weight.dim() != 2
                or (self.max_rows is not None and x.numel() > self.max_rows * x.shape[-1])):
            return self.model_linear(x, weight, bias)
        copy = self._copy(weight, bias)
        if self.mode == "fp16":
            w16, b16 = copy
            return F.linear(x.to(torch.float16), w16, b16).to(x.dtype)
        # int8: fbgemm takes fp32 activations and quantizes them itself
        return torch.ops.quantized.linear_dynamic(x.float(), copy, True).to(x.dtype)

    @property
    def copied_bytes(self) -> int:
        return self._copies.nbytes

    def _copy(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        if self.mode == "fp16":
            return self._copies.get(weight, lambda: (weight.detach().to(torch.float16),
                                                     None if bias is None else bias.detach().to(torch.float16)),
                                    weight.numel() * 2)
        return self._copies.get(weight, lambda: _int8_packed(weight.detach().float(),
                                                             None if bias is None else bias.detach().float()),
                                weight.numel())


def _int8_packed(weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """Symmetric per-output-channel int8, packed for PyTorch's dynamic-quantized linear."""
    scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    zero = torch.zeros(weight.shape[0], dtype=torch.int64)
    qweight = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(qweight, bias)
