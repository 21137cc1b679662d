"""Draft attention for sliding-window layers, over the full KV itself (no SGLang imports).

A sliding-window layer (Gemma 2 and 3, gpt-oss, Mistral's first models, OLMo 3) attends at
position ``p`` to positions ``p - window .. p`` only. Drafting such a layer over the
request's compressed entry of the whole context reads what the target never does: with
every token kept (the ``full`` compressor) a tiny Gemma 3 of window 16 needed 28-30 verify
rounds for 40 tokens where the same model without a window needed 5. But a window layer
needs no compression: its share of a request is at most ``window`` tokens, which the full
KV pool holds already. So in a round a window layer's draft attention reads those tokens
from the pool, where they lie (the slots of the request's last ``window`` verified
tokens), and the round's own provisional draft tokens, with the target's exact window at
every draft step; the compressed entries serve the full-attention layers as before.

``WindowedDraft`` stands where a round's draft passes take a ``CompressedKVStore``
(``attend``): window layers go to the pool, the others to the store. The pool is
read through ``kv_buffers(layer_id) -> (k_pool, v_pool)``, each ``[slots, H_kv, D]``, and
per row the slots of its verified tokens (SGLang's request-to-token row).

Not used for requests whose full KV is parked in host memory (``--vericache-full-device-
budget``) nor for drafts made while a prefix is fetched (its KV is not in the pool yet):
their window layers read the compressed entry, as before.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from sgl_vericache.kernels import draft_head_dim, draft_kernels_failed, launch_failed, turn_draft_kernels_off
from sgl_vericache.mem_cache.compress import attention

KVBuffers = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class WindowedDraft:
    def __init__(self, store, windows: Mapping[int, int], kv_buffers: KVBuffers, kernels: Optional[bool] = None):
        """``windows``: layer id -> its window (a query at p sees p - window .. p), for the
        model's sliding-window layers only. ``kernels``: None runs the attention on the draft
        decode kernel (``sgl_vericache.kernels``: reading the pool in place, no gather) where
        the pool is on a device it serves (CUDA), True wherever (tests, under Triton's
        interpreter), False never; never once a draft kernel has failed in this process."""
        if not windows or any(w < 0 for w in windows.values()):
            raise ValueError(f"sliding windows {dict(windows)!r}: accepted: at least one layer, windows >= 0")
        self.store = store
        self.windows = dict(windows)
        self.kv_buffers = kv_buffers
        self.kernels = kernels
        self.widest = max(self.windows.values())  # the most verified tokens a round reads of a row
        self._round: Optional[_WindowRound] = None

    def begin_round(self, slots: Sequence[torch.Tensor], verified: Sequence[int], steps: int) -> None:
        """The round's rows (the store's round order): each row's slots of its verified
        tokens (at least the last max-window of them; ``slots[b][-n:]`` are positions
        ``verified[b] - n ..``) and its verified length; ``steps`` draft steps."""
        self._round = _WindowRound(slots, verified, steps, self.widest, self._on_kernels(slots))

    def _on_kernels(self, slots: Sequence[torch.Tensor]) -> bool:
        if self.kernels is not None or not slots:
            return bool(self.kernels) and draft_kernels_failed() is None
        if slots[0].device.type != "cuda":
            return False
        from sgl_vericache.kernels import draft_attention_available

        return draft_attention_available(slots[0].device)

    def end_round(self) -> None:
        self._round = None

    def attend(self, layer_id: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               scale: float, sinks: Optional[torch.Tensor] = None, softcap: Optional[float] = None) -> torch.Tensor:
        window = self.windows.get(layer_id)
        if window is None or self._round is None:
            return self.store.attend(layer_id, q, k_new, v_new, scale, sinks, softcap)
        return self._round.attend(layer_id, window, self.kv_buffers(layer_id), q, k_new, v_new, scale, sinks,
                                  softcap)


class _WindowRound:
    """One round's window attention on torch: per layer and step, each row's last
    ``window`` pool tokens are gathered beside the round's provisional KV and masked to what
    the step's query sees."""

    def __init__(self, slots: Sequence[torch.Tensor], verified: Sequence[int], steps: int, widest: int,
                 kernels: bool = False):
        if len(slots) != len(verified):
            raise ValueError(f"{len(slots)} rows of slots for {len(verified)} verified lengths")
        self.steps = steps
        self.rows = len(verified)
        device = slots[0].device if slots else torch.device("cpu")
        # right-aligned, per row: the slots and positions of its last `widest` verified tokens
        # (position < 0: none there, a row shorter than the widest window)
        self.index = torch.zeros(self.rows, widest, dtype=torch.int64, device=device)
        lens = torch.tensor([int(n) for n in verified], dtype=torch.int64, device=device)
        self.positions = lens[:, None] - widest + torch.arange(widest, device=device)[None, :]
        for b, (row, n) in enumerate(zip(slots, verified)):
            have = min(int(n), widest)
            if row.shape[0] < have:
                raise ValueError(f"a row of {n} verified tokens has {row.shape[0]} slots")
            if have:
                self.index[b, widest - have:] = row[row.shape[0] - have:]
        self.lens = lens
        self.verified = [int(n) for n in verified]
        self.kernels = kernels
        # (window, step) -> what every window layer of that window reads at that step, made at
        # the first such layer: the torch path's (pool columns, mask), the kernel's (indices, lens, rows)
        self._masks: dict[tuple[int, int], tuple] = {}
        self._tables: dict[tuple[int, int], tuple] = {}
        self.step: dict[int, int] = {}
        self.k_extra: dict[int, torch.Tensor] = {}  # layer -> [B, steps, H_kv, D] provisional KV
        self.v_extra: dict[int, torch.Tensor] = {}

    def attend(self, layer_id, window, pools, q, k_new, v_new, scale, sinks=None, softcap=None):
        """One step of every row: q [B, H_q, D] at positions verified + step (``sinks``: the
        layer's attention sinks [H_q], ``softcap`` its logit soft cap, or None)."""
        step = self.step.get(layer_id, 0)
        assert step < self.steps and q.shape[0] == self.rows, (step, self.steps, q.shape)
        self.step[layer_id] = step + 1
        if layer_id not in self.k_extra:
            self.k_extra[layer_id] = k_new.new_empty((self.rows, self.steps, *k_new.shape[1:]))
            self.v_extra[layer_id] = v_new.new_empty((self.rows, self.steps, *v_new.shape[1:]))
        self.k_extra[layer_id][:, step] = k_new
        self.v_extra[layer_id][:, step] = v_new
        if self.kernels and step <= window and _kernel_reads(pools):
            try:
                return self._kernel_attend(layer_id, window, pools, q, scale, step, sinks, softcap)
            except Exception as exc:  # the torch path below stands in: the kernels are off from now on
                if not launch_failed(exc):
                    raise
                turn_draft_kernels_off(exc)
                self.kernels = False
        masked = self._masks.get((window, step))
        if masked is None:
            first = max(0, self.index.shape[1] - max(window - step, 0))  # older columns no row sees
            seen = torch.arange(step + 1, device=self.index.device)  # provisional token t is at verified + t
            visible = torch.cat([self._pool_visible(window, step)[:, first:],
                                 (seen[None, :] >= step - window).expand(self.rows, -1)], dim=1)
            masked = self._masks[(window, step)] = (self.index[:, first:], visible.to(q.device)[:, None, None, :])
        index, visible = masked
        k_pool, v_pool = pools
        k = torch.cat([k_pool[index], self.k_extra[layer_id][:, : step + 1]], dim=1)  # [B, C + step + 1, H_kv, D]
        v = torch.cat([v_pool[index], self.v_extra[layer_id][:, : step + 1]], dim=1)
        out = attention(q.float()[:, :, None, :], k.float().transpose(1, 2), v.float().transpose(1, 2), visible,
                        scale, sinks, softcap or None)  # [B, H_q, 1, D]
        return out[:, :, 0].to(q.dtype)

    def _pool_visible(self, window: int, step: int) -> torch.Tensor:
        """[B, widest] bool: the pool tokens the query at verified + step sees (positions
        verified + step - window .. on; none before the request's first)."""
        return (self.positions >= 0) & (self.positions >= (self.lens + step - window)[:, None])

    def _kernel_attend(self, layer_id, window, pools, q, scale, step, sinks=None, softcap=None):
        """The same attention on the draft decode kernel, reading the pool in place through
        each row's visible slots (every provisional token is visible: ``step <= window``)."""
        from sgl_vericache.kernels import ops
        from sgl_vericache.kernels.packing import paged_pool

        k_pool, v_pool = pools
        table = self._tables.get((window, step))
        if table is None:
            counts = [max(0, min(n, window - step)) for n in self.verified]  # positions n - c .. n - 1
            # row by row, ascending: each row's last counts[b] columns (right-aligned; sliced by
            # host counts, where a boolean mask would wait for the GPU at every draft step)
            widest = self.index.shape[1]
            indices = torch.cat([self.index[b, widest - c:] for b, c in enumerate(counts)]).to(torch.int32)
            if not indices.numel():
                indices = torch.zeros(1, dtype=torch.int32, device=self.index.device)  # a kernel argument needs storage
            table = self._tables[(window, step)] = (indices, counts,
                                                    paged_pool(k_pool, v_pool, indices, counts).rows())
        indices, counts, rows = table
        return ops.decode_attention(paged_pool(k_pool, v_pool, indices, counts), q, scale, rows,
                                    self.k_extra[layer_id], self.v_extra[layer_id], ext_add=step + 1, sinks=sinks,
                                    softcap=softcap)


def _kernel_reads(pools: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """The decode kernel reads these pools: heads of a size it reads, each pool laid out
    [slots, H_kv, D] contiguously (it addresses row (slot * H_kv + head) * D; SGLang's MHA
    pools are, but a view into a shared or padded buffer would be read at the wrong rows)."""
    return draft_head_dim(pools[0].shape[-1]) and all(p.is_contiguous() for p in pools)
