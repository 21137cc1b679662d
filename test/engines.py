"""A CPU engine of the tests' usual shape, speculation off or VERICACHE with a fixed setting
(test_context_limit.py, test_sliding_window.py). Not a pytest module."""

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
                  dtype="float32", max_total_tokens=4096, log_level="warning", **kw)
