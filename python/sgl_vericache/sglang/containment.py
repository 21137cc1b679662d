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
"""

from __future__ import annotations

import logging
import traceback

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
