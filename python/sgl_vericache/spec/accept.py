"""Acceptance rules for one verify round over a linear draft chain (pure torch, no SGLang).

Conventions, for a batch of ``bs`` requests and verify width ``n``:

- ``candidates`` [bs, n]: column 0 is the root (the last token already emitted, the verify
  pass's first input); columns 1..n-1 are the drafts d_1..d_{n-1}.
- Verify row j (0 <= j < n) is the target's distribution for the token that follows
  ``candidates[:, j]``.
- ``max_accept`` [bs]: at most this many drafts of request b may be accepted
  (0 <= max_accept[b] <= n-1); draft columns past it are padding and are never looked at.
- Every rule returns ``AcceptResult(num_accepted [bs], tokens [bs, n])``: request b emits
  ``tokens[b, :num_accepted[b] + 1]``, i.e. the accepted drafts d_1..d_k then one token drawn
  from row k (the correction after a rejection, or the bonus). Later entries are -1.

The rules and what each guarantees:

- ``chain_match``: accept d_j while it equals the token the target picked at row j-1
  (argmax, or a seeded draw). The emitted tokens are exactly those the target would have
  picked one at a time, so greedy output is identical to decoding without speculation.
- ``sampling_probs``: the distribution SGLang's pure-torch sampler draws from for given
  logits and sampling parameters (temperature, top-k, top-p, min-p), renormalized.
- ``rejection_sample_chain``: speculative rejection sampling (Leviathan et al. 2023;
  Chen et al. 2023). Whatever the proposal q the drafts were drawn from, the emitted
  sequence is distributed exactly as sampling token by token from the target rows p.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional, Sequence, Union

import torch

logger = logging.getLogger(__name__)

# SGLang's SamplingParams turns temperature < 1e-6 into greedy (temperature 1, top_k 1).
SAMPLING_EPS = 1e-6

MaxAccept = Union[torch.Tensor, Sequence[int]]
PerRow = Union[torch.Tensor, Sequence[float], float]


class AcceptResult(NamedTuple):
    num_accepted: torch.Tensor  # [bs] int64: accepted drafts k
    tokens: torch.Tensor  # [bs, n] int64: d_1..d_k, then the token drawn from row k, then -1


def chain_match(candidates: torch.Tensor, targets: torch.Tensor, max_accept: MaxAccept) -> AcceptResult:
    """Accept d_j while ``d_j == targets[:, j-1]`` (at most ``max_accept``); the last
    emitted token is ``targets[:, k]``. ``targets`` [bs, n]: the target's pick after each row."""
    bs, n = candidates.shape
    if targets.shape != candidates.shape:
        raise ValueError(f"targets {tuple(targets.shape)} must match candidates {tuple(candidates.shape)}")
    max_accept = _max_accept_tensor(max_accept, bs, n, candidates.device)
    matches = (candidates[:, 1:] == targets[:, :-1]) & _allowed(max_accept, n)  # [bs, n-1]
    num_accepted = _leading_true(matches)
    last = targets.gather(1, num_accepted[:, None]).squeeze(1)
    return AcceptResult(num_accepted, _emitted(candidates, num_accepted, last))


def sampling_probs(
    logits: torch.Tensor,  # [rows, V]
    temperatures: PerRow,
    top_ks: PerRow,
    top_ps: PerRow,
    min_ps: PerRow,
) -> torch.Tensor:
    """The float32 distribution [rows, V] SGLang's pure-torch sampler draws from.

    As in ``Sampler.forward`` followed by ``top_k_top_p_min_p_sampling_from_probs_torch``:
    softmax(logits / temperature); sort descending; drop ranks >= top_k, tokens whose
    preceding mass (cumsum - p, over the unfiltered sorted probs) exceeds top_p, and tokens
    below min_p times the largest prob; renormalize what is left (the multinomial does).
    Per-row parameters are tensors/sequences of length rows, or one scalar for all rows.
    Temperature < 1e-6 means greedy, as SGLang's SamplingParams rewrites it (temperature 1,
    top_k 1); top_k < 1 (SGLang's -1) means the whole vocabulary. Ties at a top-k cut keep
    the lower token id (a stable sort; SGLang's sort leaves that order unspecified).
    """
    rows, vocab = logits.shape
    temperatures = _per_row(temperatures, rows, torch.float32, logits.device)
    top_ks = _per_row(top_ks, rows, torch.int64, logits.device)
    greedy = temperatures < SAMPLING_EPS
    temperatures = torch.where(greedy, 1.0, temperatures)
    top_ks = torch.where(greedy, 1, top_ks)
    probs = torch.softmax(logits.float() / temperatures, dim=-1)
    kept = filter_probs(probs, top_ks, top_ps, min_ps)
    return kept / kept.sum(dim=-1, keepdim=True)


def filter_probs(probs: torch.Tensor, top_ks: PerRow, top_ps: PerRow, min_ps: PerRow) -> torch.Tensor:
    """``probs`` [rows, V] with the tokens top-k, top-p and min-p drop set to 0 (not
    renormalized), in vocabulary order. A row's result depends only on that row: top_k < 1
    or >= V, top_p >= 1 and min_p <= 0 leave it untouched. Ties at a top-k cut keep the
    lower token id (stable sort)."""
    rows, vocab = probs.shape
    top_ks = _per_row(top_ks, rows, torch.int64, probs.device)
    top_ks = torch.where((top_ks < 1) | (top_ks > vocab), vocab, top_ks)
    top_ps = _per_row(top_ps, rows, torch.float32, probs.device)
    min_ps = _per_row(min_ps, rows, torch.float32, probs.device)
    if not bool(((top_ks < vocab) | (top_ps < 1.0)).any()):  # min-p at most: no full-vocabulary sort
        return probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_ps, 0.0)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [rows, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    rank = torch.arange(vocab, device=probs.device)
    keep = (rank < top_ks) & ((mass_before <= top_ps) | (top_ps >= 1.0)) & (
        sorted_probs >= sorted_probs[:, :1] * min_ps)
    keep = torch.zeros_like(keep).scatter_(-1, order, keep)
    return probs.masked_fill(~keep, 0.0)


def sample_draft(
    probs: torch.Tensor, generator: Optional[torch.Generator] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``probs`` [rows, V]; returns (tokens [rows], probs), the
    probs being the proposal q to hand to ``rejection_sample_chain`` for these tokens."""
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tokens, probs


def rejection_sample_chain(
    candidates: torch.Tensor,  # [bs, n]
    target_probs: torch.Tensor,  # [bs, n, V]: row j = p_j
    draft_probs: torch.Tensor,  # [bs, n-1, V]: row j-1 = q the draft d_j was drawn from
    max_accept: MaxAccept,
    generator: Optional[torch.Generator] = None,
) -> AcceptResult:
    """Speculative rejection sampling on a chain.

    For j = 1..max_accept: accept d_j with probability min(1, p_{j-1}(d_j) / q_{j-1}(d_j)).
    On the first rejection, at j, the last token is drawn from normalize(max(p_{j-1} -
    q_{j-1}, 0)), or from p_{j-1} if that residual is all zero; if every allowed draft is
    accepted, the bonus is drawn from p_k. A one-hot q row means d_j was chosen
    deterministically (greedy drafting): it is accepted with probability p(d_j).

    q(d_j) == 0 cannot happen when d_j was really drawn from q, so the output distribution
    does not depend on what is done then; we take the ratio's limit: accept iff
    p(d_j) > 0. That tolerates a q that underflowed to 0 and never emits a token the
    target gives probability 0. Rows of p and q must sum to 1. All randomness (one
    uniform per draft, one categorical draw per request) comes from ``generator``.
    """
    bs, n = candidates.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape != (bs, n, vocab) or draft_probs.shape != (bs, n - 1, vocab):
        raise ValueError(
            f"want target_probs [{bs}, {n}, V] and draft_probs [{bs}, {n - 1}, V], "
            f"got {tuple(target_probs.shape)} and {tuple(draft_probs.shape)}"
        )
    max_accept = _max_accept_tensor(max_accept, bs, n, candidates.device)
    drafts = candidates[:, 1:, None].long()  # [bs, n-1, 1]
    p_draft = target_probs[:, :-1].gather(-1, drafts).squeeze(-1)  # p_{j-1}(d_j)
    q_draft = draft_probs.gather(-1, drafts).squeeze(-1)  # q_{j-1}(d_j)
    uniform = torch.rand(p_draft.shape, generator=generator, device=p_draft.device)
    accepted = (uniform * q_draft < p_draft) & _allowed(max_accept, n)  # u < p/q without dividing
    num_accepted = _leading_true(accepted)

    rows = torch.arange(bs, device=candidates.device)
    p_last = target_probs[rows, num_accepted].float()  # [bs, V]
    # q of the rejected draft; zero where the chain ran to max_accept (bonus from p_k)
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(bs, 1, vocab)], dim=1)
    rejected = num_accepted < max_accept
    q_last = torch.where(rejected[:, None], q_padded[rows, num_accepted].float(), 0.0)
    residual = (p_last - q_last).clamp_min(0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_last)
    residual = _drawable(residual)
    last = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return AcceptResult(num_accepted, _emitted(candidates, num_accepted, last))


# --- helpers ------------------------------------------------------------------------------


def _drawable(probs: torch.Tensor) -> torch.Tensor:
    """``probs`` [rows, V], with any row that is no distribution (NaN, infinite or negative
    entries, or no mass: a target distribution that came out undefined) replaced by a
    one-hot on its largest finite entry (token 0 if none), so that one request's undefined
    distribution does not raise in ``torch.multinomial`` and take every request on the
    server with it. Seen under API fuzzing: a logit_bias that was inf in float32
    (request_checks refuses those now), and a grammar no token can follow (the request
    then ends with a 400: sglang/containment.py); logged."""
    bad = ~(torch.isfinite(probs).all(-1) & (probs >= 0).all(-1) & (probs.sum(-1) > 0))
    if not bool(bad.any()):
        return probs
    logger.warning("VeriCache: %d row(s) of a sampled verify had no valid target distribution (NaN, infinite "
                   "or negative probabilities); each emits its most likely finite token", int(bad.sum()))
    finite = torch.nan_to_num(probs, nan=-1.0, posinf=-1.0, neginf=-1.0)
    one_hot = torch.zeros_like(probs).scatter_(-1, finite.argmax(-1, keepdim=True), 1.0)
    return torch.where(bad[:, None], one_hot, probs)


def _max_accept_tensor(max_accept: MaxAccept, bs: int, n: int, device: torch.device) -> torch.Tensor:
    max_accept = torch.as_tensor(max_accept, dtype=torch.int64, device=device)
    if max_accept.shape != (bs,):
        raise ValueError(f"max_accept must have shape [{bs}], got {tuple(max_accept.shape)}")
    if bool(((max_accept < 0) | (max_accept > n - 1)).any()):
        raise ValueError(f"max_accept must be in [0, {n - 1}], got {max_accept.tolist()}")
    return max_accept


def _per_row(value: PerRow, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar or [rows] (or SGLang's [rows, 1]) parameter as a [rows, 1] column."""
    column = torch.as_tensor(value, dtype=dtype, device=device).reshape(-1, 1)
    if column.shape[0] not in (1, rows):
        raise ValueError(f"expected one value or {rows} values, got {column.shape[0]}")
    return column.expand(rows, 1)


def _allowed(max_accept: torch.Tensor, n: int) -> torch.Tensor:
    """[bs, n-1]: draft column j (1-based) is within request b's draft length."""
    return torch.arange(1, n, device=max_accept.device) <= max_accept[:, None]


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[bs]: length of each row's all-True prefix."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def _emitted(candidates: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[bs, n]: d_1..d_k, then ``last`` at index k, then -1."""
    bs, n = candidates.shape
    drafts = torch.cat([candidates[:, 1:], candidates.new_full((bs, 1), -1)], dim=1)
    index = torch.arange(n, device=candidates.device)
    tokens = torch.where(index < num_accepted[:, None], drafts, -1).long()
    return tokens.scatter_(1, num_accepted[:, None], last[:, None].long())
