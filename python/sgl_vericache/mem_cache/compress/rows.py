"""Entry tensors that grow by rows without copying what they already hold.

Entries are values: ``append`` returns a new entry and the old one stays valid (a drafter
keeps it across a round, the compressed prefix cache hands it to any number of requests).
Done with ``torch.cat``, that copies a request's whole entry at the end of every round: a
32k-token layer of SmolLM2 took 13-15 ms a layer for ``full`` on this CPU (0.1 ms in place:
``benchmark/bench_append.py``), and on a GPU the copy reads and writes the whole entry again
each round, O(T) per round for O(1) new rows.

``append_rows(old, new)`` returns what ``torch.cat([old, new])`` would. A tensor it
returns is the leading rows of a larger buffer (``RowBuffer``) and carries that buffer as
an attribute. When ``old`` is such a tensor and nothing has yet been written after its
last row (it is the buffer's *frontier*), ``new`` is written into the spare rows and the
result is a longer view of the same buffer. ``old`` still sees exactly its rows, and those
are never written again. Otherwise (``old`` came from elsewhere, the buffer is full, or
another tensor already grew from the same rows: two requests extending one shared prefix
entry) a new buffer is allocated, with spare rows for the appends to come.

Spare rows: ``spare_rows(n)`` = n / 16, at least 16. A buffer is reallocated after its
rows grew by a sixteenth, so each appended row is copied about 16 more times in all,
whatever the context length, against T rows copied at every round before. The spare rows
are memory that ``CompressedLayer.nbytes()`` does not count: at most a sixteenth of an
entry's rows plus 16, for a tensor this module returned and for any entry holding one of
its views (a view is never shorter than its buffer's first one). ``spec.memory_reserve``
adds that sixteenth to what it keeps for entries, and the compressed prefix cache counts an
entry's whole buffers (``held_nbytes``).

Only the tensor objects this module returns carry the buffer: a slice, a copy or a tensor
moved between devices or read back from a storage tier is a plain tensor again, and
appending to it copies. Views are told apart by the attribute, not by ``Tensor._base``,
which ``torch.inference_mode`` does not record.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

SPARE_DIVISOR = 16  # spare rows: a sixteenth of the rows (see the module's docstring)
MIN_SPARE_ROWS = 16
_ATTR = "_vericache_row_buffer"


def spare_rows(num_rows: int) -> int:
    return max(num_rows // SPARE_DIVISOR, MIN_SPARE_ROWS)


class RowBuffer:
    """A tensor of ``capacity`` rows whose first ``frontier`` rows are taken; rows before
    the frontier are never written again."""

    _lock = threading.Lock()  # a claim is a check and a set: one at a time, whatever thread

    def __init__(self, data: torch.Tensor, frontier: int):
        self.data = data  # [capacity, *row_shape]
        self.frontier = frontier

    def claim(self, view: torch.Tensor, rows: int) -> bool:
        """Take the ``rows`` rows after ``view``'s last, if ``view`` ends at the frontier
        and they fit. True: the caller owns them."""
        with self._lock:
            end = view.shape[0]
            if end != self.frontier or end + rows > self.data.shape[0]:
                return False
            self.frontier = end + rows
            return True

    def view(self, rows: int) -> torch.Tensor:
        out = self.data[:rows]
        setattr(out, _ATTR, self)
        return out


def buffer_of(t: torch.Tensor) -> RowBuffer | None:
    """The buffer ``t`` is the leading rows of, if this module returned ``t``."""
    buf = getattr(t, _ATTR, None)
    if buf is None or t.data_ptr() != buf.data.data_ptr() or t.dtype != buf.data.dtype \
            or t.shape[1:] != buf.data.shape[1:] or not t.is_contiguous():
        return None  # defensive: only an untouched view of the buffer is grown in place
    return buf


def append_rows(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``torch.cat([old, new])`` along dim 0, written into ``old``'s spare rows when it
    has them and they are still free (see the module's docstring); ``old`` is unchanged."""
    if new.dim() != old.dim() or new.shape[1:] != old.shape[1:] or new.dtype != old.dtype \
            or new.device != old.device:
        raise ValueError(f"append_rows: rows {tuple(new.shape[1:])} {new.dtype} on {new.device} do not fit "
                         f"{tuple(old.shape[1:])} {old.dtype} on {old.device}; accepted: the same row shape, "
                         "dtype and device")
    n, added = old.shape[0], new.shape[0]
    buf = buffer_of(old)
    if buf is not None and buf.claim(old, added):
        buf.data[n:n + added].copy_(new)
        return buf.view(n + added)
    out = empty_rows(old, n + added)
    out[:n].copy_(old)
    out[n:].copy_(new)
    return out


def empty_rows(like: torch.Tensor, num_rows: int) -> torch.Tensor:
    """An uninitialized ``[num_rows, *like.shape[1:]]`` tensor of ``like``'s dtype and device,
    with spare rows after it: its maker fills it before anyone else sees it, and an append
    to it then grows in place."""
    data = like.new_empty((num_rows + spare_rows(num_rows), *like.shape[1:]))
    return RowBuffer(data, num_rows).view(num_rows)


def held_nbytes(tensors) -> int:
    """Bytes ``tensors`` keep alive: a tensor this module returned holds its whole buffer
    (each buffer counted once), any other its own bytes."""
    seen, total = set(), 0
    for t in tensors:
        buf = buffer_of(t)
        if buf is None:
            total += t.numel() * t.element_size()
        elif id(buf) not in seen:
            seen.add(id(buf))
            total += buf.data.numel() * buf.data.element_size()
    return total


def plain_copy(entry):
    """``entry`` (a ``CompressedLayer``) with every tensor a fresh copy holding no spare rows:
    an append to it copies every row, as every append did before this module. What the
    tests and ``benchmark/bench_append.py`` compare growing in place against."""
    fields = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    return type(entry)(**{n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in fields.items()})
