"""The draft kernels through CompressedKVStore (kernel_checks' `store` family): rounds on the
kernels against the same store on its dense torch path, and the start-up warm-up
(spec/warm_up.py) against the kernel variants later rounds launch, by Triton's own cache
keys. Imported by kernel_checks.py, which sets up the import path; not a pytest module."""

from __future__ import annotations

import math
import os

import torch

from sgl_vericache.kernels import ops
from sgl_vericache.mem_cache.compress import get_compressor

from kernel_fixtures import KIVI, Shape, _close, _gen, _kv


def check_store_rounds(methods: tuple[str, ...], device, dtype=torch.float32, sinks: bool = False,
                       softcap: float | None = None) -> float:
    """CompressedKVStore on the kernels (draft_kernels=True, what CUDA gets by default) against
    the same store on its dense torch path: requests of different lengths and compressors
    drafted together over rounds that grow them, then a teacher-forced round. Requests of one
    method share its compressor, so the round reads their entries together (in place). With
    ``sinks``, a layer's attention sinks, and with ``softcap`` its logit soft cap (each must
    move the outputs: else both paths could be ignoring it alike)."""
    shape = Shape((0,), kv_heads=2, group=3, dtype=dtype)
    from sgl_vericache.spec.drafter import CompressedKVStore

    lengths = [70, 23, 41][: len(methods)]
    kv = [_kv(200, shape, 300 + i) for i in range(len(methods))]
    kv = [(k.to(device), v.to(device)) for k, v in kv]
    prompt_q = torch.randn(8, 6, 64, generator=_gen(31)).to(dtype).to(device)
    made = _round_methods(methods)  # one compressor a method: its requests read together
    comps = [made[m] for m in methods]
    stores = [CompressedKVStore(comps[0], num_layers=2, draft_kernels=flag) for flag in (False, True)]
    sink = _sinks(6, 33, device) if sinks else None
    err = 0.0
    for rnd, grow in enumerate((0, 30)):
        lengths = [n + grow for n in lengths]
        for st in stores:
            for i, (k, v) in enumerate(kv):
                st.sync(i, lengths[i], lambda _, a, b, k=k, v=v: (k[a:b], v[a:b]), compressor=comps[i],
                        queries=[prompt_q, prompt_q])
        rids = list(range(len(methods)))[::-1] if rnd % 2 else list(range(len(methods)))
        g = _gen(40 + rnd)
        q = torch.randn(3, len(rids), 6, 64, generator=g).to(dtype).to(device)
        kn, vn = (torch.randn(3, len(rids), 2, 64, generator=g).to(dtype).to(device) for _ in range(2))
        outs = []
        for st in stores:
            st.begin_round(rids, 3)
            outs.append(torch.stack([st.attend(layer, q[s], kn[s], vn[s], 0.125, sink, softcap) for s in range(3)
                                     for layer in (0, 1)]))
        assert stores[0]._kernel_round is None and stores[1]._kernel_round is not None
        err = max(err, _close(outs[1], outs[0], dtype, f"store round {rnd} {methods}"))
        for dropped, kwargs in (("sinks", {"softcap": softcap}), ("soft cap", {"sinks": sink})):
            if (sinks if dropped == "sinks" else softcap):  # each must change the drafts' attention
                stores[0].begin_round(rids, 3)
                plain = torch.stack([stores[0].attend(layer, q[s], kn[s], vn[s], 0.125, **kwargs) for s in range(3)
                                     for layer in (0, 1)])
                assert (plain - outs[0]).abs().max() > 0.05, f"the {dropped} did not change the drafts' attention"
    if "quest" not in methods:  # teacher forcing one request (Quest selects per query: refused)
        outs = []
        for st in stores:
            st.begin_round([len(methods) - 1], 6)
            outs.append(torch.cat([st.attend_tokens(0, q[0, :1].expand(4, -1, -1) * torch.arange(1, 5, device=device)
                                                    [:, None, None].to(dtype), kn[0, :1].expand(4, -1, -1).contiguous(),
                                                    vn[0, :1].expand(4, -1, -1).contiguous(), 0.125, sink, softcap),
                                   st.attend(0, q[1, :1], kn[1, :1], vn[1, :1], 0.125, sink, softcap)]))
        err = max(err, _close(outs[1], outs[0], dtype, f"store teacher-forced {methods}"))
    assert stores[1].buffer_nbytes() > 0
    for st in stores:
        for rid in range(len(methods)):
            st.release(rid)
    assert stores[1].buffer_nbytes() == 0 and stores[1]._kernel_round is None
    return err


def _off_by_8(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to an address 8 bytes past a 16-byte boundary."""
    buf = torch.empty(t.numel() * t.element_size() + 8, dtype=torch.uint8, device=t.device)
    out = buf[8:].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def check_mixed_packing(method: str, device) -> float:
    """A round whose layers pack differently: layer 0's entries read in place, layer 1's
    copied end to end (one entry's tensors off 16 bytes, which the kernels cannot read in
    place), so their row tables differ (all starts 0 against cumulative). Until 2026-12-06
    one table, layer 0's, served every layer: row 1 read row 0's entry at layer 1."""
    from dataclasses import fields, replace

    from sgl_vericache.spec.drafter import CompressedKVStore

    shape = Shape((0,), kv_heads=2, group=3)
    comp = _round_methods((method,))[method]
    stores = [CompressedKVStore(comp, num_layers=2, draft_kernels=flag) for flag in (False, True)]
    kv = [tuple(t.to(device) for t in _kv(n, shape, 500 + n)) for n in (60, 37)]
    for st in stores:
        for rid, (k, v) in enumerate(kv):
            st.sync(rid, k.shape[0], lambda _, a, b, k=k, v=v: (k[a:b], v[a:b]))
    entry = stores[1]._entries[1]
    layer = entry.layers[1]
    entry.layers[1] = replace(layer, **{f.name: _off_by_8(getattr(layer, f.name)) for f in fields(layer)
                                        if isinstance(getattr(layer, f.name), torch.Tensor)})
    g = _gen(61)
    q = torch.randn(2, 2, 6, 64, generator=g).to(device)
    kn, vn = (torch.randn(2, 2, 2, 64, generator=g).to(device) for _ in range(2))
    outs = []
    for st in stores:
        st.begin_round([0, 1], 2)
        outs.append(torch.stack([st.attend(layer_id, q[s], kn[s], vn[s], 0.125) for s in range(2)
                                 for layer_id in (0, 1)]))
    packed = stores[1]._kernel_round._packed
    assert packed[0][0].addresses is not None and packed[1][0].addresses is None, "the layers packed alike"
    err = _close(outs[1], outs[0], torch.float32, f"mixed packing {method}")
    # every layer is packed when the round begins, but a layer drafted elsewhere (a window
    # layer, over the pool) only if it is read after all
    stores[1].begin_round([0, 1], 2, unread={1})
    lazy = stores[1]._kernel_round._packed
    assert lazy[0] is not None and lazy[1] is None, "an unread layer was packed ahead"
    again = torch.stack([stores[1].attend(layer_id, q[s], kn[s], vn[s], 0.125) for s in range(2)
                         for layer_id in (0, 1)])
    err = max(err, _close(again, outs[1], torch.float32, f"mixed packing {method}, layer 1 packed when read"))
    for rid in (0, 1):
        for st in stores:
            st.release(rid)
    return err


def _kernel_modules() -> dict:
    from sgl_vericache.kernels import triton_decode, triton_quest, triton_verify

    return {"td": triton_decode, "tq": triton_quest, "tv": triton_verify}


class LaunchKeys:
    """While entered, records Triton's compile-cache key (``compute_cache_key`` of its own
    binder: constexprs, dtypes, the integer and alignment specializations, num_warps /
    num_stages) of every launch of the draft kernels, as (kernel, key). Computed from the
    launch's own arguments for an sm_90 target, so it works under the interpreter too. The
    verify kernel's too (kernel_verify_checks.py).

    ``run=False`` records the launches without running them, for callers that read no
    kernel output: a key is a function of the arguments' types, shapes' specializations and
    constexprs, never of the values the kernels write (the warm-up checks under the
    interpreter, where running them is most of their minutes; compiled, they run, so
    ``_compiled_count`` sees what they compile)."""

    NAMES = (("td", "_decode_split_kernel"), ("td", "_combine_kernel"), ("tq", "_page_scores_kernel"),
             ("tq", "_quest_group_kernel"), ("tq", "_quest_split_kernel"), ("tv", "_verify_split_kernel"))

    def __init__(self, run: bool = True):
        self.keys: set[tuple[str, str]] = set()
        self.run = run
        self._saved = []

    def __enter__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        backend = make_backend(GPUTarget("cuda", 90, 32))
        for mod, name in self.NAMES:
            module = _kernel_modules()[mod]
            kernel = getattr(module, name)
            jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
            binder = create_function_from_signature(jit.signature, jit.params, backend)
            self._saved.append((module, name, kernel))
            setattr(module, name, _Recorded(kernel, name, binder, self))
        return self

    def __exit__(self, *exc):
        for module, name, kernel in self._saved:
            setattr(module, name, kernel)
        self._saved.clear()


def _run_launches() -> bool:
    """Whether warm-up checks run the launches they record: compiled yes (what they compile
    is counted), interpreted no (LaunchKeys' ``run``)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


class _Recorded:
    def __init__(self, kernel, name, binder, recorder: LaunchKeys):
        self.kernel, self.name, self.binder, self.recorder = kernel, name, binder, recorder

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.runtime.jit import compute_cache_key

            _, specialization, options = self.binder(*args, **kwargs)
            self.recorder.keys.add((self.name, compute_cache_key({}, specialization, options)))
            if self.recorder.run:
                return self.kernel[grid](*args, **kwargs)

        return launch


def _compiled_count(device) -> int:
    """Kernels Triton has compiled for the draft and verify kernels on this device (0 under the interpreter)."""
    total = 0
    for mod, name in LaunchKeys.NAMES:
        caches = getattr(getattr(_kernel_modules()[mod], name), "device_caches", None)
        if caches is not None:
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index in caches:
                total += len(caches[index][0])
    return total


def _round_methods(methods):
    """One compressor per method at the small cases' options (Quest pages of 8, KIVI)."""
    return {m: get_compressor(m, 4.0, **({"page_size": 8} if m == "quest" else {}),
                              **(KIVI if m.startswith("kivi") else {})) for m in methods}


def check_warm_up(methods: tuple[str, ...], device, sinks: bool = False, softcap: float = 0.0) -> float:
    """spec.warm_up compiles every kernel variant that later draft rounds launch: rounds of
    other lengths, batch sizes, draft lengths, a teacher-forced one, requests sharing a
    compressor and mixing several, and the same over entries long enough to be addressed in
    int64 (``_long_entries``), after the warm-up, launch no kernel whose Triton cache key the
    warm-up did not (and on CUDA, compile nothing new); ``sinks``: for a model with
    attention sinks (its rounds pass them, as bf16 values the warm-up never saw); ``softcap``:
    for a model whose attention soft-caps its scores at that cap."""
    warm, real, compiled = _warm_up_launches(methods, device, sinks, softcap, _run_launches())
    return _all_warmed(warm, real, device, compiled)


def check_recording_sees_the_keys_running_does(methods: tuple[str, ...], device) -> float:
    """The warm-up checks' premise under the interpreter (``LaunchKeys(run=False)``): with
    their launches recorded and not run, the warm-up and the rounds launch the same variants
    as with every launch run (no key, nor which launches happen, depends on what a kernel
    wrote)."""
    ran, recorded = (_warm_up_launches(methods, device, False, 0.0, run) for run in (True, False))
    assert ran[0].keys == recorded[0].keys and ran[1].keys == recorded[1].keys, (
        ran[0].keys ^ recorded[0].keys, ran[1].keys ^ recorded[1].keys)
    return 0.0


def _warm_up_launches(methods, device, sinks: bool, softcap: float, run: bool):
    """check_warm_up's launches: (the warm-up's LaunchKeys, the rounds', kernels compiled in
    between)."""
    from sgl_vericache.spec.drafter import CompressedKVStore
    from sgl_vericache.spec.warm_up import HeadLayout, warm_up

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = Shape((0,), kv_heads=2, group=3, dtype=dtype)
    layout = HeadLayout(6, 2, 64, dtype, dtype, logit_cap=softcap, sinks=sinks)
    sink = _sinks(6, 53, device) if sinks else None
    with LaunchKeys(run=run) as warm:
        assert warm_up(list(_round_methods(methods).values()), layout, device, draft_kernels=True,
                       lengths=(120, 70)) is not None
    names = {name for name, _ in warm.keys}
    assert "_decode_split_kernel" in names or "_quest_group_kernel" in names, names
    assert sum(name == "_combine_kernel" for name, _ in warm.keys) == int(math.log2(ops.MAX_SPLITS)), warm.keys
    compiled = _compiled_count(device)
    comps = _round_methods(methods)
    req_methods = [m for m in methods for _ in range(2 if m == methods[0] else 1)]  # the first method twice
    lengths = [90 + 37 * i for i in range(len(req_methods))]
    kv = [tuple(t.to(device) for t in _kv(max(lengths) + 40, shape, 500 + i)) for i in range(len(req_methods))]
    prompt_q = torch.randn(8, 6, 64, generator=_gen(51)).to(dtype).to(device)
    store = CompressedKVStore(comps[methods[0]], num_layers=2, draft_kernels=True)
    g = _gen(52)

    def step(attend, rows: int) -> None:
        q = torch.randn(rows, 6, 64, generator=g).to(dtype).to(device)
        kn, vn = (torch.randn(rows, 2, 64, generator=g).to(dtype).to(device) for _ in range(2))
        attend(q, kn, vn, 0.125, sink, softcap or None)

    every = list(range(len(req_methods)))
    with LaunchKeys(run=run) as real:
        for long, rounds in ((False, ((0, [0], 3), (17, every, 5), (40, [1, 0], 2))), (True, ((40, [0], 1),
                                                                                              (40, every, 1)))):
            with _long_entries(long):
                for grow, batch, steps in rounds:
                    for i, (k, v) in enumerate(kv):
                        store.sync(i, lengths[i] + grow, lambda _, a, b, k=k, v=v: (k[a:b], v[a:b]),
                                   compressor=comps[req_methods[i]], queries=[prompt_q, prompt_q])
                    store.begin_round(batch, steps)
                    for _ in range(steps):
                        for layer in (0, 1):
                            step(lambda *a, layer=layer: store.attend(layer, *a), len(batch))
                if "quest" != req_methods[-1]:
                    store.begin_round([len(req_methods) - 1], 4)
                    step(lambda *a: store.attend_tokens(0, *a), 4)
    store.clear()
    return warm, real, compiled


class _long_entries:
    """While entered with ``on``, launches address their entries in int64, as one past 2^31
    elements is (``ops.offsets32`` says no): no entry short enough to run here reaches that."""

    def __init__(self, on: bool):
        self.on, self.saved = on, ops.offsets32

    def __enter__(self):
        if self.on:
            ops.offsets32 = lambda *args: False

    def __exit__(self, *exc):
        ops.offsets32 = self.saved


def check_window_rounds(device, dtype=torch.float32, group=3, head_dim=64, sinks: bool = False,
                        softcap: float | None = None) -> float:
    """Sliding-window layers' drafts over the pool (spec/window_draft.py) on the decode kernel,
    reading the pool in place, against the same on torch: rows shorter than, past and at the
    window, one with no verified KV, scattered slots, two windows, every step of two rounds
    (a window reached inside the drafts falls back to torch, as it does on CUDA); with
    ``sinks``, a layer's attention sinks (gpt-oss's window layers have them); with ``softcap``,
    its logit soft cap (Gemma 2's window layers have one)."""
    from sgl_vericache.spec.window_draft import WindowedDraft

    shape = Shape((0,), kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    k_pool, v_pool = (t.to(device) for t in _kv(260, shape, 71))
    perm = torch.randperm(260, generator=_gen(72)).to(device)
    windows = {0: 5, 1: 40}
    drafts = [WindowedDraft(None, windows, lambda layer: (k_pool, v_pool), kernels=flag) for flag in (False, True)]
    plain = WindowedDraft(None, windows, lambda layer: (k_pool, v_pool), kernels=False)  # sinks and cap left out
    err, steps, moved = 0.0, 7, 0.0
    sink = _sinks(2 * group, 74, device) if sinks else None
    for rnd, verified in enumerate(([3, 57, 40, 0], [11, 90, 44, 6])):
        rows, at = [], 0
        for n in verified:
            rows.append(perm[at:at + n])
            at += n
        g = _gen(73 + rnd)
        extra = [torch.randn(len(verified), 2, 2, head_dim, generator=g).to(dtype).to(device) for _ in range(steps)]
        queries = [torch.randn(len(verified), 2 * group, head_dim, generator=g).to(dtype).to(device)
                   for _ in range(steps)]
        for d in drafts + [plain]:
            d.begin_round([r[max(0, n - 40):] for r, n in zip(rows, verified)], verified, steps)
        for step in range(steps):
            for layer in windows:
                outs = [d.attend(layer, queries[step], extra[step][:, 0], extra[step][:, 1], head_dim ** -0.5, sink,
                                 softcap) for d in drafts]
                err = max(err, _close(outs[1], outs[0], dtype, f"window {windows[layer]} round {rnd} step {step}"))
                without = plain.attend(layer, queries[step], extra[step][:, 0], extra[step][:, 1], head_dim ** -0.5)
                moved = max(moved, float((without - outs[0]).abs().max()))
        for d in drafts + [plain]:
            d.end_round()
    changed = bool(sinks or softcap)
    assert changed == (moved > 0.05), f"sinks {sinks}, soft cap {softcap}, yet the outputs moved by {moved} from " \
                                      "those without"
    return err


def _sinks(num_q_heads: int, seed: int, device) -> torch.Tensor:
    """Attention sinks as a model holds them ([H_q], bf16), large enough to take a good share
    of each head's softmax."""
    return (2.0 + 2.0 * torch.randn(num_q_heads, generator=_gen(seed))).to(torch.bfloat16).to(device)


def check_window_warm_up(device, softcap: float = 0.0) -> float:
    """spec.warm_up with sliding-window layers compiles what their rounds launch on the
    decode kernel: rounds of other lengths, batches, windows and steps launch no kernel
    whose Triton cache key the warm-up did not; ``softcap``: for a model that soft-caps its
    scores at that cap (Gemma 2's window layers)."""
    from sgl_vericache.spec.warm_up import HeadLayout, warm_up
    from sgl_vericache.spec.window_draft import WindowedDraft

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layout = HeadLayout(6, 2, 64, dtype, dtype, logit_cap=softcap)
    with LaunchKeys(run=_run_launches()) as warm:
        assert warm_up([], layout, device, draft_kernels=True, lengths=(120, 70), windows=True) is not None
    compiled = _compiled_count(device)
    shape = Shape((0,), kv_heads=2, group=3, dtype=dtype)
    k_pool, v_pool = (t.to(device) for t in _kv(400, shape, 81))
    draft = WindowedDraft(None, {0: 16, 1: 100}, lambda layer: (k_pool, v_pool), kernels=True)
    g = _gen(82)
    with LaunchKeys(run=_run_launches()) as real:
        for verified, steps in (([300], 3), ([50, 9, 0, 130], 5), ([7, 200], 2)):
            slots = torch.randperm(400, generator=g)[: sum(verified)].to(device).split(verified)
            draft.begin_round(list(slots), verified, steps)
            for _ in range(steps):
                q = torch.randn(len(verified), 6, 64, generator=g).to(dtype).to(device)
                kn, vn = (torch.randn(len(verified), 2, 64, generator=g).to(dtype).to(device) for _ in range(2))
                for layer in (0, 1):
                    draft.attend(layer, q, kn, vn, 0.125, None, softcap or None)
            draft.end_round()
    return _all_warmed(warm, real, device, compiled)


def _all_warmed(warm: "LaunchKeys", real: "LaunchKeys", device, compiled: int) -> float:
    """Every launch variant of the rounds was one the warm-up launched (and on CUDA nothing
    compiled since ``compiled`` was counted)."""
    missing = real.keys - warm.keys
    assert real.keys and not missing, f"{len(missing)} launch variants the warm-up did not compile: " + "; ".join(
        f"{name} {key[:300]}" for name, key in sorted(missing))
    assert _compiled_count(device) == compiled, (compiled, _compiled_count(device))
    return 0.0
