"""The draft kernels' inline PTX (kernels/codes.py, compiled half products), run on
a CPU by a small emulator of the eight PTX instructions it uses, against the Triton code the
interpreter runs: every byte value, every lane.

Inline PTX does not run under Triton's interpreter, so without this the code-decoding
assembly would only ever be checked on a lent GPU. What this cannot check is Triton's side:
how it packs four elements into a register; the compiled kernel checks on a GPU cover that.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from sgl_vericache.kernels import codes as td

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    pool = (a & MASK) | ((b & MASK) << 32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (pool >> (8 * (nib & 7))) & 0xFF
        if nib & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        # the LUT is indexed as in PTX: a -> 0xF0, b -> 0xCC, c -> 0xAA
        out |= ((lut >> idx) & 1) << bit
    return out


def _sub_f16x2(a: int, b: int) -> int:
    lanes = np.array([a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16], dtype=np.uint16).view(np.float16)
    diff = np.array([lanes[0] - lanes[2], lanes[1] - lanes[3]], dtype=np.float16).view(np.uint16)
    return int(diff[0]) | (int(diff[1]) << 16)


def run_ptx(text: str, inputs: list[int], n_out: int) -> list[int]:
    """Execute the asm block: $0..$n_out-1 are outputs, the rest the inputs, b32 (an output
    written as a half of ``mov.b32 {lo, hi}, r`` holds 16 bits)."""
    regs = {f"${n_out + i}": v & MASK for i, v in enumerate(inputs)}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) & MASK if re.match(r"^-?(0x[0-9a-fA-F]+|\d+)$", tok) else regs[tok]

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        split = re.match(r"^\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)$", args.strip())
        if op == "mov.b32" and split:  # {lo, hi}, r: a 32-bit register into two 16-bit halves
            value = val(split.group(3))
            regs[split.group(1)], regs[split.group(2)] = value & 0xFFFF, value >> 16
            continue
        ops = [a.strip() for a in args.split(",")]
        d, src = ops[0], ops[1:]
        if op == "mov.b32":
            regs[d] = val(src[0])
        elif op in ("xor.b32", "and.b32", "or.b32"):
            a, b = val(src[0]), val(src[1])
            regs[d] = a ^ b if op == "xor.b32" else (a & b if op == "and.b32" else a | b)
        elif op == "shr.u32":
            regs[d] = val(src[0]) >> val(src[1])
        elif op == "prmt.b32":
            regs[d] = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "lop3.b32":
            regs[d] = _lop3(val(src[0]), val(src[1]), val(src[2]), val(src[3]))
        elif op == "sub.f16x2":
            regs[d] = _sub_f16x2(val(src[0]), val(src[1]))
        else:
            raise AssertionError(f"the emulator does not know {op!r}: teach it, or the PTX changed")
    return [regs[f"${i}"] for i in range(n_out)]


def _halves(regs: list[int]) -> list[int]:
    """fp16 bit patterns, lane by lane (low half first) of each output register."""
    return [h for r in regs for h in (r & 0xFFFF, r >> 16)]


def _f16_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])


def _fp8_twin(b: int) -> int:
    """_fp8_e4m3_to_f16's bits: the magnitude bits shifted into an fp16, the sign on top."""
    return ((b & 0x7F) << 7) | ((b & 0x80) << 8)


def test_fp8_twin_is_e4m3_over_256():
    """The Triton twin the PTX is held to decodes every finite e4m3 code right (0x7F and
    0xFF are NaN in e4m3fn; the compressor never writes them: it clamps to +-448)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).float() / 256.0
    twin = torch.tensor([_fp8_twin(b) for b in range(256)], dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = torch.isfinite(ref)
    assert int((~finite).sum()) == 2
    assert torch.equal(twin.float()[finite], ref[finite])


def _words():
    """Every byte value in every one of the four lanes of a register."""
    for v in range(256):
        for lane in range(4):
            others = [(v * 37 + 11 * k + lane) & 0xFF for k in range(4)]
            others[lane] = v
            yield others


@pytest.mark.parametrize("ptx, n_out, expect", [
    (td._INT8_F16_PTX, 2, lambda b: [_f16_bits(b - 256 if b > 127 else b)]),
    (td._FP8_F16_PTX, 2, lambda b: [_fp8_twin(b)]),
    (td._KIVI4_F16_PTX, 4, lambda b: [_f16_bits(b & 15), _f16_bits(b >> 4)]),
    (td._KIVI2_F16_PTX, 8, lambda b: [_f16_bits((b >> s) & 3) for s in (0, 2, 4, 6)]),
], ids=["int8", "fp8_e4m3", "kivi_int4", "kivi_int2"])
def test_inline_ptx_decodes_every_byte_like_the_triton_code(ptx, n_out, expect):
    text = ptx.value if hasattr(ptx, "value") else ptx
    outputs_per_value = n_out // 2  # each output tensor takes two registers of four lanes
    for word in _words():
        packed = word[0] | word[1] << 8 | word[2] << 16 | word[3] << 24
        lanes = _halves(run_ptx(text, [packed], n_out))
        for t in range(outputs_per_value):
            got = lanes[4 * t: 4 * t + 4]
            want = [expect(b)[t] for b in word]
            if (np.array(want, dtype=np.uint16).view(np.float16) != 0).any() or got != want:
                # -0.0 and 0.0 decode the same value (fp8 0x80); otherwise bits must match
                g = np.array(got, dtype=np.uint16).view(np.float16).astype(np.float64)
                w = np.array(want, dtype=np.uint16).view(np.float16).astype(np.float64)
                assert np.array_equal(g, w, equal_nan=True), (ptx, word, t, got, want)


@pytest.mark.parametrize("ptx, expect", [
    (td._INT8_WORDS_PTX, lambda b: _f16_bits(b - 256 if b > 127 else b)),
    (td._FP8_WORDS_PTX, _fp8_twin),
], ids=["int8_words", "fp8_words"])
def test_word_ptx_decodes_code_k_of_both_words_into_output_k(ptx, expect):
    """Two 32-bit words in, output k = (code k of word 0, code k of word 1) as fp16 lanes."""
    text = ptx.value if hasattr(ptx, "value") else ptx
    words = list(_words())
    for w0, w1 in zip(words, words[7:] + words[:7]):
        pack = [c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24 for c in (w0, w1)]
        lanes = _halves(run_ptx(text, pack, 4))
        want = [x for k in range(4) for x in (expect(w0[k]), expect(w1[k]))]
        assert lanes == want, (w0, w1, lanes, want)


def test_kivi4_word_ptx_decodes_channel_k_of_a_word_into_output_k():
    """One 32-bit word of KIVI int4 codes in (byte j: channel 2j low nibble, 2j + 1 high),
    eight fp16 outputs, output k = channel k, as _nibble_f16 (the interpreter's twin)."""
    text = td._KIVI4_WORDS_PTX.value
    for codes in _words():
        word = codes[0] | codes[1] << 8 | codes[2] << 16 | codes[3] << 24
        got = run_ptx(text, [word], 8)
        assert got == [_f16_bits((word >> (4 * k)) & 15) for k in range(8)], (codes, got)


def test_emulator_refuses_what_it_does_not_know():
    with pytest.raises(AssertionError, match="does not know"):
        run_ptx("cvt.rn.f16.f32 $0, $1;", [0], 1)
