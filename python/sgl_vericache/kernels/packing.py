"""Several requests' compressed entries for one layer, as the kernels read them.

Two ways (``pack(..., in_place=)``). In place (what the drafter uses): nothing is copied; an
address table holds each entry's tensors' addresses (``PackedKV.addresses``) and the kernels
read every entry where it lies. Laid end to end (the default, and what FlashInfer's page
tables need): each entry's tensors are concatenated along their token (or page, or group)
dimension, one copy of the compressed bytes. Either way a row table says which entry each
query row reads, where it starts and how long it is (ragged: no row is padded, no kernel
reads past a row's end), and a lone entry is read in place without a table. Nothing here
dequantizes: the codes, scales and zero points are the entry's stored bytes, in the
entry's layout (see mem_cache/compress/quant.py).

Pure torch; the kernels themselves live in triton_decode.py / triton_quest.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from sgl_vericache.mem_cache.compress import CompressedLayer, KVCompressor
from sgl_vericache.mem_cache.compress.drop import KeptTokensLayer
from sgl_vericache.mem_cache.compress.full import DenseLayer
from sgl_vericache.mem_cache.compress.quant import Fp8Layer, Int8Layer, KiviLayer
from sgl_vericache.mem_cache.compress.quest import QuestCompressor, QuestLayer

# formats of the main segment (the kernels' FMT)
FMT_DENSE, FMT_KIVI, FMT_INT8, FMT_FP8 = range(4)
# row table columns (the kernels read them by these indices)
MAIN_START, MAIN_LEN, REC_START, REC_LEN, EXT_ROW, EXT_BASE, ENTRY, PAGE_START, PAGES_READ = range(9)
META_COLS = 9
# address table columns (PackedKV.addresses): the tensors an entry is read from, in place
ADDR_FIELDS = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "k_recent", "v_recent", "page_min", "page_max")
ADDR_COLS = len(ADDR_FIELDS)

# the layer classes the kernels read, and the format each is read as
KERNEL_FORMATS = {DenseLayer: FMT_DENSE, KeptTokensLayer: FMT_DENSE, QuestLayer: FMT_DENSE,
                  KiviLayer: FMT_KIVI, Int8Layer: FMT_INT8, Fp8Layer: FMT_FP8}


@dataclass(frozen=True)
class RowTable:
    """Which entry and extras each query row reads: ``meta`` for the kernels, ``entries``
    (row -> entry) kept on the host so launch sizes need no device read."""

    meta: torch.Tensor  # [R, META_COLS] int32 on the entries' device
    entries: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return len(self.entries)


@dataclass
class PackedKV:
    """One layer of E entries. ``main_*`` index the main segment's rows (tokens; for KIVI
    the quantized tokens), ``rec_*`` KIVI's full-precision window, ``page_*`` Quest's pages."""

    fmt: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the entry dtype: dequantized values are rounded to it
    k: torch.Tensor  # [N, H, D] dense / int8 codes / fp8 codes as uint8; KIVI [N, H, D*bits/8] uint8
    v: torch.Tensor
    main_start: list[int]
    main_len: list[int]
    k_scale: Optional[torch.Tensor] = None  # KIVI [N/G, H, D]; int8/fp8-token [N, H, 1]; fp8-head [E, H]
    k_zero: Optional[torch.Tensor] = None  # KIVI only
    v_scale: Optional[torch.Tensor] = None  # KIVI [N, H, D/Gv]; as k_scale otherwise
    v_zero: Optional[torch.Tensor] = None
    k_recent: Optional[torch.Tensor] = None  # KIVI [Nr, H, D] entry dtype
    v_recent: Optional[torch.Tensor] = None
    rec_start: list[int] = field(default_factory=list)
    rec_len: list[int] = field(default_factory=list)
    bits: int = 8
    token_group: int = 1  # KIVI: tokens per key scale row
    channel_group: int = 1  # KIVI: channels per value scale
    head_scale: bool = False  # fp8 scale="head"
    page_min: Optional[torch.Tensor] = None  # Quest [P, H, D]
    page_max: Optional[torch.Tensor] = None
    page_start: list[int] = field(default_factory=list)
    pages_read: list[int] = field(default_factory=list)
    page_size: int = 0
    page_per_kv_head: bool = True  # Quest's heads="kv": one page choice per KV head, not per query head
    indices: Optional[torch.Tensor] = None  # main row t of entry e is pool row indices[main_start[e] + t]
    # in place: [E, ADDR_COLS] int64 on the device, entry e's tensors' addresses (0: none); the
    # starts are then all 0 and the tensors above are one entry's, giving the kernels their
    # pointer types. ``sources`` holds every tensor addressed (alive while this is)
    addresses: Optional[torch.Tensor] = None
    sources: tuple = ()

    @property
    def num_entries(self) -> int:
        return len(self.main_len)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def tensors(self) -> list[torch.Tensor]:
        names = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "k_recent", "v_recent", "page_min", "page_max")
        return [t for t in (getattr(self, n) for n in names) if t is not None]

    def nbytes(self) -> int:
        """Bytes the kernels may read (every tensor; Quest reads the chosen pages only)."""
        return sum(t.numel() * t.element_size() for t in (self.sources or self.tensors()))

    @property
    def copied(self) -> bool:
        """Whether the entries were copied end to end (several of them, not in place)."""
        return self.num_entries > 1 and self.addresses is None

    def rows(self, row_entry: Optional[Sequence[int]] = None, ext_row: Optional[Sequence[int]] = None,
             ext_base: Optional[Sequence[int]] = None) -> RowTable:
        """The row table (on the entries' device). Row r reads entry
        row_entry[r] (default: row r reads entry r), extras row ext_row[r] (default r) and
        ext_base[r] + the call's ``ext_add`` of its extras (default 0 + ext_add)."""
        n = self.num_entries
        row_entry = list(range(n)) if row_entry is None else list(row_entry)
        ext_row = list(range(len(row_entry))) if ext_row is None else list(ext_row)
        ext_base = [0] * len(row_entry) if ext_base is None else list(ext_base)
        rec_start = self.rec_start or [0] * n
        rec_len = self.rec_len or [0] * n
        page_start = self.page_start or [0] * n
        pages_read = self.pages_read or [0] * n
        table = [[self.main_start[e], self.main_len[e], rec_start[e], rec_len[e], ext_row[r], ext_base[r], e,
                  page_start[e], pages_read[e]] for r, e in enumerate(row_entry)]
        meta = torch.tensor(table, dtype=torch.int32).reshape(len(table), META_COLS)
        return RowTable(upload(meta, self.device), tuple(row_entry))


def upload(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host table on ``device`` without blocking the host: on CUDA through pinned
    memory, asynchronously (a pageable copy would wait for every kernel queued before it,
    and the drafter packs a layer while the previous layer's kernels run; torch keeps the
    pinned block until the copy is done)."""
    if torch.device(device).type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def supports(layer: Optional[CompressedLayer]) -> bool:
    return layer is None or type(layer) in KERNEL_FORMATS


def pack(compressor: KVCompressor, layers: Sequence[Optional[CompressedLayer]], in_place: bool = False) -> PackedKV:
    """``layers`` (one per request; None = no verified KV yet) for the kernels: laid end to
    end, or, ``in_place``, addressed where they lie (see the module docstring)."""
    present = [l for l in layers if l is not None]
    if not present:
        raise ValueError("pack() needs at least one entry")
    kinds = {type(l) for l in present}
    if len(kinds) != 1 or not supports(present[0]):
        raise ValueError(f"no draft kernel reads {sorted(k.__name__ for k in kinds)} together")
    kind = kinds.pop()
    ref = present[0]
    join = _Join(in_place and len(layers) > 1)
    packed = _pack(compressor, layers, kind, ref, join)
    if join.in_place and not join.readable():  # misaligned, or entries that differ in layout: copy instead
        join = _Join(False)
        packed = _pack(compressor, layers, kind, ref, join)
    if join.in_place:
        packed.addresses = join.table(len(layers), ref.tensors()[0].device)
        packed.sources = tuple(join.sources)
    return packed


def _pack(compressor, layers, kind, ref, join) -> PackedKV:
    if kind is KiviLayer:
        return _pack_kivi(compressor, layers, ref, join)
    if kind in (Int8Layer, Fp8Layer):
        return _pack_scaled(compressor, layers, ref, FMT_INT8 if kind is Int8Layer else FMT_FP8, join)
    packed = _pack_dense(layers, ref, join)
    if kind is QuestLayer:
        _add_pages(packed, compressor, layers, ref, join)
    return packed


def paged_pool(k_pool: torch.Tensor, v_pool: torch.Tensor, indices: torch.Tensor, lens: Sequence[int]) -> PackedKV:
    """A full-KV paged pool (SGLang's layout: [slots, H, D] and a token table) read in
    place: request e's tokens are pool rows indices[sum(lens[:e]) : sum(lens[:e+1])]."""
    return PackedKV(FMT_DENSE, k_pool.shape[1], k_pool.shape[2], k_pool.dtype, k_pool, v_pool,
                    _starts(lens), list(lens), indices=indices)


def _starts(lens: Sequence[int]) -> list[int]:
    out, total = [], 0
    for n in lens:
        out.append(total)
        total += n
    return out


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """One tensor of all parts along dim 0; a lone part is read where it is. Never empty
    (a kernel argument needs storage), so an empty result is one zero row."""
    out = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
    return out if out.shape[0] else torch.zeros((1, *out.shape[1:]), dtype=out.dtype, device=out.device)


def _empty_like_entry(ref: CompressedLayer, name: str) -> torch.Tensor:
    t = getattr(ref, name)
    return t[:0]


def _field(layers, ref, name) -> list[torch.Tensor]:
    return [getattr(l, name) if l is not None else _empty_like_entry(ref, name) for l in layers]


class _Join:
    """How one field's per-entry tensors become a kernel argument: concatenated (one copy),
    or, in place, one of them (for its pointer type) with every entry's address recorded."""

    def __init__(self, in_place: bool):
        self.in_place = in_place
        self.columns: dict[str, list[int]] = {}
        self.sources: list[torch.Tensor] = []
        self.uniform = True  # every entry's tensor of a field has one dtype and row shape

    def __call__(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        if not self.in_place:
            return _cat(parts)
        parts = [p.contiguous() for p in parts]  # a copy only of an entry that is not contiguous
        self.columns[name] = [p.data_ptr() for p in parts]
        present = [p for p in parts if p.numel()]
        self.sources += present
        self.uniform &= all(p.dtype == parts[0].dtype and p.shape[1:] == parts[0].shape[1:] for p in parts)
        return present[0] if present else _cat(parts[:1])

    def readable(self) -> bool:
        """The kernels can read the entries where they lie: every tensor starts on 16 bytes
        (what they assume of an address) and has its field's dtype and row shape (they read
        every entry as the one whose tensor they were given)."""
        return self.uniform and all(addr % 16 == 0 for column in self.columns.values() for addr in column)

    def starts(self, lens: Sequence[int]) -> list[int]:
        return [0] * len(lens) if self.in_place else _starts(lens)

    def table(self, entries: int, device: torch.device) -> torch.Tensor:
        rows = [[self.columns.get(name, [0] * entries)[e] for name in ADDR_FIELDS] for e in range(entries)]
        return upload(torch.tensor(rows, dtype=torch.int64), device)


def _pack_dense(layers, ref, join) -> PackedKV:
    lens = [0 if l is None else l.k.shape[0] for l in layers]
    return PackedKV(FMT_DENSE, ref.num_kv_heads, ref.head_dim, ref.dtype, join("k", _field(layers, ref, "k")),
                    join("v", _field(layers, ref, "v")), join.starts(lens), lens)


def _add_pages(packed: PackedKV, compressor: KVCompressor, layers, ref, join) -> None:
    assert isinstance(compressor, QuestCompressor), compressor
    pages = [0 if l is None else l.page_min.shape[0] for l in layers]
    packed.page_min = join("page_min", _field(layers, ref, "page_min"))
    packed.page_max = join("page_max", _field(layers, ref, "page_max"))
    packed.page_start = join.starts(pages)
    packed.pages_read = [0 if l is None else compressor.pages_read(l.num_tokens) for l in layers]
    packed.page_size = compressor.options["page_size"]
    packed.page_per_kv_head = compressor.options["heads"] == "kv"


def _pack_kivi(compressor, layers, ref: KiviLayer, join) -> PackedKV:
    group = compressor.options["group_size"]
    main = [0 if l is None else l.quantized_len for l in layers]
    recent = [0 if l is None else l.k_recent.shape[0] for l in layers]
    names = {"k": "k_codes", "v": "v_codes"}
    f = lambda name: join(name, _field(layers, ref, names.get(name, name)))  # noqa: E731
    return PackedKV(FMT_KIVI, ref.num_kv_heads, ref.head_dim, ref.dtype, f("k"), f("v"),
                    join.starts(main), main, f("k_scale"), f("k_zero"), f("v_scale"), f("v_zero"),
                    f("k_recent"), f("v_recent"), join.starts(recent), recent, bits=compressor.bits,
                    token_group=group, channel_group=min(group, ref.head_dim))


def _pack_scaled(compressor, layers, ref, fmt: int, join) -> PackedKV:
    lens = [0 if l is None else l.num_tokens for l in layers]
    head_scale = fmt == FMT_FP8 and compressor.options["scale"] == "head"
    parts = {name: _field(layers, ref, name + "_codes") for name in ("k", "v")}
    if fmt == FMT_FP8:  # decoded from the bits in registers
        parts = {name: [p.view(torch.uint8) for p in ps] for name, ps in parts.items()}
    k, v = join("k", parts["k"]), join("v", parts["v"])
    if head_scale:  # [H, 1] per entry (unset while empty) -> [E, H], read by entry index (a copy of E x H)
        k_scale = torch.stack([_head_scale(l, ref, "k_scale") for l in layers])
        v_scale = torch.stack([_head_scale(l, ref, "v_scale") for l in layers])
    else:
        k_scale = join("k_scale", _field(layers, ref, "k_scale"))
        v_scale = join("v_scale", _field(layers, ref, "v_scale"))
    return PackedKV(fmt, ref.num_kv_heads, ref.head_dim, ref.dtype, k, v, join.starts(lens), lens,
                    k_scale=k_scale, v_scale=v_scale, head_scale=head_scale)


def _head_scale(layer, ref, name) -> torch.Tensor:
    if layer is None or layer.num_tokens == 0:
        return torch.ones(ref.num_kv_heads, dtype=torch.float32, device=ref.k_codes.device)
    return getattr(layer, name).reshape(ref.num_kv_heads).float()
