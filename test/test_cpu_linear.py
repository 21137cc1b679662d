"""Prepacked oneDNN weight products (sgl_vericache.cpu.linear) against F.linear, and
their wiring into SGLang's linear layers and lm_head. Fast (no engine)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgl_vericache.cpu import linear as cpu_linear
from sgl_vericache.cpu.linear import PackedLinear, packed_linear_available

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="PyTorch without oneDNN")


@pytest.mark.parametrize("lead", [(1,), (4,), (17,), (3, 5), (68,)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(lead, with_bias):
    g = torch.Generator().manual_seed(len(lead) * 7 + lead[0])
    weight = torch.randn(96, 40, generator=g)
    bias = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(*lead, 40, generator=g)
    packed = PackedLinear()
    out = packed.linear(x, weight, bias)
    assert out.shape == (*lead, 96)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a column slice) gives the same rows
    wide = torch.randn(*lead, 80, generator=g)
    torch.testing.assert_close(packed.linear(wide[..., ::2], weight, bias), F.linear(wide[..., ::2], weight, bias),
                               rtol=1e-5, atol=1e-5)


def test_packs_once_and_repacks_after_a_weight_update():
    weight = torch.randn(32, 16)
    x = torch.randn(4, 16)
    packed = PackedLinear()
    packed.linear(x, weight)
    packed.linear(x, weight)
    assert packed.packed_bytes == weight.numel() * 4  # one copy, made once
    with torch.no_grad():
        weight.mul_(-2.0)  # an in-place update SGLang's weight updater would make
    cpu_linear.weights_updated()  # what the adapter's WeightUpdater hook calls after it
    torch.testing.assert_close(packed.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert packed.packed_bytes == weight.numel() * 4


def test_unserved_inputs_fall_back_to_f_linear():
    packed = PackedLinear()
    for x, w in [(torch.randn(3, 8, dtype=torch.float16), torch.randn(5, 8, dtype=torch.float16)),
                 (torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)),
                 (torch.randn(0, 8), torch.randn(5, 8))]:
        assert not PackedLinear.serves(x, w)
        assert torch.equal(packed.linear(x, w), F.linear(x, w))
    assert packed.packed_bytes == 0


def test_sglang_linear_and_lm_head_use_packed_weights(monkeypatch):
    """With the packed path installed, SGLang's UnquantizedLinearMethod.apply and the
    plain lm_head product go through it (counted), and give F.linear's result."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    from sgl_vericache.sglang.linear import install_weight_products
    from sgl_vericache.sglang.runtime import Runtime

    runtime = Runtime()
    install_weight_products(runtime)
    calls = []

    class Counting(PackedLinear):
        def linear(self, x, weight, bias=None):
            calls.append(tuple(weight.shape))
            return super().linear(x, weight, bias)

    runtime.packed_linear = Counting()
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(24, 12), requires_grad=False)
    x = torch.randn(5, 12)
    out = UnquantizedLinearMethod().apply(layer, x, None)
    torch.testing.assert_close(out, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert calls == [(24, 12)]
    runtime.packed_linear = None  # torch mode: SGLang's own F.linear
    assert torch.equal(UnquantizedLinearMethod().apply(layer, x, None), F.linear(x, layer.weight))
    assert calls == [(24, 12)]


def test_cpu_linear_modes():
    from sgl_vericache.config import VeriCacheConfig
    from sgl_vericache.sglang.linear import install_cpu_linear
    from sgl_vericache.sglang.runtime import Runtime

    runtime = Runtime()
    install_cpu_linear(runtime, "torch")
    assert runtime.packed_linear is None
    install_cpu_linear(runtime, "auto")
    assert isinstance(runtime.packed_linear, PackedLinear)
    with pytest.raises(ValueError, match="--vericache-cpu-linear 'fast' is not one of auto, packed, torch"):
        VeriCacheConfig(cpu_linear="fast")


def test_weight_updater_methods_bump_the_generation():
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from sgl_vericache.sglang.linear import install_weight_update_hook
    from sgl_vericache.sglang.runtime import Runtime

    install_weight_update_hook(Runtime())
    install_weight_update_hook(Runtime())  # idempotent
    for name in ("update_weights_from_disk", "update_weights_from_tensor", "end_weight_update"):
        assert getattr(getattr(WeightUpdater, name), "_vericache", False), name
    before = cpu_linear.weights_generation()
    with pytest.raises(Exception):
        WeightUpdater.update_weights_from_tensor(object(), None)  # fails inside SGLang: still bumps
    assert cpu_linear.weights_generation() == before + 1
