"""From packed codes to floats, in registers: what the draft kernels (triton_decode.py) read
int8, fp8 and KIVI entries with.

Two ways a code becomes a float, both exact and neither a conversion instruction (an int ->
float conversion runs at a quarter of the ALU rate on Hopper, and bounded the first
kernels): in Triton, the code OR'd into the mantissa of a power of two and that power
subtracted (``_codes_float``, ``_int8_codes``, ``_fp8_e4m3_to_f16``: what the interpreter
runs); compiled, the same by inline PTX on four codes a 32-bit register (``*_asm``), checked
on every byte value by test/test_kernel_ptx.py and against the Triton code by the compiled
kernel checks.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_dense(ptr, tok, h, H, valid, D: tl.constexpr):
    """Rows tok (int64 [BN]) of head h of a contiguous [N, H, D] tensor -> [BN, D]."""
    d = tl.arange(0, D)
    return tl.load(ptr + ((tok * H + h) * D)[:, None] + d[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _codes_float(c, HALF: tl.constexpr):
    """Non-negative int32 codes as exact floats without a conversion instruction (int -> float
    runs at a quarter of the ALU rate on Hopper, and was what bounded these kernels): the
    code is OR'd into the mantissa of 2^23 (fp32) or 1024 (fp16, codes < 1024) and that
    power of two subtracted."""
    if HALF:
        return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    else:
        return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


# Inline PTX for compiled half products (ASM): four codes a 32-bit register, turned into
# f16x2 pairs by byte permutes and masks (int8 and KIVI: the 1024 + code trick of
# _codes_float, two lanes an instruction). The interpreter runs the Triton twins
# (_codes_float, _int8_codes, _fp8_e4m3_to_f16); the compiled kernel checks compare both.
_INT8_F16_PTX = tl.constexpr("""{
.reg .b32 x, k, c;
xor.b32 x, $2, 0x80808080;
mov.b32 k, 0x64646464;
prmt.b32 $0, x, k, 0x4140;
prmt.b32 $1, x, k, 0x4342;
mov.b32 c, 0x64806480;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c;
}""")

# fp8 e4m3 -> fp16 equal to the value times 2^-8 (as _fp8_e4m3_to_f16): each byte into the
# high byte of a half, the sign kept at bit 15 and the 7 magnitude bits shifted down by one
_FP8_F16_PTX = tl.constexpr("""{
.reg .b32 t, u, z;
mov.b32 z, 0;
prmt.b32 t, $2, z, 0x1404;
prmt.b32 u, $2, z, 0x3424;
shr.u32 $0, t, 1;
and.b32 $0, $0, 0x3F803F80;
and.b32 t, t, 0x80008000;
or.b32 $0, $0, t;
shr.u32 $1, u, 1;
and.b32 $1, $1, 0x3F803F80;
and.b32 u, u, 0x80008000;
or.b32 $1, $1, u;
}""")

# int8 / fp8 codes read as 32-bit words (four codes each), two words an instance: output k
# is the pair (code k of word 0, code k of word 1). Decoding whole words in the loaded layout
# keeps Triton from moving the decode after the operand shuffle of P @ V, where each code
# would be read from shared memory byte by byte.
def _words_ptx(fmt: str) -> str:
    lines = []
    if fmt == "int8":
        lines += ["xor.b32 a, $4, 0x80808080;", "xor.b32 b, $5, 0x80808080;", "mov.b32 m, 0x00FF00FF;",
                  "mov.b32 o, 0x64006400;", "mov.b32 c, 0x64806480;"]
    for k in range(4):
        if fmt == "int8":  # byte k of both words, under 0x64 high bytes: 1024 + 128 + code
            lines += [f"prmt.b32 t, a, b, {hex((4 + k) * 0x1100 + k * 0x11)};", f"lop3.b32 ${k}, t, m, o, 0xEA;"]
        else:  # byte k of both words into the high byte of each half, then as _FP8_F16_PTX
            lines += [f"prmt.b32 t, $4, $5, {hex(0x4000 + k * 0x1010)};", "shr.u32 s, t, 1;",
                      "and.b32 s, s, 0x3F803F80;", "and.b32 t, t, 0x80008000;", f"or.b32 ${k}, s, t;"]
    if fmt == "int8":
        lines += [f"sub.f16x2 ${k}, ${k}, c;" for k in range(4)]
    regs = ".reg .b32 a, b, t, m, o, c;" if fmt == "int8" else ".reg .b32 t, s;"
    return "\n".join(["{", regs, *lines, "}"])


# KIVI: byte j of a row holds 8 / BITS codes, the first in the low bits; output s (registers
# 2s and 2s + 1) is the code at shift s * BITS of each byte, as fp16
def _kivi_ptx(bits: int) -> str:
    outs = 8 // bits
    mask = (1 << bits) - 1
    lines = ["mov.b32 z, 0;", f"mov.b32 m, 0x{mask | mask << 16:08X};", "mov.b32 o, 0x64006400;",
             f"prmt.b32 u, ${2 * outs}, z, 0x4140;", f"prmt.b32 v, ${2 * outs}, z, 0x4342;"]
    for out in range(outs):  # bytes 0, 1 (from u) and 2, 3 (from v): code at shift out * bits
        for reg, src in ((2 * out, "u"), (2 * out + 1, "v")):
            if out:
                lines.append(f"shr.u32 t, {src}, {out * bits};")
            lines.append(f"lop3.b32 ${reg}, {'t' if out else src}, m, o, 0xEA;")
    lines += [f"sub.f16x2 ${r}, ${r}, o;" for r in range(2 * outs)]
    return "\n".join(["{", ".reg .b32 u, v, t, m, o, z;", *lines, "}"])


# KIVI int4 codes read as 32-bit words (eight codes each: byte j holds channels 2j, low
# nibble, and 2j + 1), one word an instance: the word shifted down by 4 (s) puts each byte's
# high nibble in the low bits of s's byte j, so a permute of byte j of the word and of s into
# bytes 0 and 2, masked under 1024's exponent, is the pair (channel 2j, channel 2j + 1), 1024
# subtracted: outputs 2j and 2j + 1 as fp16 halves, consecutive channels in one register
def _kivi4_words_ptx() -> str:
    lines = ["shr.u32 s, $8, 4;", "mov.b32 m, 0x000F000F;", "mov.b32 o, 0x64006400;"]
    for j in range(4):
        lines += [f"prmt.b32 t, $8, s, {hex((4 + j) * 0x1100 + j * 0x11)};", "lop3.b32 t, t, m, o, 0xEA;",
                  "sub.f16x2 t, t, o;", f"mov.b32 {{${2 * j}, ${2 * j + 1}}}, t;"]
    return "\n".join(["{", ".reg .b32 s, t, m, o;", *lines, "}"])


_KIVI4_WORDS_PTX = tl.constexpr(_kivi4_words_ptx())
_INT8_WORDS_PTX = tl.constexpr(_words_ptx("int8"))
_FP8_WORDS_PTX = tl.constexpr(_words_ptx("fp8"))
_KIVI4_F16_PTX = tl.constexpr(_kivi_ptx(4))
_KIVI2_F16_PTX = tl.constexpr(_kivi_ptx(2))


@triton.jit
def _int8_f16_asm(raw):
    """int8 codes -> exact fp16 (compiled only)."""
    return tl.inline_asm_elementwise(_INT8_F16_PTX, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _fp8_f16_asm(raw):
    """uint8 e4m3 bit patterns -> fp16 of 2^-8 times their value, exactly (compiled only)."""
    return tl.inline_asm_elementwise(_FP8_F16_PTX, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _words_f16_asm(data_ptr, tok, h, H, valid, FMT: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    """[BN, D] int8 / fp8 codes of rows tok as fp16 (fp8: 2^-8 of the value), read as
    32-bit words and decoded four codes a word (compiled only)."""
    w = tl.arange(0, D // 4)
    words = tl.load(data_ptr.to(tl.pointer_type(tl.int32)) + ((tok * H + h) * (D // 4))[:, None] + w[None, :],
                    mask=valid[:, None], other=0)
    if FMT == 2:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(_INT8_WORDS_PTX, "=r,=r,=r,=r,r,r", [words],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=2)
    else:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(_FP8_WORDS_PTX, "=r,=r,=r,=r,r,r", [words],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=2)
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (BN, D))


@triton.jit
def _nibble_f16(words, K: tl.constexpr):
    """Code K (bits 4K .. 4K + 3) of each int32 word as exact fp16."""
    return _codes_float((words >> (4 * K)) & 15, True)


@triton.jit
def _kivi4_words_f16(data_ptr, tok, h, H, valid, BN: tl.constexpr, D: tl.constexpr, PTX: tl.constexpr):
    """[BN, D] KIVI int4 codes of rows tok as fp16, in channel order, read as 32-bit words
    (eight codes each). PTX (compiled): decoded by inline PTX where they are loaded, no byte
    unpacked into a register of its own and packed again; else the same codes in Triton
    (the interpreter's twin: the words' addressing and order checked on a CPU)."""
    w = tl.arange(0, D // 8)
    words = tl.load(data_ptr.to(tl.pointer_type(tl.int32)) + ((tok * H + h) * (D // 8))[:, None] + w[None, :],
                    mask=valid[:, None], other=0)
    if PTX:
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            _KIVI4_WORDS_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        c0, c1, c2, c3 = _nibble_f16(words, 0), _nibble_f16(words, 1), _nibble_f16(words, 2), _nibble_f16(words, 3)
        c4, c5, c6, c7 = _nibble_f16(words, 4), _nibble_f16(words, 5), _nibble_f16(words, 6), _nibble_f16(words, 7)
    # channel 8w + 4i + 2j + l is c_(4i + 2j + l): each join adds the fastest dimension
    x = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(x, (BN, D))


@triton.jit
def _kivi_f16_asm(b, BITS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    """[BN, D*BITS/8] uint8 packed KIVI bytes -> [BN, D] fp16 codes in channel order (compiled
    only; the same join order as _unpack_codes)."""
    if BITS == 4:
        lo, hi = tl.inline_asm_elementwise(_KIVI4_F16_PTX, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=4)
        x = tl.join(lo, hi)
    else:
        s0, s1, s2, s3 = tl.inline_asm_elementwise(_KIVI2_F16_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=4)
        x = tl.join(tl.join(s0, s2), tl.join(s1, s3))
    return tl.reshape(x, (BN, D))


@triton.jit
def _unpack_codes(b, BITS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    """b [BN, D*BITS/8] int32 packed bytes (low bits first) -> [BN, D] codes in channel order."""
    if BITS == 4:
        x = tl.join(b & 15, (b >> 4) & 15)
    elif BITS == 2:
        # byte j holds channels 4j..4j+3 at shifts 0, 2, 4, 6: join orders them (i, k) -> 2i + k
        x = tl.join(tl.join(b & 3, (b >> 4) & 3), tl.join((b >> 2) & 3, (b >> 6) & 3))
    else:
        x = b
    return tl.reshape(x, (BN, D))


@triton.jit
def _gather_codes(data_ptr, tok, h, H, valid, BITS: tl.constexpr, D: tl.constexpr):
    """[BN, D] KIVI codes read in channel order without join / reshape: channel c lies at
    bits (c % (8 // BITS)) * BITS of byte c // (8 // BITS) (each byte is read by every
    channel it holds; those reads hit the same cache line)."""
    d = tl.arange(0, D)
    b = tl.load(data_ptr + ((tok * H + h) * (D * BITS // 8))[:, None] + (d // (8 // BITS))[None, :],
                mask=valid[:, None], other=0)
    return (b.to(tl.int32) >> ((d % (8 // BITS)) * BITS)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _gather_value_scales(s_ptr, z_ptr, tok, h, H, valid, CGROUP: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    """Per-token value scales and zeros broadcast to [BN, D] by gathering (no reshape)."""
    d = tl.arange(0, D)
    off = ((tok * H + h) * (D // CGROUP))[:, None] + (d // CGROUP)[None, :]
    dt = tl.float16 if HALF else tl.float32
    scale = tl.load(s_ptr + off, mask=valid[:, None], other=0.0).to(dt)
    zero = tl.load(z_ptr + off, mask=valid[:, None], other=0.0).to(dt)
    return scale, zero


@triton.jit
def _fp8_e4m3_to_f16(b):
    """uint8 e4m3fn bit patterns -> fp16 equal to the value times 2^-8, exactly: the 7
    magnitude bits shifted into an fp16 land there (normals and subnormals alike)."""
    b = b.to(tl.int32)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _fp8_e4m3_to_f32(b):
    """uint8 e4m3fn bit patterns -> fp32, exactly."""
    return _fp8_e4m3_to_f16(b).to(tl.float32) * 256.0


@triton.jit
def _int8_codes(raw, HALF: tl.constexpr):
    """int8 codes as exact fp32 (HALF: fp16) values, via their offset-binary byte."""
    u = raw.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80  # code + 128
    if HALF:
        return (u | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
    else:
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _load_codes(data_ptr, tok, h, H, valid, FMT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                ASM: tl.constexpr = 0, BN: tl.constexpr = 16):
    """int8 or fp8 codes of rows tok as exact fp32 values (no scale applied); HALF: fp16,
    fp8 ones 2^-8 times the code (the caller multiplies the scale by 256)."""
    if HALF and ASM == 2:
        return _words_f16_asm(data_ptr, tok, h, H, valid, FMT, BN, D)
    raw = _load_dense(data_ptr, tok, h, H, valid, D)
    if FMT == 2 and HALF and ASM:
        return _int8_f16_asm(raw)
    elif FMT == 2:
        return _int8_codes(raw, HALF)
    elif HALF and ASM:
        return _fp8_f16_asm(raw)
    elif HALF:
        return _fp8_e4m3_to_f16(raw)
    else:
        return _fp8_e4m3_to_f32(raw)
