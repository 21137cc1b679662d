"""Draft attention of sliding-window layers over the full KV pool (spec/window_draft.py),
against attention written out position by position: each draft step's query at position
``p`` sees exactly positions ``p - window .. p`` (the pool's verified tokens through the
request's scattered slots, then the round's provisional tokens), as SGLang's decode does.
Rows shorter and longer than the window, windows 0, 1, 5 and 40, GQA, a window reached
inside the round's own drafts; other layers go to the compressed store. No engine here:
test_sliding_window.py serves a windowed model."""

from __future__ import annotations

import pytest
import torch

from sgl_vericache.spec.window_draft import WindowedDraft

H_Q, H_KV, D, SLOTS = 6, 2, 16, 300


class _Store:
    def __init__(self):
        self.layers = []

    def attend(self, layer_id, q, k_new, v_new, scale, sinks=None, softcap=None):
        self.layers.append(layer_id)
        return torch.zeros_like(q)


def _reference(q, keys, values, scale):
    """q [H_q, D] over keys/values [N, H_kv, D], all visible."""
    k = keys.repeat_interleave(H_Q // H_KV, dim=1)
    v = values.repeat_interleave(H_Q // H_KV, dim=1)
    probs = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", probs, v)


@pytest.mark.parametrize("window", [0, 1, 5, 40])
def test_each_step_sees_exactly_its_window(window):
    gen = torch.Generator().manual_seed(window)
    k_pool = torch.randn(SLOTS, H_KV, D, generator=gen)
    v_pool = torch.randn(SLOTS, H_KV, D, generator=gen)
    verified = [3, 57, 40, 0]  # shorter than, past, at the widest window; a row with no verified KV yet
    perm = torch.randperm(SLOTS, generator=gen)
    rows, at = [], 0
    for n in verified:  # each row's slots: scattered through the pool
        rows.append(perm[at:at + n])
        at += n
    windows = {1: window, 3: 40}  # a second window layer, wider: the round keeps the widest's slots
    store = _Store()
    draft = WindowedDraft(store, windows, lambda layer: (k_pool, v_pool))
    steps, scale = 7, D ** -0.5
    widest = max(windows.values())
    draft.begin_round([r[max(0, n - widest):] for r, n in zip(rows, verified)], verified, steps)
    provisional_k = torch.randn(steps, len(verified), H_KV, D, generator=gen)
    provisional_v = torch.randn(steps, len(verified), H_KV, D, generator=gen)
    for step in range(steps):
        q = torch.randn(len(verified), H_Q, D, generator=gen)
        out = draft.attend(1, q, provisional_k[step], provisional_v[step], scale)
        assert draft.attend(0, q, provisional_k[step], provisional_v[step], scale).abs().sum() == 0  # the store's
        for b, n in enumerate(verified):
            query = n + step
            seen = range(max(0, query - window), query + 1)
            keys = torch.stack([k_pool[rows[b][p]] if p < n else provisional_k[p - n, b] for p in seen])
            values = torch.stack([v_pool[rows[b][p]] if p < n else provisional_v[p - n, b] for p in seen])
            torch.testing.assert_close(out[b], _reference(q[b], keys, values, scale), rtol=1e-5, atol=1e-5)
    assert store.layers == [0] * steps
    draft.end_round()
    draft.attend(1, q, provisional_k[0], provisional_v[0], scale)  # between rounds: the store's
    assert store.layers[-1] == 1


def test_a_round_needs_the_slots_of_its_rows():
    draft = WindowedDraft(_Store(), {0: 8}, lambda layer: None)
    with pytest.raises(ValueError, match="a row of 20 verified tokens has 5 slots"):
        draft.begin_round([torch.arange(5)], [20], 4)
    with pytest.raises(ValueError, match="accepted: at least one layer"):
        WindowedDraft(_Store(), {}, lambda layer: None)


def _round_inputs(verified, widest, seed):
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(SLOTS, generator=gen)
    rows, at = [], 0
    for n in verified:
        rows.append(perm[at:at + n][max(0, n - widest):])
        at += n
    return gen, rows


def _drafts_on_kernels_and_torch(monkeypatch, pools, launch, verified=(3, 57, 40, 0), window=5, steps=4, seed=9):
    """Outputs of every step of one round on the kernel path (its launch replaced by
    ``launch``) and on torch, window layer 0 over ``pools``."""
    from sgl_vericache.kernels import ops

    monkeypatch.setattr(ops, "decode_attention", launch)
    gen, rows = _round_inputs(verified, window, seed)
    drafts = [WindowedDraft(_Store(), {0: window}, lambda layer: pools, kernels=flag) for flag in (True, False)]
    outs = [[], []]
    for d in drafts:
        d.begin_round(rows, list(verified), steps)
    for _ in range(steps):
        q = torch.randn(len(verified), H_Q, D, generator=gen)
        k_new, v_new = torch.randn(len(verified), H_KV, D, generator=gen), torch.randn(len(verified), H_KV, D,
                                                                                       generator=gen)
        for out, d in zip(outs, drafts):
            out.append(d.attend(0, q, k_new, v_new, D**-0.5, None, 3.0))
    return drafts, [torch.stack(o) for o in outs]


def test_a_failed_window_launch_drafts_on_torch_from_then_on(monkeypatch):
    """A window layer's kernel that fails to compile (out of shared memory, say) does not stop
    the server: the step runs on the torch path, as does the rest of the round and every
    later one (the draft kernels are off for the process)."""
    from triton.runtime.errors import OutOfResources

    from sgl_vericache import kernels

    monkeypatch.setattr(kernels, "_draft_failure", None)
    calls = []

    def launch(*args, **kwargs):
        calls.append(1)
        raise OutOfResources(232448, 101376, "shared memory")

    pools = (torch.randn(SLOTS, H_KV, D), torch.randn(SLOTS, H_KV, D))
    drafts, (got, want) = _drafts_on_kernels_and_torch(monkeypatch, pools, launch)
    torch.testing.assert_close(got, want)
    assert len(calls) == 1 and kernels.draft_kernels_failed().startswith("a draft kernel failed: OutOfResources")
    drafts[0].begin_round([torch.arange(4)], [4], 2)
    assert not drafts[0]._round.kernels


def test_a_pool_the_kernel_cannot_address_drafts_on_torch(monkeypatch):
    """The decode kernel addresses pool rows as (slot * H_kv + head) * D: a pool that is a
    view (K and V in one buffer, a padded head stride) is read on torch, not at the wrong rows."""
    from sgl_vericache import kernels

    monkeypatch.setattr(kernels, "_draft_failure", None)
    kv = torch.randn(SLOTS, 2, H_KV, D)  # K and V of a slot side by side: each pool strided
    pools = (kv[:, 0], kv[:, 1])
    drafts, (got, want) = _drafts_on_kernels_and_torch(
        monkeypatch, pools, lambda *a, **k: pytest.fail("the kernel read a strided pool"))
    torch.testing.assert_close(got, want)


def test_the_kernel_paths_slot_table_never_waits_for_the_device(monkeypatch):
    """The kernel path's table of visible slots comes from host counts, never a boolean mask
    (a nonzero: the host waits for every queued kernel, at every draft step), and it holds
    each row's visible slots in order: the last min(verified, window - step) of its window."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sgl_vericache import kernels

    monkeypatch.setattr(kernels, "_draft_failure", None)
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            indices = args[1] if func is torch.ops.aten.index.Tensor else ()
            seen.append((str(func), any(i is not None and i.dtype == torch.bool for i in indices)))
            return func(*args, **(kwargs or {}))

    tables = []

    def launch(packed, q, scale, rows, *args, **kwargs):
        tables.append((packed.indices.tolist(), list(packed.main_len)))
        return torch.zeros_like(q)

    from sgl_vericache.kernels import ops

    monkeypatch.setattr(ops, "decode_attention", launch)
    verified, window = [3, 57, 40, 0], 5
    _, rows = _round_inputs(verified, window, 11)
    draft = WindowedDraft(_Store(), {0: window}, lambda layer: (torch.randn(SLOTS, H_KV, D),) * 2, kernels=True)
    draft.begin_round(rows, verified, 3)
    with Ops():
        for _ in range(3):
            draft.attend(0, torch.randn(4, H_Q, D), torch.randn(4, H_KV, D), torch.randn(4, H_KV, D), D**-0.5)
    waits = [name for name, masked in seen if masked or "nonzero" in name]
    assert not waits, waits
    for step, (indices, counts) in enumerate(tables):
        want = [min(n, window - step) for n in verified]
        assert counts == want and indices == [s for r, c in zip(rows, want) for s in r[len(r) - c:].tolist()]
