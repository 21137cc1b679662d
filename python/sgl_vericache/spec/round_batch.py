"""One decode iteration's rows as the VeriCache round sees them (no SGLang imports): the
batch the seam builds (``RoundBatch``), the drafts the round hands back for SGLang's verify
pass (``RoundDrafts``, ``pad_drafts``), which rows verify under a full-KV device budget
(``verifying_rows``), and the device clock the round's step costs are read with."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch


def device_clock(device) -> float:
    """``time.perf_counter()`` once ``device``'s current stream has run what was queued on
    it. On CUDA kernels run asynchronously: a host clock read right after a forward, a
    compression or a layout times their launches, and the adaptive planner's step costs
    (plain steps, a round's setup against its draft forwards) would be charged to whatever
    synchronizes next. Only the current stream: HiCache's and the parking's side-stream
    copies are not this iteration's compute."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()


@dataclass
class RoundBatch:
    """One decode iteration's batch, as the round sees it (built by the seam)."""

    reqs: list  # SGLang's requests, one per row
    verified: list[int]  # per row: tokens whose KV is committed (the draft's first position)
    pool_rows: list[int]  # per row: the request's row of the request-to-token table
    own_kv_start: list[int]  # per row: where the request's own KV starts (a prefix the tree held is shared)
    greedy: bool  # every row decodes greedily
    verify_always: list[bool]  # per row: it returns logprobs or follows a grammar (see _verifying_rows)
    source: Any = None  # SGLang's batch, handed back to the seam for the draft passes


class RoundDrafts(NamedTuple):
    tokens: np.ndarray  # [bs * width] root + drafts of each row, the verify pass's input
    mask: np.ndarray  # [bs * width * width] the verify mask: a causal chain per row
    width: int


def pad_drafts(drafts: np.ndarray, draft_lens: list[int], width: int) -> np.ndarray:
    """[bs, steps] drafts -> [bs, width]: a request's tokens past its own draft length
    repeat its last real draft token. Padding is verified like any draft token, so it
    can never change the output; it only fills the round's verify width (the batch's
    longest draft + 1)."""
    out = np.empty((drafts.shape[0], width), dtype=np.int64)
    if not width:  # the round verifies its roots only (the context's last position)
        return out
    for i, draft_len in enumerate(draft_lens):
        out[i, :draft_len] = drafts[i, :draft_len]
        out[i, draft_len:] = drafts[i, draft_len - 1]
    return out


def last_token(req) -> int:
    return int(req.output_ids[-1]) if len(req.output_ids) else int(req.origin_input_ids[-1])


def verifying_rows(budget: int, own_kv: Sequence[int], waited: Sequence[int],
                   forced: Optional[Sequence[bool]] = None) -> list[bool]:
    """Staggered verifies under a full-KV device budget: which rows verify this round.
    ``forced`` rows always do, first; then requests that waited longest; one verifies when
    its own full KV fits in what is left of the budget, and the first of them always does,
    so every round makes progress and no request starves. ``budget`` < 0: every row
    verifies."""
    if budget < 0:
        return [True] * len(own_kv)
    forced = forced or [False] * len(own_kv)
    order = sorted(range(len(own_kv)), key=lambda i: (not forced[i], -waited[i]))
    left, chosen, first = budget, [False] * len(own_kv), True
    for i in order:
        if forced[i] or first or own_kv[i] <= left:
            chosen[i] = True
            left = max(0, left - own_kv[i])
            first = first and forced[i]
    return chosen
