"""Compile the draft kernels (and the verify kernel) before the first request needs them.

On a GPU the drafter's attention runs on Triton kernels (``sgl_vericache.kernels``) that
compile on first use: each compressor's format in two variants (a lone request's entry;
several read in place through their address table), each again addressing entries in int64
(an entry past 2^31 elements: ``ops.offsets32``), and the split merge for every split count
a launch picks. Left to the first requests, those compiles (seconds each on a first
start; Triton caches them on disk for the next) land inside their draft rounds. ``warm_up``
runs a small draft round per compressor through a throwaway ``CompressedKVStore`` of one
layer, with the model's head layout, dtypes and logit soft cap, so the rounds that follow
find every variant they launch already compiled: kernel variants depend on the head layout,
dtypes, soft cap, sinks and compressor options, never on the lengths a round sees (the
kernels do not specialize on them; test/kernel_checks.py's warm-up cases compare Triton's
own cache keys). A draft warm-up that fails turns the draft kernels off for the process
(``kernels.turn_draft_kernels_off``): drafts then run on the dense torch path.

``warm_verify`` does the same for the verify kernel (kernels/verify.py), whose variants
depend on the head layout, dtypes, whether the model soft-caps its attention scores (or has
attention sinks: then every split merge adds them) and how many query rows a program
holds: one launch per size that verify blocks of 1 .. draft_len + 1 tokens pick.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from sgl_vericache.mem_cache.compress import KVCompressor

from .drafter import CompressedKVStore, kernels_on, selects_per_step

logger = logging.getLogger(__name__)

# two synthetic requests: long enough that every compressor keeps a compressed main part and
# (KIVI) a residual window, short enough to cost milliseconds
LENGTHS = (600, 300)
_PROMPT_QUERIES = 32  # last prompt queries handed to SnapKV / H2O


@dataclass(frozen=True)
class HeadLayout:
    """What a kernel variant depends on besides the compressor: one worker's attention heads."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype  # the full KV pool's (the compressors read it)
    q_dtype: torch.dtype  # the draft passes' queries (the model's dtype)
    logit_cap: float = 0.0  # the attention scores' soft cap (Gemma 2, Grok); 0: none. A capped
    # model's verify and draft launches are their capped variants
    sinks: bool = False  # the model's attention layers have attention sinks (gpt-oss, Granite-SWA):
    # every split merge, verify's and the drafts', launches its variant that adds them

    def sink_values(self, device) -> Optional[torch.Tensor]:
        """Stand-in sinks [H_q] for a warm-up launch (their values do not shape a variant)."""
        return torch.zeros(self.num_q_heads, device=device) if self.sinks else None

    def __post_init__(self):
        if self.num_kv_heads < 1 or self.num_q_heads % self.num_kv_heads or self.head_dim < 1:
            raise ValueError(f"a head layout needs H_q a multiple of H_kv >= 1 and head_dim >= 1, got {self}")


def warm_up(compressors: Sequence[KVCompressor], layout: HeadLayout, device: torch.device,
            draft_kernels: Optional[bool] = None, lengths: tuple[int, int] = LENGTHS,
            windows: bool = False) -> Optional[float]:
    """Run throwaway draft rounds per compressor (a lone request, two read together, and for
    compressors that do not choose keys per step a teacher-forced one) over two synthetic
    requests of ``lengths`` tokens, with ``windows`` one of sliding-window layers over a
    pool (spec/window_draft.py), and the split merge at every split count; seconds taken,
    or None when this device drafts on the dense torch path (``draft_kernels`` as
    CompressedKVStore takes it: None = the kernels on CUDA), now or after a kernel failed."""
    device = torch.device(device)
    if not kernels_on(draft_kernels, device):  # as CompressedKVStore decides
        return None
    draft_kernels = True
    from sgl_vericache.kernels import ops

    t0 = time.perf_counter()
    gen = torch.Generator(device="cpu").manual_seed(0)
    for comp in compressors:
        _warm_compressor(comp, layout, device, gen, draft_kernels, lengths)
    if windows:
        _warm_window(layout, device, gen, lengths)
    if not kernels_on(draft_kernels, device):  # a round fell back: the kernels failed, drafts are on torch
        return None
    ops.warm_merges(layout.num_q_heads, layout.head_dim, layout.q_dtype, device, sinks=layout.sinks)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _randn(gen, shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def _step(attend, rows: int, layout: HeadLayout, device, gen) -> None:
    """One draft step of layer 0 for ``rows`` query rows (a batch's requests, or one request's
    teacher-forced tokens), with the layout's sinks and soft cap."""
    q = _randn(gen, (rows, layout.num_q_heads, layout.head_dim), layout.q_dtype, device)
    k_new, v_new = (_randn(gen, (rows, layout.num_kv_heads, layout.head_dim), layout.kv_dtype, device)
                    for _ in range(2))
    attend(0, q, k_new, v_new, layout.head_dim ** -0.5, layout.sink_values(device), layout.logit_cap or None)


def _warm_compressor(comp: KVCompressor, layout: HeadLayout, device, gen, draft_kernels, lengths) -> None:
    kv_shape = (max(lengths), layout.num_kv_heads, layout.head_dim)
    kv = [(_randn(gen, kv_shape, layout.kv_dtype, device), _randn(gen, kv_shape, layout.kv_dtype, device))
          for _ in lengths]
    queries = [_randn(gen, (_PROMPT_QUERIES, layout.num_q_heads, layout.head_dim), layout.q_dtype, device)]
    store = CompressedKVStore(comp, num_layers=1, draft_kernels=draft_kernels)
    rids = list(range(len(lengths)))
    for rid, ((k, v), n) in enumerate(zip(kv, lengths)):
        store.sync(rid, n, lambda _, a, b, k=k, v=v: (k[a:b], v[a:b]), queries=queries)
    try:
        for batch in ([rids[0]], rids):  # a lone entry, then several read together
            store.begin_round(batch, 2)
            for _ in range(2):
                _step(store.attend, len(batch), layout, device, gen)
        if not selects_per_step(comp):  # a prompt's tokens past its entry, drafted at once
            store.begin_round([rids[0]], 3)
            _step(store.attend_tokens, 3, layout, device, gen)
        _warm_long_entries(store, rids, layout, device, gen)
    finally:
        store.clear()


def _warm_long_entries(store: CompressedKVStore, rids: list, layout: HeadLayout, device, gen) -> None:
    """The variants that address entries in int64, which a round launches for an entry past
    2^31 elements (``ops.offsets32``: 524k tokens at 32 KV heads of 128, 2M at 8): a lone
    entry and several, as the store's rounds read them. Else the first such request's round
    would compile them, seconds each, with every request of its batch waiting."""
    if not store.kernels_on(device):  # a kernel failed above: drafts are on torch now
        return
    from sgl_vericache.kernels import ops
    from sgl_vericache.kernels.draft_round import KernelDraftRound

    rows = [(comp, list(layers)) for comp, layers, _ in (store.entry(rid) for rid in rids)]
    if not KernelDraftRound.supports(rows):
        return
    for batch in (rows[:1], rows):
        draft = KernelDraftRound(batch, 2, store.num_layers, config=ops.LaunchConfig(int32_offsets=False))
        _step(draft.attend, len(batch), layout, device, gen)


def _warm_window(layout: HeadLayout, device, gen, lengths) -> None:
    """A round of sliding-window layers' drafts over a pool in place (the decode kernel's
    paged variant), requests of ``lengths`` tokens, a window shorter than both."""
    from sgl_vericache.spec.window_draft import WindowedDraft

    slots = sum(lengths)
    pool = [_randn(gen, (slots, layout.num_kv_heads, layout.head_dim), layout.kv_dtype, device) for _ in range(2)]
    rows = torch.arange(slots, dtype=torch.int32, device=device).split(list(lengths))
    draft = WindowedDraft(None, {0: min(lengths) // 2}, lambda _: pool, kernels=True)
    draft.begin_round(list(rows), list(lengths), 2)
    for _ in range(2):
        _step(draft.attend, len(lengths), layout, device, gen)
    draft.end_round()


def warm_verify(layout: HeadLayout, tokens: int, device: torch.device) -> float:
    """Launch the verify kernel once for every query-rows size (its compile-time QP) a
    verify block of 1 .. ``tokens`` tokens picks, with a verify mask and without (a chain:
    what CUDA rounds pass), over a small pool in SGLang's layout and dtypes (int32 token table,
    int64 lengths and rows), soft-capped as the layout's model caps and with its attention
    sinks if it has them; then the split merge at every split count. Seconds taken."""
    from sgl_vericache.kernels import ops, verify

    device = torch.device(device)
    t0 = time.perf_counter()
    gen = torch.Generator(device="cpu").manual_seed(0)
    group = layout.num_q_heads // layout.num_kv_heads
    sizes: dict[int, int] = {}
    for t in range(1, tokens + 1):
        sizes.setdefault(verify.query_rows(group, t), t)
    slots = 32 + tokens
    k, v = (_randn(gen, (slots, layout.num_kv_heads, layout.head_dim), layout.kv_dtype, device) for _ in range(2))
    table = torch.arange(slots, dtype=torch.int32, device=device).view(1, slots)
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    prefix = torch.full((1,), 32, dtype=torch.int64, device=device)
    for t in sizes.values():
        q = _randn(gen, (1, t, layout.num_q_heads, layout.head_dim), layout.q_dtype, device)
        # the mask as the kernel gets it on CPU ([bs, n, n]), and none: on CUDA NGRAM lays its
        # mask out per request ([n, prefix + n]), which the backend reads as the chain it is
        for mask in (torch.tril(torch.ones(1, t, t, dtype=torch.bool, device=device)), None):
            verify.verify_attention(q, k, v, table, rows, prefix, layout.head_dim ** -0.5, mask=mask,
                                    longest=32 + t, softcap=layout.logit_cap or None,
                                    sinks=layout.sink_values(device))
    ops.warm_merges(layout.num_q_heads, ops._pow2(layout.head_dim), layout.q_dtype, device, sinks=layout.sinks)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def warm_up_kernels(kernels: dict, device, compressors: Sequence[KVCompressor], windows: bool, draft_len: int,
                    deterministic: bool, read_layout: Callable, compile_now: bool = True) -> None:
    """A worker's warm-up at start: read the model's head layout (``read_layout()``) and
    compile the draft kernels for ``compressors`` (and sliding-window layers, ``windows``)
    and the verify kernel for blocks of up to ``draft_len + 1`` tokens; nothing to compile
    on a device that runs them on torch (its reason goes to the status), or without
    ``compile_now`` (--no-vericache-warm-up-kernels). What happened goes to ``kernels``
    (/server_info's ``vericache_kernels``); a failure is logged and the server goes on: the
    drafts on the dense torch path from then on, the verify kernel compiled at first use."""
    from sgl_vericache.kernels import draft_kernels_failed, draft_kernels_off, verify_kernel_off

    draft_off, verify_off = draft_kernels_off(device), verify_kernel_off(device)
    drafts, verifies = draft_off is None, verify_off is None and not deterministic
    kernels["draft"] = "pending" if drafts else f"off: {draft_off}"
    kernels["verify"] = "pending" if verifies else (
        "off: deterministic mode verifies on torch" if verify_off is None else f"off: {verify_off}")
    what_drafts = "the draft kernels for " + ", ".join(c.name for c in compressors) + (
        " and sliding-window layers" if windows else "")
    what_verify = f"the verify kernel for blocks of up to {draft_len + 1} tokens"
    try:
        layout = read_layout()
    except Exception as exc:  # a warm-up is an optimization: never the reason a server fails to start
        kernels["head_layout"] = f"unreadable: {type(exc).__name__}: {exc}"[:300]
        if drafts or verifies:
            logger.exception("VeriCache: compiling %s at start-up failed (reading the model's head layout); they "
                             "compile at first use instead",
                             " and ".join(w for w, on in ((what_drafts, drafts), (what_verify, verifies)) if on))
        _not_warmed(kernels, "no head layout")
        return
    kernels["head_layout"] = None if layout is None else str(layout)
    if layout is None or not compile_now:
        _not_warmed(kernels, "no attention layer found" if layout is None else "not asked to")
        return
    if drafts:
        status = _warm(what_drafts, layout, lambda: warm_up(compressors, layout, device, windows=windows),
                       _drafts_failed)
        failure = draft_kernels_failed()  # the warm-up failed, or a round of it fell back to torch
        kernels["draft"] = status if failure is None else f"off: {failure}"
    if verifies:
        kernels["verify"] = _warm(what_verify, layout, lambda: warm_verify(layout, draft_len + 1, device),
                                  _verify_failed)


def _not_warmed(kernels: dict, why: str) -> None:
    for key in ("draft", "verify"):
        if kernels[key] == "pending":
            kernels[key] = f"compiled at first use ({why})"


def _warm(what: str, layout, compile_them, failed: Callable[[str, Exception], str]) -> str:
    logger.info("VeriCache: compiling %s (%s)", what, layout)
    try:
        seconds = compile_them()
    except Exception as exc:  # a warm-up is an optimization: never the reason a server fails to start
        return failed(what, exc)
    if seconds is None:
        return "off"
    logger.info("VeriCache: %s ready in %.1f s", what, seconds)
    return f"ready in {seconds:.1f} s"


def _drafts_failed(what: str, exc: Exception) -> str:
    """The draft kernels failed to compile (a GPU short of shared memory for a variant, a
    ptxas error: ``kernels.launch_failed``): they would fail the same way in a round, so
    drafts run on torch ("off": warm_up_kernels names the failure). Running out of memory
    is not the kernels' doing, and another error is the warm-up's own: the kernels stay on
    and compile at first use."""
    from sgl_vericache.kernels import launch_failed, turn_draft_kernels_off

    if not launch_failed(exc):
        return _compiled_at_first_use(what, exc)
    turn_draft_kernels_off(exc, f"compiling {what} failed")  # logged there, with the traceback
    return "off"


def _verify_failed(what: str, exc: Exception) -> str:
    """The verify kernel failed to compile (``kernels.launch_failed``): verify attention takes
    its torch path from the start ("off", named); any other failure leaves it to compile at
    first use."""
    from sgl_vericache.kernels import launch_failed, turn_verify_kernel_off, verify_kernel_failed

    if not launch_failed(exc):
        return _compiled_at_first_use(what, exc)
    turn_verify_kernel_off(exc, f"compiling {what} failed")
    return f"off: {verify_kernel_failed()}"


def _compiled_at_first_use(what: str, exc: Exception) -> str:
    logger.exception("VeriCache: compiling %s at start-up failed; they compile at first use instead", what)
    return f"compiled at first use (warm-up failed: {type(exc).__name__}: {exc})"[:300]
