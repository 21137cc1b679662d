"""Launching SGLang's HTTP server with VeriCache: our config turned into SGLang flags.

Touches ``sglang.launch_server.run_server`` and ``server_args.prepare_server_args`` (the
server), ``sglang.srt.plugins.load_plugins`` (so this process runs ``register_all`` too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgl_vericache.config import VeriCacheConfig

SPEC_ALGORITHM = "VERICACHE"
RADIX_BACKEND = "vericache"
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16")  # SGLang's --kv-cache-dtype values that store floats
SAMPLING_BACKEND = "pytorch"  # the sampler whose draws sampled rounds reproduce (sglang/sampling.py)


def apply_vericache_flags(vc: "VeriCacheConfig", argv: list[str]) -> list[str]:
    """Translate our config into SGLang flags (the speculative algorithm and its width)."""
    if not vc.enable:
        return argv
    for flag in ("--speculative-algorithm", "--speculative-num-draft-tokens"):
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise ValueError(
                f"{flag} is set by VeriCache (use --vericache-draft-len); pass --no-vericache-enable "
                "to use another speculative algorithm"
            )
    kv_dtype = flag_value(argv, "--kv-cache-dtype")
    if kv_dtype is not None and kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_dtype} stores the full KV quantized, which VeriCache's rounds "
                         f"cannot read (they compress and draft from float KV); use one of {', '.join(KV_CACHE_DTYPES)}, or "
                         "pass --no-vericache-enable")
    check_parallelism(False, flag_value(argv, "--pp-size") or flag_value(argv, "--pipeline-parallel-size") or 1,
                      flag_value(argv, "--dcp-size") or flag_value(argv, "--decode-context-parallel-size") or 1,
                      flag_value(argv, "--attn-cp-size") or 1, "--enable-prefill-cp" in argv,
                      "--enable-two-batch-overlap" in argv)
    check_request_entry(flag_value(argv, "--tokenizer-worker-num") or 1,
                        "--smg-grpc-mode" in argv or "--grpc-mode" in argv)
    check_disaggregation(flag_value(argv, "--disaggregation-mode"), "--enable-pdmux" in argv)
    check_routed_experts("--enable-return-routed-experts" in argv)
    check_grammar_backend(flag_value(argv, "--grammar-backend"))
    extra = []
    if vc.full_device_budget >= 0:
        extra = _parking_flags(argv)
    check_graph_flags(argv)
    backend = flag_value(argv, "--sampling-backend")
    check_sampling(backend or SAMPLING_BACKEND, "--enable-custom-logit-processor" in argv)
    if backend is None:
        extra += ["--sampling-backend", SAMPLING_BACKEND]
    if "--disable-cuda-graph" not in argv:
        extra.append("--disable-cuda-graph")  # see check_cuda_graphs
    if "--disable-hybrid-swa-memory" not in argv:
        extra.append("--disable-hybrid-swa-memory")  # see check_kv_pool (no effect on models without windows)
    return argv + extra + [
        "--speculative-algorithm", SPEC_ALGORITHM,
        "--speculative-num-draft-tokens", str(vc.draft_len + 1),
        "--speculative-ngram-max-bfs-breadth", "1",
        "--disable-overlap-schedule",
    ]


def check_cuda_graphs(cuda_graphs: bool, device: str) -> None:
    """VERICACHE runs with CUDA graphs off until a GPU run proves the draft passes safe with
    them: a draft pass is a DECODE forward of the model runner, which SGLang would replay
    from a graph captured with the target's own attention (reading the full KV, or
    crashing) instead of running our draft attention over the compressed KV. The launcher
    passes --disable-cuda-graph; an engine built another way is refused here."""
    if cuda_graphs and str(device).startswith("cuda"):
        raise ValueError("--speculative-algorithm VERICACHE needs --disable-cuda-graph (draft passes would replay "
                         "graphs captured for the target's attention); python -m sgl_vericache.launch_server "
                         "sets it")


def check_graph_flags(argv: list[str]) -> None:
    """SGLang ranks --disable-cuda-graph below its per-phase selectors: a
    ``--cuda-graph-backend-decode full`` (or a ``--cuda-graph-config`` naming a backend) would
    capture graphs anyway. Refused here, before a model loads; the worker checks the engine
    it got too (``check_cuda_graphs``)."""
    import json

    for phase in ("decode", "prefill"):
        flag = f"--cuda-graph-backend-{phase}"
        value = flag_value(argv, flag)
        if value is not None and value != "disabled":
            raise ValueError(f"{flag} {value}: VERICACHE runs with CUDA graphs off (see --disable-cuda-graph); "
                             f"accepted: disabled, or leave the flag out")
    raw = flag_value(argv, "--cuda-graph-config")
    if raw is not None:
        try:
            config = json.loads(raw)
        except ValueError:
            return  # SGLang's own parser names the bad JSON
        phases = config.items() if isinstance(config, dict) else ()
        on = [f"{phase}: {spec.get('backend')}" for phase, spec in phases
              if isinstance(spec, dict) and spec.get("backend", "disabled") != "disabled"]
        if on:
            raise ValueError(f"--cuda-graph-config turns CUDA graphs on ({', '.join(on)}): VERICACHE runs with "
                             "them off; accepted: backend \"disabled\" for every phase, or no backend key")


def check_sampling(backend, custom_logit_processors: bool) -> None:
    """Sampled rounds are exact against SGLang's pytorch sampler only: with it every request
    is drawn from a seed keyed on its position (sglang/sampling.py), which drafts and verify
    reproduce. SGLang's CUDA default, FlashInfer's sampler, ignores ``sampling_seed`` and, when
    a batch holds a min-p request, filters top-k then top-p on the renormalized mass, which the
    sampled verify's target distribution does not follow. The launcher passes
    ``--sampling-backend pytorch``; another backend is refused. Custom logit processors
    (``--enable-custom-logit-processor``) change decode's logits but not verify's (SGLang's
    speculative verify never calls them): refused too, so a request that names one gets
    SGLang's own 400."""
    if backend != SAMPLING_BACKEND:
        raise ValueError(f"--sampling-backend {backend}: VERICACHE's sampled rounds reproduce the {SAMPLING_BACKEND} "
                         f"sampler's seeded draws only; accepted: {SAMPLING_BACKEND} (the launcher's default), or "
                         "pass --no-vericache-enable")
    if custom_logit_processors:
        raise ValueError("--enable-custom-logit-processor: VERICACHE's verify pass does not run custom logit "
                         "processors (no speculative verify in SGLang does), so outputs would differ from "
                         "speculation off; leave the flag out, or pass --no-vericache-enable")


def check_routed_experts(enabled: bool) -> None:
    """``--enable-return-routed-experts`` records each forward's MoE routing at the KV slots
    the forward writes; VERICACHE's draft passes write none (they read the compressed KV),
    and SGLang's recorder fails on them, which would stop the scheduler at the first round.
    Refused at start."""
    if enabled:
        raise ValueError("--enable-return-routed-experts: VERICACHE's draft passes run the model without KV slots, "
                         "which SGLang's routed-experts recorder needs; leave the flag out, or pass "
                         "--no-vericache-enable")


def check_grammar_backend(backend) -> None:
    """SGLang's speculative grammar path (``spec_utils.traverse_tree``) reads every backend's
    vocabulary mask as xgrammar's packed bitmask; outlines' is one bool a token and its
    grammars cannot roll back, so a round would accept tokens the grammar forbids or raise
    ``NotImplementedError`` in the scheduler. Refused at start (xgrammar, the default, and
    llguidance pack their masks alike)."""
    if backend == "outlines":
        raise ValueError("--grammar-backend outlines: SGLang's speculative grammar checks read xgrammar's mask "
                         "layout, which outlines does not use; accepted: xgrammar (the default) or llguidance, or "
                         "pass --no-vericache-enable")


def check_disaggregation(mode, pdmux: bool = False) -> None:
    """Prefill/decode disaggregation: a decode server receives each prompt's KV from another
    server and never runs its prefill, where SnapKV and H2O capture the prompt queries they
    compress with, and SGLang's decode side hands speculative workers state VERICACHE does
    not use. PD multiplexing (``--enable-pdmux``) runs prefills through the target worker's
    split-prefill path, around the VERICACHE worker. Never run with VERICACHE: refused at
    start rather than served untested."""
    if pdmux:
        raise ValueError("--enable-pdmux: VERICACHE has not run with PD multiplexing (its prefills bypass the "
                         "VeriCache worker); serve without it, or pass --no-vericache-enable")
    if mode not in (None, "null"):
        raise ValueError(f"--disaggregation-mode {mode}: VERICACHE has not run with prefill/decode disaggregation; "
                         "serve without it, or pass --no-vericache-enable")


def check_request_entry(tokenizer_workers, grpc_mode: bool) -> None:
    """VeriCache's request checks (``validation``: token ids in the vocabulary, a non-empty
    prompt, top logprobs, VeriCache's own ``custom_params``...) run in SGLang's tokenizer
    manager, where every request arrives. Several tokenizer workers serve HTTP from fresh
    uvicorn processes that never load plugins, and SGLang's gRPC mode builds requests
    without a tokenizer manager: both let through the single requests that stop the
    scheduler. Refused at start."""
    if int(tokenizer_workers or 1) != 1:
        raise ValueError(f"--tokenizer-worker-num {tokenizer_workers}: VeriCache checks requests in SGLang's tokenizer "
                         "manager, which extra tokenizer workers (uvicorn processes that do not load plugins) skip; "
                         "use --tokenizer-worker-num 1")
    if grpc_mode:
        raise ValueError("--smg-grpc-mode / --grpc-mode: VeriCache checks requests in SGLang's tokenizer manager, "
                         "which the gRPC mode's servicer skips; serve HTTP (the native --grpc-port server is fine)")


def check_parallelism(dp_attention: bool, pp_size, dcp_size=1, attn_cp_size=1, prefill_cp: bool = False,
                      two_batch_overlap: bool = False) -> None:
    """Ranks of a VERICACHE worker must run the same forwards: tensor-parallel ranks do (they
    share one schedule and agree on the planner's step times). Attention data parallelism
    gives each rank its own batch, so rounds would differ in rows and draft steps; pipeline
    stages would each need the round's drafts. Context parallelism splits a request's KV
    over ranks (decode: the tokens of position % dcp_size == rank, at slot // dcp_size),
    while verify and the compressors read and write every token at its own slot of one
    pool: wrong KV or out of bounds. Two-batch overlap splits a forward into micro-batches,
    while verify's per-forward state (deferred rows, the token-table rows it read) is the
    whole batch's. None is supported: refused at start."""
    for name, size in (("--dcp-size", dcp_size), ("--attn-cp-size", attn_cp_size)):
        if int(size or 1) != 1:
            raise ValueError(f"--speculative-algorithm VERICACHE does not support context parallelism ({name} "
                             f"{size}): verify and the compressors read each request's whole KV from one pool; "
                             f"use {name} 1 with tensor parallelism (--tp-size)")
    if two_batch_overlap:
        raise ValueError("--speculative-algorithm VERICACHE does not support two-batch overlap "
                         "(--enable-two-batch-overlap): verify reads a forward as one batch; serve without it")
    if prefill_cp:
        raise ValueError("--speculative-algorithm VERICACHE does not support context-parallel prefill "
                         "(--enable-prefill-cp): it has never run with it; serve without it")
    if dp_attention:
        raise ValueError("--speculative-algorithm VERICACHE does not support DP attention (--enable-dp-attention): "
                         "each rank's own batch would draft its own rounds; use tensor parallelism (--tp-size)")
    if int(pp_size or 1) != 1:
        raise ValueError(f"--speculative-algorithm VERICACHE does not support pipeline parallelism (--pp-size "
                         f"{pp_size}); use --pp-size 1 with tensor parallelism (--tp-size)")


def check_deterministic(enabled: bool, device: str) -> None:
    """--vericache-deterministic makes verify logits bit-equal to a decode step's by computing
    each verify row as torch_native's decode attention computes it and every weight product
    through F.linear on 16-row blocks: the CPU engine's kernels. A CUDA engine decodes with
    FlashInfer / FA3 / Triton attention, and its bf16 GEMMs can bypass F.linear, so the flag
    would promise what it does not deliver there (and slow every prefill): refused."""
    if enabled and not str(device).startswith("cpu"):
        raise ValueError(f"--vericache-deterministic runs on the CPU engine (device cpu), not {device}: its "
                         "bit-equal verify reproduces torch_native's decode and F.linear, which a CUDA engine's "
                         "decode does not run; leave it off there (outputs equal speculation off's up to "
                         "near-ties, docs/exactness.md)")


def check_kv_cache_dtype(dtype) -> None:
    """Every round compresses the full KV and the draft's attention reads it in the model's
    float dtypes: a pool stored quantized (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``, CUDA
    only, or ``auto`` resolved to fp8 from a checkpoint) would fail the first round and take
    the scheduler with it. Refused when the worker starts instead."""
    from sgl_vericache.mem_cache.compress.base import SUPPORTED_DTYPES

    accepted = [str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES]
    name = str(dtype).removeprefix("torch.")
    if name not in accepted:
        raise ValueError(f"--speculative-algorithm VERICACHE needs a full KV pool in {', '.join(accepted)}, "
                         f"not {name}; pass --kv-cache-dtype auto (with a float16 / bfloat16 / float32 "
                         "checkpoint) or bfloat16")


def check_kv_pool(pool, req_to_token_pool=None) -> None:
    """Verify and the compressors read every layer's KV through the token table's slots of
    the full pool, as keys and values of one shape, [slots, H_kv, D]. Refused when the
    worker starts, naming what the model has instead (its first request would otherwise
    fail inside a round and take the scheduler with it, or verify would read other KV):

    - a hybrid sliding-window pool (SGLang's SWAKVPool, for models with sliding-window layers
      unless --disable-hybrid-swa-memory) keeps those layers' KV in a pool of its own, at
      other slots. The launcher passes --disable-hybrid-swa-memory (as SGLang itself does for
      Gemma 2 / 3), so its window layers keep their KV in the full pool;
    - linear-attention or state-space layers (a ``mamba_pool``: Qwen3-Next, Nemotron-H,
      Falcon-H1...) keep a recurrent state per request that a draft pass would advance and
      verify cannot roll back;
    - multi-head latent attention (MLA: DeepSeek V2 / V3 / R1, Kimi K2...) keeps one latent
      vector per token whose value is a slice of the key;
    - any other pool whose keys and values are not [slots, H_kv, D] alike."""
    if getattr(pool, "swa_kv_pool", None) is not None:
        raise ValueError(f"--speculative-algorithm VERICACHE does not read a hybrid sliding-window KV pool "
                         f"({type(pool).__name__}: sliding-window layers' KV at slots of their own); pass "
                         "--disable-hybrid-swa-memory")
    if any(getattr(p, "mamba_pool", None) is not None for p in (pool, req_to_token_pool)):
        raise ValueError("--speculative-algorithm VERICACHE cannot serve a model with linear-attention or "
                         f"state-space layers ({type(pool).__name__} with a Mamba state pool): a draft pass would "
                         "advance their recurrent state, which verify does not roll back; serve it with "
                         "--no-vericache-enable")
    if getattr(pool, "kv_lora_rank", None) is not None or getattr(pool, "use_mla", False):
        raise ValueError("--speculative-algorithm VERICACHE does not draft or verify multi-head latent attention "
                         f"(MLA, {type(pool).__name__}: one latent vector per token, the value a slice of the key; "
                         "DeepSeek V2 / V3, Kimi K2): its compressors and verify read keys and values of one "
                         "shape per head; serve it with --no-vericache-enable")
    if not hasattr(pool, "get_key_buffer"):
        return
    start = getattr(pool, "start_layer", 0) or 0
    for layer in range(start, start + getattr(pool, "layer_num", 1)):
        k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        if k.dim() != 3 or tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"--speculative-algorithm VERICACHE reads keys and values of one shape, [slots, H_kv, D]; "
                             f"this model's KV pool ({type(pool).__name__}) holds, at layer {layer}, keys "
                             f"{tuple(k.shape)} and values {tuple(v.shape)}; serve it with --no-vericache-enable")


def flag_value(argv: list[str], flag: str):
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def check_parking_args(backend, page_size) -> None:
    """--vericache-full-device-budget parks through the `vericache` radix backend's release
    hooks and rewrites one-token slots: refuse other backends and pages."""
    if backend != RADIX_BACKEND:
        raise ValueError(f"--vericache-full-device-budget needs --radix-cache-backend {RADIX_BACKEND}, "
                         f"not {backend!r}")
    if str(page_size) != "1":
        raise ValueError(f"--vericache-full-device-budget needs --page-size 1, not {page_size!r}")


def _parking_flags(argv: list[str]) -> list[str]:
    """The flags a server with a full-KV device budget needs (the radix backend, if unset)."""
    backend = flag_value(argv, "--radix-cache-backend")
    check_parking_args(backend or RADIX_BACKEND, flag_value(argv, "--page-size") or 1)
    return [] if backend else ["--radix-cache-backend", RADIX_BACKEND]


def run_http_server(argv: list[str]) -> int:
    """Start SGLang's HTTP server with ``argv`` (SGLang flags only)."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(None, include_parent=False)
    return 0
