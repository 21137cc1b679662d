"""Per-request compressed KV for drafting (no SGLang imports).

The store keeps, for every running request and layer, a ``CompressedLayer`` that is a
compression of the request's *verified* KV: before each draft round ``sync`` compresses
(first time) or appends (later) the verified tokens it has not seen yet, reading them from
the full KV through a callback. ``begin_round`` then lays the round's requests side by side
in one draft buffer per layer: each entry's keys/values as a dense reader sees them
(``materialize``), padded to the longest, plus room for the round's draft tokens. The draft
tokens' own K/V (computed from approximate hidden states) are written into that buffer only,
never into an entry, and the next ``begin_round`` overwrites them. So the compressed cache
is always a compression of the true cache, and provisional KV never reaches either cache.

One draft step then costs one attention call per layer for the whole batch, reading each
kept key once; nothing is concatenated or copied per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Hashable, Optional, Sequence

import torch

from sgl_vericache.mem_cache.compress import CompressedLayer, KVCompressor, attention, full_nbytes

# (layer_id, start, end) -> (k, v), each [end - start, H_kv, D]: verified KV of a request
ReadKV = Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]
_ROW_ALIGN = 64  # buffer rows are allocated in multiples of this, so small growth reuses them
_GROW_ROOM = 8  # a grown buffer has 1/_GROW_ROOM of its rows spare (see _grow)


@dataclass
class _RequestEntry:
    compressor: KVCompressor
    layers: list[Optional[CompressedLayer]]
    cached_len: int = 0  # verified tokens represented by every layer's entry


@dataclass
class _Round:
    """The draft round in progress: which requests, in which rows, and how far it got."""

    entries: list[_RequestEntry]
    dense_lens: list[int]  # per request: rows of its materialized entry
    width: int  # max(dense_lens): draft token s of every request sits in column width + s
    steps: int
    valid: Optional[torch.Tensor]  # [B, 1, 1, width + steps] bool; None when no row is padded
    step: list[int]  # per layer: draft tokens written so far this round
    query_aware: bool  # some request's compressor selects keys per step (Quest)


def kernels_on(draft_kernels: Optional[bool], device) -> bool:
    """Whether draft rounds on ``device`` run on the GPU kernels (each row's own entry read
    where it lies) rather than the dense path (every row padded to the longest):
    ``draft_kernels`` as asked, None: where they are available (CUDA); never once a kernel
    has failed in this process (``kernels.turn_draft_kernels_off``). The kernels' package
    imports neither triton nor CUDA."""
    from sgl_vericache.kernels import draft_attention_available, draft_kernels_failed

    if draft_kernels is not None:
        return draft_kernels and draft_kernels_failed() is None
    return torch.device(device).type == "cuda" and draft_attention_available(device)


def _stale(entry, verified_len: int, compressor: KVCompressor) -> bool:
    return entry.cached_len > verified_len or entry.compressor is not compressor


class CompressedKVStore:
    def __init__(self, compressor: KVCompressor, num_layers: int, draft_kernels: Optional[bool] = None):
        """``draft_kernels``: None runs draft attention on the GPU kernels (sgl_vericache.kernels)
        when the entries are on a device they serve (CUDA), else on the dense buffers below;
        True uses the kernels wherever (tests, under Triton's interpreter) until one fails,
        False never."""
        self.compressor = compressor
        self.num_layers = num_layers
        self.draft_kernels = draft_kernels
        self._kernel_round = None  # kernels.draft_round.KernelDraftRound of the round in progress
        self._entries: dict[Hashable, _RequestEntry] = {}
        self._round: Optional[_Round] = None
        self._k_buf: list[Optional[torch.Tensor]] = [None] * num_layers  # [B_cap, H_kv, L_cap, D]
        self._v_buf: list[Optional[torch.Tensor]] = [None] * num_layers
        # per buffer row, what the last begin_round wrote there: (entry, its layers, rows)
        self._laid_out: list[tuple[_RequestEntry, list, int]] = []
        self.tokens_compressed = 0  # counters for metrics
        self.tokens_appended = 0
        self.tokens_reused = 0  # verified tokens whose compressed KV came from a shared prefix entry

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._entries

    def cached_len(self, rid: Hashable) -> int:
        entry = self._entries.get(rid)
        return 0 if entry is None else entry.cached_len

    def seed(self, rid: Hashable, compressor: KVCompressor, layers: Sequence[CompressedLayer], cached_len: int) -> None:
        """Start a new request's entry from compressed layers it shares with others (a
        prefix hit in ``CompressedPrefixCache``): each represents its first ``cached_len``
        verified tokens. Entries are values, so later appends never touch the shared ones."""
        if rid in self._entries:
            raise ValueError(f"request {rid!r} already has a compressed entry; seed() is for new requests")
        if len(layers) != self.num_layers or any(l.num_tokens != cached_len for l in layers):
            raise ValueError(f"a seed needs {self.num_layers} layers of {cached_len} tokens; got "
                             f"{[l.num_tokens for l in layers]}")
        self._entries[rid] = _RequestEntry(compressor, list(layers), cached_len)
        self.tokens_reused += cached_len

    def entry(self, rid: Hashable) -> Optional[tuple[KVCompressor, tuple[CompressedLayer, ...], int]]:
        """(compressor, per-layer entries, verified tokens they represent) of a request, or None."""
        entry = self._entries.get(rid)
        if entry is None or not entry.cached_len:
            return None
        return entry.compressor, tuple(entry.layers), entry.cached_len

    def rebuilds(self, rid: Hashable, verified_len: int, compressor: KVCompressor) -> bool:
        """Whether ``sync(rid, verified_len, compressor=compressor)`` builds the entry from its
        first token (none yet, another compressor, or the request went back)."""
        entry = self._entries.get(rid)
        return entry is None or not entry.cached_len or _stale(entry, verified_len, compressor)

    def behind(self, rid: Hashable, verified_len: int, compressor: KVCompressor) -> bool:
        """Whether that sync reads any of the request's KV at all."""
        return self.rebuilds(rid, verified_len, compressor) or self._entries[rid].cached_len < verified_len

    def sync(
        self,
        rid: Hashable,
        verified_len: int,
        read_kv: ReadKV,
        compressor: Optional[KVCompressor] = None,
        queries: Optional[list[torch.Tensor]] = None,  # per layer [W, H_q, D]: last prompt queries
    ) -> None:
        """Bring the request's entry up to ``verified_len`` verified tokens. ``compressor``
        (default: the store's) is fixed for the entry's lifetime; ``queries`` feed the
        query-aware methods (SnapKV, H2O) when the entry is first built."""
        compressor = compressor or self.compressor
        entry = self._entries.get(rid)
        if entry is not None and _stale(entry, verified_len, compressor):
            # The request went back (retraction / recompute), or another compressor: rebuild from scratch.
            self.release(rid)
            entry = None
        if entry is None:
            entry = self._entries[rid] = _RequestEntry(compressor, layers=[None] * self.num_layers)
        start = entry.cached_len
        if verified_len <= start:
            return
        for layer_id in range(self.num_layers):
            k, v = read_kv(layer_id, start, verified_len)
            old = entry.layers[layer_id]
            if old is None:
                q = None if queries is None else queries[layer_id]
                entry.layers[layer_id] = compressor.compress(k, v, q if compressor.needs_queries else None)
            else:
                entry.layers[layer_id] = compressor.append(old, k, v)
        if start == 0:
            self.tokens_compressed += verified_len
        else:
            self.tokens_appended += verified_len - start
        entry.cached_len = verified_len

    # ------------------------------------------------------------------ the draft round

    def begin_round(self, rids: Sequence[Hashable], steps: int, unread: Collection[int] = ()) -> None:
        """Lay out the draft buffers for ``steps`` draft steps of these (synced) requests,
        row b = rids[b]. Any earlier round's provisional KV is gone after this. A request
        that keeps its row from the last round rewrites only the rows its compressor says
        changed (``stable_rows``): steady decoding re-materializes just the new tail.
        ``unread``: layers this round drafts from elsewhere (sliding-window layers over the
        pool), which the GPU kernels' round does not pack ahead."""
        if steps < 1:
            raise ValueError(f"a draft round needs at least one step, got {steps}")
        entries = [self._entries[rid] for rid in rids]
        self._kernel_round = self._start_kernel_round(entries, steps, unread)
        if self._kernel_round is not None:
            # the dense buffers sit this round out: let them go (a dense round, for a layout
            # the kernels do not read, would otherwise hold [B, H_kv, L, D] x layers x 2 on)
            self._round, self._laid_out = None, []
            self._k_buf = [None] * self.num_layers
            self._v_buf = [None] * self.num_layers
            return
        sources = self._sources(entries)
        tails = [self._tails(entry, src) for entry, src in zip(entries, sources)]
        dense_lens = [_rows(t) for t in tails]
        width = max(dense_lens, default=0)
        valid = None
        if any(n < width for n in dense_lens):
            cols = torch.arange(width + steps)
            lens = torch.tensor(dense_lens)
            valid = ((cols[None, :] < lens[:, None]) | (cols[None, :] >= width))[:, None, None, :]
        self._round = _Round(entries, dense_lens, width, steps, valid, [0] * self.num_layers,
                             any(selects_per_step(e.compressor) for e in entries))
        grown = self._grow(len(entries), width + steps)
        if grown:  # new buffers: nothing to reuse
            # rows already materialized whole (a request's first round) are not done twice:
            # that is 4 x 4000 tokens x 30 layers of dequantizing again for kivi4
            tails = [t if _whole(t) else self._tails(entry, None) for t, entry in zip(tails, entries)]
            sources = [None] * len(entries)
        if valid is not None:
            self._round.valid = valid.to(self._k_buf[0].device)
        for layer_id in range(self.num_layers):
            k_buf, v_buf = self._buffers(layer_id, len(entries), width + steps)
            for b, (per_layer, src) in enumerate(zip(tails, sources)):
                if per_layer[layer_id] is not None:
                    start, k, v = per_layer[layer_id]
                    if start and src != b:  # moved down: its kept rows come from its old row
                        k_buf[b, :, :start] = self._k_buf[layer_id][src, :, :start]
                        v_buf[b, :, :start] = self._v_buf[layer_id][src, :, :start]
                    k_buf[b, :, start : dense_lens[b]] = k.transpose(0, 1)
                    v_buf[b, :, start : dense_lens[b]] = v.transpose(0, 1)
            if grown:
                self._zero_unlaid(layer_id, dense_lens)
        self._laid_out = [(entry, list(entry.layers), n) for entry, n in zip(entries, dense_lens)]

    def _sources(self, entries: list[_RequestEntry]) -> list[Optional[int]]:
        """Per row: the buffer row that holds the entry's rows from the last round, or None
        (new to the buffers). That is the row itself, or a later one when requests before
        it left the batch: rows are laid in order, so a row moving down is copied before
        anything overwrites it; one moving up is laid anew."""
        laid = {id(entry): row for row, (entry, _, _) in enumerate(self._laid_out)}
        return [src if src is not None and src >= b else None
                for b, src in enumerate(laid.get(id(entry)) for entry in entries)]

    def _tails(self, entry: _RequestEntry, src: Optional[int]):
        """Per layer (start, k, v): the materialized rows [start:] of the entry that buffer
        row ``src`` (None: none) does not hold, or None for an empty layer."""
        prev = None if src is None else self._laid_out[src]
        out = []
        for layer_id, layer in enumerate(entry.layers):
            if layer is None or layer.num_tokens == 0:
                out.append(None)
                continue
            start = 0
            if prev is not None and prev[1][layer_id] is not None:
                start = min(entry.compressor.stable_rows(prev[1][layer_id], layer), prev[2])
            out.append((start, *entry.compressor.materialize_tail(layer, start)))
        return out

    def attend(
        self,
        layer_id: int,
        q: torch.Tensor,  # [B, H_q, D] this draft step's queries, row b = rids[b] of begin_round
        k_new: torch.Tensor,  # [B, H_kv, D] provisional KV of the tokens being drafted from
        v_new: torch.Tensor,
        scale: float,
        sinks: Optional[torch.Tensor] = None,  # [H_q] the layer's attention sinks (gpt-oss), or None
        softcap: Optional[float] = None,  # the layer's logit soft cap (Gemma 2, Grok), or None
    ) -> torch.Tensor:  # [B, H_q, D]
        """One draft step of one layer: each request's query reads its compressed entry and
        the round's draft tokens so far (its own included, so no row is empty). Computed in
        fp32 when the entries are lower precision."""
        if self._kernel_round is not None:
            return self._kernel_round.attend(layer_id, q, k_new, v_new, scale, sinks, softcap)
        rnd = self._round
        assert rnd is not None, "attend() outside a draft round (call begin_round first)"
        step = rnd.step[layer_id]
        assert step < rnd.steps and q.shape[0] == len(rnd.entries), (step, rnd.steps, q.shape)
        rnd.step[layer_id] = step + 1
        end = rnd.width + step + 1
        k_buf, v_buf = self._buffers(layer_id, len(rnd.entries), rnd.width + rnd.steps)
        k_buf[:, :, end - 1] = k_new
        v_buf[:, :, end - 1] = v_new
        mask = None if rnd.valid is None else rnd.valid[..., :end]
        if rnd.query_aware:
            mask = self._selection_mask(layer_id, q, end, mask)
        out = attention(
            q.float()[:, :, None, :],  # [B, H_q, 1, D]
            k_buf[:, :, :end].float(),  # [B, H_kv, end, D]
            v_buf[:, :, :end].float(),
            mask, scale, sinks, softcap or None,
        )  # [B, H_q, 1, D]
        return out[:, :, 0].to(q.dtype)

    def attend_tokens(
        self,
        layer_id: int,
        q: torch.Tensor,  # [S, H_q, D] queries of S consecutive tokens of the round's one request
        k_new: torch.Tensor,  # [S, H_kv, D] their provisional KV
        v_new: torch.Tensor,
        scale: float,
        sinks: Optional[torch.Tensor] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:  # [S, H_q, D]
        """S draft steps of one layer at once, for a round of one request whose next S
        input tokens are known (teacher forcing: a prompt's tokens past its compressed
        entry). Token i reads the entry and the round's tokens up to itself, exactly as S
        calls of ``attend`` would; not for compressors that select keys per query."""
        if self._kernel_round is not None:
            return self._kernel_round.attend_tokens(layer_id, q, k_new, v_new, scale, sinks, softcap)
        rnd = self._round
        assert rnd is not None, "attend_tokens() outside a draft round (call begin_round first)"
        assert len(rnd.entries) == 1 and not rnd.query_aware, "attend_tokens() is for one request, no per-step selection"
        step, n = rnd.step[layer_id], q.shape[0]
        assert step + n <= rnd.steps, (step, n, rnd.steps)
        rnd.step[layer_id] = step + n
        start = rnd.width + step
        end = start + n
        k_buf, v_buf = self._buffers(layer_id, 1, rnd.width + rnd.steps)
        k_buf[0, :, start:end] = k_new.transpose(0, 1)
        v_buf[0, :, start:end] = v_new.transpose(0, 1)
        cols = torch.arange(end, device=q.device)
        mask = cols[None, :] <= (start + torch.arange(n, device=q.device))[:, None]  # [S, end]
        out = attention(
            q.float().transpose(0, 1)[None],  # [1, H_q, S, D]
            k_buf[:, :, :end].float(),  # [1, H_kv, end, D]
            v_buf[:, :, :end].float(),
            mask[None, None], scale, sinks, softcap or None,
        )  # [1, H_q, S, D]
        return out[0].transpose(0, 1).to(q.dtype)

    def kernels_on(self, device) -> bool:
        """Whether this store's rounds on ``device`` run on the GPU kernels (``kernels_on``)."""
        return kernels_on(self.draft_kernels, device)

    def _start_kernel_round(self, entries: list[_RequestEntry], steps: int, unread: Collection[int] = ()):
        """The round on the GPU kernels, or None for the dense path (CPU; a layout or head
        dim the kernels do not read)."""
        device = next((l.tensors()[0].device for e in entries for l in e.layers if l is not None), None)
        if device is None or not self.kernels_on(device):
            return None
        from sgl_vericache.kernels.draft_round import KernelDraftRound

        rows = [(e.compressor, list(e.layers)) for e in entries]  # as they are now, like the dense layout
        return KernelDraftRound(rows, steps, self.num_layers, unread) if KernelDraftRound.supports(rows) else None

    def _selection_mask(self, layer_id, q, end, mask):
        """Padding mask AND each query-aware request's per-step key selection."""
        rnd = self._round
        num_q_heads = q.shape[1]
        full = torch.ones(len(rnd.entries), num_q_heads, 1, end, dtype=torch.bool, device=q.device)
        if mask is not None:
            full &= mask
        for b, entry in enumerate(rnd.entries):
            layer = entry.layers[layer_id]
            if layer is not None and selects_per_step(entry.compressor):
                chosen = entry.compressor.step_selection(layer, q[b : b + 1])  # [H_q, 1, N] or None
                if chosen is not None:
                    full[b, :, :, : rnd.dense_lens[b]] &= chosen
        return full

    def _buffers(self, layer_id: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's draft buffers viewed as [rows, H_kv, cols, D], the layout the
        attention kernel reads fastest (``_grow`` sized them)."""
        return self._k_buf[layer_id][:rows, :, :cols], self._v_buf[layer_id][:rows, :, :cols]

    def _grow(self, rows: int, cols: int) -> bool:
        """Make every layer's buffers hold [rows, H_kv, cols, D]; True if they were
        reallocated (their contents are undefined: the caller lays or zeroes every row).
        Kept between rounds, so steady decoding allocates nothing."""
        k_buf = self._k_buf[0]
        if k_buf is not None and k_buf.shape[0] >= rows and k_buf.shape[2] >= cols:
            return False
        ref = self._reference_layer()
        cols = max(cols, 0 if k_buf is None else k_buf.shape[2])
        # room for an eighth more (one alignment step at least): a batch whose draft length
        # goes from 8 to 16, or whose entries grow across the next boundary, does not
        # reallocate and re-lay every row at once (0.87 s at 4 x 1k keys in bench_adaptive's
        # W3). A fixed step alone re-laid 4 x 4k kivi4 rows every 64-128 decoded tokens
        # (0.7-0.8 s each, offline; now one re-lay per ~500 tokens there, 0.6 s).
        room = max(_ROW_ALIGN, cols // _GROW_ROOM)
        shape = (max(rows, 0 if k_buf is None else k_buf.shape[0]), ref.num_kv_heads,
                 -(-(cols + room) // _ROW_ALIGN) * _ROW_ALIGN, ref.head_dim)
        self._k_buf = [None] * self.num_layers  # free the old ones first
        self._v_buf = [None] * self.num_layers
        # uninitialized: begin_round lays every row and zeroes the rest (_zero_unlaid)
        self._k_buf = [torch.empty(shape, dtype=ref.dtype, device=ref.device) for _ in range(self.num_layers)]
        self._v_buf = [torch.empty(shape, dtype=ref.dtype, device=ref.device) for _ in range(self.num_layers)]
        return True

    def _zero_unlaid(self, layer_id: int, dense_lens: list[int]) -> None:
        """Zero what this round did not lay in a new (uninitialized) buffer: padding columns
        are read under a False mask, and garbage there (NaN) would still poison the softmax.
        Writing only these, not zeros first and then the rows, halves a first round's stores."""
        for buf in (self._k_buf[layer_id], self._v_buf[layer_id]):
            for b, n in enumerate(dense_lens):
                buf[b, :, n:].zero_()
            buf[len(dense_lens):].zero_()

    def _reference_layer(self):
        for entry in self._round.entries:
            for layer in entry.layers:
                if layer is not None:
                    t = layer.tensors()[0]
                    return _BufferSpec(layer.num_kv_heads, layer.head_dim, layer.dtype, t.device)
        raise ValueError("a draft round needs at least one request with verified KV")

    # ------------------------------------------------------------------ lifetime

    def release(self, rid: Hashable) -> None:
        self._entries.pop(rid, None)
        if not self._entries:  # idle: give the draft buffers' memory back
            self.clear()

    def release_all_but(self, live_rids) -> None:
        for rid in [r for r in self._entries if r not in live_rids]:
            self.release(rid)

    def clear(self) -> None:
        self._entries.clear()
        self._round = None
        self._kernel_round = None
        self._laid_out = []
        self._k_buf = [None] * self.num_layers
        self._v_buf = [None] * self.num_layers

    def nbytes(self) -> int:
        return sum(l.nbytes() for e in self._entries.values() for l in e.layers if l is not None)

    def buffer_nbytes(self) -> int:
        """Bytes the draft buffers hold (a dense copy of the round's entries plus draft room)."""
        bufs = [b for b in self._k_buf + self._v_buf if b is not None]
        kernel = 0 if self._kernel_round is None else self._kernel_round.nbytes()
        return sum(b.numel() * b.element_size() for b in bufs) + kernel

    def full_nbytes(self) -> int:
        total = 0
        for entry in self._entries.values():
            for layer in entry.layers:
                if layer is not None:
                    total += full_nbytes(layer.num_tokens, layer.num_kv_heads, layer.head_dim, layer.dtype)
        return total

    def check_integrity(self) -> None:
        for rid, entry in self._entries.items():
            assert len(entry.layers) == self.num_layers, rid
            for layer in entry.layers:
                if entry.cached_len:
                    assert layer is not None and layer.num_tokens == entry.cached_len, (rid, entry.cached_len)
                    layer.check_integrity()
        for k_buf, v_buf in zip(self._k_buf, self._v_buf):
            assert (k_buf is None) == (v_buf is None) and (k_buf is None or k_buf.shape == v_buf.shape)


def _whole(per_layer) -> bool:
    """Every layer's tail starts at row 0: the request is materialized whole."""
    return all(t is None or t[0] == 0 for t in per_layer)


def _rows(per_layer) -> int:
    """Materialized rows of a request (the same in every layer)."""
    rows = {0 if t is None else t[0] + t[1].shape[0] for t in per_layer}
    assert len(rows) == 1, f"layers of one request materialize different row counts: {sorted(rows)}"
    return rows.pop()


@dataclass(frozen=True)
class _BufferSpec:
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


def selects_per_step(compressor: KVCompressor) -> bool:
    """The compressor picks keys per draft query (Quest): each step's attention needs its own mask."""
    return type(compressor).step_selection is not KVCompressor.step_selection
