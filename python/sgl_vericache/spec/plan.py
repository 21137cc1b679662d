"""What each request drafts from and how far, and when the batch speculates at all (no SGLang
imports).

A request's ``Plan`` comes from the server's config and its own ``custom_params`` (a bad
value aborts that request alone). With ``--vericache-adaptive`` the ``Planner`` also asks
the controller (``spec/adaptive.py``) each decode iteration whether to speculate and how
long to draft, feeds it each iteration's outcome, and under ``--vericache-compressor auto``
picks each request's compressor and moves it when its measured acceptance says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import NamedTuple, Optional, Sequence

from sgl_vericache.config import AUTO, AUTO_CANDIDATES, FLAG_PREFIX, VeriCacheConfig, check_layouts, request_config
from sgl_vericache.mem_cache.compress import KVCompressor
from sgl_vericache.spec.adaptive import Controller, Decision, Row

logger = logging.getLogger(__name__)

# Tests: draft lengths the adaptive controller cycles through instead of deciding (0 = plain),
# and every how many rounds an auto request moves to the next candidate compressor regardless
SCHEDULE_ENV = "VERICACHE_ADAPTIVE_SCHEDULE"
SWITCH_ENV = "VERICACHE_ADAPTIVE_SWITCH_EVERY"
MAX_SWITCHES = 2  # compressor moves per request
# Diagnosis: a file the controller's inputs, decisions and outcomes are appended to, one JSON line each
TRACE_ENV = "VERICACHE_ADAPTIVE_TRACE"


class Plan(NamedTuple):
    compressor: KVCompressor
    draft_len: int  # the most it drafts (the server's --vericache-draft-len, or its own)
    error: Optional[str] = None  # a bad override: the request was aborted
    fixed: bool = False  # its custom_params set its draft length: the controller does not change it
    auto: bool = False  # its compressor is the controller's choice (--vericache-compressor auto)
    switches: int = 0  # times the controller moved it to another compressor


def draft_kv_fraction(compressor: KVCompressor) -> float:
    """The share of a request's full KV a draft step reads from its compressed entry: a
    dropper's kept tokens; a quantizer's dense copy (on this path) and Quest's scored pages
    read as much as the full KV."""
    return 1.0 / compressor.ratio if compressor.ratio and compressor.name != "quest" else 1.0


def _finished(req) -> bool:
    """Whether SGLang has finished ``req`` (``Req.finished()``; the overlap scheduler, which
    flips it a step late, is off under VERICACHE)."""
    finished = getattr(req, "finished", None)
    return bool(finished()) if callable(finished) else False


def verifies_every_round(req) -> bool:
    """Whether ``req`` must verify in every round (never deferred or parked): it is
    penalized. SGLang adds a request's last output token to its penalty state once an
    iteration whether or not the iteration emitted one for it, so an iteration without a
    token would count that token again (a frequency penalty twice, min_new_tokens' count
    one ahead)."""
    return penalized(req)


def penalized(req) -> bool:
    """Whether ``req`` has frequency, presence or repetition penalties or a min_new_tokens
    (SGLang's four penalizers): its verified positions are penalized position by position
    (``sglang.penalties``), and it verifies in every round. A min_new_tokens counts even
    once the output has reached it: a retraction restarts SGLang's count."""
    params = req.sampling_params
    return (getattr(params, "frequency_penalty", 0.0) not in (0, None)
            or getattr(params, "presence_penalty", 0.0) not in (0, None)
            or getattr(params, "repetition_penalty", 1.0) not in (1, None)
            or (getattr(params, "min_new_tokens", 0) or 0) > 0)


def _remaining(req) -> Optional[int]:
    """Tokens ``req`` may still emit before its ``max_new_tokens`` (None: no limit known)."""
    limit = getattr(req.sampling_params, "max_new_tokens", None)
    return max(limit - len(req.output_ids), 0) if isinstance(limit, int) else None


def layout_refusals(vc: VeriCacheConfig, names: Sequence[str], layouts: Sequence[tuple[int, int]]) -> dict:
    """name -> why that compressor, as ``vc`` builds it, cannot serve ``layouts`` ((num_kv_heads,
    head_dim) of the model's attention layers), for each of ``names`` that cannot."""
    refusals = {}
    for name in names:
        try:
            check_layouts(vc.build_compressor(name), layouts)
        except ValueError as exc:
            refusals[name] = str(exc)
    return refusals


def auto_candidates(vc: VeriCacheConfig, layouts: Sequence[tuple[int, int]]) -> tuple[str, ...]:
    """The candidates ``auto`` chooses among on this model (the server's or a request's
    ``auto``: default options): kivi4 drops out, logged, where its group size does not divide
    head_dim, rather than stop the scheduler at the first round of a request it is chosen for."""
    refusals = layout_refusals(dataclasses.replace(vc, compressor=AUTO, compressor_options=""), AUTO_CANDIDATES,
                               layouts)
    for name, why in refusals.items():
        logger.warning("VeriCache: auto (the server's compressor or a request's) chooses without %s on this model "
                       "(%s): %s", name, _shown(layouts), why)
    return tuple(name for name in AUTO_CANDIDATES if name not in refusals)


def served_compressors(vc: VeriCacheConfig, layouts: Sequence[tuple[int, int]]) -> tuple[str, ...]:
    """The compressors requests get without naming one: the configured one, or ``auto``'s
    candidates that fit. A configured compressor that cannot serve ``layouts``, or an ``auto``
    with no candidate left, raises ValueError naming the rule: the server refuses to start."""
    if vc.compressor == AUTO:
        served = auto_candidates(vc, layouts)
        if not served:
            raise ValueError(f"{FLAG_PREFIX}compressor {AUTO}: no candidate ({', '.join(AUTO_CANDIDATES)}) can serve "
                             f"this model's attention ({_shown(layouts)}); name a compressor that can")
        return served
    refusal = layout_refusals(vc, [vc.compressor], layouts).get(vc.compressor)
    if refusal is not None:
        raise ValueError(f"{FLAG_PREFIX}compressor {vc.compressor} cannot serve this model's attention "
                         f"({_shown(layouts)}): {refusal}; set its options with {FLAG_PREFIX}compressor-options, "
                         "or choose another compressor")
    return (vc.compressor,)


def _shown(layouts: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"{heads} KV heads of head_dim {dim}" for heads, dim in layouts)


class Planner:
    def __init__(self, vc: VeriCacheConfig, stats, abort, default_compressor: KVCompressor,
                 padded_drafts: bool = True):
        """``abort(req, message, status=400)`` ends one request (the seam's); ``padded_drafts``:
        the controller's (see Controller)."""
        self.vc, self.stats, self.abort = vc, stats, abort
        self.default_compressor = default_compressor
        self.plans = {}  # rid -> Plan
        self.owners = {}  # rid -> the Req planned (SGLang accepts a finished request's rid again)
        self.compressors = {}  # (method, ratio, options) -> compressor (shared, stateless)
        self.layouts = ()  # the model's (num_kv_heads, head_dim) pairs, once serve_layouts knows them
        self.candidates = AUTO_CANDIDATES  # auto's, narrowed by serve_layouts to those that fit
        self.controller = None
        if vc.adaptive:
            schedule = [int(d) for d in os.environ.get(SCHEDULE_ENV, "").split(",") if d.strip()]
            self.controller = Controller(vc.draft_len, allow_plain=vc.full_device_budget < 0, schedule=schedule,
                                         padded_drafts=padded_drafts)
        self.switch_every = int(os.environ.get(SWITCH_ENV, "0") or 0)
        self.rounds = 0
        self.decision: Optional[Decision] = None  # this decode iteration's, with the controller on
        self.rows: Optional[list[Row]] = None  # the controller's view of this iteration's batch
        self.batch_reqs = []  # that batch's requests
        self.unseen = {}  # rid -> Req planned but not yet in a decode batch (one may finish at its prefill)
        trace = os.environ.get(TRACE_ENV)
        self.trace = open(trace, "a", buffering=1) if trace and self.controller is not None else None

    # -- per request -----------------------------------------------------------------

    def plan(self, req, rows: Optional[int] = None) -> Plan:
        """The request's compressor and draft length; a bad override aborts it with a 400.
        ``rows``: the batch it is expected to draft in (for ``auto``; default: the last decode
        iteration's, itself included)."""
        plan = self.plans.get(req.rid)
        if plan is not None and self.owners.get(req.rid) is not req:
            self.forget(req.rid)  # a finished request's rid, sent again: its plan is not this one's
            plan = None
        if plan is None:
            try:
                plan = self._new_plan(req, rows or len(self._running()) + 1)
                self.stats.planned(plan.compressor.name)
            except ValueError as exc:  # a bad override: this request alone ends, with a 400
                self.abort(req, str(exc))
                plan = Plan(self.default_compressor, 1, str(exc))
            except Exception as exc:  # our bug, contained to this request (a 500), never the server
                logger.exception("VeriCache: planning request %s failed", req.rid)
                message = f"VeriCache could not plan this request: {type(exc).__name__}: {exc}"
                self.abort(req, message, status=500)
                plan = Plan(self.default_compressor, 1, message)
            self.plans[req.rid], self.owners[req.rid] = plan, req
            if all(r is not req for r in self.batch_reqs):
                # planned before any decode batch had it (at its prefill, or while its prefix
                # was still fetched, for drafting meanwhile): an abort then reports no departure
                self.unseen.setdefault(req.rid, req)
            self._trace("plan", rid=req.rid, context=len(req.origin_input_ids), compressor=plan.compressor.name)
        return plan

    def plan_arriving(self, reqs) -> list[Plan]:
        """Plans of requests arriving together (a prefill batch): the new ones will draft
        beside each other and the running batch."""
        self._forget_finished()
        rows = len(reqs) + len(self._running())
        self.unseen.update((req.rid, req) for req in reqs)
        return [self.plan(req, rows) for req in reqs]

    def _running(self) -> list[Row]:
        """The last decode iteration's rows whose requests have not finished since (departed
        requests are reported only at the next decode iteration, after the arrivals' prefill)."""
        return [row for row, req in zip(self.rows or (), self.batch_reqs) if not _finished(req)]

    def _forget_finished(self) -> None:
        """Requests that finished before any decode iteration (at their prefill: one new
        token, or aborted) never depart a decode batch: their plans go here."""
        for rid in [rid for rid, req in self.unseen.items() if _finished(req)]:
            self.forget(rid)

    def serve_layouts(self, layouts: Sequence[tuple[int, int]]) -> None:
        """The model's attention layouts, given once its worker knows them (before any request):
        a request's compressor override is checked against them at its plan (a 400, where the
        tokenizer's checks did not already refuse it), and ``auto`` chooses among the candidates
        that fit. Raises ValueError (``served_compressors``) when the server's compressor cannot
        serve them."""
        served = served_compressors(self.vc, layouts)
        self.layouts = tuple(layouts)
        self.candidates = served if self.vc.compressor == AUTO else auto_candidates(self.vc, layouts)
        if self.default_compressor.name not in served:  # what an aborted request's plan names
            self.default_compressor = self._compressor(self.vc, served[0])

    def _new_plan(self, req, rows: int) -> Plan:
        custom = req.sampling_params.custom_params
        cfg = request_config(custom, self.vc, self.layouts)
        name = cfg.compressor
        if name == AUTO:
            name = self._choose(cfg, len(req.origin_input_ids), req.rid, rows=rows, remaining=_remaining(req))
        fixed = isinstance(custom, dict) and "vericache_draft_len" in custom
        return Plan(self._compressor(cfg, name), cfg.draft_len, fixed=fixed, auto=cfg.compressor == AUTO)

    def configured_compressors(self) -> list[KVCompressor]:
        """The compressors requests get without asking for another: the configured one, or
        under ``auto`` each candidate (the instances their plans will share)."""
        names = self.candidates if self.vc.compressor == AUTO else (self.vc.compressor,)
        return [self._compressor(self.vc, name) for name in names]

    def _compressor(self, cfg: VeriCacheConfig, name: str) -> KVCompressor:
        key = (name, cfg.ratio, cfg.compressor_options if name == cfg.compressor else "")
        if key not in self.compressors:
            self.compressors[key] = cfg.build_compressor(name)
        return self.compressors[key]

    def _choose(self, cfg: VeriCacheConfig, context: int, rid=None, current=None, rows: int = 1,
                remaining: Optional[int] = None) -> str:
        """``rows``: the batch it drafts in; the last decode iteration's rows (the running
        batch) are priced as they are, the rest like this request."""
        if self.controller is None or len(self.candidates) == 1:
            return self.candidates[0]
        candidates = [(name, draft_kv_fraction(self._compressor(cfg, name))) for name in self.candidates]
        return self.controller.choose_compressor(candidates, context, rid, current, margin=0.15, rows=rows,
                                                 others=self._running(), remaining=remaining)

    def forget(self, rid, unless=None) -> None:
        """Drop what is known of ``rid``'s request, unless ``unless`` is the request planned
        under it (then it is another request, already planned afresh)."""
        if unless is not None and self.owners.get(rid) is unless:
            return
        self.plans.pop(rid, None)
        self.owners.pop(rid, None)
        self.unseen.pop(rid, None)
        if self.controller is not None:
            self.controller.forget(rid)

    def draft_len(self, plan: Plan) -> int:
        """What a request drafts this round: its own length, or the controller's choice."""
        if self.decision is None or plan.fixed:
            return plan.draft_len
        return min(plan.draft_len, self.decision.draft_len)

    # -- per iteration ---------------------------------------------------------------

    def decide(self, reqs, verified: Sequence[int], queued, must_round: bool) -> bool:
        """Whether this decode iteration is a round (else plain decoding). ``queued``: rids
        with drafts made ahead."""
        self.decision = self.rows = None
        self.batch_reqs = list(reqs)
        self._forget_finished()
        for req in reqs:
            self.unseen.pop(req.rid, None)
        if self.controller is None:
            return True
        plans = [self.plan(r, len(reqs)) for r in reqs]
        self.rows = [Row(req.rid, n, int(n * draft_kv_fraction(plan.compressor)), plan.compressor.name,
                         plan.draft_len if plan.fixed else None, req.rid in queued, _remaining(req))
                     for req, n, plan in zip(reqs, verified, plans)]
        self.decision = self.controller.decide(self.rows, force=must_round)
        if self.trace is not None:
            ctl = self.controller
            self._trace("decide", rows=[[r.rid, r.full_kv, r.draft_kv, r.compressor, round(ctl.alpha(r.rid, r.compressor, r.full_kv), 3)]
                                        for r in self.rows], d=self.decision.draft_len, probe=self.decision.probe,
                        s=self.decision.predicted_seconds, t=self.decision.predicted_tokens,
                        plain_s=ctl.costs.plain.predict(ctl.costs.plain_x(self.rows)),
                        draft_s=ctl.costs.draft.predict([r for r in self.rows if not r.queued]))
        return self.decision.draft_len > 0

    def undecided(self) -> None:
        """This iteration is not the planner's to learn from (paused after drafting ran out
        of memory, or a round whose drafts did): its rows and decision are let go, so neither
        a plain step nor the round is booked against another batch's rows."""
        self.decision = self.rows = None

    def plain_done(self, seconds: float) -> None:
        if self.controller is not None and self.rows is not None:
            self.controller.observe_plain(self.rows, seconds)
        self._count_prediction(seconds)
        self._trace("plain", s=seconds)

    def round_done(self, reqs, lens: Sequence[int], accept_lens: Sequence[int], draft_seconds: float,
                   seconds: float, setup_seconds: float = 0.0) -> None:
        """The controller learns the round's costs and acceptance (row i drafted ``lens[i]``,
        emitted ``accept_lens[i]``); auto requests may move to the other compressor. Of the
        round's ``seconds``, ``draft_seconds`` were its draft forwards and ``setup_seconds``
        the bringing up to date of compressed entries and draft buffers (whole prompts
        compressed at a request's first round, an entry rebuilt after a switch: once per
        request, not per round); the rest was the verify pass."""
        if self.controller is None or self.rows is None or len(lens) != len(reqs):
            return
        accepted = [max(0, n - 1) for n in accept_lens]
        verify_seconds = max(seconds - draft_seconds - setup_seconds, 0.0)
        self.controller.observe_round(self.rows, max(lens, default=0), draft_seconds, verify_seconds, lens, accepted,
                                      setup_seconds=setup_seconds)
        self._count_prediction(seconds)
        self._trace("round", lens=list(lens), accepted=accepted, draft_s=draft_seconds, setup_s=setup_seconds,
                    s=seconds)
        self.rounds += 1
        forced = bool(self.switch_every) and self.rounds % self.switch_every == 0
        for req, row in zip(reqs, self.rows):
            self._rechoose(req, row, forced)

    def _rechoose(self, req, row: Row, forced: bool) -> None:
        plan = self.plans.get(req.rid)
        if plan is None or not plan.auto or plan.switches >= MAX_SWITCHES or not (
                forced or self.controller.has_evidence(req.rid)):
            return
        cfg = request_config(req.sampling_params.custom_params, self.vc)
        if forced:
            name = self.candidates[(self.candidates.index(plan.compressor.name) + 1) % len(self.candidates)]
        else:
            name = self._choose(cfg, row.full_kv, req.rid, plan.compressor.name, rows=len(self.rows),
                                remaining=row.remaining)
        if name != plan.compressor.name:  # its next sync rebuilds its compressed entry
            self.plans[req.rid] = plan._replace(compressor=self._compressor(cfg, name), switches=plan.switches + 1)
            self.controller.forget(req.rid)  # its acceptance was the old compressor's
            self.stats.add("compressor_switches", 1)
            self.stats.planned(name)
            self._trace("switch", rid=req.rid, compressor=name)

    def _trace(self, event: str, **fields) -> None:
        if self.trace is not None:
            self.trace.write(json.dumps({"event": event, "at": round(time.monotonic(), 4), **fields}, default=str) + "\n")

    def _count_prediction(self, seconds: float) -> None:
        if self.decision is not None:
            self.stats.add("predicted_step_seconds", self.decision.predicted_seconds)
            self.stats.add("measured_step_seconds", seconds)
