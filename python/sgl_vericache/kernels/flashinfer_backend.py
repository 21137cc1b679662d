"""FlashInfer's paged decode for the dense layouts (droppers' kept tokens, full), opt-in.

FlashInfer already has a decode kernel for this case: the kept K/V rows are a paged cache
with one token a page, so no kernel of ours is needed for the entry. The round's
provisional KV goes through a second call over its own buffer (also one token a page) and
FlashInfer's ``merge_state`` joins the two softmax states, so both log-sum-exps come from
FlashInfer and share its convention.

Off unless SGL_VERICACHE_DRAFT_FLASHINFER=1 and flashinfer imports on a CUDA device: no
machine of this project has run it (CI is CPU-only; the lent GPU machine has no FlashInfer),
so the Triton kernels, which are checked, stay the default. The page-table arithmetic is
tested on CPU against a torch stand-in of FlashInfer's documented semantics.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional, Sequence

import torch

ENV = "SGL_VERICACHE_DRAFT_FLASHINFER"
WORKSPACE_BYTES = 128 << 20
# (device, group slot) -> its FlashInferDecode: two 128 MiB workspaces a slot, made once, not
# every round (a round's plans are keyed by its id, so a later round replans on its own)
_SHARED: dict = {}
# query heads per KV head that FlashInfer's CUDA-core decode kernels are built for; others
# (7 for Qwen2.5-7B, 5) raise "Unsupported group_size" at plan()
CUDA_CORE_GROUPS = frozenset({1, 2, 3, 4, 6, 8, 16})


def use_tensor_cores(group: int) -> bool:
    """Whether the decode runs on FlashInfer's tensor-core kernels (its prefill kernels, which
    take any group size): SGLang's rule for 16-bit KV (a group of 4 or more), and always
    where no CUDA-core kernel exists."""
    return group >= 4 or group not in CUDA_CORE_GROUPS


def page_tables(starts: Sequence[int], lens: Sequence[int], device) -> tuple[torch.Tensor, ...]:
    """(indptr [R + 1], indices [sum lens], last_page_len [R]) int32 for rows whose tokens are
    rows starts[r] .. starts[r] + lens[r] - 1 of a cache with one token a page."""
    if any(n < 1 for n in lens):
        raise ValueError("every row needs at least one token (FlashInfer has no empty rows)")
    indptr = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32)
    indices = torch.cat([torch.arange(s, s + n, dtype=torch.int32) for s, n in zip(starts, lens)])
    last = torch.ones(len(lens), dtype=torch.int32)
    return indptr.to(device), indices.to(device), last.to(device)


class FlashInferDecode:
    """One compressor group's decode: a wrapper for the entries (planned once a round) and
    one for the provisional KV (planned once a draft step, shared by every layer)."""

    def __init__(self, device: torch.device, flashinfer_module=None):
        self._fi = flashinfer_module or importlib.import_module("flashinfer")
        # zeroed: FlashInfer wants its float workspace zeroed before its first use
        self._workspaces = [torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
        self._group = None  # query heads per KV head the wrappers were made for (one model a worker)
        self._main = self._extra = None
        self._main_plan = None
        self._extra_plan = None

    def _wrappers_for(self, group: int) -> None:
        """Make the two wrappers at the first decode, when the group size is known."""
        if self._group == group:
            return
        tensor_cores = use_tensor_cores(group)
        self._main, self._extra = (self._fi.BatchDecodeWithPagedKVCacheWrapper(w, "NHD", use_tensor_cores=tensor_cores)
                                   for w in self._workspaces)
        self._group, self._main_plan, self._extra_plan = group, None, None

    @staticmethod
    def maybe(device: torch.device, slot: int = 0) -> Optional["FlashInferDecode"]:
        """The backend of a round's ``slot``-th compressor group when switched on and usable
        here, else None."""
        if os.environ.get(ENV, "0") != "1" or torch.device(device).type != "cuda":
            return None
        try:
            return FlashInferDecode.shared(torch.device(device), slot)
        except ImportError:
            return None

    @staticmethod
    def shared(device: torch.device, slot: int, flashinfer_module=None) -> "FlashInferDecode":
        """The one backend of ``slot`` on ``device``, made at its first round. Rounds run one
        at a time on a device, and each group of a round has its own slot."""
        key = (str(device), slot)
        if key not in _SHARED:
            _SHARED[key] = FlashInferDecode(device, flashinfer_module)
        return _SHARED[key]

    def decode(self, plan_key, packed, entries: Sequence[int], q: torch.Tensor, scale: float,
               k_extra: torch.Tensor, v_extra: torch.Tensor, extra_rows: Sequence[int],
               extra_lens: Sequence[int]) -> torch.Tensor:
        """Row r: q[r] over entry entries[r]'s dense rows and extras row extra_rows[r]'s first
        extra_lens[r] tokens. ``plan_key`` names the round (the entries' plan is reused while
        it stays the same); the extras' plan is redone when their lengths change."""
        assert packed.addresses is None, "FlashInfer's page tables index entries laid end to end (pack's default)"
        heads, dim = packed.num_kv_heads, packed.head_dim
        num_q_heads = q.shape[1]
        self._wrappers_for(num_q_heads // heads)
        if self._main_plan != plan_key:
            tables = page_tables([packed.main_start[e] for e in entries], [packed.main_len[e] for e in entries],
                                 q.device)
            self._main.plan(*tables, num_q_heads, heads, dim, 1, q_data_type=q.dtype, kv_data_type=packed.dtype,
                            sm_scale=scale)
            self._main_plan = plan_key
        extra_key = (plan_key, tuple(extra_rows), tuple(extra_lens))
        if self._extra_plan != extra_key:
            cap = k_extra.shape[1]
            tables = page_tables([r * cap for r in extra_rows], extra_lens, q.device)
            self._extra.plan(*tables, num_q_heads, heads, dim, 1, q_data_type=q.dtype, kv_data_type=k_extra.dtype,
                             sm_scale=scale)
            self._extra_plan = extra_key
        out_a, lse_a = self._main.run(q, (packed.k.unsqueeze(1), packed.v.unsqueeze(1)), return_lse=True)
        pages = (k_extra.reshape(-1, 1, heads, dim), v_extra.reshape(-1, 1, heads, dim))
        out_b, lse_b = self._extra.run(q, pages, return_lse=True)
        out, _ = self._fi.merge_state(out_a, lse_a, out_b, lse_b)
        return out.to(q.dtype)
