"""Quest (Tang et al., ICML 2024): query-aware page selection.

All KV stays; each page of `page_size` tokens also stores the per-channel min and max of
its keys. At every draft step each query head bounds q.k on every page by
sum_d max(q_d * min_d, q_d * max_d) and the top pages are read. The ratio sets the
pages read per step: min(P, max(ceil(P / ratio), ceil(min_budget / page_size))) of the
P pages, so Quest saves reads, not memory: nbytes() is the full KV plus the min/max
metadata (achieved_ratio < 1), read_nbytes() what one step reads (achieved_read_ratio).

Who chooses (option ``heads``): the paper's models are multi-head, one query head a KV head.
Under GQA, ``kv`` (the default) chooses once per KV head by the largest of its query heads'
bounds (a page any head of the group may attend to), so each chosen page is read once for
the whole group; ``query`` chooses per query head as the paper does, so a GPU draft reads a
KV head's chosen pages once per query head of its group (group / ratio of the KV, more than
all of it at group > ratio; read_nbytes() counts them once either way). With one query head
a KV head the two are the same. Measured: benchmark/results/quest_heads.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import CompressedLayer, KVCompressor, OptionSpec, check_append, check_kv
from .registry import register_compressor
from .rows import append_rows


@dataclass
class QuestLayer(CompressedLayer):
    k: torch.Tensor  # [T, H, D] every key, uncompressed
    v: torch.Tensor  # [T, H, D]
    page_min: torch.Tensor  # [P, H, D] per-page, per-channel key minimum, P = ceil(T / page_size)
    page_max: torch.Tensor  # [P, H, D]

    def tensors(self):
        return (self.k, self.v, self.page_min, self.page_max)

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self.k.shape[0] == self.num_tokens and self.page_min.shape == self.page_max.shape


def page_bounds(k: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k [n, H, D] starting on a page boundary -> (min, max) [ceil(n / page_size), H, D]."""
    num_pages = -(-k.shape[0] // page_size)
    pad = num_pages * page_size - k.shape[0]
    if pad:  # repeat the last key: min and max are unchanged
        k = torch.cat([k, k[-1:].expand(pad, -1, -1)])
    pages = k.reshape(num_pages, page_size, *k.shape[1:])
    return pages.amin(1), pages.amax(1)


@register_compressor("quest")
class QuestCompressor(KVCompressor):
    name = "quest"
    grows_in_place = True
    uses_ratio = True
    default_ratio = 4.0
    option_specs = (
        OptionSpec("page_size", 16, "tokens per page", 1, 1 << 16),
        OptionSpec("min_budget", 16, "tokens always read (rounded up to pages)", 0, 1 << 30),
        OptionSpec("heads", "kv", "who chooses pages: 'kv' (per KV head, by the largest of its query heads' "
                   "bounds) or 'query' (per query head, as the paper)", choices=("kv", "query")),
    )

    def num_pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.options["page_size"])

    def pages_read(self, num_tokens: int) -> int:
        pages = self.num_pages(num_tokens)
        floor = -(-self.options["min_budget"] // self.options["page_size"])
        return min(pages, max(math.ceil(pages / self.ratio), floor))

    def compress(self, k, v, queries=None):
        check_kv(k, v)
        empty_bounds = k.new_empty(0, *k.shape[1:])
        layer = QuestLayer(0, k.shape[1], k.shape[2], k.dtype, k[:0], v[:0], empty_bounds, empty_bounds)
        return self.append(layer, k, v)

    def append(self, layer, k, v, queries=None):
        check_append(layer, k, v)
        keys = append_rows(layer.k, k)
        first_page = layer.num_tokens // self.options["page_size"]  # the page the new tokens start in
        low, high = page_bounds(keys[first_page * self.options["page_size"] :], self.options["page_size"])
        if first_page == layer.page_min.shape[0]:  # the last page was full: pages are only added
            page_min, page_max = append_rows(layer.page_min, low), append_rows(layer.page_max, high)
        else:  # the last page's bounds change: a new tensor (entries are values)
            page_min = torch.cat([layer.page_min[:first_page], low])
            page_max = torch.cat([layer.page_max[:first_page], high])
        return QuestLayer(keys.shape[0], layer.num_kv_heads, layer.head_dim, layer.dtype, keys,
                          append_rows(layer.v, v), page_min, page_max)

    def materialize(self, layer):
        positions = torch.arange(layer.num_tokens, device=layer.k.device)[:, None]
        return layer.k, layer.v, positions.expand(-1, layer.num_kv_heads)

    def stable_rows(self, old, new):
        return old.num_tokens  # every key is kept as it is; append only adds rows

    def page_scores(self, layer: QuestLayer, q: torch.Tensor) -> torch.Tensor:
        """Upper bound of q.k over each page: [S, H_q, P] fp32 (q: [S, H_q, D])."""
        group = q.shape[1] // layer.num_kv_heads
        low = layer.page_min.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H_q, P, D]
        high = layer.page_max.float().repeat_interleave(group, dim=1).transpose(0, 1)
        qf = q.float()[:, :, None, :]  # [S, H_q, 1, D]
        return torch.maximum(qf * low, qf * high).sum(-1)

    def choice_scores(self, layer: QuestLayer, q: torch.Tensor) -> torch.Tensor:
        """What the choice ranks pages by: [S, H_kv, P] (``heads="kv"``: the largest bound
        among each KV head's query heads) or [S, H_q, P] (``heads="query"``), fp32."""
        bounds = self.page_scores(layer, q)
        if self.options["heads"] == "query":
            return bounds
        s, hq, p = bounds.shape
        return bounds.reshape(s, layer.num_kv_heads, hq // layer.num_kv_heads, p).amax(2)

    def selected_tokens(self, layer: QuestLayer, q: torch.Tensor) -> torch.Tensor:
        """[H_q, S, T] bool: the tokens of the pages each query head reads."""
        scores = self.choice_scores(layer, q)  # [S, H_c, P]
        top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : self.pages_read(layer.num_tokens)]
        pages = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)
        pages = pages.repeat_interleave(q.shape[1] // pages.shape[1], dim=1)  # [S, H_q, P]
        token_page = torch.arange(layer.num_tokens, device=q.device) // self.options["page_size"]
        return pages[..., token_page].transpose(0, 1)

    def step_selection(self, layer, q):
        if self.pages_read(layer.num_tokens) < self.num_pages(layer.num_tokens):
            return self.selected_tokens(layer, q)
        return None

    def nbytes_for(self, num_tokens, num_kv_heads, head_dim, dtype):
        return 2 * (num_tokens + self.num_pages(num_tokens)) * num_kv_heads * head_dim * dtype.itemsize

    def read_nbytes(self, layer):
        """Metadata of every page plus the KV of the pages read (counted as full pages)."""
        tokens_read = min(layer.num_tokens, self.pages_read(layer.num_tokens) * self.options["page_size"])
        per_token = 2 * layer.num_kv_heads * layer.head_dim * layer.dtype.itemsize
        return tokens_read * per_token + self.num_pages(layer.num_tokens) * per_token
