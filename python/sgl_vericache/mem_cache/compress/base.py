"""The KV compressor interface and the pieces every method shares.

A compressor turns one request's full KV for one layer into a `CompressedLayer`,
grows that entry as verified decode tokens arrive, and answers the draft attention
over it. Entries are values: `compress` and `append` return new objects and never
modify their inputs, so a caller may keep an old entry (e.g. across a rejected draft).
An append may write into spare rows past the end of the old entry's tensors, which no
tensor it holds can see (`rows.py`), so the old entry still reads exactly what it did.

Shapes (one layer, one request):
    k, v        [T, H_kv, D]   post-RoPE keys and values, as SGLang's KV pool stores them
    queries     [W, H_q, D]    post-RoPE queries of the LAST W tokens of k (causal)
    q           [S, H_q, D]    the draft step's queries, H_q a multiple of H_kv (GQA)
    k_extra     [E, H_kv, D]   the draft tokens' own provisional KV, E >= S
    positions   [N, H_kv]      int64 token index (in the request) of each kept key
"""

from __future__ import annotations

import math
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class OptionSpec:
    """One method option: its default (the paper's setting), type and accepted range."""

    name: str
    default: Any
    help: str
    low: float | None = None  # inclusive
    high: float | None = None  # inclusive
    choices: tuple[str, ...] | None = None

    def accepted(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        kind = "an integer" if isinstance(self.default, int) else "a number"
        high = "inf" if self.high is None else self.high
        return f"{kind} in [{self.low}, {high}]"

    def validate(self, method: str, value: Any) -> Any:
        """Coerce (strings from a command line are accepted) and range-check `value`."""
        bad = ValueError(f"{method}: option {self.name}={value!r} is invalid; accepted: {self.accepted()}")
        if self.choices is not None:
            if value not in self.choices:
                raise bad
            return value
        kind = int if isinstance(self.default, int) else float
        try:
            if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
                raise TypeError
            value = kind(value)
        except (TypeError, ValueError):
            raise bad from None
        if not math.isfinite(value) or (self.low is not None and value < self.low):
            raise bad
        if self.high is not None and value > self.high:
            raise bad
        return value


@dataclass(frozen=True)
class CompressorConfig:
    """What a user chooses: `--vericache-compressor NAME --vericache-ratio R` plus options.

    ratio: target compression (full bytes / compressed bytes), >= 1. Token droppers turn it
    into a kept-token budget and Quest into pages read per step; for quantizers the bit
    width fixes the ratio and `ratio` is checked (>= 1) but otherwise ignored (their
    `compressor.ratio` is None) — read the achieved ratio from
    `KVCompressor.achieved_ratio`. None means the method's default (4.0 for droppers/Quest).
    """

    name: str
    ratio: float | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "options", types.MappingProxyType(dict(self.options)))


@dataclass
class CompressedLayer:
    """One request's compressed KV for one layer. Subclasses add their tensors."""

    num_tokens: int  # tokens of the request represented (compressed + appended)
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the KV dtype the entry stands in for

    def tensors(self) -> Sequence[torch.Tensor]:
        """Every tensor that is part of the stored entry (all of them count in nbytes)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """True storage: codes, scales, zero points, kept indices, scores, metadata."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def check_integrity(self) -> None:
        assert self.num_tokens >= 0
        for t in self.tensors():
            assert t.device == self.tensors()[0].device


def full_nbytes(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of the uncompressed K and V of `num_tokens` tokens."""
    return 2 * num_tokens * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def check_kv(k: torch.Tensor, v: torch.Tensor) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, H_kv, D]; got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype not in SUPPORTED_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"k/v dtype must be one of {SUPPORTED_DTYPES} and equal; got {k.dtype}, {v.dtype}")


def check_append(layer: CompressedLayer, k: torch.Tensor, v: torch.Tensor) -> None:
    check_kv(k, v)
    if (k.shape[1], k.shape[2], k.dtype) != (layer.num_kv_heads, layer.head_dim, layer.dtype):
        raise ValueError(
            f"appended k/v {tuple(k.shape)} {k.dtype} do not match the entry "
            f"[*, {layer.num_kv_heads}, {layer.head_dim}] {layer.dtype}"
        )


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              sinks: torch.Tensor | None = None, cap: float | None = None) -> torch.Tensor:
    """SDPA with GQA (q [B, H_q, L_q, D]; k, v [B, H_kv, L, D]; mask broadcastable to
    [B, H_q, L_q, L], True where seen, or None), written out for what SDPA has no argument
    for: ``sinks`` [H_q] (a layer's attention sinks: gpt-oss, Granite-SWA), one more term
    exp(sink) in each query head's softmax denominator, and ``cap`` (Gemma 2, Grok), scores
    cap * tanh(score / cap), as the target's decode applies them. Drafts, verify's torch path
    and the compressors' reference (causal_attention) share it."""
    if sinks is None and cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scale  # [B, H_q, L_q, L]
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, -1) @ v
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v


def causal_attention(
    q: torch.Tensor,  # [S, H_q, D]
    k: torch.Tensor,  # [N, H_kv, D] compressed part: visible to every query
    v: torch.Tensor,  # [N, H_kv, D]
    scale: float,
    k_extra: torch.Tensor | None = None,  # [E, H_kv, D] causal part
    v_extra: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,  # [H_q, S, N] bool: which compressed keys each query reads
    softcap: float | None = None,  # a logit soft cap: scores -> cap * tanh(score / cap)
) -> torch.Tensor:
    """Reference draft attention, computed in fp32. Query i sees the compressed keys and
    extra[: E - S + i + 1]. A query that sees nothing returns zeros."""
    num_q, num_q_heads, _ = q.shape
    num_extra = 0 if k_extra is None else k_extra.shape[0]
    if num_extra < num_q and k_extra is not None:
        raise ValueError(f"k_extra has {num_extra} tokens but there are {num_q} queries (need E >= S)")
    if num_extra:
        k, v = torch.cat([k, k_extra]), torch.cat([v, v_extra])
    if num_q_heads % k.shape[1]:
        raise ValueError(f"H_q={num_q_heads} must be a multiple of H_kv={k.shape[1]}")
    if k.shape[0] == 0:
        return torch.zeros_like(q)
    visible = None
    if mask is not None or (num_q > 1 and num_extra > 0):
        visible = _visibility(num_q, num_q_heads, k.shape[0], num_extra, mask, q.device)
    out = attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
                    None if visible is None else visible[None], scale, cap=softcap or None)[0]  # [H_q, S, D]
    if visible is not None:
        out = out.nan_to_num(0.0)  # rows that see nothing
    return out.transpose(0, 1).to(q.dtype)


def _visibility(num_q, num_q_heads, num_keys, num_extra, mask, device) -> torch.Tensor:
    """[H_q, S, N+E] bool mask: compressed part per `mask`, extra part causal."""
    num_comp = num_keys - num_extra
    if mask is None:
        mask = torch.ones(num_q_heads, num_q, num_comp, dtype=torch.bool, device=device)
    rows = torch.arange(num_q, device=device)[:, None]
    cols = torch.arange(num_extra, device=device)[None, :]
    causal = (cols <= rows + (num_extra - num_q)).expand(num_q_heads, num_q, num_extra)
    return torch.cat([mask, causal], dim=-1)


class KVCompressor(ABC):
    """One compression method with its validated options. Stateless across requests:
    all per-request state lives in the `CompressedLayer` entries."""

    name: ClassVar[str]
    needs_queries: ClassVar[bool] = False  # compress() requires the last prompt queries
    option_specs: ClassVar[tuple[OptionSpec, ...]] = ()
    uses_ratio: ClassVar[bool] = False  # False: the method fixes its own ratio (quantizers)
    default_ratio: ClassVar[float | None] = None  # used when the config gives none
    # the entry's tensors keep spare rows after their end, where append() writes new tokens
    # (rows.py): an entry of N rows may hold up to rows.spare_rows(N) more than nbytes() counts
    grows_in_place: ClassVar[bool] = False

    def __init__(self, config: CompressorConfig):
        self.config = config
        self.ratio = self._validate_ratio(config.ratio)
        self.options = types.MappingProxyType(self._validate_options(config.options))
        self._post_init()

    def _post_init(self) -> None:
        """Cross-option checks and derived settings (override)."""

    def _validate_ratio(self, ratio: float | None) -> float | None:
        if ratio is None:
            return self.default_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio < 1:
            raise ValueError(f"{self.name}: ratio={ratio!r} is invalid; accepted: a number in [1, inf)")
        return float(ratio) if self.uses_ratio else None

    def _validate_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        specs = {s.name: s for s in self.option_specs}
        unknown = sorted(set(options) - set(specs))
        if unknown:
            known = ", ".join(specs) or "none"
            raise ValueError(f"{self.name}: unknown option(s) {', '.join(unknown)}; accepted options: {known}")
        return {n: s.validate(self.name, options.get(n, s.default)) for n, s in specs.items()}

    @property
    def query_window(self) -> int | None:
        """How many trailing prompt queries compress() uses (None: as many as given)."""
        return None

    def check_layout(self, num_kv_heads: int, head_dim: int) -> None:
        """Raise ValueError, naming the value and what is accepted, if entries of this many KV
        heads of this size break one of the method's rules (override where one exists). Checked
        before a request is admitted and when a server starts: compress() raising at a
        request's first round would stop SGLang's scheduler, not end one request."""

    @abstractmethod
    def compress(self, k: torch.Tensor, v: torch.Tensor, queries: torch.Tensor | None = None) -> CompressedLayer:
        """Build the entry from a request's full KV for one layer (k, v: [T, H_kv, D])."""

    @abstractmethod
    def append(
        self, layer: CompressedLayer, k: torch.Tensor, v: torch.Tensor, queries: torch.Tensor | None = None
    ) -> CompressedLayer:
        """Add n verified tokens (k, v: [n, H_kv, D]; queries: their [n, H_q, D] queries),
        keeping the method's policy. Returns a new entry; `layer` stays valid."""

    @abstractmethod
    def materialize(self, layer: CompressedLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v, positions): the keys/values a dense reader sees, dequantized to
        layer.dtype ([N, H_kv, D] each), and their token positions [N, H_kv]."""

    def materialize_tail(self, layer: CompressedLayer, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [start:] of ``materialize(layer)``'s (k, v). Methods that can produce them
        without the rows before override this; the drafter uses it with ``stable_rows``."""
        k, v, _ = self.materialize(layer)
        return k[start:], v[start:]

    def stable_rows(self, old: CompressedLayer, new: CompressedLayer) -> int:
        """For ``new`` grown from ``old`` by append() calls: how many leading rows of
        ``materialize(new)`` are bit-equal to those of ``materialize(old)`` (0: assume none).
        Lets a reader that kept old's dense rows rewrite only the rest."""
        return 0

    def dequantize(self, layer: CompressedLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.materialize(layer)

    @abstractmethod
    def nbytes_for(self, num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes an entry holding `num_tokens` tokens takes (what `layer.nbytes()` will say;
        it depends only on sizes, so a pool can plan its memory)."""

    def attend(
        self,
        layer: CompressedLayer,
        q: torch.Tensor,  # [S, H_q, D]
        scale: float,
        k_extra: torch.Tensor | None = None,  # [E, H_kv, D]
        v_extra: torch.Tensor | None = None,
        softcap: float | None = None,  # the layer's logit soft cap (Gemma 2, Grok), or None
    ) -> torch.Tensor:  # [S, H_q, D] in q.dtype
        """Draft attention over the entry plus the causal provisional extras (fp32 softmax):
        the reference for the drafter's batched path, which reads ``materialize`` and
        ``step_selection`` the same way."""
        k, v, _ = self.materialize(layer)
        return causal_attention(q, k, v, scale, k_extra, v_extra, mask=self.step_selection(layer, q),
                                softcap=softcap)

    def step_selection(self, layer: CompressedLayer, q: torch.Tensor) -> torch.Tensor | None:
        """[H_q, S, N] bool: which materialized keys each query head reads at this draft
        step (q: [S, H_q, D]), or None for all of them. Query-aware methods (Quest) override."""
        return None

    def read_nbytes(self, layer: CompressedLayer) -> int:
        """Bytes one attend() step reads from the entry (all of it, except for Quest)."""
        return layer.nbytes()

    @staticmethod
    def full_nbytes(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return full_nbytes(num_tokens, num_kv_heads, head_dim, dtype)

    def achieved_ratio(self, layer: CompressedLayer) -> float:
        """Full KV bytes (in layer.dtype) over the entry's bytes; 1.0 for an empty entry."""
        if layer.num_tokens == 0:
            return 1.0
        full = full_nbytes(layer.num_tokens, layer.num_kv_heads, layer.head_dim, layer.dtype)
        return full / layer.nbytes()

    def achieved_read_ratio(self, layer: CompressedLayer) -> float:
        """Full KV bytes over the bytes one attend() step reads."""
        if layer.num_tokens == 0:
            return 1.0
        full = full_nbytes(layer.num_tokens, layer.num_kv_heads, layer.head_dim, layer.dtype)
        return full / self.read_nbytes(layer)

    def __repr__(self) -> str:
        args = [f"ratio={self.ratio}"] + [f"{k}={v!r}" for k, v in self.options.items()]
        return f"{type(self).__name__}({', '.join(args)})"
