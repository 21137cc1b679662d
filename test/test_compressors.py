"""KV compressors: registry, sizes and ratios, edge cases, quantization error, Quest page
selection, append consistency. Which tokens the droppers keep, and how: test_droppers.py.
CPU, a few seconds."""

import math

import pytest
import torch

from sgl_vericache.mem_cache.compress import (
    KVCompressor,
    available_compressors,
    causal_attention,
    get_compressor,
    parse_options,
    register_compressor,
)
from sgl_vericache.mem_cache.compress import registry
from sgl_vericache.mem_cache.compress.full import FullCompressor
from sgl_vericache.mem_cache.compress.quant import pack_bits, unpack_bits

QUANTIZERS = ["kivi4", "kivi2", "int8", "fp8"]
DROPPERS = ["streamingllm", "snapkv", "h2o"]
ALL = QUANTIZERS + DROPPERS + ["quest", "full"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
H_KV, H_Q, D = 2, 6, 32
SCALE = 1 / math.sqrt(D)


def make_kv(num_tokens, dtype=torch.float32, seed=0, num_heads=H_KV, head_dim=D):
    """Keys with per-channel offsets (the outlier channels KIVI is built for), plain values."""
    gen = torch.Generator().manual_seed(seed)
    offsets = 3 * torch.randn(1, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_heads, head_dim, generator=gen) + offsets
    v = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    return k.to(dtype), v.to(dtype)


def make_q(num, dtype=torch.float32, seed=1, num_heads=H_Q, head_dim=D):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num, num_heads, head_dim, generator=gen).to(dtype)


def compress(comp, k, v, num_queries=40, seed=1):
    """compress() with the last prompt queries for the methods that want them."""
    num_q, num_heads, head_dim = min(num_queries, k.shape[0]), 3 * k.shape[1], k.shape[2]
    queries = make_q(num_q, k.dtype, seed, num_heads, head_dim) if comp.needs_queries else None
    return comp.compress(k, v, queries)


def rel_err(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


# ---------------------------------------------------------------- registry and validation


def test_registry_lists_every_method():
    assert set(ALL) <= set(available_compressors())
    for name in ALL:
        assert get_compressor(name).name == name


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown compressor 'zip'.*kivi4.*snapkv"):
        get_compressor("zip")


@pytest.mark.parametrize("ratio", [0.5, 0, -2, float("nan"), float("inf"), "4", True])
@pytest.mark.parametrize("name", ["streamingllm", "kivi4"])
def test_invalid_ratio_names_the_range(name, ratio):
    with pytest.raises(ValueError, match=r"ratio=.*accepted: a number in \[1, inf\)"):
        get_compressor(name, ratio)


@pytest.mark.parametrize(
    "name, option, value, accepted",
    [
        ("kivi4", "group_size", 0, "[1, 4096]"),
        ("kivi2", "residual_length", -1, "[0, "),
        ("kivi2", "group_size", 2.5, "an integer"),
        ("snapkv", "pooling", "median", "'maxpool'"),
        ("snapkv", "kernel_size", 4, "odd"),
        ("snapkv", "window_size", 0, "[1, "),
        ("h2o", "heavy_fraction", 1.5, "[0.0, 1.0]"),
        ("quest", "page_size", 0, "[1, 65536]"),
        ("streamingllm", "num_sinks", "x", "an integer"),
        ("streamingllm", "min_budget", 2, "num_sinks"),
        ("fp8", "scale", "channel", "'head', 'token'"),
    ],
)
def test_invalid_option_names_option_and_range(name, option, value, accepted):
    with pytest.raises(ValueError) as info:
        get_compressor(name, **{option: value})
    message = str(info.value)
    assert option in message and accepted in message, message


def test_unknown_option_lists_accepted_options():
    with pytest.raises(ValueError, match="unknown option.*bits.*accepted options: group_size, residual_length"):
        get_compressor("kivi4", bits=3)
    with pytest.raises(ValueError, match="accepted options: none"):
        get_compressor("int8", group_size=32)


def test_options_from_a_command_line_string():
    comp = get_compressor("kivi4", **parse_options("group_size=16, residual_length=0"))
    assert dict(comp.options) == {"group_size": 16, "residual_length": 0}
    assert get_compressor("h2o", 2, **parse_options("heavy_fraction=0.25")).options["heavy_fraction"] == 0.25
    with pytest.raises(ValueError, match="name=value"):
        parse_options("group_size")


def test_ratio_rules():
    assert get_compressor("kivi2", 8).ratio is None  # bits fix a quantizer's ratio
    assert get_compressor("snapkv").ratio == 4.0  # droppers default to 4x
    assert get_compressor("quest", 2).ratio == 2.0


def test_register_external_compressor():
    class Copy(FullCompressor):
        name = "copy-test"

    try:
        register_compressor("copy-test", Copy)
        assert "copy-test" in available_compressors()
        assert isinstance(get_compressor("copy-test"), Copy)
        with pytest.raises(ValueError, match="already registered"):
            register_compressor("copy-test")(FullCompressor)
        with pytest.raises(TypeError):
            register_compressor("not-a-class", object)
    finally:
        registry._REGISTRY.pop("copy-test", None)


def test_bad_inputs_raise():
    comp = get_compressor("int8")
    k, v = make_kv(10)
    with pytest.raises(ValueError, match="k and v"):
        comp.compress(k, v[:5])
    with pytest.raises(ValueError, match="dtype"):
        comp.compress(k.double(), v.double())
    layer = comp.compress(k, v)
    with pytest.raises(ValueError, match="do not match"):
        comp.append(layer, *make_kv(2, num_heads=3))
    with pytest.raises(ValueError, match="E >= S"):
        comp.attend(layer, make_q(3), SCALE, *make_kv(2))
    for name in ["snapkv", "h2o"]:
        with pytest.raises(ValueError, match="queries"):
            get_compressor(name).compress(k, v)
        with pytest.raises(ValueError, match="last W"):
            get_compressor(name).compress(k, v, make_q(11))


# ---------------------------------------------------------------- layout rules


@pytest.mark.parametrize("name, options, head_dim, named", [
    ("kivi4", {"group_size": 48}, 64, ["kivi4: group_size=48 does not divide head_dim=64",
                                       "accepted: a divisor of 64 (1, 2, 4, 8, 16, 32, 64), or 64 and above"]),
    ("kivi4", {"group_size": 3}, 64, ["group_size=3", "head_dim=64"]),
    ("kivi2", {"group_size": 6}, 64, ["kivi2: group_size=6", "head_dim=64"]),
    ("kivi4", {}, 80, ["group_size=32 does not divide head_dim=80", "(1, 2, 4, 5, 8, 10, 16, 20, 40, 80)"]),
    ("kivi4", {}, 112, ["group_size=32 does not divide head_dim=112"]),
    ("kivi4", {}, 120, ["group_size=32 does not divide head_dim=120"]),
    ("kivi2", {"group_size": 1}, 66, ["kivi2: head_dim=66 is not a multiple of 4", "2-bit codes"]),
    ("kivi4", {"group_size": 1}, 65, ["kivi4: head_dim=65 is not a multiple of 2"]),
])
def test_layout_refused_naming_the_value_and_what_is_accepted(name, options, head_dim, named):
    """KIVI's layout rules, checked before a request's first round (where compress raising
    would stop the scheduler): the message names the value and what would be accepted."""
    with pytest.raises(ValueError) as info:
        get_compressor(name, **options).check_layout(2, head_dim)
    for part in named:
        assert part in str(info.value), (part, str(info.value))


@pytest.mark.parametrize("name, options, head_dim", [
    ("kivi4", {"group_size": 16}, 64), ("kivi4", {"group_size": 32}, 64), ("kivi4", {"group_size": 64}, 64),
    ("kivi4", {"group_size": 4096}, 64),  # a group of at least head_dim covers the whole head
    ("kivi4", {"group_size": 16}, 80), ("kivi2", {"group_size": 40}, 120), ("kivi4", {}, 96),
] + [(name, {}, head_dim) for name in ALL if not name.startswith("kivi") for head_dim in (80, 66, 65)])
def test_layout_accepted(name, options, head_dim):
    get_compressor(name, **options).check_layout(2, head_dim)


@pytest.mark.parametrize("name", ALL)
def test_layout_check_agrees_with_compress(name):
    """check_layout passes exactly where compress, append and attend run: every rule that
    only compress() would meet is named up front."""
    settings = [{}] if not name.startswith("kivi") else [
        {"group_size": g, "residual_length": 0} for g in (1, 3, 6, 16, 32, 48, 4096)]
    for options in settings:
        comp = get_compressor(name, **options)
        for head_dim in (16, 64, 65, 66, 80, 120):
            try:
                comp.check_layout(H_KV, head_dim)
                fits = True
            except ValueError:
                fits = False
            k, v = make_kv(100, head_dim=head_dim)
            try:
                layer = compress(comp, k, v)
                layer = comp.append(layer, *make_kv(3, seed=3, head_dim=head_dim))
                comp.attend(layer, make_q(2, head_dim=head_dim), SCALE)
                ran = True
            except ValueError:
                ran = False
            assert fits == ran, (name, options, head_dim, fits, ran)


# ---------------------------------------------------------------- every method: shapes, dtypes, sizes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ALL)
def test_shapes_dtypes_and_sizes(name, dtype):
    comp = get_compressor(name, 4)
    k, v = make_kv(100, dtype)
    layer = compress(comp, k, v)
    layer.check_integrity()
    assert layer.num_tokens == 100 and layer.nbytes() == comp.nbytes_for(100, H_KV, D, dtype)
    keys, values, positions = comp.materialize(layer)
    assert keys.dtype == values.dtype == dtype and keys.shape == values.shape
    assert positions.shape == keys.shape[:2] and positions.dtype == torch.int64
    k_extra, v_extra = make_kv(5, dtype, seed=7)
    out = comp.attend(layer, make_q(3, dtype), SCALE, k_extra, v_extra)
    assert out.shape == (3, H_Q, D) and out.dtype == dtype and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ALL)
def test_empty_context(name):
    comp = get_compressor(name, 4)
    k, v = make_kv(0)
    layer = compress(comp, k, v)
    layer.check_integrity()
    assert layer.num_tokens == 0 and comp.achieved_ratio(layer) == 1.0
    q, (k_extra, v_extra) = make_q(2), make_kv(3, seed=5)
    expected = causal_attention(q, k[:0], v[:0], SCALE, k_extra, v_extra)  # only the extras
    assert torch.equal(comp.attend(layer, q, SCALE, k_extra, v_extra), expected)
    assert torch.equal(comp.attend(layer, q, SCALE), torch.zeros_like(q))  # nothing to attend to
    grown = comp.append(layer, *make_kv(1), make_q(1) if comp.needs_queries else None)
    assert grown.num_tokens == 1 and grown.nbytes() == comp.nbytes_for(1, H_KV, D, torch.float32)


@pytest.mark.parametrize("name", ALL)
def test_one_token_context(name):
    comp = get_compressor(name, 8)
    k, v = make_kv(1)
    layer = compress(comp, k, v)
    keys, values, positions = comp.materialize(layer)
    assert positions.tolist() == [[0] * H_KV]
    if name not in ("int8", "fp8"):  # KIVI keeps it in the recent window; droppers keep it
        assert torch.equal(keys, k) and torch.equal(values, v)
    out = comp.attend(layer, make_q(1), SCALE)  # one key: the output is its value
    assert torch.allclose(out, v.repeat_interleave(H_Q // H_KV, dim=1), rtol=0.07, atol=0.01)


def test_attention_reference_is_causal_gqa():
    k, v = make_kv(7)
    k_extra, v_extra = make_kv(4, seed=3)
    q = make_q(2)
    out = causal_attention(q, k, v, SCALE, k_extra, v_extra)
    for i in range(2):  # query i sees the 7 compressed tokens and extra[: 4 - 2 + i + 1]
        keys, values = torch.cat([k, k_extra[: 3 + i]]), torch.cat([v, v_extra[: 3 + i]])
        for h in range(H_Q):
            kv_head = h // (H_Q // H_KV)
            probs = torch.softmax(keys[:, kv_head] @ q[i, h] * SCALE, 0)
            assert torch.allclose(out[i, h], probs @ values[:, kv_head], atol=1e-5)


@pytest.mark.parametrize("name", ALL)
def test_deterministic(name):
    comp = get_compressor(name, 4)
    k, v = make_kv(150)
    first, second = compress(comp, k, v), compress(comp, k, v)
    assert all(torch.equal(a, b) for a, b in zip(first.tensors(), second.tensors()))
    q, (k_extra, v_extra) = make_q(2), make_kv(2, seed=4)
    assert torch.equal(comp.attend(first, q, SCALE, k_extra, v_extra), comp.attend(second, q, SCALE, k_extra, v_extra))


# ---------------------------------------------------------------- ratios and budgets


@pytest.mark.parametrize("num_tokens", [64, 100, 257, 1000])
@pytest.mark.parametrize("ratio", [2, 4, 8])
@pytest.mark.parametrize("name", DROPPERS)
def test_dropper_ratio_within_granularity(name, ratio, num_tokens):
    comp = get_compressor(name, ratio)
    layer = compress(comp, *make_kv(num_tokens, head_dim=64, num_heads=1), num_queries=32)
    kept = layer.positions.shape[0]
    assert kept == max(math.ceil(num_tokens / ratio), 16)
    if num_tokens >= 16 * ratio:  # above the min_budget floor the ratio is met
        metadata = (8 if comp.scored else 4) / (2 * 64 * 4)  # positions (+ scores) per kept token
        achieved = comp.achieved_ratio(layer)
        assert ratio * (1 - ratio / num_tokens - metadata) <= achieved <= ratio


@pytest.mark.parametrize("num_tokens", [64, 257, 1000])
@pytest.mark.parametrize("ratio", [2, 4, 8])
def test_quest_read_ratio_within_a_page(ratio, num_tokens):
    comp = get_compressor("quest", ratio, min_budget=0)
    layer = comp.compress(*make_kv(num_tokens))
    pages = math.ceil(num_tokens / 16)
    assert comp.pages_read(num_tokens) == math.ceil(pages / ratio)
    read = min(num_tokens, math.ceil(pages / ratio) * 16) + pages  # KV of the pages read + min/max of all
    assert comp.achieved_read_ratio(layer) == pytest.approx(num_tokens / read, rel=1e-9)
    assert 1 / (1 / ratio + 1 / 16 + 33 / num_tokens) <= comp.achieved_read_ratio(layer) <= ratio  # page rounding
    assert comp.achieved_ratio(layer) < 1  # Quest keeps everything plus metadata


@pytest.mark.parametrize("name", ["kivi4", "kivi2", "int8", "fp8"])
def test_quantizer_ratio_follows_bits(name):
    comp = get_compressor(name, residual_length=0) if name.startswith("kivi") else get_compressor(name)
    layer = comp.compress(*make_kv(256, torch.float16, head_dim=64))
    # bits per element vs fp16: codes + fp16 scale and zero per 32 (KIVI) or scale per 64 (int8)
    bits = {"kivi4": 4 + 1, "kivi2": 2 + 1, "int8": 8 + 0.25, "fp8": 8}[name]
    assert comp.achieved_ratio(layer) == pytest.approx(16 / bits, rel=1e-3)


@pytest.mark.parametrize("num_tokens", [1, 10, 16])
@pytest.mark.parametrize("name", DROPPERS + ["quest"])
def test_short_contexts_keep_everything(name, num_tokens):
    comp = get_compressor(name, 8)
    k, v = make_kv(num_tokens)
    layer = compress(comp, k, v)
    keys, values, positions = comp.materialize(layer)
    assert torch.equal(keys, k) and torch.equal(values, v)
    assert positions[:, 0].tolist() == list(range(num_tokens))
    q, (k_extra, v_extra) = make_q(3), make_kv(3, seed=9)
    expected = causal_attention(q, k, v, SCALE, k_extra, v_extra)
    assert torch.allclose(comp.attend(layer, q, SCALE, k_extra, v_extra), expected, atol=1e-6)


# ---------------------------------------------------------------- quantizers


def test_pack_unpack_roundtrip():
    gen = torch.Generator().manual_seed(0)
    for bits in (2, 4):
        codes = torch.randint(0, 2**bits, (5, 3, 16), generator=gen, dtype=torch.uint8)
        packed = pack_bits(codes, bits)
        assert packed.shape == (5, 3, 16 * bits // 8) and torch.equal(unpack_bits(packed, bits), codes)


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_error_within_half_a_step(bits):
    comp = get_compressor(f"kivi{bits}", group_size=32, residual_length=64)
    k, v = make_kv(300)
    layer = comp.compress(k, v)
    num_q = 32 * ((300 - 64) // 32)
    assert layer.quantized_len == num_q == 224
    keys, values, _ = comp.materialize(layer)
    assert torch.equal(keys[num_q:], k[num_q:]) and torch.equal(values[num_q:], v[num_q:])
    levels = 2**bits - 1
    kg = k[:num_q].reshape(-1, 32, H_KV, D)  # keys: per channel over 32 tokens
    k_step = (kg.amax(1, keepdim=True) - kg.amin(1, keepdim=True)) / levels
    k_err = (keys[:num_q].reshape(kg.shape) - kg).abs()
    vg = v[:num_q].reshape(num_q, H_KV, 1, D)  # values: per token over 32 channels
    v_step = (vg.amax(-1, keepdim=True) - vg.amin(-1, keepdim=True)) / levels
    v_err = (values[:num_q].reshape(vg.shape) - vg).abs()
    slack = 2e-3 * (1 + k.abs().amax())  # fp16 scales and zero points
    assert bool((k_err <= 0.5 * k_step * 1.01 + slack).all())
    assert bool((v_err <= 0.5 * v_step * 1.01 + slack).all())


def test_int8_and_fp8_error_bounds():
    k, v = make_kv(200)
    keys, _, _ = get_compressor("int8").materialize(get_compressor("int8").compress(k, v))
    absmax = k.abs().amax(-1, keepdim=True)
    assert bool(((keys - k).abs() <= absmax / 127 * 0.5 * 1.01).all())
    for scale in ("head", "token"):
        comp = get_compressor("fp8", scale=scale)
        keys, _, _ = comp.materialize(comp.compress(k, v))
        # e4m3: 3 mantissa bits -> relative error <= 2^-4; subnormals below 2^-6 * scale
        assert bool(((keys - k).abs() <= 2**-4 * k.abs() + 2**-9 * k.abs().amax() / 448 * 8).all())


def _quantized_errors():
    k, v = make_kv(512, head_dim=64)
    q, (k_extra, v_extra) = make_q(4, head_dim=64), make_kv(4, seed=3, head_dim=64)
    ref = causal_attention(q, k, v, 1 / 8, k_extra, v_extra)
    errors = {}
    for name in QUANTIZERS:
        comp = get_compressor(name, residual_length=0) if name.startswith("kivi") else get_compressor(name)
        layer = comp.compress(k, v)
        keys, values, _ = comp.materialize(layer)
        kv_err = rel_err(torch.cat([keys, values]), torch.cat([k, v]))
        errors[name] = kv_err, rel_err(comp.attend(layer, q, 1 / 8, k_extra, v_extra), ref)
    return errors


def test_quantizer_error_decreases_with_bits():
    errors = _quantized_errors()
    kv = {name: e[0] for name, e in errors.items()}
    attn = {name: e[1] for name, e in errors.items()}
    assert kv["kivi2"] > kv["kivi4"] > max(kv["int8"], kv["fp8"])
    assert attn["kivi2"] > attn["kivi4"] > max(attn["int8"], attn["fp8"])
    # attention output vs full attention
    assert attn["int8"] < 0.015 and attn["fp8"] < 0.05 and attn["kivi4"] < 0.07 and attn["kivi2"] < 0.35


def test_fp8_head_scale_fixed_at_prefill_saturates_later_outliers():
    comp = get_compressor("fp8")
    k, v = make_kv(20)
    layer = comp.compress(k, v)
    big = 10 * k.abs().amax()
    grown = comp.append(layer, torch.full((1, H_KV, D), float(big)), v[:1])
    assert torch.equal(grown.k_scale, layer.k_scale)
    assert float(comp.materialize(grown)[0][-1].max()) <= float(k.abs().amax()) * 1.001
    token_scaled = get_compressor("fp8", scale="token")
    grown = token_scaled.append(token_scaled.compress(k, v), torch.full((1, H_KV, D), float(big)), v[:1])
    assert float(token_scaled.materialize(grown)[0][-1].max()) == pytest.approx(float(big), rel=0.07)


# ---------------------------------------------------------------- Quest


def _spiky_keys(num_tokens, spikes, num_heads=1, head_dim=8, seed=0):
    """Small random keys, except that key `pos` of head `h` points along axis 0 for each
    (pos, h, strength) in spikes; queries along axis 0 then attend there."""
    gen = torch.Generator().manual_seed(seed)
    k = 0.1 * torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    for pos, head, strength in spikes:
        k[pos, head, 0] = strength
    v = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    return k, v


def _axis_queries(num, num_heads=2, head_dim=8, strength=4.0):
    q = torch.zeros(num, num_heads, head_dim)
    q[..., 0] = strength
    return q


def test_quest_page_bound_is_an_upper_bound():
    comp = get_compressor("quest", 4)
    k, v = make_kv(200)
    layer = comp.compress(k, v)
    q = make_q(3)
    bounds = comp.page_scores(layer, q)  # [S, H_q, P]
    exact = torch.einsum("shd,nhd->shn", q, k.repeat_interleave(H_Q // H_KV, dim=1))
    padded = torch.cat([exact, exact[..., -1:].expand(-1, -1, 13 * 16 - 200)], -1)
    page_max = padded.reshape(3, H_Q, 13, 16).amax(-1)
    assert bool((bounds >= page_max - 1e-4).all())


def test_quest_reads_the_best_page():
    k, v = _spiky_keys(128, [(37, 0, 3.0)])  # 8 pages; the spike lives in page 2
    comp = get_compressor("quest", 8, min_budget=0)  # one page per step
    layer = comp.compress(k, v)
    q = _axis_queries(2, num_heads=2)
    k_extra, v_extra = _spiky_keys(2, [], seed=5)
    expected = causal_attention(q, k[32:48], v[32:48], 0.3, k_extra, v_extra)
    assert torch.allclose(comp.attend(layer, q, 0.3, k_extra, v_extra), expected, atol=1e-6)
    dense = get_compressor("quest", 1)
    full = causal_attention(q, k, v, 0.3, k_extra, v_extra)
    assert torch.allclose(dense.attend(dense.compress(k, v), q, 0.3, k_extra, v_extra), full, atol=1e-6)


def test_quest_chooses_per_kv_head_unless_asked_per_query_head():
    """Two query heads of one KV head want different pages (a strong spike in page 2 along
    axis 0, a weaker one in page 5 along axis 1): heads="kv" reads the page with the larger
    bound for both, heads="query" gives each head its own; one query head a KV
    head makes them the same."""
    k, v = _spiky_keys(128, [(37, 0, 3.0)])  # 8 pages of 16
    k[90, 0, 1] = 2.0
    q = torch.zeros(1, 2, 8)
    q[0, 0, 0] = q[0, 1, 1] = 4.0
    page = lambda n: torch.arange(128) // 16 == n  # noqa: E731
    by_kv = get_compressor("quest", 8, min_budget=0)  # one page per step
    by_query = get_compressor("quest", 8, min_budget=0, heads="query")
    layer = by_kv.compress(k, v)
    chosen = by_kv.selected_tokens(layer, q)[:, 0]  # [H_q, T]
    assert torch.equal(chosen[0], page(2)) and torch.equal(chosen[1], page(2))
    chosen = by_query.selected_tokens(layer, q)[:, 0]
    assert torch.equal(chosen[0], page(2)) and torch.equal(chosen[1], page(5))
    largest = by_query.page_scores(layer, q).amax(1)  # [S, P]: what heads="kv" ranks by
    assert torch.equal(by_kv.choice_scores(layer, q)[:, 0], largest)
    one = q[:, :1]  # MHA: the two choices agree
    assert torch.equal(by_kv.selected_tokens(layer, one), by_query.selected_tokens(layer, one))
    with pytest.raises(ValueError, match="heads='group'.*'kv', 'query'"):
        get_compressor("quest", 4, heads="group")


# ---------------------------------------------------------------- append consistency


def _split_appends(comp, k, v, queries=None):
    """compress(k[:37]) then append the rest in chunks of 1, 5 and 64 tokens."""
    cuts = [37, 38, 43, 107, k.shape[0]]
    q = (lambda a, b: queries[a:b]) if queries is not None else (lambda a, b: None)
    layer = comp.compress(k[:37], v[:37], q(0, 37))
    for start, end in zip(cuts, cuts[1:]):
        layer = comp.append(layer, k[start:end], v[start:end], q(start, end))
        layer.check_integrity()
        assert layer.nbytes() == comp.nbytes_for(end, H_KV, D, k.dtype)
    return layer


@pytest.mark.parametrize("name", ["kivi4", "kivi2", "int8", "streamingllm", "quest", "full"])
def test_append_equals_compress_for_query_agnostic_methods(name):
    comp = get_compressor(name, 4, **({"residual_length": 32} if name.startswith("kivi") else {}))
    k, v = make_kv(300)
    whole, pieces = comp.compress(k, v), _split_appends(comp, k, v)
    assert whole.num_tokens == pieces.num_tokens == 300
    assert all(torch.equal(a, b) for a, b in zip(whole.tensors(), pieces.tensors()))


@pytest.mark.parametrize("name", ["snapkv", "h2o", "fp8"])
def test_append_behaves_like_compress_for_stateful_methods(name):
    comp = get_compressor(name, 4)
    k, v = make_kv(300)
    queries = make_q(300)
    whole = comp.compress(k, v, queries if comp.needs_queries else None)
    pieces = _split_appends(comp, k, v, queries if comp.needs_queries else None)
    assert whole.nbytes() == pieces.nbytes()
    if comp.needs_queries:  # both keep the recent window
        recent = set(range(300 - comp.recent_len(comp.budget(300)), 300))
        assert recent <= set(whole.positions[:, 0].tolist()) and recent <= set(pieces.positions[:, 0].tolist())
    q, (k_extra, v_extra) = make_q(2, seed=11), make_kv(2, seed=12)
    ref = causal_attention(q, k, v, SCALE, k_extra, v_extra)
    whole_err = rel_err(comp.attend(whole, q, SCALE, k_extra, v_extra), ref)
    piece_err = rel_err(comp.attend(pieces, q, SCALE, k_extra, v_extra), ref)
    assert piece_err < 2 * whole_err + 0.05, (whole_err, piece_err)


def test_entries_are_values():
    comp = get_compressor("kivi4", residual_length=8)
    k, v = make_kv(40)
    layer = comp.compress(k, v)
    before = [t.clone() for t in layer.tensors()]
    comp.append(layer, *make_kv(30, seed=2))
    assert layer.num_tokens == 40 and all(torch.equal(a, b) for a, b in zip(before, layer.tensors()))


def test_compressor_is_the_interface():
    for name in ALL:
        comp = get_compressor(name)
        assert isinstance(comp, KVCompressor) and isinstance(comp.needs_queries, bool)
    assert get_compressor("snapkv").query_window == 32 and get_compressor("h2o").query_window is None
