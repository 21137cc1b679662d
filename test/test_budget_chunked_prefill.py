"""--vericache-full-device-budget with chunked prefill: prompts longer than the prefill
chunk, three at once, on an engine whose budget keeps each running request's prompt its
own (SGLang's post-chunk publish into the radix tree is skipped until the request
leaves). Token ids equal speculation off with the same chunk size; the prompts were
parked between verifies and loaded back; once the requests left, the tree holds their
prompts (the same prompt again is a prefix hit). Integrity checks run at every idle point."""

import os

import pytest

CHUNK = 64  # prefill chunk (tokens): every prompt below takes four chunks
BUDGET = 64
PARAMS = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
ENGINE_KW = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True, dtype="float32",
                 max_total_tokens=4096, log_level="warning", random_seed=0, chunked_prefill_size=CHUNK,
                 sleep_on_idle=True)


def _prompts(model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    text = "The quick brown fox jumps over the lazy dog near the riverbank while the sun sets. " * 12
    return [tok(f"Document {k}. " + text)["input_ids"] for k in range(3)]


def test_chunked_prompts_are_parked_and_published_when_they_leave(default_model_path, monkeypatch):
    from sgl_vericache.config import VeriCacheConfig

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.setenv("VERICACHE_CHECK_INTEGRITY", "1")
    from sglang.srt.entrypoints.engine import Engine

    prompts = _prompts(default_model_path)
    assert min(len(p) for p in prompts) > 3 * CHUNK
    off = Engine(model_path=str(default_model_path), **ENGINE_KW)
    try:
        reference = [o["output_ids"] for o in off.generate(input_ids=prompts, sampling_params=[PARAMS] * 3)]
    finally:
        off.shutdown()
    saved = os.environ.get("VERICACHE_CONFIG")
    VeriCacheConfig(compressor="kivi4", ratio=4.0, draft_len=8, adaptive=False, full_device_budget=BUDGET).to_env()
    try:
        vc = Engine(model_path=str(default_model_path), **ENGINE_KW, speculative_algorithm="VERICACHE",
                    speculative_num_draft_tokens=9, speculative_ngram_max_bfs_breadth=1,
                    disable_overlap_schedule=True, radix_cache_backend="vericache")
    finally:
        if saved is None:
            os.environ.pop("VERICACHE_CONFIG", None)
        else:
            os.environ["VERICACHE_CONFIG"] = saved
    try:
        outs = vc.generate(input_ids=prompts, sampling_params=[PARAMS] * 3)
        for i, (out, ref) in enumerate(zip(outs, reference)):
            assert out["output_ids"] == ref, f"prompt {i} differs from speculation off"
        state = vc.get_server_info()["internal_states"][0]["vericache"]
        assert state["deferred_rows"] > 0 and state["full_kv_parks"] > 0, state
        # each park holds at least the parked request's prompt (a few tokens may be shared)
        assert state["full_kv_parked_tokens"] >= state["full_kv_parks"] * (min(map(len, prompts)) - 8), state
        assert state["full_kv_loaded_tokens"] == state["full_kv_parked_tokens"], state
        again = vc.generate(input_ids=prompts[0], sampling_params=PARAMS)
        assert again["output_ids"] == reference[0]
        assert again["meta_info"]["cached_tokens"] >= len(prompts[0]) - 1, again["meta_info"]
    finally:
        vc.shutdown()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
