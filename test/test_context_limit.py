"""Drafts and verifies at the end of the model's context (issue 29).

A round verifies its root and drafts at positions ``seq_len .. seq_len + width - 1``; near
the context's end those would pass the model's last position (its rotary table ends there:
an index error in the scheduler, the whole server down). The round's draft lengths are cut
so that every position stays inside the context. Here the default model is served with a
320-token context (its config's ``max_position_embeddings``), and three requests, two of
them (one greedy, one with seeded sampling) with prompt + ``max_new_tokens`` exactly the
context length, decode together to their last token: token ids equal speculation off.

The sampled one also walks into SGLang 0.5.23's own crash near the context's end: a decode
reserves 2 x the draft tokens of KV past a request's committed length, but its
request-to-token row had only 4 + the draft tokens past the context (an IndexError in the
scheduler; ``scheduler.install_context_end_headroom``). Greedy decoding's accepted lengths
here happen to step over that window; seeded sampling at temperature 0.9 does not.
"""

from __future__ import annotations

import json

CONTEXT = 320
GREEDY = {"temperature": 0, "ignore_eos": True}
SAMPLED = {"temperature": 0.9, "sampling_seed": 11, "ignore_eos": True}


def _short_context_model(model_path, tmp_path):
    """The default model's files, its config saying ``CONTEXT`` positions."""
    short = tmp_path / "smollm2-320"
    short.mkdir()
    for f in model_path.iterdir():
        if f.name != "config.json":
            (short / f.name).symlink_to(f)
    config = json.loads((model_path / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (short / "config.json").write_text(json.dumps(config))
    return short


def _generate(model, prompts, spec):
    from sgl_vericache.config import VeriCacheConfig

    from engines import cpu_engine

    engine = cpu_engine(model, VeriCacheConfig(compressor="streamingllm", draft_len=16, adaptive=False)
                        if spec else None)
    try:
        assert engine.tokenizer_manager.context_len == CONTEXT
        params = [{**kind, "max_new_tokens": CONTEXT - len(p) - extra}
                  for p, kind, extra in zip(prompts, (GREEDY, GREEDY, SAMPLED), (0, 40, 0))]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        state = engine.get_server_info()["internal_states"][0]
        cut = state.get("vericache", {}).get("context_limited_rounds")
        if spec:  # read once SGLang built the pool (the GPU kernels' warm-up needs it; nothing compiles on CPU)
            assert state["vericache_kernels"]["head_layout"].startswith(
                "HeadLayout(num_q_heads=9, num_kv_heads=3, head_dim=64"), state.get("vericache_kernels")
            # the KV budget was split before the pool was built (scheduler.install_draft_memory_reserve):
            # streamingllm's entries and, on CPU's dense path, its buffers keep a quarter of the full KV each
            assert state["vericache_windows"] == {"layers": 0, "windows": [], "drafts": "none"}, state
            memory = state["vericache_memory"]
            assert memory["compressors"] == ["streamingllm"] and 0.25 <= memory["entry_fraction"] < 0.26, memory
            assert memory["buffer_fraction"] == 0.25 and memory["prefix_cache_bytes"] == 512 << 20, memory
            split = memory["pool_bytes"] * (1 + memory["entry_fraction"] + 0.25) + (512 << 20)
            assert abs(split - memory["budget_bytes"]) < 1e-4 * memory["budget_bytes"], memory
        return [o["output_ids"] for o in outs], [o["meta_info"].get("spec_verify_ct", 0) for o in outs], cut
    finally:
        engine.shutdown()


def test_rounds_at_the_end_of_the_context_stay_inside_it(default_model_path, tmp_path):
    from transformers import AutoTokenizer

    model = _short_context_model(default_model_path, tmp_path)
    tok = AutoTokenizer.from_pretrained(model)
    text = ("The tile cache daemon keeps a journal per shard and batches its writes; a torn entry is caught by "
            "its checksum and skipped. ") * 12
    ids = tok(text)["input_ids"]
    prompts = [ids[:270], ids[:230], ids[:270]]  # 270 + 50 new = the context; 230 + 50 new ends 40 short of it
    ref, _, _ = _generate(model, prompts, spec=False)
    ours, rounds, cut = _generate(model, prompts, spec=True)
    # SGLang ends the first at the context's end (a couple of tokens before prompt +
    # max_new_tokens: its own margin), the second at max_new_tokens
    assert len(ref[0]) >= 45 and len(prompts[0]) + len(ref[0]) >= CONTEXT - 4 and len(ref[1]) == 50, \
        [len(o) for o in ref]
    assert len(ref[2]) == len(ref[0]), [len(o) for o in ref]  # sampled, to the same end
    assert ours == ref, [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(ours, ref)]
    assert all(0 < r < 50 for r in rounds[:2]) and 0 < rounds[2] <= 50, rounds  # it speculated
    assert cut and cut >= 1, cut  # the last rounds drafted less, to stay inside the context
