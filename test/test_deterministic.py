"""Deterministic mode (``--vericache-deterministic``): verify logits are bit-equal to
one-token decode logits, so VeriCache's output equals speculation off with no exception.

Both engines run with the flag (it makes every weight product row-invariant, and each
verify row's attention a decode-shaped call), one with speculation off. For all-greedy
batches SGLang computes the returned logprobs from the logits with the same function
(log_softmax) in decode and in verify, so bit-equal logprobs (the chosen token's and the
top 5 at every step) are a direct check of bit-equal logits.
"""

from __future__ import annotations

import os

import pytest

from prompts import prompt_set
from test_exactness import ENGINE_KW, _input_ids, first_divergence

PROMPTS = prompt_set(1)[:4]
CONFIGS = [("kivi4", 8), ("snapkv", 4), ("quest", 8), ("streamingllm", 1)]
DRAFT_LEN = 8
MAX_NEW = 40


def _run(model_path, spec: bool):
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sglang.srt.entrypoints.engine import Engine

    from sgl_vericache.config import VeriCacheConfig

    VeriCacheConfig(enable=spec, compressor="kivi4", draft_len=DRAFT_LEN, adaptive=False, deterministic=True).to_env()
    kw = dict(speculative_algorithm="VERICACHE", speculative_num_draft_tokens=DRAFT_LEN + 1,
              speculative_ngram_max_bfs_breadth=1, disable_overlap_schedule=True) if spec else {}
    engine = Engine(model_path=str(model_path), **ENGINE_KW, **kw)
    try:
        params = [{"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                   "custom_params": {"vericache_compressor": c, "vericache_draft_len": d}} for c, d in CONFIGS]
        return engine.generate(input_ids=_input_ids(model_path, PROMPTS), sampling_params=params,
                               return_logprob=True, top_logprobs_num=5)
    finally:
        engine.shutdown()
        os.environ.pop("VERICACHE_CONFIG", None)


@pytest.fixture(scope="module")
def runs(default_model_path):
    off = _run(default_model_path, spec=False)  # never two engines alive at once
    on = _run(default_model_path, spec=True)
    return off, on


def test_deterministic_mode_is_bit_exact(runs):
    off, on = runs
    for (name, _), (comp, draft_len), a, b in zip(PROMPTS, CONFIGS, off, on):
        where = f"prompt {name} [{comp}, draft_len={draft_len}]"
        idx = first_divergence(b["output_ids"], a["output_ids"])
        assert idx is None, f"{where}: first divergent index {idx}"
        lp_off = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp_on = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        bad = [i for i, (x, y) in enumerate(zip(lp_off, lp_on)) if x != y]
        assert not bad, f"{where}: logprob not bit-equal at steps {bad[:5]}: {lp_off[bad[0]]!r} vs {lp_on[bad[0]]!r}"
        top_off = [[t[:2] for t in step] for step in a["meta_info"]["output_top_logprobs"]]
        top_on = [[t[:2] for t in step] for step in b["meta_info"]["output_top_logprobs"]]
        assert top_off == top_on, f"{where}: top-5 logprobs not bit-equal"
        assert b["meta_info"]["spec_verify_ct"] < MAX_NEW, f"{where}: no draft was ever accepted"


def test_row_invariant_linear_is_bit_exact_across_row_counts():
    """The kernel behind the mode, on its own: a row's output is the same bits whatever
    the number of rows in the call (plain F.linear is not: MKL picks other GEMM paths),
    for the matmul route (the lm_head) too, and close to F.linear."""
    import torch
    import torch.nn.functional as F

    from sgl_vericache.cpu.row_invariant import row_invariant_linear as _row_invariant_linear
    from sgl_vericache.cpu.row_invariant import row_invariant_mode as _row_invariant_mode

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(1536, 576, generator=g), torch.randn(1536, generator=g)
    x = torch.randn(70, 576, generator=g)
    one = _row_invariant_linear(x[:1], w, b)
    for m in (2, 3, 16, 17, 31, 70):
        assert torch.equal(_row_invariant_linear(x[:m], w, b)[0], one[0]), m
    torch.testing.assert_close(_row_invariant_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    with _row_invariant_mode():
        via_mode = [torch.matmul(x[:m], w.T)[0] for m in (1, 5, 40)]
        via_linear = [F.linear(x[:m], w)[0] for m in (1, 5, 40)]
    assert all(torch.equal(r, via_mode[0]) for r in via_mode + via_linear)
    plain = [F.linear(x[:m], w)[0] for m in (1, 5, 40)]
    print("plain F.linear row-invariant on this CPU:", all(torch.equal(r, plain[0]) for r in plain))


def test_only_draft_passes_skip_the_row_invariant_mode(monkeypatch):
    """The mode wraps every ``ModelRunner.forward`` except the worker's draft passes (their
    tokens are proposals that verify recomputes): a weight product inside forward goes
    through the row-invariant kernel, unless the runtime is drafting."""
    import torch
    import torch.nn.functional as F
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sgl_vericache.cpu import row_invariant
    from sgl_vericache.sglang.linear import install_row_invariant_forward
    from sgl_vericache.sglang.runtime import Runtime

    w, x = torch.randn(8, 4), torch.randn(3, 4)
    calls = []
    kernel = row_invariant.row_invariant_linear
    monkeypatch.setattr(row_invariant, "row_invariant_linear", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(ModelRunner, "forward", lambda self: F.linear(x, w))  # restored afterwards
    runtime = Runtime()
    install_row_invariant_forward(runtime)
    assert getattr(ModelRunner.forward, "_vericache", False)

    ModelRunner.forward(None)  # prefill / decode / verify
    assert len(calls) == 1
    runtime.drafting = True
    out = ModelRunner.forward(None)  # a draft pass: plain F.linear
    assert len(calls) == 1 and torch.equal(out, F.linear(x, w))
