"""When and how to speculate (no SGLang imports).

Each decode iteration the ``Controller`` picks, for the running batch, plain decoding (one
token per request, SGLang's ordinary decode forward) or a VeriCache round and its draft
length, by expected tokens per second:

- **cost**: seconds of a plain decode step and a verify pass, each a linear function of the
  batch (rows, tokens per row, full KV per row) fitted online (``OnlineLinear``: weighted
  least squares, forgetting old samples but not the prior) from the measured time of every
  forward it sees; a draft step is the plain step at the KV the drafts read, times learned
  factors (``DraftCost``); these cost models live in ``spec/step_costs.py``;
- **tokens**: a round of draft length ``d`` emits ``1 + a + a^2 + ... + a^d`` tokens per row
  in expectation, ``a`` being the row's per-token acceptance (``Acceptance``: its own
  history, decayed, on top of a prior per compressor that all requests teach);
- **decision**: the draft length with the most tokens per second, against one token per row
  per plain step; with hysteresis, so that noise does not flip it every iteration.

While the batch decodes plainly nothing updates the acceptance estimates, so the
controller probes a short round now and then (backing off while probes keep losing); while
it speculates it runs a plain step now and then so that the plain cost stays measured.

Under ``--vericache-compressor auto`` each new request drafts from the candidate with the
best expected tokens per second at its context length (``choose_compressor``), and is moved
to another when its own measured acceptance says the other would do better by a margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from sgl_vericache.spec.step_costs import Costs, Row, context_bucket

# Per-token acceptance priors per compressor (agreement measured on SmolLM2-135M, fp32, at
# 4x: docs' calibration table; a 4-bit quantizer agrees most, droppers less at short context).
PRIOR_ACCEPTANCE = {"full": 0.98, "int8": 0.97, "fp8": 0.96, "kivi4": 0.96, "kivi2": 0.85, "streamingllm": 0.88,
                    "snapkv": 0.9, "h2o": 0.88, "quest": 0.9}
# A token dropper keeping a quarter agrees more at long context (docs' calibration table:
# streamingllm 0.83 at 45-216 tokens, 0.95 at 3k-6k; SnapKV 0.93 at 3k-6k): the prior goes from
# PRIOR_ACCEPTANCE at 1k tokens to this at 4k, in log-context.
PRIOR_ACCEPTANCE_LONG = {"streamingllm": 0.95, "snapkv": 0.93, "h2o": 0.93}
DEFAULT_PRIOR = 0.85


def prior_acceptance(compressor: str, context: int) -> float:
    short = PRIOR_ACCEPTANCE.get(compressor, DEFAULT_PRIOR)
    long = PRIOR_ACCEPTANCE_LONG.get(compressor, short)
    t = min(max(math.log2(max(context, 1) / 1000) / 2, 0.0), 1.0)
    return short + t * (long - short)


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


PRIOR_WEIGHT = 4.0  # pseudo-observations (drafts) behind a prior


def expected_tokens(alpha: float, draft_len: int) -> float:
    """Tokens a round of ``draft_len`` drafts emits in expectation at per-token acceptance
    ``alpha`` (the accepted prefix plus the bonus token)."""
    if draft_len <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(draft_len + 1)
    return (1.0 - alpha ** (draft_len + 1)) / (1.0 - alpha)


class Acceptance:
    """Per-token acceptance of one stream of drafts. A round that accepted ``k`` of ``d``
    drafts observed ``k`` acceptances and, if ``k < d``, one rejection (the drafts after it
    were never judged). Two estimates: a slow one (counts decayed by ``decay`` per round, on
    top of ``prior`` held as ``PRIOR_WEIGHT`` drafts) and a fast one (decayed by half each
    round, a prior of one draft). ``alpha`` is the slow one unless the fast one has fallen
    well below it: a stream whose drafts suddenly fail (another kind of text) is noticed in
    two or three rounds, while steady streams keep a low-noise estimate."""

    FAST_DECAY, FAST_DROP = 0.5, 0.12

    def __init__(self, prior: float, decay: float = 0.9, fast: bool = True):
        """``fast=False``: the slow estimate only (a compressor's prior, which every request
        teaches in turn: one request's rejected round says little about the next request's)."""
        self.prior, self.decay, self.use_fast = prior, decay, fast
        self.slow = [0.0, 0.0]  # decayed (accepted, rejected)
        self.fast = [0.0, 0.0]
        self.rounds = 0

    def _estimate(self, counts, weight) -> float:
        accepted = counts[0] + weight * self.prior
        return accepted / (accepted + counts[1] + weight * (1.0 - self.prior))

    @property
    def alpha(self) -> float:
        slow, fast = self._estimate(self.slow, PRIOR_WEIGHT), self._estimate(self.fast, 1.0)
        return fast if self.use_fast and fast < slow - self.FAST_DROP else slow

    def observe(self, accepted: int, drafted: int) -> None:
        if drafted <= 0:
            return
        rejected = 1.0 if accepted < drafted else 0.0
        self.rounds += 1
        for counts, decay in ((self.slow, self.decay), (self.fast, self.FAST_DECAY)):
            counts[0] = counts[0] * decay + accepted
            counts[1] = counts[1] * decay + rejected


@dataclass
class Decision:
    draft_len: int  # 0: plain decoding
    predicted_seconds: float
    predicted_tokens: float
    probe: bool = False  # chosen to measure, not because it was predicted best


class Controller:
    """The decision for each iteration, and what it learns from each one's outcome."""

    HYSTERESIS = 0.05  # the other choice must be predicted this much faster to switch
    PROBE_EVERY = 8  # plain iterations before a probe round (doubles while probes lose)
    MAX_PROBE_EVERY = 64
    PROBE_DRAFT = 3
    PLAIN_PROBE_EVERY = 64  # speculating iterations before a plain step re-measures its cost
    CALIBRATION_PLAIN = 3  # plain steps measured early (the first iteration, then every 4th), before trusting
    CALIBRATION_ROUNDS = 3  # rounds measured early (every 4th iteration while plain is chosen), before trusting

    def __init__(self, max_draft_len: int, allow_plain: bool = True, schedule: Sequence[int] = (),
                 padded_drafts: bool = True):
        """``schedule``: draft lengths to cycle through instead of deciding (0 = plain), so
        that tests switch modes deterministically (``VERICACHE_ADAPTIVE_SCHEDULE``);
        ``padded_drafts``: draft steps read every row padded to the longest (the CPU path; the
        GPU kernels read each row's own length)."""
        self.max_draft_len = max_draft_len
        self.schedule, self.scheduled = list(schedule), 0
        self.allow_plain = allow_plain  # False under a full-KV device budget (every round drafts)
        self.costs = Costs(padded=padded_drafts)
        self.priors = {}  # compressor -> Acceptance shared by its requests (the prior the next one starts from)
        self.rows = {}  # rid -> its own Acceptance
        self.speculating = True
        self.since_switch = 0
        self.iterations = 0
        self.probe_every = self.PROBE_EVERY
        self.plain_seen = (0, 0.0)  # the most rows and full KV (thousands) a measured plain step had
        self.drafted_at = {}  # compressor -> (least, most) full KV of a row whose drafts a round measured
        self.exploring = {}  # compressor -> (request trying it where it was not measured, iteration it was chosen)
        self.last = None  # the last Decision

    # -- acceptance ------------------------------------------------------------------

    def _prior(self, compressor: str, context: int = 0) -> Acceptance:
        """The acceptance every request of ``compressor`` at about ``context`` tokens teaches
        (a band no round has taught yet starts from ``PRIOR_ACCEPTANCE``)."""
        key = (compressor, context_bucket(context))
        if key not in self.priors:
            self.priors[key] = Acceptance(self._band_start(compressor, context), decay=0.98, fast=False)
        return self.priors[key]

    TRANSFER_WEIGHT = 8.0  # drafts of evidence at which the other bands' lesson counts half
    BAND_TRUST = 0.5  # what a band one away teaches of this one's (per band between them)
    MAX_RAISE = 0.5  # log-odds the other bands may raise a band's start above its calibrated prior

    def _band_start(self, compressor: str, context: int) -> float:
        """Where a band no round has taught starts: the calibrated prior at its context, moved
        (in log-odds) by what the compressor's other bands taught against their own priors,
        in proportion to their evidence and by half per band between (a compressor that
        agrees less than calibrated at 1k likely does at 2k too, while a dropper's rise with
        context stays). A raise is held to ``MAX_RAISE``: a quantizer agreeing on 0.998 of
        short prompts' drafts started the 4k band there, and priced its 16-token drafts as
        nearly sure (bench_adaptive's W3 chose it where a dropper was 1.4x faster); a drop
        carries whole, the cautious direction."""
        shift, weight = 0.0, 0.0
        here = context_bucket(context)
        for (name, band), acc in self.priors.items():
            seen = (acc.slow[0] + acc.slow[1]) * self.BAND_TRUST ** abs(band - here)
            if name == compressor and seen > 0:
                shift += seen * (_logit(acc.alpha) - _logit(acc.prior))
                weight += seen
        static = prior_acceptance(compressor, context)
        if not weight:
            return static
        moved = min(shift / weight * weight / (weight + self.TRANSFER_WEIGHT), self.MAX_RAISE)
        return 1.0 / (1.0 + math.exp(-(_logit(static) + moved)))

    def alpha(self, rid, compressor: str, context: int = 0) -> float:
        own = self.rows.get(rid)
        return own.alpha if own is not None else self._prior(compressor, context).alpha

    def _row_acceptance(self, row: Row) -> Acceptance:
        own = self.rows.get(row.rid)
        if own is None:
            own = self.rows[row.rid] = Acceptance(self._prior(row.compressor, row.full_kv).alpha)
        return own

    def has_evidence(self, rid, rounds: int = 4) -> bool:
        """Whether ``rid``'s own acceptance rests on at least ``rounds`` rounds' worth of drafts."""
        own = self.rows.get(rid)
        return own is not None and own.rounds >= rounds

    def forget(self, rid) -> None:
        self.rows.pop(rid, None)
        for name in [n for n, (who, _) in self.exploring.items() if who == rid]:
            del self.exploring[name]  # it left before its drafts were measured: another may try

    # -- the decision ----------------------------------------------------------------

    def candidate_lens(self) -> list[int]:
        lens, d = [], 1
        while d < self.max_draft_len:
            lens.append(d)
            d = d + 1 if d < 4 else d * 2 if d < 16 else d + 8
        return lens + [self.max_draft_len]

    def tokens(self, rows: Sequence[Row], draft_len: int) -> float:
        """Expected tokens a round emits; a row near its ``max_new_tokens`` emits at most what
        it has left (drafts past that are verified for nothing)."""
        total = 0.0
        for r in rows:
            d = r.draft_len or draft_len
            if r.remaining is not None:
                d = min(d, max(r.remaining - 1, 0))
            total += expected_tokens(self.alpha(r.rid, r.compressor, r.full_kv), d)
        return total

    LONGER_BY = 0.04  # a longer draft must be predicted this much faster than the best shorter one

    def best_round(self, rows: Sequence[Row]) -> Decision:
        """The draft length with the most expected tokens per second, preferring the shorter
        of two within ``LONGER_BY``: the expected tokens of long drafts rest on the acceptance
        estimate's far tail (alpha^16), where a row that accepted 8 of 8 twice reads as 0.99
        though its rejections come in bursts; bench_adaptive's W3 then drafted 16, predicted
        a tie with 8, and emitted 16 tokens per second where 8 drafts made 23."""
        best, best_rate = None, 0.0
        for d in self.candidate_lens():
            steps = max([d] + [r.draft_len for r in rows if r.draft_len])
            seconds, tokens = self.costs.round_seconds(rows, steps), self.tokens(rows, d)
            rate = tokens / max(seconds, 1e-9)
            if best is None or rate > best_rate * (1 + self.LONGER_BY):
                best, best_rate = Decision(d, seconds, tokens), rate
        return best

    def decide(self, rows: Sequence[Row], force: bool = False) -> Decision:
        """Plain decoding (``draft_len`` 0) or a round of the returned draft length. Rows with
        their own draft length or drafts made ahead, and ``force``, always make it a round."""
        spec = self.best_round(rows)
        plain = Decision(0, self.costs.plain.predict(self.costs.plain_x(rows)), float(len(rows)))
        forced = force or any(r.draft_len or r.queued for r in rows) or not self.allow_plain
        if self.schedule:
            d = min(self.schedule[self.scheduled % len(self.schedule)], self.max_draft_len)
            self.scheduled += 1
            d = d or (spec.draft_len if forced else 0)
            self.last = Decision(d, self.costs.round_seconds(rows, d) if d else plain.predicted_seconds,
                                 self.tokens(rows, d) if d else plain.predicted_tokens)
            return self.last
        rate = lambda d: d.predicted_tokens / max(d.predicted_seconds, 1e-9)  # noqa: E731
        if forced:
            choice = spec
        elif self.speculating:
            choice = plain if rate(plain) > rate(spec) * (1 + self.HYSTERESIS) else spec
        else:
            choice = spec if rate(spec) > rate(plain) * (1 + self.HYSTERESIS) else plain
        self.since_switch += 1
        self.iterations += 1
        # a request no round has measured yet (a new one) is probed at the base interval: the
        # back-off learned from earlier requests says nothing about its drafts
        probe_every = self.PROBE_EVERY if any(r.rid not in self.rows for r in rows) else self.probe_every
        if not forced and choice.draft_len == 0 and (self.since_switch >= probe_every or (
                self.costs.draft.samples < self.CALIBRATION_ROUNDS and self.iterations % 4 == 3)):
            choice = Decision(min(self.PROBE_DRAFT, self.max_draft_len), self.costs.round_seconds(rows, self.PROBE_DRAFT),
                              self.tokens(rows, self.PROBE_DRAFT), probe=True)
        elif not forced and choice.draft_len and (self.since_switch >= self.PLAIN_PROBE_EVERY or (
                self.costs.plain.samples < self.CALIBRATION_PLAIN and self.iterations % 4 == 1)
                or self._plain_unmeasured(rows)):
            choice = Decision(0, plain.predicted_seconds, plain.predicted_tokens, probe=True)
        if choice.probe or (choice.draft_len > 0) != self.speculating:
            self.since_switch = 0
        if not choice.probe:
            self.speculating = choice.draft_len > 0
        self.last = choice
        return choice

    def _plain_unmeasured(self, rows: Sequence[Row]) -> bool:
        """The batch is well outside what plain steps have been measured at (half as many
        rows again, or half as much full KV again): its plain cost would be an extrapolation,
        and speculating iterations re-measure it only every ``PLAIN_PROBE_EVERY``."""
        _, rows_n, kv = self.costs.plain_x(rows)
        seen_rows, seen_kv = self.plain_seen
        return rows_n > 1.5 * max(seen_rows, 1) or kv > 1.5 * max(seen_kv, 0.5)

    # -- what happened ---------------------------------------------------------------

    def observe_plain(self, rows: Sequence[Row], seconds: float) -> None:
        x = self.costs.plain_x(rows)
        self.costs.plain.observe(x, seconds)
        self.plain_seen = (max(self.plain_seen[0], x[1]), max(self.plain_seen[1], x[2]))

    def observe_round(self, rows: Sequence[Row], steps: int, draft_seconds: float, verify_seconds: float,
                      drafted: Sequence[int], accepted: Sequence[int], setup_seconds: float = 0.0) -> None:
        """A round: ``steps`` draft steps took ``draft_seconds`` together, the verify pass
        (width ``steps + 1``) ``verify_seconds``, bringing the compressed entries and draft
        buffers up to date ``setup_seconds`` (kept out of the other two, and learned from
        steady rounds only: a request's first round, or its first after a switch, compresses
        its whole prompt once, and would price every later round as if it did again); row i drafted ``drafted[i]`` tokens of which verify
        accepted ``accepted[i]`` (a deferred row: 0 drafted)."""
        drafting = [r for r in rows if not r.queued]
        new = [r for r in rows if r.rid not in self.rows]  # their first round: whole entries built, once
        if not new:
            self.costs.observe_residual(rows, self.costs.forward_seconds(rows, steps), draft_seconds + verify_seconds)
            self.costs.observe_setup(rows, setup_seconds)
        else:
            steady = sum(self.costs.setup(r.compressor) for r in rows if r.rid in self.rows)
            self.costs.observe_build(new, max(setup_seconds - steady, 0.0))
        if steps and drafting and draft_seconds > 0:
            self.costs.draft.observe(drafting, draft_seconds / steps)
        self.costs.verify.observe(self.costs.verify_x(rows, steps + 1), verify_seconds)
        gained = 0.0
        for row, d, k in zip(rows, drafted, accepted):
            self._row_acceptance(row).observe(k, d)
            self._prior(row.compressor, row.full_kv).observe(k, d)
            gained += k
            if d:
                lo, hi = self.drafted_at.get(row.compressor, (row.full_kv, row.full_kv))
                self.drafted_at[row.compressor] = (min(lo, row.full_kv), max(hi, row.full_kv))
                self.exploring.pop(row.compressor, None)
        calibrating = self.costs.draft.samples <= self.CALIBRATION_ROUNDS  # this round was one of the first
        if self.last is not None and self.last.probe and self.last.draft_len and not calibrating:
            # a probe that paid resets the back-off; one that lost doubles it
            won = gained + len(rows) > len(rows) * (draft_seconds + verify_seconds) / max(
                self.costs.plain.predict(self.costs.plain_x(rows)), 1e-9)
            self.probe_every = self.PROBE_EVERY if won else min(self.probe_every * 2, self.MAX_PROBE_EVERY)

    # -- compressor choice (--vericache-compressor auto) ------------------------------

    # a candidate not measured near a context is tried if it would be the best at the optimistic
    # end of what is unknown there: its rejections this fraction of its prior's, its rounds
    # this fraction of their predicted cost
    EXPLORE_REJECT, EXPLORE_COST = 0.5, 0.85
    EXPLORE_RANGE = 4.0  # "near": within this factor of a context its drafts were measured at
    EXPLORE_WAIT = 16  # decode iterations a trial waits for its request's first round before another may try

    HORIZON = 256  # tokens a request is expected to emit when its max_new_tokens is unknown

    def choose_compressor(self, candidates: Sequence[tuple[str, float]], context: int,
                          rid=None, current: Optional[str] = None, margin: float = 0.0, rows: int = 1,
                          others: Sequence[Row] = (), remaining: Optional[int] = None) -> str:
        """The candidate (name, fraction of the full KV a draft step reads) with the most
        expected tokens per second for a request of ``context`` tokens drafting in a batch of
        ``rows`` requests: ``others`` as they are (the running batch, this request left out)
        and the rest like this one; with ``current``, another wins only by ``margin``.

        The batch is priced whole because its rows draft together: one row reading a dense
        4k-token copy makes every row's draft step as dear (on the CPU path the draft buffers
        are padded to the longest row), so a request whose dropper drafts fail must not move to a quantizer
        on its own tokens per second while three others keep drafting well.

        A new request may instead try a candidate whose drafts were never measured near its
        context (within ``EXPLORE_RANGE``) if it would be the best at the optimistic end of
        what is unknown (``EXPLORE_REJECT``, ``EXPLORE_COST``): its draft cost there is the
        plain model's extrapolation and its acceptance a prior, so without this a candidate
        predicted second would never be measured at all. Only optimistically best, not merely
        close: one row of kivi4 tried among three streamingllm rows at 4k (its dense 4k copy
        pads every row's draft step, and its entry took 1-3 s to build) made a fresh server's
        first 4 x 4k batch 1.8x slower than drafting from streamingllm alone.
        One request at a time tries it (another may once ``EXPLORE_WAIT`` decode iterations
        pass without its drafts measured: it may have finished at its prefill); the re-choice
        after its own rounds moves it back when the measurements say so.

        Each rate is over the request's life (``remaining`` tokens, else ``HORIZON``) and counts
        the one-time build of its entry (and the others' arriving with it): a kivi4 entry of
        a 4k prompt took 2.8 s to build where streamingllm's took 0.5 s, more than a 48-token
        request's whole decode. A re-choice (``current``) pays the rebuild for the other
        candidates only."""
        others = [r for r in others if r.rid != rid][:max(0, rows - 1)]
        fractions = dict(candidates)
        alike = max(1, rows - len(others))  # this request and the others arriving with it

        def rate(name, rest=None, optimistic=False):
            """The batch's tokens per second, this request drafting from ``name`` and the others
            arriving with it from ``rest`` (default: ``name`` too); ``optimistic``: ``name``'s
            acceptance and the rounds' cost at the favourable end of what is unknown."""
            rest = rest or name

            def alpha(n):
                a = self.alpha(rid, n, context) if n == current else self._prior(n, context).alpha
                return 1.0 - (1.0 - a) * self.EXPLORE_REJECT if optimistic and n == name else a

            slack = self.EXPLORE_COST if optimistic else 1.0
            mine = [Row(rid, context, int(context * fractions[name]), name)]
            mine += [Row(rid, context, int(context * fractions[rest]), rest)] * (alike - 1)
            batch = others + mine
            steady = max((expected_tokens(alpha(name), d) + expected_tokens(alpha(rest), d) * (alike - 1)
                          + self.tokens(others, d)) / max(slack * self.costs.round_seconds(batch, d), 1e-9)
                         for d in self.candidate_lens())
            builds = 0.0 if name == current else self.costs.build(name, context)
            if current is None:
                builds += self.costs.build(rest, context) * (alike - 1)
            life = (remaining or self.HORIZON) * len(batch) / max(steady, 1e-9)  # seconds of the batch's decode
            return steady * life / (life + builds)

        rates = {name: rate(name) for name in fractions}
        best = max(rates, key=rates.get)
        if current in rates:
            return current if rates[best] <= rates[current] * (1 + margin) else best
        for name in sorted(rates, key=rates.get, reverse=True):
            trial = self.exploring.get(name)
            if (name != best and (trial is None or self.iterations - trial[1] > self.EXPLORE_WAIT)
                    and not self.measured_near(name, context)
                    and rate(name, rest=best, optimistic=True) >= rates[best]):  # one trial beside the rest
                self.exploring[name] = (rid, self.iterations)
                return name
        return best

    def measured_near(self, compressor: str, context: int) -> bool:
        """Whether a round measured drafts from ``compressor`` at a context within ``EXPLORE_RANGE``."""
        lo, hi = self.drafted_at.get(compressor, (math.inf, 0))
        return lo / self.EXPLORE_RANGE <= context <= hi * self.EXPLORE_RANGE
