"""An analytic (roofline) cost model of decoding with full KV and with VeriCache.

Every forward pass costs  max(bytes / mem_bw, flops / flop_rate)  plus a fixed overhead;
bytes = weights + the KV it reads (+ its new KV), flops = 2 x params x tokens + attention.
A KV that lives in host memory also crosses the host link; with ``overlap`` the transfer
runs beside the compute (layer-wise prefetch for full KV; VeriCache's staggering, where a
request's full KV streams in while the others draft) and the pass costs the larger of the
two, else their sum. Device memory capacity caps the batch each arm can hold.

Arms (``predict``):
  full_resident        full KV in device memory; batch capped by capacity.
  full_offloaded       full KV in host memory, streamed over the host link at EVERY step.
  vericache_resident   compressed + full KV both in device memory; drafts read the
                       compressed one, verify reads the full one (no host link).
  vericache_offloaded  compressed KV in device memory, full KV in host memory, streamed in
                       once per round for the verify pass (the paper's setting).
A round = ``draft_len`` single-token draft passes over KV / ratio + one verify pass of
draft_len + 1 tokens over the full KV, and yields the mean acceptance length of tokens
(accepted drafts + the bonus token). ``ratio`` is the factor by which the draft reads
fewer KV bytes: our CPU drafter dequantizes a quantized entry once per round and reads
that dense copy, so for quantizers as built today the effective ratio is 1.

    python benchmark/cost_model.py --paper --calibrate --out benchmark/results/cost_model.json
    python benchmark/cost_model.py --measured benchmark/results/decode.json --calibrate
    python benchmark/cost_model.py --gpu-kernels bench_kernels.json   # a GPU's measured attention terms

``--gpu-kernels`` replaces the roofline's ideal attention (every KV byte at the HBM peak) with
what bench_kernels.py measured on a GPU: the share of the peak reached by full-KV decode
attention and by each compressor's draft kernel (which reads the compressed entry in place,
so quantizers too save draft bandwidth there), each compressor's read ratio, the verify
kernel's share for the verify pass (where timed; else full-KV decode's), and the host
link's measured GB/s; then projects the paper's Llama-70B setting with them (gpu_projection.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    params: int = 0  # total parameters, embeddings counted once; 0: count from the shape

    def __post_init__(self):
        if self.params == 0:
            object.__setattr__(self, "params", self.count_params())

    def count_params(self) -> int:
        """Llama architecture: attention q/k/v/o, gated MLP, two RMSNorms a layer."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * layer + embeddings + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def read_params(self) -> int:
        """Parameters one forward pass reads in full and multiplies with every token: all
        but an untied input embedding table, of which only the tokens' rows are gathered."""
        return self.params - (0 if self.tied_embeddings else self.vocab * self.hidden)

    def attention_flops(self, context: int, n_tokens: int) -> float:
        """One request: n_tokens queries over context cached tokens + the causal block;
        QK^T and PV are 2 flops per multiply-add each."""
        keys_seen = n_tokens * context + n_tokens * (n_tokens + 1) / 2
        return 4 * self.layers * self.heads * self.head_dim * keys_seen


def smollm2_135m() -> ModelShape:
    """SmolLM2-135M(-Instruct): HF config / DESIGN.md; counts to 134,515,008 params."""
    return ModelShape("SmolLM2-135M", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64,
                      intermediate=1536, vocab=49152, tied_embeddings=True)


def llama_70b() -> ModelShape:
    """Llama-3(.1)-70B: counts to 70,553,706,496 params."""
    return ModelShape("Llama-70B", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
                      intermediate=28672, vocab=128256, tied_embeddings=False)


@dataclass(frozen=True)
class Hardware:
    name: str
    mem_bw: float  # device memory bytes/s, all devices together
    flops: float  # dense FLOP/s at the compute dtype, all devices together
    host_link_bw: Optional[float] = None  # host -> device bytes/s; None: no separate host tier
    mem_capacity: Optional[float] = None  # device bytes for weights + KV; None: unlimited
    step_overhead_s: float = 0.0  # per forward pass (kernel launches, sync)
    # per scheduler iteration: a full-KV decode step is one, a whole VeriCache round is one
    # (our drafter runs its draft passes inside the iteration)
    iteration_overhead_s: float = 0.0
    kv_read_passes: float = 1.0  # times each KV byte crosses memory per pass (gather + copy: ~3)
    # Bytes/s at which the engine's full-KV attention consumes KV (None: mem_bw /
    # kv_read_passes, a kernel that reads the paged cache in place). SGLang's CPU path
    # (torch_native) copies each request's KV rows out of the pool and runs SDPA over a
    # strided view of the copy, per request and layer: calibrate() measures it.
    full_kv_bw: Optional[float] = None
    verify_kv_bw: Optional[float] = None  # the same for passes of several tokens (None: full_kv_bw)
    draft_kv_bw: Optional[float] = None  # the draft's read of the compressed entry (None: mem_bw)
    # seconds per request and layer on the full-KV attention path (a Python loop on the CPU)
    attn_call_overhead_s: float = 0.0


def h100_nvl_x2() -> Hardware:
    """2x H100 NVL, tensor parallel (NVIDIA H100 datasheet, H100 NVL column): 94 GB HBM3 and
    3.9 TB/s each; BF16 tensor 1,671 TFLOPS *with sparsity* -> 835 dense each; PCIe Gen5 x16
    128 GB/s listed = both directions, so 64 GB/s host -> device per GPU (measured H2D on
    Gen5 hosts is ~54 GB/s: see --paper's sensitivity rows). Tensor parallelism splits the
    KV heads, so each GPU streams its half of every request's KV over its own link.
    Capacity: 90% of HBM (vLLM's default gpu_memory_utilization). No overheads: an upper
    bound that ignores the all-reduces and launch costs."""
    return Hardware("2x H100 NVL (TP=2)", mem_bw=2 * 3.9 * TB, flops=2 * 835 * TB,
                    host_link_bw=2 * 64 * GB, mem_capacity=0.9 * 2 * 94 * GB)


def cpu_this_machine(mem_bw: float, flops: float, **overrides) -> Hardware:
    """This CPU as the 'device': DRAM is device memory, unlimited for our sizes, no host tier."""
    return Hardware("cpu (calibrated)", mem_bw=mem_bw, flops=flops, **overrides)


# ---------------------------------------------------------------- the model


def expected_acceptance_length(alpha: float, draft_len: int) -> float:
    """Mean tokens per round (accepted drafts + bonus) when each draft token is accepted
    independently with probability alpha: sum_{i=0..gamma} alpha^i."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1:
        return draft_len + 1.0
    return (1 - alpha ** (draft_len + 1)) / (1 - alpha)


def _pass_time(shape, hw, context, batch, dtype_bytes, n_tokens, kv_ratio=1.0,
               link_bytes=0.0, overlap=True, weight_bytes=None, draft=False) -> float:
    """One forward pass of n_tokens per request for batch requests, its operations run one
    after another (as an eager engine launches them): the weight products at their roofline
    (weights read once, ``weight_bytes`` per parameter, default dtype_bytes: a draft with
    --vericache-draft-weights fp16 reads 2), then attention at its own (the KV at the rate
    of its path: the draft's compressed entry or the full-KV path), then the new KV written."""
    weights = shape.read_params() * (dtype_bytes if weight_bytes is None else weight_bytes)
    linear = max(weights / hw.mem_bw, batch * 2 * shape.read_params() * n_tokens / hw.flops)
    kv_read = batch * context * shape.kv_bytes_per_token(dtype_bytes) / kv_ratio
    if draft:
        kv_bw = hw.draft_kv_bw or hw.mem_bw
    else:
        kv_bw = hw.full_kv_bw or hw.mem_bw / hw.kv_read_passes
        if n_tokens > 1 and hw.verify_kv_bw:
            kv_bw = hw.verify_kv_bw
    attention = max(kv_read / kv_bw, batch * shape.attention_flops(context / kv_ratio, n_tokens) / hw.flops)
    if not draft:
        attention += batch * shape.layers * hw.attn_call_overhead_s
    kv_write = batch * n_tokens * shape.kv_bytes_per_token(dtype_bytes) / hw.mem_bw
    compute = linear + attention + kv_write
    link = 0.0
    if link_bytes:
        if hw.host_link_bw is None:
            raise ValueError(f"{hw.name} has no host link to offload over")
        link = link_bytes / hw.host_link_bw
    return (max(compute, link) if overlap else compute + link) + hw.step_overhead_s


def full_kv_step_time(shape: ModelShape, hw: Hardware, context: int, batch: int, dtype_bytes: float,
                      n_tokens: int = 1, offloaded: bool = False, overlap: bool = True) -> float:
    """Seconds for one full-KV decode step (one scheduler iteration). Offloaded: every
    request's whole KV crosses the host link this step."""
    link = batch * context * shape.kv_bytes_per_token(dtype_bytes) if offloaded else 0.0
    return _pass_time(shape, hw, context, batch, dtype_bytes, n_tokens, 1.0, link, overlap) \
        + hw.iteration_overhead_s


def vericache_round_time(shape: ModelShape, hw: Hardware, context: int, batch: int, dtype_bytes: float,
                         ratio: float, draft_len: int, offloaded: bool = True, overlap: bool = True,
                         draft_weight_bytes: Optional[float] = None) -> float:
    """Seconds for one round of every request in the batch: draft_len draft passes over the
    compressed KV, then one verify pass of draft_len + 1 tokens over the full KV. Offloaded:
    the full KV crosses the host link once per round; with overlap it streams while the
    batch drafts (the paper's staggering), so the round costs max(compute, transfer).
    The context is taken as fixed over the round (draft_len << context). The draft passes
    read ``draft_weight_bytes`` per parameter (default: the model's dtype_bytes)."""
    draft = draft_len * _pass_time(shape, hw, context, batch, dtype_bytes, 1, ratio,
                                   weight_bytes=draft_weight_bytes, draft=True)
    verify = _pass_time(shape, hw, context, batch, dtype_bytes, draft_len + 1)
    compute = draft + verify
    if offloaded:
        if hw.host_link_bw is None:
            raise ValueError(f"{hw.name} has no host link to offload over")
        link = batch * context * shape.kv_bytes_per_token(dtype_bytes) / hw.host_link_bw
        compute = max(compute, link) if overlap else compute + link
    return compute + hw.iteration_overhead_s


def fit_batch(shape: ModelShape, hw: Hardware, context: int, batch: int, dtype_bytes: float,
              resident_fraction: float) -> int:
    """Requests that fit beside the weights when each keeps resident_fraction of its full
    KV in device memory (0 when not even one fits)."""
    if hw.mem_capacity is None or resident_fraction == 0:
        return batch
    free = hw.mem_capacity - shape.params * dtype_bytes
    per_request = context * shape.kv_bytes_per_token(dtype_bytes) * resident_fraction
    return max(0, min(batch, math.floor(free / per_request)))


def _arm_rates(shape, hw, context, batch, dtype_bytes, ratio, draft_len, acc_len, overlap, draft_weight_bytes=None):
    """Arm -> (batch held, tok/s); no offloaded arms on hardware without a host tier."""
    def full(offloaded, fraction):
        b = fit_batch(shape, hw, context, batch, dtype_bytes, fraction)
        t = full_kv_step_time(shape, hw, context, b, dtype_bytes, offloaded=offloaded, overlap=overlap)
        return b, (b / t if b else 0.0)

    def vericache(offloaded, fraction):
        b = fit_batch(shape, hw, context, batch, dtype_bytes, fraction)
        t = vericache_round_time(shape, hw, context, b, dtype_bytes, ratio, draft_len, offloaded, overlap,
                                 draft_weight_bytes)
        return b, (b * acc_len / t if b else 0.0)

    arms = {"full_resident": full(False, 1.0),
            "vericache_resident": vericache(False, 1.0 + 1.0 / ratio)}  # full and compressed KV
    if hw.host_link_bw is not None:
        arms["full_offloaded"] = full(True, 0.0)  # streamed layer by layer: no resident KV
        # compressed KV, plus the full KV of the 1/(draft_len+1) of the batch verifying now
        arms["vericache_offloaded"] = vericache(True, 1.0 / ratio + 1.0 / (draft_len + 1))
    return arms


def predict(shape: ModelShape, hw: Hardware, context: int, batch: int, dtype_bytes: float, ratio: float,
            draft_len: int, acc_len: Optional[float] = None, alpha: Optional[float] = None,
            overlap: bool = True, draft_weight_bytes: Optional[float] = None) -> dict:
    """Predicted tok/s (all requests together) of every arm, for ``batch`` requests offered
    at ``context`` tokens each; an arm holds as many of them as its device memory allows.
    Give the mean acceptance length (tokens per round, bonus included) as ``acc_len``, or a
    per-token acceptance rate ``alpha`` (see expected_acceptance_length).

    ``speedup``: each VeriCache arm over the best full-KV arm (what one would run instead).
    ``ideal_speedup``: the best VeriCache arm over the best full-KV arm if every draft were
    accepted (acc_len = draft_len + 1), all else equal: the bound acceptance tuning can
    approach. With unlimited memory and free flops it tends, as draft_len grows, to
    (W + B*C*k) / (W + B*C*k / ratio) <= ratio (W weight bytes, B*C*k KV bytes)."""
    if (acc_len is None) == (alpha is None):
        raise ValueError("give exactly one of acc_len or alpha")
    if acc_len is None:
        acc_len = expected_acceptance_length(alpha, draft_len)
    if not 1 <= acc_len <= draft_len + 1:
        raise ValueError(f"acc_len {acc_len} outside [1, draft_len + 1 = {draft_len + 1}]")
    args = (shape, hw, context, batch, dtype_bytes, ratio, draft_len)
    arms = _arm_rates(*args, acc_len, overlap, draft_weight_bytes)
    ideal = _arm_rates(*args, draft_len + 1.0, overlap, draft_weight_bytes)
    baseline = max((a for a in arms if a.startswith("full")), key=lambda a: arms[a][1])

    def best_vc(rates):
        return max(rates[a][1] for a in rates if a.startswith("vericache"))

    base = arms[baseline][1]
    return {
        "acc_len": acc_len,
        "batch": {a: b for a, (b, _) in arms.items()},
        "tok_s": {a: r for a, (_, r) in arms.items()},
        "baseline": baseline,
        "speedup": {a: (r / base if base else math.inf) for a, (_, r) in arms.items() if a.startswith("vericache")},
        "best_speedup": best_vc(arms) / base if base else math.inf,
        "ideal_speedup": best_vc(ideal) / base if base else math.inf,
    }


def fraction_of_bound(measured_speedup: float, predicted_speedup: float) -> float:
    """measured / predicted speedup. Issue 6's "VeriCache reaches 80% of what the cost model
    says is possible at 8k" is fraction_of_bound(m, p) >= 0.8 with
      m = tok_s_vc / tok_s_off measured by bench_decode at context 8192, and
      p = predict(...)["best_speedup"] for the same model, batch, context, draft length and
          nominal compression ratio, with the MEASURED mean acceptance length, on this
          CPU calibrated by --calibrate.
    Acceptance is thus not part of the gap, only how close the system runs to the roofline.
    Near p = 1 the ratio is lenient (p 1.25, m 1.0 gives 0.8 with no gain at all);
    gain_fraction reports the share of the predicted gain instead. Where p < 1 (the model
    says VeriCache cannot win on that hardware, as for SmolLM2-135M on our 2-core CPU) the
    target says little."""
    if predicted_speedup <= 0:
        raise ValueError(f"predicted speedup must be positive, got {predicted_speedup}")
    return measured_speedup / predicted_speedup


def gain_fraction(measured_speedup: float, predicted_speedup: float) -> Optional[float]:
    """(m - 1) / (p - 1): the share of the predicted gain realised; None when p <= 1."""
    return None if predicted_speedup <= 1 else (measured_speedup - 1) / (predicted_speedup - 1)


# ---------------------------------------------------------------- calibration


def _best_seconds(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls of ``fn``, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def calibrate(repeats: int = 3, mbytes: int = 256) -> dict:
    """This CPU's read bandwidth (a sum over ``mbytes`` MB of fp32, far past the caches) and
    fp32 matmul rate (2048^3), best of ``repeats``, with torch's default threads. A few s."""
    import torch

    nbytes = mbytes * 2**20
    x = torch.full((nbytes // 4,), 1.0)
    y = torch.empty_like(x)
    def best(fn):
        return _best_seconds(fn, repeats)

    read_s, copy_s = best(lambda: x.sum()), best(lambda: y.copy_(x))
    del x, y
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm_s = best(lambda: a @ b)
    return {"mem_bw": nbytes / read_s, "copy_bw_read_plus_write": 2 * nbytes / copy_s,
            "flops": 2 * n**3 / mm_s, "threads": torch.get_num_threads(),
            "method": f"best of {repeats}: x.sum() over {mbytes} MB fp32; y.copy_(x); fp32 {n}^3 matmul"}


def calibrate_attention(shape: Optional[ModelShape] = None, context: int = 8192, batch: int = 4,
                        ratio: float = 4.0, verify_tokens: int = 17, repeats: int = 5) -> dict:
    """The attention paths' rates on this CPU for one layer of ``shape`` (default SmolLM2:
    9 query heads, 3 KV heads, head dim 64), fp32, best of ``repeats``:
      full_kv_bw       SGLang's torch_native decode for one request: copy its K and V rows
                       out of the pool (slots in order), SDPA of one query over the copy;
                       bytes = K + V of ``context`` tokens.
      verify_kv_bw     our verify attention (sglang/attention.py: verify_attention): the same
                       copy, then ``verify_tokens`` queries under a boolean mask.
      draft_kv_bw      our drafter (spec/drafter.py): one SDPA for ``batch`` requests over
                       a contiguous buffer of context / ratio tokens each, sliced as it is.
      attn_call_overhead_s  the decode path's time at 16 tokens: its cost per call.
    ~1 s."""
    import torch
    import torch.nn.functional as F

    shape = shape or smollm2_135m()
    hq, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    k_pool, v_pool = torch.randn(context + 64, hkv, d), torch.randn(context + 64, hkv, d)
    kv_bytes = 2 * hkv * d * 4  # one token's K + V in one layer, fp32

    def best(fn):
        return _best_seconds(fn, repeats)

    def decode(n_ctx):
        slots = torch.arange(32, 32 + n_ctx)
        q = torch.randn(hq, 1, d)
        return lambda: F.scaled_dot_product_attention(
            q.unsqueeze(0), k_pool[slots].movedim(0, 1).unsqueeze(0), v_pool[slots].movedim(0, 1).unsqueeze(0),
            enable_gqa=True)

    slots = torch.arange(32, 32 + context + verify_tokens)
    qv = torch.randn(hq, verify_tokens, d)
    visible = torch.ones(verify_tokens, context + verify_tokens, dtype=torch.bool)
    visible[:, context:] = torch.tril(visible[:, context:])

    def verify():
        return F.scaled_dot_product_attention(qv, k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1),
                                              attn_mask=visible, enable_gqa=True)

    width = int(context / ratio)
    k_buf, v_buf = torch.randn(batch, hkv, width + 32, d), torch.randn(batch, hkv, width + 32, d)
    qd = torch.randn(batch, hq, 1, d)

    def draft():
        return F.scaled_dot_product_attention(qd, k_buf[:, :, :width], v_buf[:, :, :width], enable_gqa=True)

    overhead = best(decode(16))
    return {
        "full_kv_bw": context * kv_bytes / (best(decode(context)) - overhead),
        "verify_kv_bw": context * kv_bytes / (best(verify) - overhead),
        "draft_kv_bw": batch * width * kv_bytes / best(draft),
        "attn_call_overhead_s": overhead,
        "method": f"one layer of {shape.name}, fp32, best of {repeats}: torch_native decode at {context} and 16 "
                  f"tokens; verify of {verify_tokens} queries; draft of {batch} x {width} tokens",
    }


# ---------------------------------------------------------------- reports

PAPER = {"source": "arXiv 2605.17613 as summarised in DESIGN.md: long-context decoding, Llama-70B "
                   "on 2x H100 NVL, full KV 102 tok/s -> VeriCache 256 tok/s (4x compression, draft 30, "
                   "acceptance length ~23)",
         "full_kv_tok_s": 102.0, "vericache_tok_s": 256.0}
PAPER_ASSUMPTIONS = {
    "context": 32768, "offered_batch": 32, "dtype_bytes": 2, "ratio": 4.0, "draft_len": 30, "acc_len": 23.0,
    "why": "The paper's context and concurrency are not in DESIGN.md: 32k tokens per request and 32 "
           "requests offered (more than any arm can hold) are our assumptions. bf16 weights and KV; "
           "acc_len 23 is the paper's Llama-70B acceptance length. Overheads (TP all-reduce, launches) "
           "are ignored, so predictions are upper bounds. Staggered verification overlaps the full-KV "
           "transfer with drafting; a verifying request holds its whole full KV while it verifies.",
}
# DESIGN.md, "Calibration measured on these machines": SGLang CPU engine decode step time fits
DESIGN_STEP_FIT = {1: (0.062, 0.0107), 4: (0.125, 0.011)}  # batch -> (fixed s, s per 1000 tokens per request)
CPU_GRID = {"contexts": [2048, 4096, 8192], "batches": [1, 4], "ratio": 4.0, "draft_len": 30, "acc_len": 17.0}
# our drafter dequantizes these once per round and reads the dense copy: effective ratio 1
DENSE_DRAFT = {"kivi4", "kivi2", "int8", "fp8", "full"}


def paper_report() -> dict:
    a, shape, hw = PAPER_ASSUMPTIONS, llama_70b(), h100_nvl_x2()
    run = dict(ratio=a["ratio"], draft_len=a["draft_len"], acc_len=a["acc_len"])
    p = predict(shape, hw, a["context"], a["offered_batch"], a["dtype_bytes"], **run)
    t = p["tok_s"]
    table = [
        {"arm": "full KV, resident (batch capped by HBM)", "predicted": t["full_resident"],
         "reported": PAPER["full_kv_tok_s"], "batch": p["batch"]["full_resident"]},
        {"arm": "full KV, offloaded (streamed every step)", "predicted": t["full_offloaded"],
         "reported": PAPER["full_kv_tok_s"], "batch": p["batch"]["full_offloaded"]},
        {"arm": "VeriCache, full KV offloaded", "predicted": t["vericache_offloaded"],
         "reported": PAPER["vericache_tok_s"], "batch": p["batch"]["vericache_offloaded"]},
        {"arm": "speedup (best VeriCache / best full KV)", "predicted": p["best_speedup"],
         "reported": PAPER["vericache_tok_s"] / PAPER["full_kv_tok_s"]},
    ]
    for row in table:
        row["predicted_over_reported"] = row["predicted"] / row["reported"]
    sensitivity = []
    for context in (8192, 16384, 32768, 65536):
        for link in (64 * GB, 54 * GB):
            q = predict(shape, replace(hw, host_link_bw=2 * link), context, a["offered_batch"],
                        a["dtype_bytes"], **run)
            sensitivity.append({"context": context, "host_link_per_gpu_GBps": link / GB, **q["tok_s"],
                                "best_speedup": q["best_speedup"], "ideal_speedup": q["ideal_speedup"]})
    # the context at which streaming every step would give the reported baseline
    implied = hw.host_link_bw / (PAPER["full_kv_tok_s"] * shape.kv_bytes_per_token(a["dtype_bytes"]))
    return {"paper": PAPER, "assumptions": a, "model": asdict(shape), "hardware": asdict(hw),
            "prediction": p, "table": table, "sensitivity": sensitivity,
            "context_where_streamed_baseline_is_102": implied}


def cpu_report(hw: Hardware) -> dict:
    """SmolLM2-135M fp32 on this CPU: predicted speedups on a grid, and the model's full-KV
    step time against DESIGN.md's measured SGLang step-time fit."""
    shape, g = smollm2_135m(), CPU_GRID
    grid = []
    for context in g["contexts"]:
        for batch in g["batches"]:
            run = dict(draft_len=g["draft_len"], acc_len=g["acc_len"])
            nominal = predict(shape, hw, context, batch, 4, g["ratio"], **run)
            as_built = predict(shape, hw, context, batch, 4, 1.0, **run)
            grid.append({"context": context, "batch": batch, "full_tok_s": nominal["tok_s"]["full_resident"],
                         "vericache_tok_s": nominal["tok_s"]["vericache_resident"],
                         "speedup": nominal["best_speedup"], "speedup_as_built": as_built["best_speedup"],
                         "ideal_speedup": nominal["ideal_speedup"]})
    steps = []
    for batch, (fixed, slope) in DESIGN_STEP_FIT.items():
        for context in (256, 2048, 4096, 7500):
            steps.append({"batch": batch, "context": context,
                          "predicted_ms": 1e3 * full_kv_step_time(shape, hw, context, batch, 4),
                          "measured_fit_ms": 1e3 * (fixed + slope * batch * context / 1000)})
    model_slope = shape.kv_bytes_per_token(4) * 1000 / hw.mem_bw  # s per 1000 tokens per request
    return {"model": asdict(shape), "hardware": asdict(hw), "grid_assumptions": g, "grid": grid,
            "step_time_vs_design": steps,
            "implied_kv_read_passes": {b: s / model_slope for b, (_, s) in DESIGN_STEP_FIT.items()}}


# bytes per parameter the draft passes read, per --vericache-draft-weights (fp32 model)
DRAFT_WEIGHT_BYTES = {"fp16": 2.0, "int8": 1.0, "model": None}
AUTO_FP16_MAX_BATCH = 2  # auto drafts from the fp16 copy up to this batch (spec/draft_weights.AUTO_FP16_MAX_ROWS)


def _draft_weight_bytes(mode: str, batch: int) -> Optional[float]:
    if mode == "auto":
        return DRAFT_WEIGHT_BYTES["fp16"] if batch <= AUTO_FP16_MAX_BATCH else None
    return DRAFT_WEIGHT_BYTES.get(mode)


def fit_step_overhead(rows: list[dict], hw: Hardware) -> float:
    """The per-forward-pass overhead (s) that makes the model's full-KV step time match the
    measured speculation-off arm (step = batch / tok/s) in the least-squares sense, >= 0.
    Fitted on the baseline only: the VeriCache arm stays a prediction."""
    shape = smollm2_135m()
    gaps = [row["batch"] / row["tok_s_off"] - full_kv_step_time(shape, hw, row["context"], row["batch"], 4)
            for row in rows]
    return max(0.0, sum(gaps) / len(gaps)) if gaps else 0.0


def measured_report(path: Path, hw: Hardware, nominal_ratio: float, fit_overhead: bool = False) -> dict:
    """Predicted against measured speedup and tok/s for each row of a bench_decode JSON.
    ``fit_overhead``: first fit the hardware's per-pass overhead to the off arm."""
    data = json.loads(path.read_text())
    rows = data["results"] if isinstance(data, dict) else data
    shape, out = smollm2_135m(), []
    fitted = fit_step_overhead(rows, hw) if fit_overhead else 0.0
    hw = replace(hw, step_overhead_s=hw.step_overhead_s + fitted)
    # the VERICACHE arm's --vericache-draft-weights (runs before it existed drafted with fp32 weights)
    mode = (data.get("config", {}) if isinstance(data, dict) else {}).get("draft_weights", "model")
    for row in rows:
        weight_bytes = _draft_weight_bytes(mode, row["batch"])
        ratio = 1.0 if row["compressor"] == "full" else float(row.get("ratio", nominal_ratio))
        args = (shape, hw, row["context"], row["batch"], 4)
        # A request's drafts are padded to the round's verify width, and padding can
        # verify too, so a round may emit more than draft_len + 1 tokens: model the round
        # with at least as many draft steps as it emitted tokens.
        draft_len = max(row["draft_len"], math.ceil(row["mean_acc_len"]) - 1)
        run = dict(draft_len=draft_len, acc_len=row["mean_acc_len"], draft_weight_bytes=weight_bytes)
        pred = predict(*args, ratio, **run)
        p = pred["best_speedup"]
        p_built = predict(*args, 1.0 if row["compressor"] in DENSE_DRAFT else ratio, **run)["best_speedup"]
        m = row["tok_s_vc"] / row["tok_s_off"]
        rec = {k: row[k] for k in ("context", "batch", "compressor", "draft_len", "mean_acc_len")}
        rec.update(measured_speedup=m, predicted_speedup=p, predicted_speedup_as_built=p_built,
                   fraction_of_bound=fraction_of_bound(m, p), gain_fraction=gain_fraction(m, p),
                   tok_s_off={"measured": row["tok_s_off"], "predicted": pred["tok_s"]["full_resident"]},
                   tok_s_vc={"measured": row["tok_s_vc"], "predicted": pred["tok_s"]["vericache_resident"]})
        split = row.get("time_split")
        if split:
            draft = row["draft_len"] * _pass_time(shape, hw, row["context"], row["batch"], 4, 1, ratio,
                                                  weight_bytes=weight_bytes, draft=True)
            verify = _pass_time(shape, hw, row["context"], row["batch"], 4, draft_len + 1)
            rec["draft_share"] = {"measured": split["draft"] / sum(split.values()),
                                  "predicted": draft / (draft + verify)}
        out.append(rec)
    return {"fitted_step_overhead_s": fitted if fit_overhead else None, "hardware": asdict(hw), "rows": out}


def _provenance() -> dict:
    import os
    import platform
    import subprocess

    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    return {"commit": commit, "machine": {"platform": platform.platform(), "cores": os.cpu_count(),
                                          "load_avg": list(os.getloadavg())}}


def _print_paper(rep: dict) -> None:
    print(f"paper example ({rep['assumptions']['context']} tokens, {rep['assumptions']['offered_batch']} offered):")
    for row in rep["table"]:
        batch = f"  batch {row['batch']}" if "batch" in row else ""
        print(f"  {row['arm']:<42} predicted {row['predicted']:7.2f}  reported {row['reported']:6.2f}"
              f"  ({row['predicted_over_reported']:.2f}x){batch}")


def _print_cpu(rep: dict) -> None:
    print("SmolLM2-135M fp32 on this CPU (ratio 4, draft 30, acc_len 17):")
    for r in rep["grid"]:
        print(f"  ctx {r['context']:5d} batch {r['batch']}: full {r['full_tok_s']:6.2f} tok/s, VeriCache "
              f"{r['vericache_tok_s']:6.2f}; speedup {r['speedup']:.2f} (as built {r['speedup_as_built']:.2f},"
              f" ideal {r['ideal_speedup']:.2f})")
    for r in rep["step_time_vs_design"]:
        print(f"  step ctx {r['context']:5d} batch {r['batch']}: predicted {r['predicted_ms']:6.1f} ms,"
              f" DESIGN.md fit {r['measured_fit_ms']:6.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paper", action="store_true", help="predicted vs reported for the paper's Llama-70B example")
    ap.add_argument("--calibrate", action="store_true", help="measure this CPU's bandwidth and FLOP rate (~3 s)")
    ap.add_argument("--cpu-mem-bw", type=float, help="CPU read bandwidth, bytes/s (instead of --calibrate)")
    ap.add_argument("--cpu-flops", type=float, help="CPU fp32 FLOP/s (instead of --calibrate)")
    ap.add_argument("--cpu-iteration-overhead", type=float, default=0.0,
                    help="engine seconds per scheduler iteration on the CPU (default 0: pure roofline)")
    ap.add_argument("--cpu-full-kv-bw", type=float,
                    help="bytes/s of the engine's full-KV attention path (default: measured with --calibrate, "
                         "else the read bandwidth)")
    ap.add_argument("--cpu-verify-kv-bw", type=float,
                    help="bytes/s of the verify pass's full-KV attention (default as above, else --cpu-full-kv-bw)")
    ap.add_argument("--cpu-draft-kv-bw", type=float, help="bytes/s of the draft's attention (default as above)")
    ap.add_argument("--cpu-attn-call-overhead", type=float,
                    help="seconds per request and layer of the full-KV attention path (default as above, else 0)")
    ap.add_argument("--fit-overhead", action="store_true",
                    help="with --measured: fit a per-forward-pass overhead to the speculation-off arm first")
    ap.add_argument("--measured", type=Path, help="a bench_decode.py JSON: predicted vs measured per row")
    ap.add_argument("--ratio", type=float, default=4.0, help="compression ratio of measured rows without one")
    ap.add_argument("--gpu-kernels", type=Path,
                    help="a bench_kernels.py JSON: project the paper's Llama-70B with its measured attention terms")
    ap.add_argument("--out", type=Path, help="write the JSON here")
    args = ap.parse_args()
    if not (args.paper or args.calibrate or args.measured or args.cpu_mem_bw or args.gpu_kernels):
        ap.error("nothing to do: give --paper, --calibrate, --cpu-mem-bw/--cpu-flops, --measured or --gpu-kernels")
    if args.fit_overhead and not args.measured:
        ap.error("--fit-overhead needs --measured (the off arm it is fitted to)")
    result: dict = {"generated": time.strftime("%Y-%m-%d %H:%M:%S"), **_provenance()}
    if args.paper:
        result["paper"] = paper_report()
        _print_paper(result["paper"])
    if args.gpu_kernels:
        from gpu_projection import gpu_kernel_terms, gpu_projection, print_gpu

        result["gpu_projection"] = gpu_projection(gpu_kernel_terms(json.loads(args.gpu_kernels.read_text())))
        print_gpu(result["gpu_projection"])
    hw = None
    attention = {}
    if args.calibrate:
        result["attention_calibration"] = attention = calibrate_attention()
        print(f"attention: full-KV path {attention['full_kv_bw'] / GB:.2f} GB/s (verify "
              f"{attention['verify_kv_bw'] / GB:.2f}), draft {attention['draft_kv_bw'] / GB:.2f} GB/s, "
              f"{attention['attn_call_overhead_s'] * 1e6:.0f} us a call")
    paths = dict(full_kv_bw=args.cpu_full_kv_bw or attention.get("full_kv_bw"),
                 verify_kv_bw=args.cpu_verify_kv_bw or attention.get("verify_kv_bw"),
                 draft_kv_bw=args.cpu_draft_kv_bw or attention.get("draft_kv_bw"),
                 attn_call_overhead_s=args.cpu_attn_call_overhead or attention.get("attn_call_overhead_s", 0.0),
                 iteration_overhead_s=args.cpu_iteration_overhead)
    if args.cpu_mem_bw and args.cpu_flops:
        hw = cpu_this_machine(args.cpu_mem_bw, args.cpu_flops, **paths)
    elif args.calibrate or args.measured:
        result["calibration"] = calibrate()
        c = result["calibration"]
        print(f"calibrated: read {c['mem_bw'] / GB:.2f} GB/s, fp32 matmul {c['flops'] / 1e9:.1f} GFLOP/s,"
              f" {c['threads']} threads")
        hw = cpu_this_machine(c["mem_bw"], c["flops"], **paths)
    if hw is not None:
        result["cpu"] = cpu_report(hw)
        _print_cpu(result["cpu"])
    if args.measured:
        result["measured"] = rep = measured_report(args.measured, hw, args.ratio, args.fit_overhead)
        if args.fit_overhead:
            print(f"fitted to the off arm: {rep['fitted_step_overhead_s'] * 1e3:.1f} ms a forward pass")
        for r in rep["rows"]:
            print(f"  {r['compressor']:<12} ctx {r['context']:5d} batch {r['batch']} draft {r['draft_len']}: measured"
                  f" {r['measured_speedup']:.2f}x, predicted {r['predicted_speedup']:.2f}x"
                  f" (as built {r['predicted_speedup_as_built']:.2f}x), fraction {r['fraction_of_bound']:.2f};"
                  f" tok/s off {r['tok_s_off']['measured']:.2f} (model {r['tok_s_off']['predicted']:.2f}),"
                  f" VeriCache {r['tok_s_vc']['measured']:.2f} (model {r['tok_s_vc']['predicted']:.2f})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
