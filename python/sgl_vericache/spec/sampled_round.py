"""Drafting and acceptance for a round whose batch samples (no SGLang imports).

Rows come in two kinds. *Matched* rows (a ``sampling_seed`` given, or greedy) draft with
the engine's own sampler over the draft logits at the same (seed, position) the target
will use, and are verified by comparing each draft token with the target's own draw:
token-identical to non-speculative seeded sampling. *Rejection* rows (no seed) draft by
sampling q (the draft distribution under the request's temperature/top-k/top-p/min-p) and
are verified by speculative rejection sampling (``accept.rejection_sample_chain``): the
output is distributed exactly as non-speculative sampling.

``params`` is the batch's per-row sampling parameters (tensors ``temperatures``, ``top_ks``,
``top_ps``, ``min_ps``, ``sampling_seed`` (None without seeds), one row per request), and
``engine_draw(logits, params_of_rows, repeat, positions)`` the tokens the serving engine's
sampler draws from ``logits`` (the SGLang seam provides it), so that a matched row's draw
is the very draw non-speculative decoding makes.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from sgl_vericache.spec.accept import chain_match, rejection_sample_chain, sampling_probs

PARAM_FIELDS = ("temperatures", "top_ks", "top_ps", "min_ps", "sampling_seed")


class RowParams:
    """The sampling parameters of some rows of a batch (the fields a sampler reads)."""

    def __init__(self, params, idx: torch.Tensor):
        for name in PARAM_FIELDS:
            value = getattr(params, name)
            setattr(self, name, None if value is None else value[idx])
        for name in ("need_top_p_sampling", "need_top_k_sampling", "need_min_p_sampling", "max_top_k"):
            setattr(self, name, getattr(params, name, None))


def repeat_rows(t, repeat):
    """Each row of ``t`` repeated ``repeat`` times (one per verify position); None stays None."""
    return None if t is None else torch.repeat_interleave(t, repeat, dim=0)


class SampledRound:
    """One round's drafting state for a batch that samples."""

    def __init__(self, params, seeded: Sequence[bool], rows: Sequence[int], engine_draw: Callable,
                 rng: torch.Generator):
        self.params = params
        self.rows = list(rows)  # the batch rows that draft, in the order of the draft logits
        self.engine_draw = engine_draw
        self.rng = rng
        greedy = (params.top_ks.view(-1) == 1).tolist()
        # without seeds in the batch only greedy rows can be matched
        self.matched = greedy if params.sampling_seed is None else [g or s for g, s in zip(greedy, seeded)]
        self.q_steps = []  # per step: [bs, V] draft distributions (rejection rows; others unused)
        # per batch row: its own draft length (set by the round once known; None: every row
        # drafted every step). Steps past it were drafted for the round's longest row only.
        self.own_lens = None
        self._generators = {}  # device -> this round's generator there (see generator())

    def generator(self, device: torch.device) -> torch.Generator:
        """Rejection sampling's generator on ``device`` (where the probabilities are): the
        CPU one itself, or one seeded from it once per round for an accelerator."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.rng
        if device not in self._generators:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.rng))
            self._generators[device] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[device]

    def draw(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One draft step: ``logits`` [drafting rows, V] -> their tokens. The draft
        distributions are kept by batch row ([bs, V]; rows that do not draft stay 0)."""
        device = logits.device
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=device)
        match = [j for j, r in enumerate(self.rows) if self.matched[r]]
        reject = [j for j, r in enumerate(self.rows) if not self.matched[r]]
        q = None
        if match:
            local, rows = torch.tensor(match), torch.tensor([self.rows[j] for j in match])
            tokens[local] = self.engine_draw(logits[local], RowParams(self.params, rows), 1, positions[local])
        if reject:
            local, rows = torch.tensor(reject), torch.tensor([self.rows[j] for j in reject])
            q = torch.zeros((len(self.matched), logits.shape[1]), dtype=torch.float32, device=device)
            q[rows] = self.probs(logits[local], rows, 1)
            tokens[local] = torch.multinomial(q[rows], 1, generator=self.generator(device)).view(-1)
        self.q_steps.append(q)
        return tokens

    def probs(self, logits: torch.Tensor, idx: torch.Tensor, repeat: int) -> torch.Tensor:
        """The sampling distribution of rows ``idx`` (each ``repeat`` times) over ``logits``."""
        p = self.params
        pick = lambda t: repeat_rows(t[idx], repeat).view(-1)  # noqa: E731
        return sampling_probs(logits.float(), pick(p.temperatures), pick(p.top_ks), pick(p.top_ps), pick(p.min_ps))

    def accept(self, candidates: torch.Tensor, logits: torch.Tensor, positions: torch.Tensor,
               skip: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify: ``candidates`` [bs, n] (root + drafts), ``logits`` [bs, n, V] of the verify
        pass (penalties, bias and grammar already applied), ``positions`` [bs, n]. Rows in
        ``skip`` accept nothing. Returns (accepted drafts [bs], emitted tokens [bs, n], -1
        past a row's accepted drafts + 1)."""
        bs, n = candidates.shape
        device = logits.device  # every tensor of the acceptance lives where the logits do
        candidates, positions = candidates.to(device), positions.to(device)
        num_acc = torch.zeros(bs, dtype=torch.int64, device=device)
        tokens = torch.full((bs, n), -1, dtype=torch.int64, device=device)
        max_accept = torch.full((bs,), n - 1, dtype=torch.int64, device=device)
        skipped = set(skip)
        match_rows = [i for i, m in enumerate(self.matched) if m and i not in skipped]
        if match_rows:
            idx = torch.tensor(match_rows, device=device)
            targets = self.engine_draw(logits[idx].reshape(len(idx) * n, -1), RowParams(self.params, idx), n,
                                       positions[idx].reshape(-1)).view(len(idx), n)
            num_acc[idx], tokens[idx] = chain_match(candidates[idx], targets.to(device), max_accept[idx])
        rej_rows = [i for i, m in enumerate(self.matched) if not m and i not in skipped]
        if rej_rows:
            idx = torch.tensor(rej_rows, device=device)
            p = self.probs(logits[idx].reshape(len(idx) * n, -1), idx, n).view(len(idx), n, -1)
            q = self._draft_probs(candidates, idx, n, p.shape[-1])
            num_acc[idx], tokens[idx] = rejection_sample_chain(candidates[idx], p, q, max_accept[idx],
                                                               generator=self.generator(device))
        return num_acc, tokens

    def _draft_probs(self, candidates, idx, n, vocab) -> torch.Tensor:
        """q [rows, n - 1, V] of the rejection rows ``idx``. Columns past a request's own draft
        length repeat its last draft token, a deterministic proposal: one-hot q there (also
        where no q was recorded). A row shorter than the round's longest did draft those
        steps, but their tokens were replaced by the padding: the q recorded there is not the
        padding's, and accepting against it skewed what the row emitted."""
        q = torch.zeros((len(idx), n - 1, vocab), dtype=torch.float32, device=candidates.device)
        own = None if self.own_lens is None else torch.tensor([self.own_lens[i] for i in idx.tolist()],
                                                                device=candidates.device)
        for j in range(n - 1):
            step_q = self.q_steps[j] if j < len(self.q_steps) else None
            if step_q is not None:
                q[:, j] = step_q[idx]
            pad = q[:, j].sum(-1) == 0
            if own is not None:
                pad |= own <= j
            if pad.any():
                q[pad, j] = 0.0
                q[pad, j, candidates[idx[pad], j + 1]] = 1.0
        return q
