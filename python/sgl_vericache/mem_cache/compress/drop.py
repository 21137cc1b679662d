"""Token droppers: StreamingLLM, SnapKV, H2O.

The ratio sets the kept-token budget: budget(T) = min(T, max(ceil(T / ratio), min_budget)),
so contexts of at most `min_budget` tokens keep everything and longer ones keep about
T / ratio. The budget follows the request as it grows: append() evicts down to
budget(T + n). Kept tokens are chosen per KV head (SnapKV and H2O select per head, as
the papers do); each entry stores the kept positions (int32) and, for the scored
methods, the fp32 scores later evictions rank by — both count in nbytes().

Scores are attention probabilities computed with the 1/sqrt(D) softmax scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .base import CompressedLayer, KVCompressor, OptionSpec, check_append, check_kv
from .registry import register_compressor
from .rows import append_rows, empty_rows

MIN_BUDGET = OptionSpec("min_budget", 16, "contexts up to this many tokens are kept whole", 0, 1 << 30)
SCORE_CHUNK = 256  # queries scored at a time, to bound the [H_q, W, T] probability tensor


@dataclass
class KeptTokensLayer(CompressedLayer):
    k: torch.Tensor  # [N, H, D] kept keys, ascending position per head
    v: torch.Tensor  # [N, H, D]
    positions: torch.Tensor  # [N, H] int32
    scores: torch.Tensor | None  # [N, H] fp32, accumulated attention (scored methods)

    def tensors(self):
        kept = (self.k, self.v, self.positions)
        return kept if self.scores is None else kept + (self.scores,)

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self.k.shape == self.v.shape and self.positions.shape == self.k.shape[:2]
        if self.positions.shape[0] > 1:
            assert bool((self.positions[1:] > self.positions[:-1]).all()), "positions must ascend"
        if self.positions.numel():
            assert int(self.positions.max()) < self.num_tokens


def gather_tokens(x: torch.Tensor, index: torch.Tensor, spare: bool = False) -> torch.Tensor:
    """x [T, H, ...], index [N, H] -> [N, H, ...]: a different token set per head. Keys and
    values are read as T * H rows of D: one row copy each (a gather over an expanded index
    took 13x as long, most of a scored dropper's append). ``spare``: the result has spare
    rows after it (``rows.empty_rows``), so that the next append joins the new tokens to it
    in place."""
    if x.dim() == 2:
        return x.gather(0, index)
    heads = x.shape[1]
    rows = (index.long() * heads + torch.arange(heads, device=index.device)).reshape(-1)
    flat = x.reshape(x.shape[0] * heads, *x.shape[2:])
    if not spare:
        return flat.index_select(0, rows).view(*index.shape, *x.shape[2:])
    out = empty_rows(x, index.shape[0])
    torch.index_select(flat, 0, rows, out=out.view(rows.shape[0], *x.shape[2:]))
    return out


def attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention each key receives, summed over queries and over the query heads sharing
    its KV head. q [W, H_q, D] are the queries of the LAST W keys (causal); k [N, H_kv, D].
    Returns [N, H_kv] fp32. One product a KV head for its whole query group, against the
    keys as they lie (a view): copying the keys out per query head and the logits into
    einsum's order took 13x as long (SnapKV's 32 queries over 8k keys: 114 ms against 8.7)."""
    num_q, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    keys = k.float().permute(1, 2, 0)  # [H_kv, D, N]
    mass = torch.zeros(num_kv_heads, group, num_keys, dtype=torch.float32, device=k.device)
    cols = torch.arange(num_keys, device=k.device)
    for start in range(0, num_q, SCORE_CHUNK):
        qc = q[start : start + SCORE_CHUNK].float()
        n = qc.shape[0]
        rows = torch.arange(start, start + n, device=k.device)
        hidden = cols[None, :] > rows[:, None] + (num_keys - num_q)  # [Wc, N]: after the query
        qg = qc.reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
        logits = torch.bmm(qg, keys).view(num_kv_heads, group, n, num_keys) * scale
        mass += torch.softmax(logits.masked_fill_(hidden, float("-inf")), -1).sum(2)
    return mass.sum(1).T.contiguous()


class TokenDropper(KVCompressor):
    """Shared budget rule, storage and size accounting of the droppers."""

    uses_ratio = True
    default_ratio = 4.0
    scored = False  # whether entries carry scores

    def budget(self, num_tokens: int) -> int:
        if num_tokens <= self.options["min_budget"]:
            return num_tokens
        return min(num_tokens, max(math.ceil(num_tokens / self.ratio), self.options["min_budget"]))

    def nbytes_for(self, num_tokens, num_kv_heads, head_dim, dtype):
        kept = self.budget(num_tokens) * num_kv_heads
        return kept * (2 * head_dim * dtype.itemsize + 4 + (4 if self.scored else 0))

    def materialize(self, layer):
        return layer.k, layer.v, layer.positions.long()

    @staticmethod
    def _new_positions(start: int, count: int, num_heads: int, device) -> torch.Tensor:
        pos = torch.arange(start, start + count, dtype=torch.int32, device=device)
        return pos[:, None].expand(count, num_heads)


# ---------------------------------------------------------------- StreamingLLM


@register_compressor("streamingllm")
class StreamingLLMCompressor(TokenDropper):
    """StreamingLLM (Xiao et al., ICLR 2024): the first `num_sinks` tokens (attention
    sinks) plus the most recent budget - num_sinks tokens. Query-agnostic, so
    compress(all) and compress(prefix) + append(rest) keep the same tokens."""

    name = "streamingllm"
    option_specs = (OptionSpec("num_sinks", 4, "attention-sink tokens kept at the start", 0, 1 << 20), MIN_BUDGET)

    def _post_init(self):
        if self.options["min_budget"] < self.options["num_sinks"]:
            raise ValueError(
                f"streamingllm: option min_budget={self.options['min_budget']} is invalid; "
                f"accepted: an integer in [num_sinks={self.options['num_sinks']}, inf]"
            )

    def _bounds(self, num_tokens: int) -> tuple[int, int]:
        """(sinks, window start) of what ``num_tokens`` tokens keep: positions below the first
        and from the second on (all of them while the budget holds every token)."""
        budget = self.budget(num_tokens)
        sinks = min(self.options["num_sinks"], budget)
        return sinks, num_tokens - (budget - sinks)

    def kept_ends(self, positions: torch.Tensor, num_tokens: int) -> tuple[int, int]:
        """positions [N] ascending -> (head, tail): keep the first ``head`` and the last ``tail``
        of them, the sinks and the recent window (disjoint: the window starts past the sinks)."""
        sinks, window = self._bounds(num_tokens)
        bounds = torch.tensor([sinks, window], dtype=positions.dtype, device=positions.device)
        head, window_start = torch.searchsorted(positions.contiguous(), bounds).tolist()
        return head, positions.shape[0] - window_start

    def appended_ends(self, layer, added: int) -> Optional[tuple[int, int]]:
        """``kept_ends`` of ``layer``'s positions followed by ``added`` new ones, from the
        token counts alone: the layer holds what this compressor keeps of its tokens (the
        sinks below ``s`` and the window from ``w``), so how many of its positions lie below a
        bound is arithmetic, with no read of its positions from the device (on a GPU a wait
        per layer and request every round). None when the layer's size does not fit that
        shape (the caller reads the positions)."""
        old = layer.num_tokens
        s, w = self._bounds(old)
        if layer.k.shape[0] != s + (old - w):
            return None

        def below(x: int) -> int:  # positions < x among the layer's and the added ones
            return min(max(x, 0), s) + max(0, min(x, old) - w) + max(0, min(x, old + added) - old)

        sinks, window = self._bounds(old + added)
        return below(sinks), layer.k.shape[0] + added - below(window)

    def compress(self, k, v, queries=None):
        check_kv(k, v)
        num_tokens, num_heads, head_dim = k.shape
        empty = KeptTokensLayer(0, num_heads, head_dim, k.dtype, k[:0], v[:0],
                                self._new_positions(0, 0, num_heads, k.device), None)
        return self.append(empty, k, v)

    def append(self, layer, k, v, queries=None):
        check_append(layer, k, v)
        num_tokens = layer.num_tokens + k.shape[0]
        new_pos = self._new_positions(layer.num_tokens, k.shape[0], layer.num_kv_heads, k.device)
        ends = self.appended_ends(layer, k.shape[0])
        if ends is None:
            ends = self.kept_ends(torch.cat([layer.positions[:, 0], new_pos[:, 0]]), num_tokens)  # same in every head
        head, tail = ends
        assert head + tail == self.budget(num_tokens), "an evicted token was needed again"

        def kept(old, new):
            """The first ``head`` rows of old + new and its last ``tail``, as slices (a boolean
            index was 2x slower). A steady round keeps the sinks and the new rows whole: one
            copy then, not old + new copied and copied again (half an append's time)."""
            rows, added = old.shape[0] + new.shape[0], new.shape[0]
            if head <= old.shape[0] and tail >= added:
                return torch.cat([old[:head], old[old.shape[0] - (tail - added):], new])
            both = torch.cat([old, new])
            return torch.cat([both[:head], both[rows - tail:]])

        return KeptTokensLayer(num_tokens, layer.num_kv_heads, layer.head_dim, layer.dtype, kept(layer.k, k),
                               kept(layer.v, v), kept(layer.positions, new_pos), None)


# ---------------------------------------------------------------- scored droppers


class ScoredDropper(TokenDropper):
    """Keep a protected recent window plus the highest-scoring older tokens, per KV head.
    append() adds the new tokens' attention (when their queries are given) to every
    kept token's score, then evicts the lowest scores outside the recent window."""

    needs_queries = True
    scored = True
    grows_in_place = True  # the kept rows carry spare rows, where the next append joins its tokens

    def recent_len(self, budget: int) -> int:
        raise NotImplementedError

    def prompt_scores(self, k: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """[T, H_kv] fp32 score of every prompt token."""
        raise NotImplementedError

    def compress(self, k, v, queries=None):
        check_kv(k, v)
        if queries is None:
            raise ValueError(f"{self.name} needs the last prompt queries ([W, H_q, D]) to compress")
        _check_queries(queries, k)
        num_tokens, num_heads, head_dim = k.shape
        positions = self._new_positions(0, num_tokens, num_heads, k.device)
        scores = self.prompt_scores(k, queries) if num_tokens else torch.zeros(0, num_heads)
        return self._select(num_tokens, k, v, positions, scores.to(k.device))

    def append(self, layer, k, v, queries=None):
        check_append(layer, k, v)
        # joined in the old entry's spare rows (rows.py): what _select gathers from, with no
        # copy of the whole entry first (the gather is the one copy an append makes)
        keys = append_rows(layer.k, k)
        new_scores = torch.zeros(k.shape[0], layer.num_kv_heads, device=k.device)
        scores = torch.cat([layer.scores, new_scores])
        if queries is not None and k.shape[0]:
            _check_queries(queries, k)
            scores = scores + attention_mass(queries, keys, 1.0 / math.sqrt(layer.head_dim))
        new_pos = self._new_positions(layer.num_tokens, k.shape[0], layer.num_kv_heads, k.device)
        positions = torch.cat([layer.positions, new_pos])
        return self._select(layer.num_tokens + k.shape[0], keys, append_rows(layer.v, v), positions, scores)

    def _select(self, num_tokens, k, v, positions, scores) -> KeptTokensLayer:
        """Evict per head down to budget(num_tokens): recent window first, then by score
        (ties: the earlier token wins), kept in ascending position order."""
        budget = self.budget(num_tokens)
        if k.shape[0] > budget:
            protected = positions >= num_tokens - self.recent_len(budget)
            index = kept_rows(scores.masked_fill(protected, float("inf")), budget)
            k, v = gather_tokens(k, index, spare=True), gather_tokens(v, index, spare=True)
            positions, scores = positions.gather(0, index), scores.gather(0, index)
        return KeptTokensLayer(num_tokens, k.shape[1], k.shape[2], k.dtype, k.contiguous(), v.contiguous(),
                               positions.contiguous(), scores.contiguous())


def kept_rows(rank: torch.Tensor, budget: int) -> torch.Tensor:
    """[budget, H] row index, ascending, of the ``budget`` highest-ranked rows of ``rank``
    [T, H] in each column (ties: the earlier row wins; NaN ranks as +inf): what a stable
    descending sort's first ``budget`` rows are, re-sorted, without sorting. A steady round
    drops a few rows of thousands, for which two sorts of every kept row were the wrong tool:
    this is a selection and a few passes, O(T), with no host sync (``test_droppers.py``
    checks it against the sorts, ties and infinities too). With ``gather_tokens``' row
    copies, an append at 32k tokens went from 11.6 to 1.9 ms a layer."""
    rows, cols = rank.shape
    drop = rows - budget
    if drop <= 0:
        return torch.arange(rows, device=rank.device)[:, None].expand(rows, cols)
    rank = rank.masked_fill(rank.isnan(), float("inf"))  # (nan_to_num would also make +-inf finite)
    edge = rank.kthvalue(drop, dim=0, keepdim=True).values  # [1, H]: the highest rank dropped
    below = rank < edge  # all dropped; of the rows at the edge, the latest go
    tied = rank == edge
    left = drop - below.sum(0, keepdim=True)  # edge rows to drop, >= 1
    from_end = tied.flip(0).cumsum(0).flip(0)  # edge rows at or after each row
    keep = ~(below | (tied & (from_end <= left)))
    slot = keep.cumsum(0) - 1  # a kept row's place in the output; dropped rows go past the end
    slot = torch.where(keep, slot, budget)
    index = torch.empty(budget + 1, cols, dtype=torch.int64, device=rank.device)
    index.scatter_(0, slot, torch.arange(rows, device=rank.device)[:, None].expand(rows, cols).contiguous())
    return index[:budget]


def _check_queries(queries: torch.Tensor, k: torch.Tensor) -> None:
    if queries.dim() != 3 or queries.shape[2] != k.shape[2] or queries.shape[1] % k.shape[1]:
        raise ValueError(f"queries must be [W, H_q, D] with H_q a multiple of H_kv; got {tuple(queries.shape)}")
    if queries.shape[0] > k.shape[0]:
        raise ValueError(f"{queries.shape[0]} queries for {k.shape[0]} tokens: they must be the last W tokens'")


@register_compressor("snapkv")
class SnapKVCompressor(ScoredDropper):
    """SnapKV (Li et al., NeurIPS 2024): the last `window_size` prompt queries vote (their
    attention over the earlier tokens, pooled over `kernel_size` neighbours); keep the
    observation window plus the top-voted tokens per KV head."""

    name = "snapkv"
    option_specs = (
        OptionSpec("window_size", 32, "observation window: trailing prompt queries that vote", 1, 1 << 20),
        OptionSpec("kernel_size", 7, "pooling kernel over positions (odd)", 1, 1023),
        OptionSpec("pooling", "maxpool", "how votes are pooled", choices=("maxpool", "avgpool")),
        MIN_BUDGET,
    )

    def _post_init(self):
        if self.options["kernel_size"] % 2 == 0:
            raise ValueError(f"snapkv: option kernel_size={self.options['kernel_size']} is invalid; "
                             "accepted: an odd integer in [1, 1023]")

    @property
    def query_window(self) -> int:
        return self.options["window_size"]

    def recent_len(self, budget: int) -> int:
        return min(self.options["window_size"], budget)

    def prompt_scores(self, k, queries):
        queries = queries[-self.options["window_size"] :]
        votes = attention_mass(queries, k, 1.0 / math.sqrt(k.shape[2]))  # [T, H]
        prefix = k.shape[0] - queries.shape[0]  # tokens before the observation window
        if prefix > 0:
            votes[:prefix] = self._pool(votes[:prefix])
        return votes

    def _pool(self, votes: torch.Tensor) -> torch.Tensor:
        kernel = self.options["kernel_size"]
        pool = F.max_pool1d if self.options["pooling"] == "maxpool" else F.avg_pool1d
        return pool(votes.T[:, None], kernel, stride=1, padding=kernel // 2)[:, 0].T


@register_compressor("h2o")
class H2OCompressor(ScoredDropper):
    """H2O (Zhang et al., NeurIPS 2023): heavy hitters by accumulated attention plus the
    most recent tokens; `heavy_fraction` of the budget goes to heavy hitters (the paper
    splits it evenly). compress() accumulates over every query it is given, so pass all
    prompt queries for the paper's rule (fewer work, like a SnapKV window)."""

    name = "h2o"
    option_specs = (
        OptionSpec("heavy_fraction", 0.5, "share of the budget chosen by accumulated attention", 0.0, 1.0),
        MIN_BUDGET,
    )

    def recent_len(self, budget: int) -> int:
        return budget - math.floor(budget * self.options["heavy_fraction"])

    def prompt_scores(self, k, queries):
        return attention_mass(queries, k, 1.0 / math.sqrt(k.shape[2]))
