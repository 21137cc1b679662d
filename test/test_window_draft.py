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
