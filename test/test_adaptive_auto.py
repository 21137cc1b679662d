"""``--vericache-compressor auto`` over whole requests (spec/adaptive.py's ``choose_compressor``),
without SGLang: a ``Fleet`` of requests, each drafting from the compressor chosen for its batch
and re-chosen after four rounds, against synthetic true costs (a plain step as
``test_adaptive.World``'s) and acceptances."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from sgl_vericache.spec.adaptive import Controller, Row

CANDIDATES = [("streamingllm", 0.25), ("kivi4", 1.0)]  # as the Planner reports them: a quantizer reads a dense copy


class Fleet:
    """Requests under ``--vericache-compressor auto`` as the Planner runs them: each new one
    drafts from ``choose_compressor``'s pick (``rows``: the requests arriving with it), and
    after four rounds of its own moves to the other candidate when that is predicted 15%
    faster (at most twice). True costs: a plain step as ``World``'s; a draft step is that same
    forward over the keys the drafts really read (``reads``: share of the full KV per
    compressor; the dense buffers pad every row to the longest), times ``overhead``."""

    def __init__(self, reads, alpha, overhead=0.8, seed=0):
        self.reads, self.alpha, self.overhead = reads, alpha, overhead
        self.rng = random.Random(seed)
        self.n = 0
        self.seconds = self.tokens = 0.0
        self.chosen = Counter()  # first choices of new requests

    @staticmethod
    def plain_seconds(rows):
        return 0.07 + 0.012 * len(rows) + 1.2e-5 * sum(r.full_kv for r in rows)

    def draft_seconds(self, rows):
        longest = max(r.full_kv * self.reads[r.compressor] for r in rows)
        return self.overhead * (0.07 + 0.012 * len(rows) + 1.2e-5 * len(rows) * longest)

    @staticmethod
    def verify_seconds(rows, width):
        kv = sum(r.full_kv for r in rows)
        return 0.075 + 0.005 * len(rows) * width + 1.4e-5 * kv + 2e-7 * kv * width

    def run(self, ctl, requests, context, new_tokens, fixed=None):
        """``requests`` requests of ``context`` tokens at once, until each has ``new_tokens``;
        ``fixed`` = (compressor, draft length) runs them so instead. Returns tokens per second."""
        rows, made, switches = [], {}, {}
        for _ in range(requests):
            self.n += 1
            rid = f"q{self.n}"
            name = fixed[0] if fixed else ctl.choose_compressor(CANDIDATES, context, rid, rows=requests)
            self.chosen[name] += not fixed
            rows.append(Row(rid, context, int(context * dict(CANDIDATES)[name]), name,
                            draft_len=fixed[1] if fixed else None))
            made[rid], switches[rid] = 0, 0
        seconds = tokens = 0.0
        while rows:
            d = fixed[1] if fixed else ctl.decide(rows).draft_len
            if d == 0:
                t = self.plain_seconds(rows)
                ctl.observe_plain(rows, t)
                gained = {r.rid: 1 for r in rows}
            else:
                accepted = []
                for r in rows:
                    k = 0
                    while k < d and self.rng.random() < self.alpha[r.compressor]:
                        k += 1
                    accepted.append(k)
                draft_t, verify_t = d * self.draft_seconds(rows), self.verify_seconds(rows, d + 1)
                ctl.observe_round(rows, d, draft_t, verify_t, [d] * len(rows), accepted)
                t = draft_t + verify_t
                gained = {r.rid: k + 1 for r, k in zip(rows, accepted)}
                for i, r in enumerate(rows):
                    if fixed or switches[r.rid] >= 2 or not ctl.has_evidence(r.rid):
                        continue
                    name = ctl.choose_compressor(CANDIDATES, r.full_kv, r.rid, current=r.compressor,
                                                 margin=0.15, rows=len(rows))
                    if name != r.compressor:
                        rows[i] = Row(r.rid, r.full_kv, int(r.full_kv * dict(CANDIDATES)[name]), name)
                        switches[r.rid] += 1
                        ctl.forget(r.rid)
            seconds += t
            for r in rows:
                made[r.rid] += gained[r.rid]
                tokens += gained[r.rid]
            done = [r for r in rows if made[r.rid] >= new_tokens]
            for r in done:
                ctl.forget(r.rid)
            rows = [r for r in rows if made[r.rid] < new_tokens]
            for r in rows:
                r.full_kv += gained[r.rid]
        self.seconds += seconds
        self.tokens += tokens
        return tokens / seconds


CPU_READS = {"streamingllm": 0.25, "kivi4": 1.0}  # the CPU path: a quantizer's draft reads a dense copy
TRUE_ALPHA = {"streamingllm": 0.9, "kivi4": 0.96}  # the quantizer agrees more


def _warm(ctl, fleet):
    """A serving phase first (8 x 400 tokens), as bench_adaptive's W1 runs before W3: the
    draft costs are learned where the KV hardly matters."""
    for _ in range(3):
        fleet.run(ctl, 8, 400, 32)


def test_auto_prices_a_quantizer_draft_by_the_kv_it_reads():
    """4 x 4k after a short-context phase, quantizer drafts as dear as plain steps over the full
    KV and a dropper's over a quarter: auto must draft from the dropper although the
    quantizer's prior acceptance is higher (a draft-cost fit of its own, [1, rows, draft KV],
    learned no KV term at 400 tokens and priced kivi4 reading 16k like streamingllm reading 4k),
    and come within 10% of the best fixed setting."""
    ctl, fleet = Controller(max_draft_len=16), Fleet(CPU_READS, TRUE_ALPHA)
    _warm(ctl, fleet)
    fleet.chosen.clear()
    rates = [fleet.run(ctl, 4, 4000, 48) for _ in range(3)]
    assert fleet.chosen["streamingllm"] >= 11 and fleet.chosen["kivi4"] <= 1, fleet.chosen
    best = max(Fleet(CPU_READS, TRUE_ALPHA, seed=1).run(Controller(16), 4, 4000, 48, fixed=(c, d))
               for c in CPU_READS for d in (8, 16))
    assert sum(rates[1:]) / 2 >= 0.9 * best, (rates, best)


def test_auto_keeps_the_quantizer_where_it_pays():
    """Drafts cheap against a plain step (half-precision draft weights at small batches),
    short contexts where the KV is a small part of a step, and a dropper that agrees less
    (a quarter of a short prompt): the quantizer's drafts cost about what the dropper's do,
    its rounds run 17-25% faster, and auto keeps choosing it (one trial of the other
    aside), also after a long-context phase."""
    alpha = {"streamingllm": 0.8, "kivi4": 0.96}
    ctl, fleet = Controller(max_draft_len=16), Fleet(CPU_READS, alpha, overhead=0.4)
    for requests, context in ((1, 500), (4, 4000), (2, 1200), (1, 800)):
        fleet.chosen.clear()
        for _ in range(3):
            fleet.run(ctl, requests, context, 48)
        if context < 4000:
            assert fleet.chosen["kivi4"] >= 3 * requests - 1, (requests, context, fleet.chosen)


def test_a_candidate_never_measured_near_a_context_is_tried_once():
    """New requests at a context where only streamingllm was measured: one request (not all
    of them) tries kivi4 while it would be the best at the optimistic end of what is unknown
    (EXPLORE_REJECT, EXPLORE_COST); once measured, or where even that would lose, it is not
    tried again; a request that left before drafting frees the trial."""
    ctl = Controller(max_draft_len=16)
    ctl.drafted_at = {"streamingllm": (1000, 1000)}
    picks = [ctl.choose_compressor(CANDIDATES, 1000, f"r{i}", rows=4) for i in range(4)]
    assert picks.count("kivi4") == 1, picks
    ctl.forget(f"r{picks.index('kivi4')}")  # left before its first round
    assert ctl.choose_compressor(CANDIDATES, 1000, "r4", rows=4) == "kivi4"
    assert ctl.choose_compressor(CANDIDATES, 1000, "r5", rows=4) == "streamingllm"
    ctl.iterations += Controller.EXPLORE_WAIT + 1  # r4 never drafted (it finished at its prefill)
    assert ctl.choose_compressor(CANDIDATES, 1000, "r4", rows=4) == "kivi4"
    ctl.observe_round([Row("r4", 1000, 1000, "kivi4")], 4, 4 * 0.3, 0.2, [4], [4])
    assert ctl.measured_near("kivi4", 1000) and not ctl.exploring
    after = [ctl.choose_compressor(CANDIDATES, 1000, f"s{i}", rows=4) for i in range(4)]
    assert len(set(after)) == 1 and not ctl.exploring, after  # chosen by the model now, no trial beside it
    # bench_adaptive's W3 shape on a fresh server, 4 x 4k arriving together: one kivi4 row would
    # pad every row's draft step to its dense 4k copy (a trial made that batch 1.8x slower)
    ctl = Controller(max_draft_len=16)
    ctl.drafted_at = {"streamingllm": (4000, 4000)}
    assert [ctl.choose_compressor(CANDIDATES, 4000, f"r{i}", rows=4) for i in range(4)] == ["streamingllm"] * 4
    ctl = Controller(max_draft_len=16)  # far slower by the plain model: 4 x 64k, kivi4 reading it all
    ctl.drafted_at = {"streamingllm": (64000, 64000)}
    assert [ctl.choose_compressor(CANDIDATES, 64000, f"r{i}", rows=4) for i in range(4)] == ["streamingllm"] * 4


# -- from bench_adaptive's W3: an entry's build, a row's re-choice in its batch -----------------------


def test_the_build_of_an_entry_is_priced_over_the_requests_life():
    """A request's first round builds its entry from the whole prompt: at 4k tokens 2.8 s for
    kivi4 and 0.5 s for streamingllm (bench_adaptive --quick's W3 at 4b346c1). Where kivi4's
    rounds are a little faster, a request with a long life still drafts from it, one with 48
    tokens to go from the dropper; a request already on kivi4 is not moved for the rebuild."""
    ctl = Controller(max_draft_len=16)
    for i in range(8):  # first rounds: 0.7 s per 1000 tokens for kivi4, 0.13 s for streamingllm;
        # kivi4 agrees on every draft, streamingllm on 6 of 8: kivi4's rounds are the faster
        ctl.observe_round([Row(f"k{i}", 4000, 4000, "kivi4")], 8, 0.8, 0.4, [8], [8], setup_seconds=2.8)
        ctl.observe_round([Row(f"s{i}", 4000, 1000, "streamingllm")], 8, 0.4, 0.4, [8], [6], setup_seconds=0.52)
    assert ctl.costs.build("kivi4", 4000) == pytest.approx(2.8, rel=0.1)
    assert ctl.costs.build("streamingllm", 4000) == pytest.approx(0.52, rel=0.1)
    ctl.drafted_at = {"streamingllm": (4000, 4000), "kivi4": (4000, 4000)}  # no trials: the predictions decide
    assert ctl.choose_compressor(CANDIDATES, 4000, "long", remaining=100000) == "kivi4"
    assert ctl.choose_compressor(CANDIDATES, 4000, "short", remaining=48) == "streamingllm"
    for _ in range(4):
        ctl.observe_round([Row("k", 4000, 4000, "kivi4")], 8, 0.8, 0.4, [8], [8])
    assert ctl.choose_compressor(CANDIDATES, 4000, "k", current="kivi4", margin=0.15, remaining=48) == "kivi4"


def test_a_new_compressor_for_one_row_is_priced_with_the_batch_it_drafts_in():
    """4 x 4k, three rows accepting their dropper drafts and one rejecting them: alone, that
    request would draft faster from the quantizer (its prior agrees more); in the batch its
    dense 4k copy pads every row's draft step to 4k keys (bench_adaptive's W3 moved it, and the
    batch's drafts took 3x as long). It must stay."""
    fleet = Fleet(CPU_READS, TRUE_ALPHA)
    ctl = Controller(max_draft_len=16)
    rows = [Row(f"r{i}", 4000, 1000, "streamingllm") for i in range(4)]
    for _ in range(12):
        ctl.observe_plain(rows, fleet.plain_seconds(rows))
        ctl.observe_round(rows, 8, 8 * fleet.draft_seconds(rows), fleet.verify_seconds(rows, 9), [8] * 4,
                          [8, 8, 8, 0])
    kivi = [Row("k", 4000, 4000, "kivi4")]
    for _ in range(6):  # the quantizer's drafts measured at this context (another request, alone)
        ctl.observe_round(kivi, 8, 8 * fleet.draft_seconds(kivi), fleet.verify_seconds(kivi, 9), [8], [8])
    assert ctl.choose_compressor(CANDIDATES, 4000, "r3", current="streamingllm", margin=0.15) == "kivi4"
    assert ctl.choose_compressor(CANDIDATES, 4000, "r3", current="streamingllm", margin=0.15, rows=4,
                                 others=rows) == "streamingllm"
