"""The draft passes' plumbing around SGLang, without an engine: drafts padded to the verify
width, a batch narrowed to the rows that draft or verify (multimodal rotary positions
included), SGLang's fused rotary KV write turned off while drafting, a prefill's prompt
queries captured per request and layer, and the draft weights (fp16 / int8 products)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sgl_vericache.config import VeriCacheConfig, parse_known
from sgl_vericache.mem_cache.compress import get_compressor


def test_pad_drafts_fills_the_verify_width():
    from sgl_vericache.spec.round_batch import pad_drafts as _pad_drafts

    drafts = np.array([[5, 6, 7], [8, 9, 10]])
    out = _pad_drafts(drafts, [1, 3], 5)
    assert out.tolist() == [[5, 5, 5, 5, 5], [8, 9, 10, 10, 10]]


def test_narrow_rows_keeps_only_the_drafting_rows():
    """Staggered verifies: the draft pass runs over the rows that verify this round only."""
    import dataclasses

    from sgl_vericache.sglang.forward import narrow_rows as _narrow_rows

    @dataclasses.dataclass
    class FB:  # the shape of SGLang's ForwardBatch that matters here
        batch_size: int
        req_pool_indices: torch.Tensor
        seq_lens: torch.Tensor
        seq_lens_cpu: torch.Tensor
        seq_lens_sum: int
        rids: list
        weights: torch.Tensor  # not per row: left alone
        scalar: torch.Tensor

    fb = FB(4, torch.tensor([7, 8, 9, 10]), torch.tensor([3, 4, 5, 6]), torch.tensor([3, 4, 5, 6]), 18,
            ["a", "b", "c", "d"], torch.ones(2, 4), torch.tensor(1.0))
    _narrow_rows(fb, [1, 3], 4)
    assert fb.batch_size == 2 and fb.seq_lens_sum == 10
    assert fb.req_pool_indices.tolist() == [8, 10] and fb.seq_lens.tolist() == [4, 6] and fb.rids == ["b", "d"]
    assert fb.weights.shape == (2, 4) and fb.scalar.item() == 1.0


@dataclasses.dataclass
class _VerifyBatch:  # the shape of SGLang's ForwardBatch that narrowing a verify batch reads
    batch_size: int
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    seq_lens_sum: int
    input_ids: torch.Tensor = None
    out_cache_loc: torch.Tensor = None
    num_token_non_padded: torch.Tensor = None
    mrope_positions: torch.Tensor = None


def test_narrow_rows_of_a_verify_batch_keeps_each_rows_tokens():
    """The verify forward of a staggered round: per-row fields by row, per-token fields
    (``width`` tokens a row: ids, positions, write slots) by the kept rows' tokens, and the
    count of real tokens follows."""
    from sgl_vericache.sglang.forward import narrow_rows as _narrow_rows

    width = 3  # 4 rows x 3 tokens; row r's tokens are 10r, 10r+1, 10r+2
    ids = torch.tensor([10 * r + j for r in range(4) for j in range(width)])
    fb = _VerifyBatch(4, torch.tensor([3, 4, 5, 6]), torch.tensor([3, 4, 5, 6]), 18, ids, ids + 100, torch.tensor(12))
    _narrow_rows(fb, [0, 2], 4, width)
    assert fb.batch_size == 2 and fb.seq_lens.tolist() == [3, 5] and fb.seq_lens_sum == 8
    assert fb.input_ids.tolist() == [0, 1, 2, 20, 21, 22]
    assert fb.out_cache_loc.tolist() == [100, 101, 102, 120, 121, 122]
    assert int(fb.num_token_non_padded) == 6


def test_narrow_rows_takes_multimodal_rotary_positions_by_token():
    """``mrope_positions`` is [3, tokens] (temporal, height, width): narrowing takes the kept
    rows' tokens along its second dimension, and never reads its 3 as a row count (a batch
    of 3 rows would otherwise have lost a positional axis)."""
    from sgl_vericache.sglang.forward import narrow_rows as _narrow_rows

    for bs, width, keep in ((3, 1, [0, 2]), (4, 3, [1, 3]), (2, 1, [1])):
        mrope = torch.arange(bs * width)[None, :] + torch.tensor([[0], [100], [200]])
        fb = _VerifyBatch(bs, torch.arange(bs) + 3, torch.arange(bs) + 3, 0, mrope_positions=mrope)
        _narrow_rows(fb, keep, bs, width)
        tokens = [r * width + j for r in keep for j in range(width)]
        assert fb.mrope_positions.tolist() == [tokens, [t + 100 for t in tokens], [t + 200 for t in tokens]], (bs, width)


def test_draft_passes_move_multimodal_rotary_positions_with_each_step(monkeypatch):
    """Qwen2-VL / 2.5-VL / 3-VL and GLM-4.1V read positions from ``mrope_positions`` (3 rows:
    temporal, height, width). A draft step at position p must put each row at p + the
    request's delta (SGLang's ``mrope_position_delta``: how far an image moved its text
    positions; 0 without one), for the round's rows and for one request's teacher-forced
    tokens; before, the steps kept the batch's first positions (wrong drafts), a narrowed
    round kept every row's, and a fetch-drafting row had none. The model runner is stood in
    for by one that records what its forward reads."""
    from types import SimpleNamespace

    from sglang.srt.model_executor import forward_batch_info

    from sgl_vericache.sglang.forward import DraftPasses, mrope_deltas
    from sgl_vericache.sglang.runtime import Runtime

    def mm(delta):
        return SimpleNamespace(mrope_position_delta=None if delta is None else torch.tensor([[delta]]))

    assert mrope_deltas([None, mm(-7), mm(None), mm(12)]) == [0, -7, 0, 12]
    seen = []

    def forward(fb):
        seen.append(fb.mrope_positions.clone())
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=torch.zeros(len(fb.positions), 5)))

    runner = SimpleNamespace(device="cpu", model_config=SimpleNamespace(model_is_mrope=True), forward=forward,
                             req_to_token_pool=None, token_to_kv_pool=None)
    passes = DraftPasses(runner, Runtime(), None)
    fb = passes.one_row(SimpleNamespace(multimodal_inputs=mm(-7)))
    passes.place(fb, 20)
    with passes.run(fb, store=object()) as step:
        step([1, 2, 3], [20, 21, 22], tokens_of_one=True)
        step([4], [23])
    assert [m.tolist() for m in seen] == [[[13, 14, 15]] * 3, [[16]] * 3]

    assert not fb.needs_forward_metadata_init()  # SGLang's own backend does not plan a draft step
    three = passes.one_row()  # a round of three requests, of which rows 0 and 2 draft
    three.spec_info, three.forward_metadata_ready = SimpleNamespace(name="the last round's NgramVerifyInput"), False
    monkeypatch.setattr(forward_batch_info.ForwardBatch, "init_new", staticmethod(lambda *a, **k: three))
    batch = SimpleNamespace(reqs=[0, 1, 2], multimodal_inputs=[None, mm(5), mm(-3)])
    three.batch_size, three.seq_lens = 3, torch.tensor([4, 5, 6])
    fb = passes.for_rows(batch, [0, 2])
    assert fb.spec_info is None and not fb.needs_forward_metadata_init()
    seen.clear()
    with passes.run(fb, store=object()) as step:
        step([1, 2], [40, 50])
    assert seen[0].tolist() == [[40, 47]] * 3
    assert DraftPasses(SimpleNamespace(**{**vars(runner), "model_config": SimpleNamespace()}), Runtime(), None).mrope is False


def test_draft_passes_turn_sglangs_fused_rotary_kv_write_off(monkeypatch):
    """On CUDA with a bfloat16 pool, Qwen3-MoE, gpt-oss and others write K/V inside their
    rotary embedding at the batch's write slots when ``enable_fused_set_kv_buffer`` says so.
    A draft pass has no write slots and writes no pool: while a worker drafts the models are
    told the fused write is off (a module imported before the install included); otherwise
    SGLang's choice stands. The GPU is stood in for by the function's own inputs."""
    from types import SimpleNamespace

    import sglang.srt.models.qwen3_moe as imported_before
    from sglang.srt.models import utils

    from sgl_vericache.sglang.forward import install_unfused_draft_kv
    from sgl_vericache.sglang.runtime import Runtime

    runtime = Runtime()
    install_unfused_draft_kv(runtime)
    import sglang.srt.models.gpt_oss as imported_after

    monkeypatch.setattr(utils, "_is_cuda", True)
    monkeypatch.setattr(utils, "get_token_to_kv_pool", lambda: SimpleNamespace(dtype=torch.bfloat16))
    monkeypatch.setattr(utils, "is_cp_active", lambda fb: False)
    fb = SimpleNamespace(dcp_kv_mask=None)
    for module in (utils, imported_before, imported_after):
        assert module.enable_fused_set_kv_buffer(fb) is True, module.__name__  # SGLang's choice here
        runtime.drafting = True
        assert module.enable_fused_set_kv_buffer(fb) is False, module.__name__
        runtime.drafting = False


def test_prompt_queries_are_captured_per_request_and_layer():
    """A capturing prefill keeps each request's trailing prefill queries (for SnapKV/H2O),
    across chunked prefills, as many as its compressor reads, capped at MAX_CAPTURED_QUERIES."""
    from types import SimpleNamespace

    from sgl_vericache.sglang.attention import capture_queries as _capture_queries
    from sgl_vericache.spec.entry_sync import MAX_CAPTURED_QUERIES, layer_queries as _layer_queries

    captured = {}
    layer = SimpleNamespace(tp_q_head_num=3, qk_head_dim=4, layer_id=1)
    q = torch.arange(5 * 12, dtype=torch.float32).reshape(5, 12)  # 2 + 3 tokens, [tokens, H_q * D]
    every = [MAX_CAPTURED_QUERIES] * 2
    _capture_queries(captured, ["a", "b"], q, layer, SimpleNamespace(extend_seq_lens_cpu=[2, 3]), every)
    assert captured["a"][1].shape == (2, 3, 4)
    torch.testing.assert_close(captured["b"][1], q[2:].reshape(3, 3, 4))
    big = torch.randn(MAX_CAPTURED_QUERIES + 10, 12)
    _capture_queries(captured, ["b"], big, layer, SimpleNamespace(extend_seq_lens_cpu=[big.shape[0]]), every)
    kept = captured["b"][1]
    assert kept.shape[0] == MAX_CAPTURED_QUERIES
    torch.testing.assert_close(kept, big[-MAX_CAPTURED_QUERIES:].reshape(-1, 3, 4))
    # each kept tensor holds its own rows only, not the chunk it was cut from
    assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
    _capture_queries(captured, ["b"], q[:2], layer, SimpleNamespace(extend_seq_lens_cpu=[2]), every)  # a later chunk
    grown = captured["b"][1]
    assert grown.shape[0] == MAX_CAPTURED_QUERIES and grown.untyped_storage().nbytes() == kept.untyped_storage().nbytes()
    torch.testing.assert_close(grown, torch.cat([big[-MAX_CAPTURED_QUERIES + 2:], q[:2]]).reshape(-1, 3, 4))
    _capture_queries(captured, ["c"], big, layer, SimpleNamespace(extend_seq_lens_cpu=[big.shape[0]]), every)
    assert captured["c"][1].untyped_storage().nbytes() == kept.untyped_storage().nbytes()
    # a SnapKV request keeps its observation window (across chunks too), a dropper's nothing
    two = SimpleNamespace(extend_seq_lens_cpu=[big.shape[0] - 7, 7])
    _capture_queries(captured, ["w", "none"], big, layer, two, [32, 0])
    assert "none" not in captured
    torch.testing.assert_close(captured["w"][1], big[-39:-7].reshape(-1, 3, 4))
    _capture_queries(captured, ["w"], q, layer, SimpleNamespace(extend_seq_lens_cpu=[5]), [32])
    torch.testing.assert_close(captured["w"][1], torch.cat([big[-34:-7], q]).reshape(-1, 3, 4))
    per_layer = _layer_queries(captured["a"], num_layers=3)
    assert per_layer[0] is None and per_layer[1].shape == (2, 3, 4)


def test_a_prefill_keeps_the_prompt_queries_its_compressor_reads():
    """SnapKV reads its observation window (32 by default), H2O every query it is given (up
    to MAX_CAPTURED_QUERIES), the others none: a prefill keeps that many of each request on
    the device until its first round (before, 512 of every request in a batch with one such
    request: 128 MiB a request at Llama-3-8B's size)."""
    from types import SimpleNamespace

    from sgl_vericache.spec.entry_sync import MAX_CAPTURED_QUERIES
    from sgl_vericache.spec.round import Speculator

    spec = Speculator.__new__(Speculator)  # only its planner's plans are read
    spec.planner = SimpleNamespace(plan_arriving=lambda reqs: [SimpleNamespace(compressor=get_compressor(
        name, 4.0 if name != "kivi4" else None, **options)) for name, options in reqs])
    reqs = [("snapkv", {}), ("snapkv", {"window_size": 8}), ("h2o", {}), ("streamingllm", {}), ("kivi4", {})]
    assert spec.query_windows(reqs) == [32, 8, MAX_CAPTURED_QUERIES, 0, 0]


def test_capturing_prefills_keep_the_models_own_backend():
    """Capturing prompt queries does not put a wrapper in the model's way: the backend the
    model reaches is SGLang's own object (a model may test its class), its output is its own,
    the queries of extend forwards only are kept, and after the prefill, even one that
    raised, the backend is as it was (no instance attribute left behind)."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context, get_attn_backend

    from sgl_vericache.sglang.attention import capturing_queries

    class TritonLike(AttentionBackend):
        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            return q * 2 + (1 if kwargs.get("sinks") is not None else 0)

    def batch(mode):
        return SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: mode == "extend"),
                               extend_seq_lens_cpu=[2, 1])

    backend, captured = TritonLike(), {}
    layer = SimpleNamespace(tp_q_head_num=1, qk_head_dim=4, layer_id=0)
    q = torch.randn(3, 4)
    with forward_context(ForwardContext(attn_backend=backend)):
        with capturing_queries(backend, captured, ["a", "b"], [8, 8]):
            seen = get_attn_backend()
            assert seen is backend and type(seen) is TritonLike
            torch.testing.assert_close(seen.forward(q, None, None, layer, batch("extend"), sinks=q), q * 2 + 1)
            seen.forward(q + 1, None, None, layer, batch("decode"))  # not a prefill: nothing kept
        torch.testing.assert_close(captured["a"][0], q[:2].reshape(2, 1, 4))
        torch.testing.assert_close(captured["b"][0], q[2:].reshape(1, 1, 4))
        assert "forward" not in vars(backend)
        with pytest.raises(RuntimeError, match="boom"):
            with capturing_queries(backend, captured, ["c"], [8]):
                raise RuntimeError("boom")
        assert "forward" not in vars(backend) and "c" not in captured


@pytest.mark.parametrize("mode, tolerance", [("fp16", 2e-3), ("int8", 3e-2)])
def test_draft_weights_approximate_the_model_product(mode, tolerance):
    """The draft's cheaper weight copies give products close to the model's (relative
    error of the output), made once per weight; 'model' is the product itself."""
    from sgl_vericache.spec.draft_weights import DraftWeights

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g) * 0.05, torch.randn(96, generator=g)
    x = torch.randn(4, 64, generator=g)
    exact = torch.nn.functional.linear(x, w, b)
    dw = DraftWeights(mode)
    out = dw.linear(x, w, b)
    assert out.dtype == x.dtype and out.shape == exact.shape
    err = ((out - exact).norm() / exact.norm()).item()
    assert 0 < err < tolerance, err  # approximate, and not the exact product by accident
    first = dw.copied_bytes
    dw.linear(x, w, b)
    assert first == w.numel() * (2 if mode == "fp16" else 1) and dw.copied_bytes == first  # copied once
    assert torch.equal(DraftWeights("model").linear(x, w, b), exact)


def test_draft_weights_refuse_bad_modes_and_devices():
    from sgl_vericache.spec.draft_weights import DraftWeights

    with pytest.raises(ValueError, match="'int4' is not one of model, fp16, int8"):
        DraftWeights("int4")
    with pytest.raises(ValueError, match="int8 runs on CPU only"):
        DraftWeights("int8").check_device(torch.device("cuda"))
    # a 16-bit model's fp16 copy on a GPU: a second copy of every weight for nothing
    with pytest.raises(ValueError, match="fp16 on a bfloat16 model \\(device cuda:0\\) copies every weight"):
        DraftWeights("fp16").check_device(torch.device("cuda:0"), torch.bfloat16)
    DraftWeights("fp16").check_device(torch.device("cuda:0"), torch.float32)
    DraftWeights("fp16").check_device(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="--vericache-draft-weights .bf8. is not one of auto, model, fp16, int8"):
        VeriCacheConfig(draft_weights="bf8")
    assert parse_known(["--vericache-draft-weights", "int8"])[0].draft_weights == "int8"


def test_draft_weights_auto_is_fp16_for_small_products_of_fp32_models_on_cpus_only():
    from sgl_vericache.spec.draft_weights import AUTO_FP16_MAX_ROWS, DraftWeights, resolve_mode

    assert VeriCacheConfig().draft_weights == "auto"
    assert resolve_mode("auto", torch.float32) == ("fp16", AUTO_FP16_MAX_ROWS)
    assert resolve_mode("auto", torch.float32, "cuda:0") == ("model", None)  # measured on CPUs only
    assert resolve_mode("auto", torch.bfloat16) == ("model", None)
    assert resolve_mode("int8", torch.bfloat16) == ("int8", None)
    assert resolve_mode("fp16", torch.float32) == ("fp16", None)
    # above max_rows the product goes to the engine's own weight path, exactly
    calls = []

    def model_linear(x, w, b=None):
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, w, b)

    dw = DraftWeights("fp16", max_rows=2, model_linear=model_linear)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 8, generator=g)
    small, big = torch.randn(2, 8, generator=g), torch.randn(3, 8, generator=g)
    assert not torch.equal(dw.linear(small, w), torch.nn.functional.linear(small, w))  # the fp16 copy
    assert torch.equal(dw.linear(big, w), torch.nn.functional.linear(big, w)) and calls == [3]
    assert torch.equal(dw.linear(big[None], w), torch.nn.functional.linear(big[None], w)) and calls == [3, 1]
