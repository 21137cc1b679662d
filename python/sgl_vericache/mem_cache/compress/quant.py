"""Quantizers: KIVI int4/int2, int8, fp8 e4m3.

The bit width fixes the ratio: the `ratio` a user passes is checked (>= 1) and otherwise
ignored (`compressor.ratio` is None); `achieved_ratio(layer)` reports what the entry really takes, scales and zero
points (stored as fp16, as KIVI's kernels do) and the full-precision window included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import CompressedLayer, KVCompressor, OptionSpec, check_append, check_kv
from .registry import register_compressor
from .rows import append_rows

META_DTYPE = torch.float16  # scales and zero points
FP8_MAX = 448.0  # largest finite float8_e4m3fn


# ---------------------------------------------------------------- asymmetric integer codes


def quantize_asym(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max asymmetric quantization reducing over `dim` (kept as size 1).
    Returns (codes uint8 in [0, 2^bits - 1], scale fp16, zero fp16)."""
    levels = 2**bits - 1
    xf = x.float()
    zero = xf.amin(dim, keepdim=True).to(META_DTYPE)
    span = xf.amax(dim, keepdim=True) - zero.float()
    scale = (span / levels).to(META_DTYPE)
    inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    codes = (xf - zero.float()).mul_(inv).round_().clamp_(0, levels)  # in place: one temporary
    return codes.to(torch.uint8), scale, zero


def dequantize_asym(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float() + zero.float()


def dequantize_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
    """out[...] = dequantize_asym(codes, scale, zero) in out's dtype: the same fp32 products
    and sums, computed in place where out is fp32 (a first round dequantizes whole prompts)."""
    work = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    work.copy_(codes)
    work.mul_(scale.float()).add_(zero.float())
    if work is not out:
        out.copy_(work)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] uint8 codes < 2^bits -> [..., D * bits / 8] uint8 (low bits first)."""
    per_byte = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    # OR of shifted uint8 codes (they never overlap), not a sum in int32: a prompt's first
    # compress packs every code, and the widening copies cost as much as the quantizing
    packed = grouped[..., 0].clone()
    for i in range(1, per_byte):
        packed |= grouped[..., i] << (i * bits)
    return packed


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed[..., None] >> shifts) & (2**bits - 1)  # uint8 throughout: no widening copies
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


# ---------------------------------------------------------------- KIVI


@dataclass
class KiviLayer(CompressedLayer):
    # Tq = quantized tokens (a multiple of group_size), R = full-precision recent tokens
    k_codes: torch.Tensor  # [Tq, H, D*bits/8] uint8, per-channel groups along tokens
    k_scale: torch.Tensor  # [Tq/G, H, D] fp16
    k_zero: torch.Tensor  # [Tq/G, H, D] fp16
    v_codes: torch.Tensor  # [Tq, H, D*bits/8] uint8, per-token groups along channels
    v_scale: torch.Tensor  # [Tq, H, D/Gv] fp16
    v_zero: torch.Tensor  # [Tq, H, D/Gv] fp16
    k_recent: torch.Tensor  # [R, H, D] layer.dtype
    v_recent: torch.Tensor  # [R, H, D]

    def tensors(self):
        return (self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero,
                self.k_recent, self.v_recent)

    @property
    def quantized_len(self) -> int:
        return self.k_codes.shape[0]

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self.quantized_len + self.k_recent.shape[0] == self.num_tokens
        assert self.k_recent.shape == self.v_recent.shape and self.v_codes.shape == self.k_codes.shape


class KiviCompressor(KVCompressor):
    """KIVI (Liu et al., ICML 2024): asymmetric low-bit codes, keys per channel (groups of
    `group_size` tokens), values per token (groups of `group_size` channels), the most
    recent tokens in full precision.

    Tokens [0, Tq) are quantized with Tq = group_size * floor(max(0, T - residual_length) /
    group_size), so the full-precision window holds residual_length .. residual_length +
    group_size - 1 tokens (everything when T <= residual_length). Because Tq depends only
    on T, compress(all) and compress(prefix) + append(rest) give bit-identical entries.
    """

    bits: int
    grows_in_place = True  # the quantized groups; the full-precision window is small
    option_specs = (
        OptionSpec("group_size", 32, "tokens per key group and channels per value group", 1, 4096),
        OptionSpec("residual_length", 128, "recent tokens kept in full precision (at least)", 0, 1 << 20),
    )

    def quantized_len(self, num_tokens: int) -> int:
        group = self.options["group_size"]
        return group * (max(0, num_tokens - self.options["residual_length"]) // group)

    def check_layout(self, num_kv_heads, head_dim):
        """A value's scale covers ``group_size`` channels of a head (the whole head when the
        group is at least head_dim), and codes are packed 8 // bits to a byte along it."""
        per_byte = 8 // self.bits
        if head_dim % per_byte:
            raise ValueError(f"{self.name}: head_dim={head_dim} is not a multiple of {per_byte} ({self.bits}-bit codes "
                             f"are packed {per_byte} to a byte along a head); accepted: a head_dim that is a multiple "
                             f"of {per_byte}; use another compressor (int8, fp8, a token dropper) for this model")
        group = self.options["group_size"]
        if head_dim % min(group, head_dim):
            divisors = ", ".join(str(d) for d in range(1, head_dim + 1) if head_dim % d == 0)
            raise ValueError(f"{self.name}: group_size={group} does not divide head_dim={head_dim} (a value's scale "
                             f"covers group_size channels of a head); accepted: a divisor of {head_dim} "
                             f"({divisors}), or {head_dim} and above")

    def compress(self, k, v, queries=None):
        check_kv(k, v)
        num_tokens, num_heads, head_dim = k.shape
        self.check_layout(num_heads, head_dim)
        empty = self._quantize(k[:0], v[:0])
        layer = KiviLayer(0, num_heads, head_dim, k.dtype, *empty, k[:0].clone(), v[:0].clone())
        return self.append(layer, k, v)

    def append(self, layer, k, v, queries=None):
        check_append(layer, k, v)
        # a first compress reads the prompt where it lies: copying it whole into the recent
        # window first was a third of compress(); the clones below keep the entry a value
        fresh = layer.k_recent.shape[0] == 0
        k_recent = k if fresh else torch.cat([layer.k_recent, k])
        v_recent = v if fresh else torch.cat([layer.v_recent, v])
        num_tokens = layer.num_tokens + k.shape[0]
        flush = self.quantized_len(num_tokens) - layer.quantized_len  # a multiple of group_size
        merged = (layer.k_codes, layer.k_scale, layer.k_zero, layer.v_codes, layer.v_scale, layer.v_zero)
        if flush:  # otherwise the quantized tensors are shared: entries are never modified
            new = self._quantize(k_recent[:flush], v_recent[:flush])
            merged = [b if not a.shape[0] else append_rows(a, b) for a, b in zip(merged, new)]
        return KiviLayer(num_tokens, layer.num_kv_heads, layer.head_dim, layer.dtype, *merged,
                         k_recent[flush:].clone(), v_recent[flush:].clone())

    def _quantize(self, k, v):
        """k, v: [Tq, H, D] with Tq a multiple of group_size -> the six quantized tensors."""
        num_tokens, num_heads, head_dim = k.shape
        group, vgroup = self.options["group_size"], min(self.options["group_size"], head_dim)
        kg = k.reshape(num_tokens // group, group, num_heads, head_dim)
        k_codes, k_scale, k_zero = quantize_asym(kg, dim=1, bits=self.bits)  # reduce over tokens
        vg = v.reshape(num_tokens, num_heads, head_dim // vgroup, vgroup)
        v_codes, v_scale, v_zero = quantize_asym(vg, dim=3, bits=self.bits)  # reduce over channels
        k_codes = pack_bits(k_codes.reshape(num_tokens, num_heads, head_dim), self.bits)
        v_codes = pack_bits(v_codes.reshape(num_tokens, num_heads, head_dim), self.bits)
        return (k_codes, k_scale.squeeze(1), k_zero.squeeze(1), v_codes, v_scale.squeeze(-1), v_zero.squeeze(-1))

    def materialize(self, layer):
        k, v = self.materialize_tail(layer, 0)
        return k, v, _dense_positions(layer.num_tokens, layer.num_kv_heads, k.device)

    def materialize_tail(self, layer, start):
        group = self.options["group_size"]
        if start % group or start > layer.quantized_len:  # not on a group boundary of the codes
            return super().materialize_tail(layer, start)
        num_q, num_heads, head_dim = layer.quantized_len - start, layer.num_kv_heads, layer.head_dim
        vgroup = min(group, head_dim)
        g0 = start // group
        # dequantized straight into the output, the recent window after: no concatenation
        k = layer.k_recent.new_empty((num_q + layer.k_recent.shape[0], num_heads, head_dim))
        v = torch.empty_like(k)
        k_codes = unpack_bits(layer.k_codes[start:], self.bits).reshape(num_q // group, group, num_heads, head_dim)
        dequantize_into(k[:num_q].view(k_codes.shape), k_codes, layer.k_scale[g0:, None], layer.k_zero[g0:, None])
        v_codes = unpack_bits(layer.v_codes[start:], self.bits).reshape(num_q, num_heads, head_dim // vgroup, vgroup)
        dequantize_into(v[:num_q].view(v_codes.shape), v_codes, layer.v_scale[start:, ..., None],
                        layer.v_zero[start:, ..., None])
        k[num_q:] = layer.k_recent
        v[num_q:] = layer.v_recent
        return k, v

    def stable_rows(self, old, new):
        return old.quantized_len  # quantized groups never change; the recent window does

    def nbytes_for(self, num_tokens, num_kv_heads, head_dim, dtype):
        num_q = self.quantized_len(num_tokens)
        group, vgroup = self.options["group_size"], min(self.options["group_size"], head_dim)
        meta = META_DTYPE.itemsize
        codes = 2 * num_q * num_kv_heads * head_dim * self.bits // 8
        k_meta = 2 * (num_q // group) * num_kv_heads * head_dim * meta
        v_meta = 2 * num_q * num_kv_heads * (head_dim // vgroup) * meta
        recent = 2 * (num_tokens - num_q) * num_kv_heads * head_dim * dtype.itemsize
        return codes + k_meta + v_meta + recent


@register_compressor("kivi4")
class Kivi4Compressor(KiviCompressor):
    name = "kivi4"
    bits = 4


@register_compressor("kivi2")
class Kivi2Compressor(KiviCompressor):
    name = "kivi2"
    bits = 2


def _dense_positions(num_tokens: int, num_heads: int, device) -> torch.Tensor:
    return torch.arange(num_tokens, device=device)[:, None].expand(num_tokens, num_heads)


# ---------------------------------------------------------------- int8


@dataclass
class Int8Layer(CompressedLayer):
    k_codes: torch.Tensor  # [T, H, D] int8
    v_codes: torch.Tensor  # [T, H, D] int8
    k_scale: torch.Tensor  # [T, H, 1] fp16, absmax / 127 per token and head
    v_scale: torch.Tensor  # [T, H, 1] fp16

    def tensors(self):
        return (self.k_codes, self.v_codes, self.k_scale, self.v_scale)


def quantize_sym_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(token, head) int8: x [T, H, D] -> (codes [T, H, D], scale [T, H, 1])."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127).to(META_DTYPE)
    inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    return (xf * inv).round().clamp_(-127, 127).to(torch.int8), scale


@register_compressor("int8")
class Int8Compressor(KVCompressor):
    """Symmetric int8 with one fp16 scale per token and head (~1.9x vs fp16, ~3.9x vs fp32)."""

    name = "int8"
    grows_in_place = True

    def compress(self, k, v, queries=None):
        check_kv(k, v)
        num_heads, head_dim = k.shape[1:]
        empty = Int8Layer(0, num_heads, head_dim, k.dtype, *self._codes(k[:0], v[:0]))
        return self.append(empty, k, v)

    def _codes(self, k, v):
        (kc, ks), (vc, vs) = quantize_sym_int8(k), quantize_sym_int8(v)
        return kc, vc, ks, vs

    def append(self, layer, k, v, queries=None):
        check_append(layer, k, v)
        merged = [append_rows(a, b) for a, b in zip(layer.tensors(), self._codes(k, v))]
        return Int8Layer(layer.num_tokens + k.shape[0], layer.num_kv_heads, layer.head_dim, layer.dtype, *merged)

    def materialize(self, layer):
        k, v = self.materialize_tail(layer, 0)
        return k, v, _dense_positions(layer.num_tokens, layer.num_kv_heads, k.device)

    def materialize_tail(self, layer, start):
        k = (layer.k_codes[start:].float() * layer.k_scale[start:].float()).to(layer.dtype)
        v = (layer.v_codes[start:].float() * layer.v_scale[start:].float()).to(layer.dtype)
        return k, v

    def stable_rows(self, old, new):
        return old.num_tokens  # each token is coded on its own, once

    def nbytes_for(self, num_tokens, num_kv_heads, head_dim, dtype):
        return 2 * num_tokens * num_kv_heads * (head_dim + META_DTYPE.itemsize)


# ---------------------------------------------------------------- fp8 e4m3


@dataclass
class Fp8Layer(CompressedLayer):
    k_codes: torch.Tensor  # [T, H, D] float8_e4m3fn
    v_codes: torch.Tensor  # [T, H, D] float8_e4m3fn
    k_scale: torch.Tensor  # [H, 1] fp32 ("head") or [T, H, 1] fp32 ("token")
    v_scale: torch.Tensor

    def tensors(self):
        return (self.k_codes, self.v_codes, self.k_scale, self.v_scale)


@register_compressor("fp8")
class Fp8Compressor(KVCompressor):
    """FP8 e4m3 codes with fp32 scales. scale="head" (default): one scale per KV head set
    from the first non-empty compress/append (absmax / 448) and kept fixed, as FlashInfer's
    per-layer k/v scales are; later values beyond it saturate at +-448 * scale.
    scale="token": one scale per token and head, never saturates (~1.88x vs fp16)."""

    name = "fp8"
    grows_in_place = True
    option_specs = (OptionSpec("scale", "head", "scale granularity", choices=("head", "token")),)

    def compress(self, k, v, queries=None):
        check_kv(k, v)
        num_heads, head_dim = k.shape[1:]
        codes = torch.empty(0, num_heads, head_dim, dtype=torch.float8_e4m3fn, device=k.device)
        scale_shape = (0, num_heads, 1) if self.options["scale"] == "token" else (0, 1)
        scale = torch.empty(scale_shape, dtype=torch.float32, device=k.device)
        return self.append(Fp8Layer(0, num_heads, head_dim, k.dtype, codes, codes, scale, scale), k, v)

    def append(self, layer, k, v, queries=None):
        check_append(layer, k, v)
        k_scale, k_new_scale = self._scales(layer.k_scale, k)
        v_scale, v_new_scale = self._scales(layer.v_scale, v)
        k_codes = append_rows(layer.k_codes, _to_fp8(k, k_new_scale))
        v_codes = append_rows(layer.v_codes, _to_fp8(v, v_new_scale))
        return Fp8Layer(layer.num_tokens + k.shape[0], layer.num_kv_heads, layer.head_dim, layer.dtype,
                        k_codes, v_codes, k_scale, v_scale)

    def _scales(self, stored: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the entry's scale tensor after the append, the scale to encode x with)."""
        absmax = x.float().abs().amax(-1, keepdim=True)  # [n, H, 1]
        if self.options["scale"] == "token":
            new = (absmax / FP8_MAX).clamp_min(1e-12)
            return append_rows(stored, new), new
        if stored.shape[0] > 0 or x.shape[0] == 0:
            return stored, stored
        new = (absmax.amax(0) / FP8_MAX).clamp_min(1e-12)  # [H, 1]
        return new, new

    def materialize(self, layer):
        if layer.num_tokens == 0:  # the head scale is not set yet
            empty = layer.k_codes.to(layer.dtype)
            return empty, empty, _dense_positions(0, layer.num_kv_heads, empty.device)
        k, v = self.materialize_tail(layer, 0)
        return k, v, _dense_positions(layer.num_tokens, layer.num_kv_heads, k.device)

    def materialize_tail(self, layer, start):
        if layer.num_tokens == 0:
            return super().materialize_tail(layer, start)
        k_scale = layer.k_scale if layer.k_scale.dim() == 2 else layer.k_scale[start:]  # "head": [H, 1]
        v_scale = layer.v_scale if layer.v_scale.dim() == 2 else layer.v_scale[start:]
        k = (layer.k_codes[start:].float() * k_scale).to(layer.dtype)
        v = (layer.v_codes[start:].float() * v_scale).to(layer.dtype)
        return k, v

    def stable_rows(self, old, new):
        # codes are per token; the head scale is fixed by the first non-empty append
        return old.num_tokens

    def nbytes_for(self, num_tokens, num_kv_heads, head_dim, dtype):
        per_token = self.options["scale"] == "token"
        scales = (num_tokens if per_token else int(num_tokens > 0)) * num_kv_heads * 4
        return 2 * (num_tokens * num_kv_heads * head_dim + scales)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 0:
        return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
