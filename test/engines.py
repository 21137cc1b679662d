"""A CPU engine of the tests' usual shape, speculation off or VERICACHE with a fixed setting
(test_context_limit.py), and tiny random-weight models served by it
(test_sliding_window.py, test_attention_sinks.py). Not a pytest module."""

from __future__ import annotations

import os


def cpu_engine(model, vericache=None, **kw):
    """SGLang's CPU engine (torch_native attention, fp32, no CUDA graphs) on ``model``; with
    ``vericache`` (a VeriCacheConfig), VERICACHE verifying draft_len + 1 tokens a round."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sglang.srt.entrypoints.engine import Engine

    if vericache is not None:
        vericache.to_env()
        kw = dict(speculative_algorithm="VERICACHE", speculative_num_draft_tokens=vericache.draft_len + 1,
                  speculative_ngram_max_bfs_breadth=1, disable_overlap_schedule=True, **kw)
    return Engine(model_path=str(model), device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                  dtype="float32", max_total_tokens=4096, log_level="warning", sleep_on_idle=True, **kw)


def save_tiny_model(model, dest, tokenizer_dir) -> None:
    """A random-weight transformers model saved with the default model's tokenizer beside it."""
    import shutil

    model.save_pretrained(dest)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dest / f.name)


def tiny_prompts(lengths) -> list[list[int]]:
    """Token-id prompts of these lengths, varied enough that a tiny model's outputs vary."""
    return [[(i * 37 + 11 * b) % 40000 + 100 for i in range(n)] for b, n in enumerate(lengths)]


def greedy_pair(model_dir, spec: bool, prompts, new: int, **engine_kw):
    """Two greedy requests on a CPU engine (with ``spec``: VERICACHE, streamingllm, draft
    length 8, no adaptive; the second request drafting with the ``full`` compressor, so only
    draft attention that differs from the target's can make its drafts miss): (output ids,
    verify rounds per request, the worker's /server_info internal state)."""
    from sgl_vericache.config import VeriCacheConfig

    engine = cpu_engine(model_dir, VeriCacheConfig(compressor="streamingllm", draft_len=8, adaptive=False)
                        if spec else None, **engine_kw)
    try:
        params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        full = {**params, "custom_params": {"vericache_compressor": "full"}} if spec else params
        outs = engine.generate(input_ids=prompts, sampling_params=[params, full])
        state = engine.get_server_info()["internal_states"][0]
        return [o["output_ids"] for o in outs], [o["meta_info"].get("spec_verify_ct", 0) for o in outs], state
    finally:
        engine.shutdown()
