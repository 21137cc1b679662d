"""Drafts made ahead of a request's decode rounds (no SGLang imports).

A request that SGLang holds back while its prefix streams in from a storage tier can draft
meanwhile (from the prefix's compressed entry); those drafts wait here until its decode
rounds start. ``tokens[j]`` is the draft for the request's output position ``j``. A round
takes the drafts that follow the output so far, as long as every draft before them was
right (the request's verified output starts with them); after the first wrong one the rest
predicts a continuation the request did not take, so its queue is dropped.

Drafts only ever become verify candidates, so a queue can never change output, only how
many tokens a round accepts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional, Sequence


class DraftQueue:
    def __init__(self, capacity: int = 256):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"draft queue capacity {capacity!r} is invalid; accepted: an int >= 1")
        self.capacity = capacity
        self._tokens: "OrderedDict[Hashable, tuple[int, ...]]" = OrderedDict()
        self.taken = 0  # counters: rounds served, queues dropped as wrong or used up
        self.dropped = 0

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def put(self, rid: Hashable, tokens: Sequence[int]) -> None:
        """Queue ``tokens`` (drafts for output positions 0, 1, ...) for ``rid``; the oldest
        queue goes when more than ``capacity`` requests have one (its request never came)."""
        tokens = tuple(int(t) for t in tokens)
        self._tokens.pop(rid, None)
        if not tokens:
            return
        self._tokens[rid] = tokens
        while len(self._tokens) > self.capacity:
            self._tokens.popitem(last=False)
            self.dropped += 1

    def take(self, rid: Hashable, output_ids: Sequence[int], n: int) -> Optional[list[int]]:
        """The next ``n`` (or fewer, at the queue's end) drafts after ``output_ids``, or None:
        no queue, or a queued draft for the output so far was wrong, or none is left (the
        queue is dropped in the last two cases)."""
        tokens = self._tokens.get(rid)
        if tokens is None:
            return None
        m = len(output_ids)
        if m >= len(tokens) or any(int(o) != t for o, t in zip(output_ids, tokens[:m])):
            del self._tokens[rid]
            self.dropped += 1
            return None
        self.taken += 1
        return list(tokens[m:m + n])

    def drop(self, rid: Hashable) -> None:
        self._tokens.pop(rid, None)

    def clear(self) -> None:
        self._tokens.clear()
