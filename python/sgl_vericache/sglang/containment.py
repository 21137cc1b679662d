"""Containment in SGLang's scheduler: an error that belongs to one arriving request ends
that request (an HTTP 500 naming the error), and the server goes on.

Touches ``Scheduler.handle_generate_request`` (``handle_batch_generate_request`` calls it
per item): the scheduler builds an arriving request's own objects there (its ``Req``,
sampling parameters, session lookup, logprob and length bounds, grammar lookup) before it
joins any queue or batch, so an exception raised there is that request's and nothing
shared has changed yet. SGLang 0.5.23 lets any such exception end the scheduler's loop, and
its launcher then stops every process.

Not contained (they stop the server, loudly, as SGLang does): anything raised inside
``Scheduler._add_request_to_queue`` (queue limits, the HiCache storage prefetch) or inside a
cache (``mem_cache`` of SGLang or ours), where shared state may be half-changed; and every
error after admission: a forward pass, batch assembly, result processing, the
detokenizer. A forward serves a whole batch, so its errors are no one request's; the
checks in ``validation`` keep the known per-request causes from getting that far.
VeriCache's own per-request settings are contained where the round plans a request
(``spec/round.py``: a bad override a 400, any other planning error a 500).

Also touches ``SchedulerBatchResultProcessor._apply_prefill_grammar`` and
``_accept_grammar_tokens``: SGLang ends a request whose sampled token its grammar refuses
with a 500 ("Grammar accept_token failed", its FIXME for xgrammar faults). When the
grammar admits no token at all at that point (a regex such as ``"\u0016"`` no token of the
vocabulary spells: every score masked, token 0 drawn), the fault is the request's grammar:
a 400 saying so. A refused token while the grammar admits some stays SGLang's 500.
"""

from __future__ import annotations

import logging
import traceback
from http import HTTPStatus

from sgl_vericache.sglang.runtime import Runtime, patch

logger = logging.getLogger(__name__)

# frames that touch shared scheduler state: an error raised below them is not contained
SHARED_FUNCTIONS = frozenset({"_add_request_to_queue", "_prefetch_kvcache"})
SHARED_PATH_PARTS = ("/mem_cache/",)


def attributable(exc: BaseException) -> bool:
    """Whether ``exc`` (raised while admitting one request) was raised outside shared state."""
    if not isinstance(exc, Exception):
        return False  # KeyboardInterrupt, SystemExit: the process's, never a request's
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.name in SHARED_FUNCTIONS or any(p in frame.filename.replace("\\", "/") for p in SHARED_PATH_PARTS):
            return False
    return True


def install_admission_containment(runtime: Runtime) -> None:
    from sglang.srt.managers.scheduler import Scheduler

    def make(original):
        def handle_generate_request(self, recv_req, *args, **kwargs):
            try:
                return original(self, recv_req, *args, **kwargs)
            except Exception as exc:
                if not attributable(exc):
                    raise
                logger.exception("request %s failed at admission; it alone ends (HTTP 500)", recv_req.rid)
                end_request(self, recv_req, f"the scheduler could not admit this request: {type(exc).__name__}: {exc}")
                return None

        return handle_generate_request

    patch(Scheduler, "handle_generate_request", runtime, make)


def admits_nothing(grammar) -> bool:
    """Whether ``grammar`` (SGLang's grammar object, at its current state) allows no next
    token; False when that cannot be told (another backend, an error)."""
    try:
        size = int(grammar.vocab_size)
        mask = grammar.allocate_vocab_mask(size, 1, "cpu")
        grammar.fill_vocab_mask(mask, 0)
        return not bool(mask.any())
    except Exception:  # a backend without these: leave SGLang's answer alone
        return False


GRAMMAR_FAILED = "Grammar accept_token failed"


def install_grammar_dead_ends(runtime: Runtime) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    def refused_by_grammar(req) -> None:
        finish = req.to_finish
        if not (isinstance(finish, FINISH_ABORT) and str(finish.message).startswith(GRAMMAR_FAILED)):
            return
        if req.grammar is None or not admits_nothing(req.grammar):
            return
        key = getattr(req.grammar, "key_string", None)
        req.to_finish = FINISH_ABORT(
            f"the request's grammar ({key!r}) admits no token of this model's vocabulary after "
            f"{len(req.output_ids)} generated token(s); accepted: a regex / JSON schema / EBNF grammar that the "
            "tokenizer's tokens can spell", HTTPStatus.BAD_REQUEST, "BadRequestError")

    def make_prefill(original):
        def _apply_prefill_grammar(self, *, req, **kwargs):
            out = original(self, req=req, **kwargs)
            refused_by_grammar(req)
            return out

        return _apply_prefill_grammar

    def make_accept(original):
        def _accept_grammar_tokens(self, req, tokens):
            out = original(self, req, tokens)
            refused_by_grammar(req)
            return out

        return _accept_grammar_tokens

    patch(SchedulerBatchResultProcessor, "_apply_prefill_grammar", runtime, make_prefill)
    patch(SchedulerBatchResultProcessor, "_accept_grammar_tokens", runtime, make_accept)


def end_request(scheduler, recv_req, message: str) -> None:
    """Take ``recv_req``'s request out of the queues it may have reached and answer it with
    a 500 carrying ``message``."""
    from sglang.srt.managers.io_struct import AbortReq

    rid = recv_req.rid
    scheduler.waiting_queue[:] = [r for r in scheduler.waiting_queue if r.rid != rid]
    grammar = getattr(scheduler, "grammar_manager", None)
    if grammar is not None:
        grammar.grammar_queue[:] = [r for r in grammar.grammar_queue if r.rid != rid]
    reason = {"type": "abort", "status_code": 500, "message": message, "err_type": "InternalServerError"}
    scheduler.send_abort_output(AbortReq(rid=rid, finished_reason=reason), recv_req)
