"""GPU launch hazards (issue 29), decided on any machine and, where CUDA exists, run there.

- CUDA graphs stay off with VeriCache on: a draft pass is a DECODE forward SGLang would
  replay from a graph captured for the target's attention. The launcher adds
  --disable-cuda-graph; an engine built another way with graphs on a CUDA device is refused.
- A sampled round keeps its generator and tensors on the logits' device.
- The adaptive planner's step times wait for the device: on CUDA a host clock read right
  after a forward times its launches (``spec.round_batch.device_clock``).

Imports nothing from SGLang, so scripts/gpu_check.sh can run it on a bare GPU machine.
"""

from __future__ import annotations

import contextlib
import re

import torch

try:
    import pytest
except ImportError:  # a bare GPU machine without pytest runs this file as a script (scripts/gpu_check.sh)
    pytest = None

from sgl_vericache.config import VeriCacheConfig
from sgl_vericache.sglang.server import (apply_vericache_flags, check_cuda_graphs, check_deterministic,
                                         check_kv_cache_dtype, check_kv_pool, check_parallelism, check_sampling)
from sgl_vericache.spec.round_batch import device_clock
from sgl_vericache.spec.sampled_round import SampledRound


def test_the_launcher_turns_cuda_graphs_off_with_vericache_on():
    argv = apply_vericache_flags(VeriCacheConfig(), ["--model-path", "m"])
    assert argv.count("--disable-cuda-graph") == 1
    assert apply_vericache_flags(VeriCacheConfig(), ["--disable-cuda-graph"]).count("--disable-cuda-graph") == 1
    # speculation off: SGLang's own choice stands
    assert "--disable-cuda-graph" not in apply_vericache_flags(VeriCacheConfig(enable=False), ["--model-path", "m"])


def test_the_launcher_refuses_graph_flags_that_outrank_disable_cuda_graph():
    """SGLang lets its per-phase graph selectors win over --disable-cuda-graph: a decode
    graph would be replayed for the draft passes and verify."""
    vc = VeriCacheConfig()
    with _raises(ValueError, "--cuda-graph-backend-decode full: VERICACHE runs with CUDA graphs off"):
        apply_vericache_flags(vc, ["--cuda-graph-backend-decode", "full"])
    with _raises(ValueError, "--cuda-graph-backend-prefill breakable"):
        apply_vericache_flags(vc, ["--cuda-graph-backend-prefill=breakable"])
    with _raises(ValueError, r"--cuda-graph-config turns CUDA graphs on \(decode: full\)"):
        apply_vericache_flags(vc, ["--cuda-graph-config", '{"decode": {"backend": "full", "max_bs": 8}}'])
    for fine in (["--cuda-graph-backend-decode", "disabled"], ["--cuda-graph-config", '{"decode": {"max_bs": 8}}']):
        assert apply_vericache_flags(vc, fine).count("--disable-cuda-graph") == 1
    # speculation off: SGLang's own choice stands
    assert apply_vericache_flags(VeriCacheConfig(enable=False), ["--cuda-graph-backend-decode", "full"])


def test_the_launcher_samples_with_the_pytorch_sampler_and_no_logit_processors():
    """Sampled rounds reproduce the pytorch sampler's seeded draws; SGLang's CUDA default
    (FlashInfer's sampler) ignores seeds and filters min-p batches another way, and custom
    logit processors are not run by verify: the launcher picks pytorch, refuses the rest,
    and the worker refuses an engine built another way."""
    argv = apply_vericache_flags(VeriCacheConfig(), ["--model-path", "m"])
    at = argv.index("--sampling-backend")
    assert argv[at + 1] == "pytorch" and argv.count("--sampling-backend") == 1
    assert apply_vericache_flags(VeriCacheConfig(), ["--sampling-backend", "pytorch"]).count("--sampling-backend") == 1
    for bad in (["--sampling-backend", "flashinfer"], ["--sampling-backend=flashinfer"]):
        with _raises(ValueError, "--sampling-backend flashinfer: VERICACHE's sampled rounds.*accepted: pytorch"):
            apply_vericache_flags(VeriCacheConfig(), bad)
    with _raises(ValueError, "--enable-custom-logit-processor: VERICACHE's verify pass does not run"):
        apply_vericache_flags(VeriCacheConfig(), ["--enable-custom-logit-processor"])
    off = apply_vericache_flags(VeriCacheConfig(enable=False), ["--sampling-backend", "flashinfer",
                                                                "--enable-custom-logit-processor"])
    assert "--sampling-backend" in off and off.count("--sampling-backend") == 1  # speculation off: SGLang's choice
    check_sampling("pytorch", False)
    with _raises(ValueError, "--sampling-backend flashinfer"):
        check_sampling("flashinfer", False)
    with _raises(ValueError, "--enable-custom-logit-processor"):
        check_sampling("pytorch", True)


def test_the_launcher_refuses_routed_experts_recording():
    """SGLang's routed-experts recorder reads each forward's KV slots, which draft passes do
    not have: the first round would stop the scheduler. Refused at launch and by the worker."""
    from sgl_vericache.sglang.server import check_routed_experts

    with _raises(ValueError, "--enable-return-routed-experts: VERICACHE's draft passes"):
        apply_vericache_flags(VeriCacheConfig(), ["--enable-return-routed-experts"])
    assert "--enable-return-routed-experts" in apply_vericache_flags(VeriCacheConfig(enable=False),
                                                                   ["--enable-return-routed-experts"])
    check_routed_experts(False)
    with _raises(ValueError, "--enable-return-routed-experts"):
        check_routed_experts(True)


def test_the_launcher_refuses_the_outlines_grammar_backend():
    """SGLang's speculative grammar checks read xgrammar's packed mask; outlines' bool mask
    and missing rollback would accept forbidden tokens or raise in the scheduler."""
    from sgl_vericache.sglang.server import check_grammar_backend

    with _raises(ValueError, "--grammar-backend outlines: SGLang's speculative grammar checks"):
        apply_vericache_flags(VeriCacheConfig(), ["--grammar-backend", "outlines"])
    apply_vericache_flags(VeriCacheConfig(), ["--grammar-backend", "xgrammar"])
    for backend in (None, "xgrammar", "llguidance", "none"):
        check_grammar_backend(backend)


def test_the_launcher_refuses_disaggregation():
    """Prefill/decode disaggregation has never run with VERICACHE (a decode server runs no
    prefill, where SnapKV / H2O capture their queries): refused, not served untested."""
    from sgl_vericache.sglang.server import check_disaggregation

    for mode in ("decode", "prefill"):
        with _raises(ValueError, f"--disaggregation-mode {mode}: VERICACHE has not run"):
            apply_vericache_flags(VeriCacheConfig(), ["--disaggregation-mode", mode])
    apply_vericache_flags(VeriCacheConfig(), ["--disaggregation-mode", "null"])
    check_disaggregation("null")
    check_disaggregation(None)
    # PD multiplexing runs prefills around the VERICACHE worker (its split-prefill path)
    with _raises(ValueError, "--enable-pdmux: VERICACHE has not run"):
        apply_vericache_flags(VeriCacheConfig(), ["--enable-pdmux"])
    with _raises(ValueError, "--enable-pdmux"):
        check_disaggregation(None, True)


def test_the_launcher_refuses_entries_that_skip_the_tokenizer_managers_checks():
    """Extra tokenizer workers (uvicorn processes that never load plugins) and SGLang's gRPC
    mode take requests without the tokenizer manager, where the request checks run: the
    single requests that stop a scheduler (out-of-vocabulary ids, an empty prompt) got through."""
    from sgl_vericache.sglang.server import check_request_entry

    for argv in (["--tokenizer-worker-num", "4"], ["--tokenizer-worker-num=2"]):
        with _raises(ValueError, "--tokenizer-worker-num [24]: VeriCache checks requests"):
            apply_vericache_flags(VeriCacheConfig(), argv)
    for flag in ("--smg-grpc-mode", "--grpc-mode"):
        with _raises(ValueError, "gRPC mode's servicer skips"):
            apply_vericache_flags(VeriCacheConfig(), [flag])
    apply_vericache_flags(VeriCacheConfig(), ["--tokenizer-worker-num", "1", "--grpc-port", "30001"])
    check_request_entry(1, False)
    with _raises(ValueError, "--tokenizer-worker-num 3"):
        check_request_entry(3, False)


def test_the_launcher_keeps_window_layers_kv_in_the_full_pool():
    """gpt-oss, Granite-SWA, MiMo-V2, Llama 4, Gemma 4 get SGLang's hybrid sliding-window pool
    by default, which verify cannot read (check_kv_pool refuses it once the model is loaded):
    the launcher asks for one pool up front, once, and leaves speculation-off servers alone."""
    argv = apply_vericache_flags(VeriCacheConfig(), ["--model-path", "m"])
    assert argv.count("--disable-hybrid-swa-memory") == 1
    assert apply_vericache_flags(VeriCacheConfig(), ["--disable-hybrid-swa-memory"]).count(
        "--disable-hybrid-swa-memory") == 1
    assert "--disable-hybrid-swa-memory" not in apply_vericache_flags(VeriCacheConfig(enable=False), ["--model-path", "m"])


def test_a_vericache_worker_refuses_cuda_graphs_on_cuda():
    with _raises(ValueError, "VERICACHE needs --disable-cuda-graph"):
        check_cuda_graphs(True, "cuda")
    with _raises(ValueError, "needs --disable-cuda-graph"):
        check_cuda_graphs(True, "cuda:1")
    check_cuda_graphs(False, "cuda")
    check_cuda_graphs(True, "cpu")  # no graphs exist on a CPU device


def test_a_vericache_worker_refuses_deterministic_mode_off_the_cpu_engine():
    """Bit-equal verify reproduces torch_native's decode and F.linear: a CUDA engine's decode
    runs neither."""
    with _raises(ValueError, "--vericache-deterministic runs on the CPU engine \\(device cpu\\), not cuda:0"):
        check_deterministic(True, "cuda:0")
    check_deterministic(True, "cpu")
    check_deterministic(False, "cuda")


def test_a_vericache_worker_refuses_a_quantized_full_kv_pool():
    """--kv-cache-dtype fp8_* (CUDA only) stores the pool in fp8: rounds compress and read it
    as the model's float dtypes, so the worker refuses it at start, naming what it accepts."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        check_kv_cache_dtype(dtype)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        name = str(dtype).removeprefix("torch.")
        with _raises(ValueError, f"in float32, bfloat16, float16, not {name}; pass --kv-cache-dtype auto"):
            check_kv_cache_dtype(dtype)
    # the launcher refuses the flag before a model loads
    for value in ("fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4", "fp4_mx_block16"):
        with _raises(ValueError, f"--kv-cache-dtype {value} stores the full KV quantized.*auto, bf16, bfloat16"):
            apply_vericache_flags(VeriCacheConfig(), ["--kv-cache-dtype", value])
    for value in ("auto", "bf16", "bfloat16"):
        apply_vericache_flags(VeriCacheConfig(), [f"--kv-cache-dtype={value}"])
    assert apply_vericache_flags(VeriCacheConfig(enable=False), ["--kv-cache-dtype", "fp8_e4m3"])  # off: SGLang's


def test_a_vericache_worker_refuses_a_hybrid_sliding_window_pool():
    """Sliding-window layers' KV in a pool of its own (SGLang's SWAKVPool) sits at slots the
    token table does not give: verify would read other tokens. Refused at start, naming the
    flag that keeps one pool; a plain pool passes."""
    from types import SimpleNamespace

    class SWAKVPool:
        swa_kv_pool = object()

    with _raises(ValueError, "hybrid sliding-window KV pool \\(SWAKVPool.*--disable-hybrid-swa-memory"):
        check_kv_pool(SWAKVPool())
    check_kv_pool(SimpleNamespace(k_buffer=[]))
    check_kv_pool(SimpleNamespace(swa_kv_pool=None))


def test_a_vericache_worker_refuses_dp_attention_and_pipeline_stages():
    """Every rank of a VERICACHE worker must run the same forwards: tensor parallelism does;
    DP attention (a batch a rank) and pipeline stages are refused, at start and by the
    launcher."""
    check_parallelism(False, 1)
    check_parallelism(False, "1")
    with _raises(ValueError, "does not support DP attention"):
        check_parallelism(True, 1)
    with _raises(ValueError, r"does not support pipeline parallelism \(--pp-size 2\)"):
        check_parallelism(False, 2)
    for flag in ("--pp-size", "--pipeline-parallel-size"):
        with _raises(ValueError, "pipeline parallelism"):
            apply_vericache_flags(VeriCacheConfig(), [flag, "4"])
    apply_vericache_flags(VeriCacheConfig(), ["--tp-size", "8", "--pp-size", "1"])
    # context parallelism splits a request's KV over ranks (decode: every dcp_size-th token)
    for argv in (["--dcp-size", "2"], ["--decode-context-parallel-size", "4"], ["--attn-cp-size", "2"]):
        with _raises(ValueError, "does not support context parallelism"):
            apply_vericache_flags(VeriCacheConfig(), argv)
    with _raises(ValueError, "context-parallel prefill"):
        apply_vericache_flags(VeriCacheConfig(), ["--enable-prefill-cp"])
    check_parallelism(False, 1, 1, 1, False)
    with _raises(ValueError, r"\(--dcp-size 2\)"):
        check_parallelism(False, 1, 2)
    # two-batch overlap hands verify micro-batches; its per-forward state is the whole batch's
    with _raises(ValueError, "does not support two-batch overlap"):
        apply_vericache_flags(VeriCacheConfig(), ["--enable-two-batch-overlap"])
    with _raises(ValueError, "two-batch overlap"):
        check_parallelism(False, 1, two_batch_overlap=True)


class _Params:
    """Per-row sampling parameters as SGLang's SamplingBatchInfo holds them."""

    def __init__(self, rows, device, seeded):
        self.temperatures = torch.full((rows, 1), 0.8, device=device)
        self.top_ks = torch.full((rows,), 40, dtype=torch.int32, device=device)
        self.top_ps = torch.full((rows,), 0.95, device=device)
        self.min_ps = torch.zeros(rows, device=device)
        self.sampling_seed = torch.arange(rows, dtype=torch.int64, device=device) + 7 if seeded else None
        self.need_top_p_sampling = self.need_top_k_sampling = True
        self.need_min_p_sampling = False


def _engine_draw(logits, params, repeat, positions):
    assert logits.device == positions.device == params.temperatures.device, "a draw across devices"
    return torch.argmax(logits, dim=-1)  # stands in for SGLang's seeded sampler (the seam's engine_draw)


def _sampled_round_on(device):
    rows, vocab, n = 3, 50, 4
    params = _Params(rows, device, seeded=True)
    rnd = SampledRound(params, seeded=[True, False, False], rows=[0, 1, 2], engine_draw=_engine_draw,
                       rng=torch.Generator().manual_seed(0))
    gen = torch.Generator(device=device).manual_seed(1)
    drafts = []
    for step in range(n - 1):
        logits = torch.randn(rows, vocab, device=device, generator=gen)
        tokens = rnd.draw(logits, torch.full((rows,), 10 + step, device=device))
        assert tokens.device == logits.device and tokens.dtype == torch.int64
        drafts.append(tokens)
    roots = torch.zeros(rows, 1, dtype=torch.int64, device=device)
    candidates = torch.cat([roots, torch.stack(drafts, 1)], 1)
    verify_logits = torch.randn(rows, n, vocab, device=device, generator=gen)
    positions = torch.arange(n, device=device).repeat(rows, 1) + 10
    num_acc, tokens = rnd.accept(candidates, verify_logits, positions, skip=[2])
    assert num_acc.device == tokens.device == verify_logits.device
    assert int(num_acc[2]) == 0 and bool((tokens[2] == -1).all())  # a skipped row accepts nothing
    for b in range(2):
        k = int(num_acc[b])
        assert 0 <= k <= n - 1 and bool((tokens[b, : k + 1] >= 0).all()) and bool((tokens[b, k + 1:] == -1).all())
    return rnd


def test_a_sampled_round_on_cpu():
    rnd = _sampled_round_on("cpu")
    assert rnd._generators == {}  # the CPU generator itself served


def _gpu(test):
    return pytest.mark.gpu(test) if pytest is not None else test


@contextlib.contextmanager
def _raises(kind, pattern):
    try:
        yield
    except kind as exc:
        assert re.search(pattern, str(exc)), (pattern, str(exc))
    else:
        raise AssertionError(f"{kind.__name__} matching {pattern!r} not raised")


@_gpu
def test_a_sampled_round_keeps_its_tensors_on_the_gpu():
    rnd = _sampled_round_on("cuda")
    assert [d.type for d in rnd._generators] == ["cuda"]  # one generator, seeded from the CPU one


def test_the_step_clock_waits_for_the_current_cuda_stream_only_on_cuda():
    calls = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            calls.append(self.device)

    real = torch.cuda.current_stream
    torch.cuda.current_stream = Stream  # stands in on a machine without CUDA
    try:
        device_clock(torch.device("cpu"))
        device_clock(None)
        assert calls == []
        device_clock(torch.device("cuda", 1))
        device_clock("cuda")
        assert calls == [torch.device("cuda", 1), "cuda"]
    finally:
        torch.cuda.current_stream = real


@_gpu
def test_gpu_the_step_clock_counts_queued_kernels():
    torch.cuda.synchronize()
    t0 = device_clock("cuda")
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU clock, queued: the host goes on at once
    assert device_clock("cuda") - t0 > 0.02, "the clock did not wait for the queued kernel"


if __name__ == "__main__":  # without pytest: every test here, the GPU one where CUDA exists
    for name, test in list(globals().items()):
        if name.startswith("test_") and ("gpu" not in name or torch.cuda.is_available()):
            test()
            print("passed", name)
