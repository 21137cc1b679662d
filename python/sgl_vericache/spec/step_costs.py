"""What a decode step costs (no SGLang imports): the step-cost models the speculation
controller (``spec/adaptive.py``) prices plain decoding and VeriCache rounds with.

- ``OnlineLinear``: seconds as a linear function of a batch's features, fitted online;
- ``DraftCost``: a draft step, priced from the plain-step model at the KV the drafts read;
- ``Costs``: plain step, verify pass, draft steps and per-round setup together, with a
  per-(compressor, context band) correction of what the linear models miss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

def context_bucket(context: int) -> int:
    """The context band a compressor's shared acceptance is learned per: below 1k, 1-2k, 2-4k,
    ... (a dropper keeping a quarter agrees far less at 300 tokens than at 4k: 0.83 against
    0.95 in the docs' calibration, so a serving phase's short prompts must not price it for a
    long-context one)."""
    return max(0, min(int(math.log2(max(context, 1) / 512)), 8))


@dataclass
class Row:
    """One request of the batch, as the controller sees it."""

    rid: object
    full_kv: int  # tokens of full KV a verify reads
    draft_kv: int  # tokens of KV a draft step reads for it (its compressed entry, dense)
    compressor: str
    draft_len: Optional[int] = None  # its own custom_params draft length (it then always drafts that)
    queued: bool = False  # drafts made ahead wait for it: a round costs it no draft steps
    remaining: Optional[int] = None  # tokens it may still emit (max_new_tokens less its output), None: unknown


class OnlineLinear:
    """``seconds ~ w . x``, fitted to the measurements by weighted least squares, older ones
    weighing ``forget^age``, each with a relative error of ``NOISE`` (so a slow step counts no
    more than a fast one), and regularized toward ``prior``: each weight is held with a
    standard deviation of ``prior_sd`` (default: its prior's magnitude, 1 where the prior is
    0), a term forgetting does not decay. Solved exactly at every measurement (a few features).

    The prior matters where the batches seen do not separate the features: rows and KV grow
    together when one workload's requests are alike, and recursive least squares with
    forgetting then let the weights drift along that direction freely (a KV weight of -0.5
    after a noisy serving phase, every plain step priced at 0 s). Here they stay at the prior
    in directions no measurement pins, and follow the measurements in the others.

    Robust to outliers (one-sided): a measurement further above the prediction than ``CLIP``
    times the typical relative error weighs by the square of that ratio (a batch shape not
    measured before has the leverage to pull the fit through it). A step can take many times its usual
    time once (a new batch shape compiled, the machine busy); fitted as is, one such plain
    step at a batch size not seen before priced every plain step after it at 0.5 s."""

    CLIP = 3.0
    SPREAD_RATE = 0.1  # of the running mean of |relative error| that scales the clip
    MIN_SPREAD = 0.05
    NOISE = 0.1  # a measurement's relative error, against the prior's

    def __init__(self, prior: Sequence[float], forget: float = 0.97, prior_sd: Optional[Sequence[float]] = None):
        self.prior = [float(v) for v in prior]
        self.prior_sd = list(prior_sd) if prior_sd is not None else [abs(p) or 1.0 for p in self.prior]
        self.w = list(self.prior)
        n = len(self.w)
        self.a = [[0.0] * n for _ in range(n)]  # sum of forget^age x x' / sigma^2
        self.b = [0.0] * n  # sum of forget^age x y / sigma^2
        self.forget = forget
        self.samples = 0
        self.seen = [0.0] * n  # the largest value of each feature observed
        self.spread = 0.5  # running mean of the (clipped) relative errors

    def add_feature(self, prior: float, prior_sd: float) -> None:
        """A new feature (its weight ``prior`` until measurements say otherwise); every
        measurement so far had it at 0."""
        self.prior.append(float(prior))
        self.prior_sd.append(prior_sd)
        self.w.append(float(prior))
        self.seen.append(0.0)
        for row in self.a:
            row.append(0.0)
        self.a.append([0.0] * len(self.w))
        self.b.append(0.0)

    def predict(self, x: Sequence[float]) -> float:
        """``w . x``, never less than at ``x`` cut back to the largest values measured: a weight
        below zero is noise fitted inside the measured range (a cost term that is too small to
        see there), and must not make a batch beyond it (more rows, more KV) look cheaper."""
        inside = [min(v, top) for v, top in zip(x, self.seen)]
        return max(0.0, sum(w * v for w, v in zip(self.w, x)), sum(w * v for w, v in zip(self.w, inside)))

    def observe(self, x: Sequence[float], seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        n, lam = len(self.w), self.forget
        predicted = sum(w * v for w, v in zip(self.w, x))
        ref = max(predicted, 0.1 * seconds)  # relative to the prediction (unless that is near 0 or below)
        relative = (seconds - predicted) / ref
        limit = self.CLIP * self.spread
        # a step is slowed, never sped up, by a hiccup: one far above the prediction weighs less
        weight = min(1.0, limit / relative) ** 2 if relative > 0 else 1.0
        self.spread = max(self.MIN_SPREAD, self.spread + self.SPREAD_RATE * (min(abs(relative), limit) - self.spread))
        weight /= (self.NOISE * ref) ** 2
        self.a = [[lam * self.a[i][j] + weight * x[i] * x[j] for j in range(n)] for i in range(n)]
        self.b = [lam * self.b[i] + weight * x[i] * seconds for i in range(n)]
        self.seen = [max(u, v) for u, v in zip(self.seen, x)]
        self.samples += 1
        self.refit()

    def refit(self) -> None:
        """The weights minimizing the weighted squared errors plus the prior's term."""
        n = len(self.w)
        held = [1.0 / sd ** 2 for sd in self.prior_sd]
        m = [[self.a[i][j] + (held[i] if i == j else 0.0) for j in range(n)] + [self.b[i] + held[i] * self.prior[i]]
             for i in range(n)]
        for c in range(n):  # Gauss-Jordan with partial pivoting (positive definite: no zero pivot)
            pivot = max(range(c, n), key=lambda r: abs(m[r][c]))
            m[c], m[pivot] = m[pivot], m[c]
            for r in range(n):
                if r != c and m[r][c]:
                    f = m[r][c] / m[c][c]
                    m[r] = [u - f * v for u, v in zip(m[r], m[c])]
        self.w = [m[i][n] / m[i][i] for i in range(n)]


class DraftCost:
    """Seconds of one draft step of a batch. A draft step is the target model's own decode
    forward whose attention reads each row's compressed entry instead of its full KV, so it is
    priced from the plain-step model at the KV the drafts read: its part without KV (weights,
    ``plain.predict([1, rows, 0])``) times a factor shared by every draft (half-precision draft
    weights, the round's bookkeeping), plus its KV part (``plain.predict([1, rows, draft KV])``
    less that) times a factor per compressor and context band (how fast that compressor's
    draft path reads a key against plain decoding's attention: a dense copy, dequantization,
    a kernel).

    The KV dependence thus comes from the plain-step fit, which can learn it: plain steps are
    measured at every context the server sees. A fit of its own on ``[1, rows, draft KV]``
    could not: within a workload the draft KV hardly varies, so its KV term stayed at the
    prior, and a quantizer draft reading a request's full 4k KV was priced like a dropper's
    reading 1k (bench_adaptive's W3 then chose kivi4 and decoded plainly).

    The KV factors are kept per context band (``context_bucket`` of the rows' full KV): at a
    few hundred tokens keys are a small share of a step and the factor fitted there is
    mostly the plain model's split error (kivi4 learned 0.27 on W1/W2's short prompts, where
    0.47 matched its dense 4k copies at 4 x 4k, and W3 chose it). A band no draft step has
    measured takes the compressor's nearest measured band, drawn toward the prior by half
    per band between them; a compressor measured nowhere, the mean of the others measured in
    that band (else the prior).

    The factors are fitted (``OnlineLinear``, a feature added per (compressor, band) as it
    first drafts) to each measured draft step, relative to the plain step at the drafts' KV
    (features: the two parts' shares of it, the KV part split by the rows' (compressor,
    band); target: the measured step over it). With ``padded`` (the dense draft buffers of
    the CPU path) every row reads as many keys as the longest row of the batch."""

    # both factors' prior: decode_medium.json's draft steps (streamingllm, kivi4; 2k x 1, 4k x 4)
    # took 0.55-0.7 of a plain step
    PRIOR = 0.7
    # the KV factors' standard deviation about it: they move where keys are a large part of a
    # draft step, not where a 10% error in the plain model's split would leak into them
    KV_SD = 0.15
    FLOOR = 0.05
    BAND_TRUST = 0.5  # what a factor measured one band away says about this one (per band, toward the prior)

    def __init__(self, plain: OnlineLinear, padded: bool = True):
        self.plain, self.padded = plain, padded
        self.fit = OnlineLinear([self.PRIOR], forget=0.95, prior_sd=[self.PRIOR])  # [shared, per (compressor, band)...]
        self.index = {}  # (compressor, band) -> its factor's slot in fit
        self.measured = [0]  # draft steps measured per slot
        self.samples = 0

    @staticmethod
    def key(row: Row) -> tuple:
        return row.compressor, context_bucket(row.full_kv)

    def _measured(self, key) -> Optional[float]:
        i = self.index.get(key)
        return max(self.fit.w[i], self.FLOOR) if i is not None and self.measured[i] else None

    def factor(self, compressor: str, band: int) -> float:
        """The KV factor of ``compressor``'s drafts at context band ``band``."""
        own = self._measured((compressor, band))
        if own is not None:
            return own
        near = [(abs(b - band), b) for (name, b), i in self.index.items() if name == compressor and self.measured[i]]
        if near:
            distance, b = min(near)
            return self.PRIOR + (self._measured((compressor, b)) - self.PRIOR) * self.BAND_TRUST ** distance
        others = [self._measured(k) for k in self.index if k[1] == band and self._measured(k) is not None]
        return sum(others) / len(others) if others else self.PRIOR

    def base_x(self, rows: Sequence[Row]) -> list:
        """The plain-step features of the KV the drafts read (thousands of tokens)."""
        kv = len(rows) * max(r.draft_kv for r in rows) if self.padded else sum(r.draft_kv for r in rows)
        return [1.0, float(len(rows)), kv / 1000]

    def features(self, rows: Sequence[Row]) -> tuple[float, float, dict]:
        """Seconds of a plain step at the drafts' KV, and its parts' shares: without KV, and
        the KV part split by (compressor, band)'s share of the rows."""
        x = self.base_x(rows)
        base = self.plain.predict(x)
        fixed = min(self.plain.predict([x[0], x[1], 0.0]), base)
        fixed_share = fixed / base if base > 0 else 1.0
        shares = {}
        for r in rows:
            shares[self.key(r)] = shares.get(self.key(r), 0.0) + (1.0 - fixed_share) / len(rows)
        return base, fixed_share, shares

    def predict(self, rows: Sequence[Row]) -> float:
        if not rows:
            return 0.0
        base, fixed_share, shares = self.features(rows)
        return base * (max(self.fit.w[0], self.FLOOR) * fixed_share
                       + sum(self.factor(*key) * share for key, share in shares.items()))

    def observe(self, rows: Sequence[Row], seconds: float) -> None:
        """One draft step of ``rows`` took ``seconds``."""
        if not rows:
            return
        base, fixed_share, shares = self.features(rows)
        if not (base > 0 and seconds > 0 and math.isfinite(seconds)):
            return
        for key in shares:
            if key not in self.index:  # first drafts in this band: the fit starts from the factor it was priced at
                start = self.factor(*key)
                self.index[key] = len(self.measured)
                self.fit.add_feature(start, self.KV_SD)
                self.measured.append(0)
        x = [fixed_share] + [0.0] * len(self.index)
        for key, share in shares.items():
            x[self.index[key]] = share
        self.fit.observe(x, seconds / base)
        self.measured = [n + (v > 0) for n, v in zip(self.measured, x)]
        self.samples += 1


@dataclass
class Costs:
    """The step-cost models. Features (KV in thousands of tokens, summed over rows): plain
    ``[1, rows, full_kv]``; verify ``[1, rows * width, full_kv, full_kv * width]``; a draft
    step is the plain model at the KV the drafts read, times a learned factor per compressor
    (``DraftCost``). Priors: SmolLM2-135M fp32 on a 2-core CPU (62 ms a decode step at batch 1
    plus ~11 ms per 1000 tokens of context per request); the first measurements replace them."""

    plain: OnlineLinear = field(default_factory=lambda: OnlineLinear([0.05, 0.015, 0.011]))
    verify: OnlineLinear = field(default_factory=lambda: OnlineLinear([0.06, 0.004, 0.013, 0.0003]))
    draft: DraftCost = None
    # compressor -> seconds a steady round spends bringing one of its rows' compressed entry
    # and draft buffer up to date (a quantizer re-lays its groups; a dropper appends)
    setup_per_row: dict = field(default_factory=dict)
    # compressor -> seconds its first round spends building a row's entry, per 1000 tokens of
    # context (the whole prompt read and compressed once; again after a switch)
    build_per_ktok: dict = field(default_factory=dict)

    # (compressor, context band) -> measured over modeled seconds of its steady rounds: what the
    # linear models miss (a quantizer's dense 4k copies at batch 4 ran rounds 1.5-2x the model)
    residual: dict = field(default_factory=dict)
    # draft steps read every row's KV padded to the longest row (the CPU path's dense draft
    # buffers); False on the GPU kernels, which read each row's own length
    padded: bool = True

    SETUP_RATE = 0.3
    # a build's prior before any is measured (2.1 s for streamingllm's 4 x 4k first round, 11 s
    # for kivi4's, in bench_adaptive --quick at 4b346c1: 0.13 and 0.7 s per 1000 tokens)
    BUILD_PRIOR = 0.1
    BUILD_RATE = 0.5
    RESIDUAL_RATE, RESIDUAL_RANGE = 0.3, (0.5, 3.0)

    def __post_init__(self):
        if self.draft is None:
            self.draft = DraftCost(self.plain, padded=self.padded)

    @staticmethod
    def plain_x(rows: Sequence[Row]) -> list:
        return [1.0, float(len(rows)), sum(r.full_kv for r in rows) / 1000]

    @staticmethod
    def verify_x(rows: Sequence[Row], width: int) -> list:
        kv = sum(r.full_kv for r in rows) / 1000
        return [1.0, float(len(rows) * width), kv, kv * width]

    def round_seconds(self, rows: Sequence[Row], draft_len: int) -> float:
        return (self.forward_seconds(rows, draft_len) * self.residual_factor(rows)
                + sum(self.setup(r.compressor) for r in rows))

    def forward_seconds(self, rows: Sequence[Row], draft_len: int) -> float:
        """A round's draft steps and verify pass as the linear models price them (no setup:
        that has its own estimate, ``setup``, and the residual does not see it)."""
        drafting = [r for r in rows if not r.queued]
        return draft_len * self.draft.predict(drafting) + self.verify_seconds(rows, draft_len + 1)

    def residual_factor(self, rows: Sequence[Row]) -> float:
        if not rows:
            return 1.0
        return sum(self.residual.get((r.compressor, context_bucket(r.full_kv)), 1.0) for r in rows) / len(rows)

    def observe_residual(self, rows: Sequence[Row], modeled: float, seconds: float) -> None:
        """A steady round's draft steps and verify took ``seconds`` where the models said
        ``modeled`` (``forward_seconds``): each of its (compressor, band)'s factor moves by its
        rows' share, the ratio held to RESIDUAL_RANGE. Setup stays out of it: a round whose
        entry sync stalled once (0.78 s where steady ones take 0.05 s: a streamingllm 4 x 4k
        second round in bench_adaptive's W3, fresh memory for the grown entries) raised the
        factor to 1.37 and priced the next 8-draft round at 1.30 s (it took 0.93 s), so a
        3-draft round won the decision before it; ``observe_setup`` cuts such a sample."""
        if not rows or not (modeled > 0 and seconds > 0 and math.isfinite(seconds)):
            return
        lo, hi = self.RESIDUAL_RANGE
        ratio = min(max(seconds / modeled, lo), hi)
        keys = [(r.compressor, context_bucket(r.full_kv)) for r in rows]
        for key in dict.fromkeys(keys):  # in the rows' order (see observe_setup)
            old = self.residual.get(key, 1.0)
            self.residual[key] = old + self.RESIDUAL_RATE * keys.count(key) / len(keys) * (ratio - old)

    def verify_seconds(self, rows: Sequence[Row], width: int) -> float:
        """A verify pass is a decode forward over the same full KV with ``width`` queries a
        row: never cheaper than the plain step (its own fit, pinned where rounds ran, priced a
        4 x 4k verify below the measured plain step after a short-context phase, and so a
        1-draft round below plain decoding)."""
        return max(self.verify.predict(self.verify_x(rows, width)), self.plain.predict(self.plain_x(rows)))

    def setup(self, compressor: str) -> float:
        """A steady round's setup seconds for one row of ``compressor`` (one not measured yet:
        the measured ones' mean)."""
        if compressor in self.setup_per_row:
            return self.setup_per_row[compressor]
        return sum(self.setup_per_row.values()) / len(self.setup_per_row) if self.setup_per_row else 0.0

    def observe_setup(self, rows: Sequence[Row], seconds: float) -> None:
        """A steady round (no row in its first round) spent ``seconds`` bringing its rows'
        compressed entries and draft buffers up to date: each compressor's estimate moves by
        its rows' share. A sample is cut to 4x the estimate plus 10 ms (a stalled machine)."""
        if not rows or not (seconds >= 0 and math.isfinite(seconds)):
            return
        predicted = sum(self.setup(r.compressor) for r in rows)
        per_row = min(seconds, 4 * predicted + 0.01 * len(rows)) / len(rows)
        # every estimate from the ones before this sample: a compressor not measured yet
        # starts from the others' mean, which must not depend on which of them moved first
        # (a set's order follows the process's string hashing, so tensor-parallel ranks
        # would have learned different costs and decided apart)
        updates = {}
        for name in dict.fromkeys(r.compressor for r in rows):
            share = sum(r.compressor == name for r in rows) / len(rows)
            old = self.setup(name)
            updates[name] = old + self.SETUP_RATE * share * (per_row - old)
        self.setup_per_row.update(updates)

    def build(self, compressor: str, context: int) -> float:
        """Seconds a row of ``context`` tokens spends building its ``compressor`` entry, once
        (a compressor not measured yet: the measured ones' mean)."""
        per = self.build_per_ktok.get(compressor)
        if per is None:
            known = list(self.build_per_ktok.values())
            per = sum(known) / len(known) if known else self.BUILD_PRIOR
        return per * context / 1000

    def observe_build(self, new: Sequence[Row], seconds: float) -> None:
        """A round's rows ``new`` built their entries (their first round) in ``seconds``
        (the round's setup less the steady setup of its other rows): each compressor's
        estimate moves by its rows' share of the predicted build."""
        predicted = sum(self.build(r.compressor, r.full_kv) for r in new)
        if not new or predicted <= 0 or not (seconds >= 0 and math.isfinite(seconds)):
            return
        ratio = seconds / predicted
        updates = {}  # from the estimates before this sample, as in observe_setup
        for name in dict.fromkeys(r.compressor for r in new):
            share = sum(self.build(r.compressor, r.full_kv) for r in new if r.compressor == name) / predicted
            old = self.build(name, 1000)
            updates[name] = old * (1 + self.BUILD_RATE * share * (ratio - 1))
        self.build_per_ktok.update(updates)
