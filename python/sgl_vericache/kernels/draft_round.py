"""A draft round of ``CompressedKVStore`` on the kernels (the store's CUDA path).

Instead of materializing every entry into a dense buffer, the round keeps, per layer and per
compressor among its requests, the entries as the kernels read them (``packing.pack``: in
place, through a table of their addresses; laid end to end, one copy of the compressed bytes
per layer and round, only for the opt-in FlashInfer path or an entry not 16-byte aligned) and
one small buffer for the round's provisional KV, [B, steps, H_kv, D]. Each draft step writes its new
K/V there and runs one kernel launch per compressor group. Entries are never modified.

A launch that fails to compile or run (a GPU short of shared memory or registers for a
variant, a ptxas error) does not end the server: the kernels are turned off for the process
(``turn_draft_kernels_off``: later rounds take the store's dense path) and this round's
remaining steps, the failed one included, run on their torch twin, row by row.
"""

from __future__ import annotations

import itertools
from typing import Collection, Optional, Sequence

import torch

from sgl_vericache.mem_cache.compress import CompressedLayer, KVCompressor, attention

from . import draft_head_dim, launch_failed, ops, turn_draft_kernels_off
from .flashinfer_backend import FlashInferDecode
from .packing import FMT_DENSE, PackedKV, RowTable, pack, supports, upload

_ROUND_IDS = itertools.count()  # names a round's FlashInfer plan


class KernelDraftRound:
    def __init__(self, rows: Sequence[tuple[KVCompressor, Sequence[Optional[CompressedLayer]]]], steps: int,
                 num_layers: int, unread: Collection[int] = (), config: ops.LaunchConfig = ops.LaunchConfig()):
        """rows[b] = (compressor, per-layer entries) of request b; ``steps`` draft steps;
        ``unread``: layers the round drafts from elsewhere (packed only if read after all);
        ``config``: the launches' (the warm-up's int64-offset variants set int32_offsets=False)."""
        ref = _reference(rows)
        self.config = config
        self.failed = False  # a launch failed: the round's remaining steps run on the torch twin
        self.num_layers, self.steps, self.batch = num_layers, steps, len(rows)
        self.num_kv_heads, self.head_dim, self.dtype, self.device = ref
        self._rows = rows
        self._groups: list[tuple[KVCompressor, list[int]]] = []  # compressor, its batch rows
        for b, (comp, _) in enumerate(rows):
            for c, members in self._groups:
                if c is comp:
                    members.append(b)
                    break
            else:
                self._groups.append((comp, [b]))
        self._packed: list[Optional[list[PackedKV]]] = [None] * num_layers  # every layer's, packed below
        # per group, its row tables by the packing's starts (read in place: all 0; copied: cumulative)
        self._tables: list[dict] = [{} for _ in self._groups]
        self._lens: Optional[list] = None  # per group (main_len, rec_len, pages_read) of the first packed layer
        # each group's batch rows, for a batch of several groups (a pageable copy would wait for
        # every kernel queued: through pinned memory, as the row tables go)
        self._index = [upload(torch.tensor(m), self.device) for _, m in self._groups] if len(self._groups) > 1 else []
        shape = (len(rows), steps, self.num_kv_heads, self.head_dim)
        self._k_extra = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]
        self._v_extra = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]
        self.step = [0] * num_layers
        self._id = next(_ROUND_IDS)
        self._flashinfer = [FlashInferDecode.maybe(self.device, g) for g in range(len(self._groups))]  # None: off
        # packed here, not at each layer's first draft step: the host work is the round's
        # setup (timed as layout by the round), so the planner's per-step price stays the kernels'
        for layer_id in range(num_layers):
            if layer_id not in unread:
                self._layer(layer_id)

    @staticmethod
    def supports(rows: Sequence[tuple[KVCompressor, Sequence[Optional[CompressedLayer]]]]) -> bool:
        """Every entry is a layout the kernels read and the head dim is one they handle."""
        try:
            head_dim = _reference(rows)[1]
        except ValueError:
            return False
        return draft_head_dim(head_dim) and all(supports(layer) for _, layers in rows for layer in layers)

    def nbytes(self) -> int:
        """Bytes this round holds beside the entries: the provisional KV and packed copies."""
        extra = sum(t.numel() * t.element_size() for t in self._k_extra + self._v_extra)
        copies = 0
        for per_layer in self._packed:
            for packed in per_layer or ():
                if packed.copied:
                    copies += packed.nbytes()
        return extra + copies

    def attend(self, layer_id: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               scale: float, sinks: Optional[torch.Tensor] = None, softcap: Optional[float] = None) -> torch.Tensor:
        """One draft step: q [B, H_q, D], k_new/v_new [B, H_kv, D] -> [B, H_q, D]; ``sinks``
        [H_q]: the layer's attention sinks, ``softcap`` its logit soft cap (None: none)."""
        step = self.step[layer_id]
        assert step < self.steps and q.shape[0] == self.batch, (step, self.steps, q.shape)
        self.step[layer_id] = step + 1
        self._k_extra[layer_id][:, step] = k_new
        self._v_extra[layer_id][:, step] = v_new
        packed = self._layer(layer_id)
        if not self.failed:
            try:
                return self._groups_step(packed, q, scale, layer_id, step + 1, sinks, softcap)
            except Exception as exc:
                if not launch_failed(exc):
                    raise
                self._fail(exc)
        return torch.cat([self._twin(b, layer_id, q[b : b + 1], step + 1, scale, sinks, softcap)
                          for b in range(self.batch)])

    def _groups_step(self, packed: list[PackedKV], q, scale, layer_id: int, seen: int, sinks,
                     softcap) -> torch.Tensor:
        if len(self._groups) == 1:
            return self._group_step(0, packed[0], q, scale, layer_id, seen, sinks, softcap)
        out = torch.empty_like(q)
        for g, index in enumerate(self._index):
            out[index] = self._group_step(g, packed[g], q[index], scale, layer_id, seen, sinks, softcap)
        return out

    def _group_step(self, g: int, packed: PackedKV, q, scale, layer_id: int, seen: int, sinks,
                    softcap) -> torch.Tensor:
        """Group g's rows see their entries and the round's first ``seen`` provisional tokens
        (on FlashInfer only without sinks or a soft cap, which its path here does not pass)."""
        fi = self._flashinfer[g]
        if (fi is not None and sinks is None and not softcap and packed.fmt == FMT_DENSE and not packed.page_size
                and min(packed.main_len) > 0):
            members = self._groups[g][1]
            return fi.decode((self._id, g), packed, range(len(members)), q, scale, self._k_extra[layer_id],
                             self._v_extra[layer_id], members, [seen] * len(members))
        return self._launch(packed, q, scale, self._table(g, packed), layer_id, seen, sinks, softcap)

    def attend_tokens(self, layer_id: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      scale: float, sinks: Optional[torch.Tensor] = None,
                      softcap: Optional[float] = None) -> torch.Tensor:
        """S teacher-forced steps of the round's one request: q [S, H_q, D] -> [S, H_q, D];
        token i reads the entry and the round's tokens up to itself."""
        step, n = self.step[layer_id], q.shape[0]
        assert self.batch == 1 and step + n <= self.steps, (self.batch, step, n, self.steps)
        packed = self._layer(layer_id)[0]
        assert not packed.page_size, "attend_tokens() is for one request, no per-step selection"
        self.step[layer_id] = step + n
        self._k_extra[layer_id][0, step : step + n] = k_new
        self._v_extra[layer_id][0, step : step + n] = v_new
        if not self.failed:
            rows = packed.rows(row_entry=[0] * n, ext_row=[0] * n, ext_base=[step + i for i in range(n)])
            try:
                return self._launch(packed, q, scale, rows, layer_id, 1, sinks, softcap)
            except Exception as exc:
                if not launch_failed(exc):
                    raise
                self._fail(exc)
        return self._twin(0, layer_id, q, step + n, scale, sinks, softcap)

    def _launch(self, packed: PackedKV, q, scale, rows: RowTable, layer_id: int, ext_add: int,
                sinks=None, softcap=None) -> torch.Tensor:
        return ops.decode_attention(packed, q, scale, rows, self._k_extra[layer_id], self._v_extra[layer_id],
                                    ext_add=ext_add, config=self.config, sinks=sinks, softcap=softcap)

    def _fail(self, exc: BaseException) -> None:
        """A launch failed (``kernels.launch_failed``): the kernels are off for the process and
        this round goes on on the torch twin (every row has its provisional KV in the extras)."""
        turn_draft_kernels_off(exc)
        self.failed = True

    def _twin(self, b: int, layer_id: int, q: torch.Tensor, seen: int, scale, sinks, softcap) -> torch.Tensor:
        """Row b's attention on torch: q [S, H_q, D] over its entry and its first ``seen``
        provisional tokens, query i seeing those up to seen - S + i -> [S, H_q, D]."""
        comp, layers = self._rows[b]
        return dense_attention(comp, layers[layer_id], q, self._k_extra[layer_id][b, :seen],
                               self._v_extra[layer_id][b, :seen], scale, sinks, softcap)

    def _layer(self, layer_id: int) -> list[PackedKV]:
        if self._packed[layer_id] is None:
            packed = [pack(comp, [self._rows[b][1][layer_id] for b in members], in_place=fi is None)
                      for (comp, members), fi in zip(self._groups, self._flashinfer)]
            lens = [(p.main_len, p.rec_len, p.pages_read) for p in packed]
            if self._lens is None:
                self._lens = lens
            assert lens == self._lens, f"layer {layer_id}'s entries differ in length from the other layers'"
            self._packed[layer_id] = packed
        return self._packed[layer_id]

    def _table(self, g: int, packed: PackedKV) -> RowTable:
        """Group g's row table for this layer's packing. Every layer's entries have the same
        lengths (``_layer`` checks), so one table serves every layer packed alike; a layer
        whose entries could not be read in place (an address off 16 bytes: copied end to
        end) has other starts, and a table of its own."""
        key = (tuple(packed.main_start), tuple(packed.rec_start), tuple(packed.page_start))
        table = self._tables[g].get(key)
        if table is None:
            table = self._tables[g][key] = packed.rows(ext_row=self._groups[g][1])
        return table


def dense_attention(comp: KVCompressor, layer: Optional[CompressedLayer], q: torch.Tensor, k_extra: torch.Tensor,
                    v_extra: torch.Tensor, scale: float, sinks: Optional[torch.Tensor] = None,
                    softcap: Optional[float] = None) -> torch.Tensor:
    """What the kernels compute, as the store's dense path does (``materialize``, each query
    head's ``step_selection``, fp32 attention with sinks and soft cap): q [S, H_q, D] over
    ``layer`` (None: no verified KV yet) and k_extra / v_extra [E, H_kv, D], query i seeing
    extras[: E - S + i + 1] -> [S, H_q, D] in q.dtype."""
    num_q, num_q_heads, _ = q.shape
    k, v, chosen = k_extra[:0], v_extra[:0], None
    if layer is not None and layer.num_tokens:
        k, v, _ = comp.materialize(layer)
        chosen = comp.step_selection(layer, q)  # [H_q, S, N] or None: every key
    n, total = k.shape[0], k.shape[0] + k_extra.shape[0]
    last = total - num_q + torch.arange(num_q, device=q.device)  # the last column query i sees
    visible = (torch.arange(total, device=q.device)[None, :] <= last[:, None]).expand(num_q_heads, -1, -1)
    if chosen is not None:
        visible = torch.cat([visible[:, :, :n] & chosen, visible[:, :, n:]], dim=-1)
    keys, values = (torch.cat([a, b]).float().transpose(0, 1)[None] for a, b in ((k, k_extra), (v, v_extra)))
    out = attention(q.float().transpose(0, 1)[None], keys, values, visible[None], scale, sinks, softcap or None)
    return out[0].transpose(0, 1).to(q.dtype)  # [1, H_q, S, D] -> [S, H_q, D]


def _reference(rows) -> tuple[int, int, torch.dtype, torch.device]:
    for _, layers in rows:
        for layer in layers:
            if layer is not None:
                return layer.num_kv_heads, layer.head_dim, layer.dtype, layer.tensors()[0].device
    raise ValueError("a draft round needs at least one request with verified KV")
