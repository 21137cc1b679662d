"""Scheduler hooks: rows that did not verify, preempted requests that keep their KV,
drafting while a prefix is fetched, VeriCache's numbers in ``/server_info``, and room in
the request-to-token rows for a speculative decode near the context's end, and room in the
KV budget for VeriCache's own memory.

Touches ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens``, ``Req.
update_spec_correct_drafts_histogram`` / ``update_finish_state``, ``SchedulerOutputStreamer.
stream_output``, ``SchedulerMetricsReporter.update_spec_metrics``, ``GenerationBatchResult.
get_num_generated_tokens`` (a deferred row: no token, no verify), ``schedule_batch.release_req``
(preemption), ``Scheduler._prefetch_kvcache`` and ``UnifiedRadixCache.check_prefetch_progress``
(the poll of a request waiting for its storage prefetch), ``Scheduler._release_aborted_request``
(a waiting request aborted: its drafting ahead let go of), ``SchedulerInternalStateController.
_add_speculative`` (``/server_info``), ``kv_cache_configurator.get_req_to_token_extra_context_len``
(the rows' headroom), ``KVCacheConfigurator._profile_available_bytes`` (the pool's budget),
``Session._concat_token_arrays`` (a session's next prompt).
"""

from __future__ import annotations

import logging
import time

from sgl_vericache.sglang.runtime import Runtime, patch

logger = logging.getLogger(__name__)


def install_session_turns(runtime: Runtime) -> None:
    """A session's next turn (non-streaming ``session_params``) starts from the last turn's
    prompt and ``output_ids``, cut at its ``max_new_tokens`` only. A speculative round can
    accept tokens past the point where the turn finished (a stop string inside the run:
    ``finished_len``), which the response leaves out and decoding never made; the next turn
    carried them in its prompt, so its ids differed from speculation off. It starts from the
    finished output. (Streaming sessions trim the output themselves.)"""
    import types

    from sglang.srt.session.session_controller import Session

    def make(original):
        def _concat_token_arrays(last_req, req, session_params):
            cut = getattr(last_req, "finished_len", None)
            if cut is not None and cut < len(last_req.output_ids):
                last_req = types.SimpleNamespace(  # read only: the turn as the response gave it
                    output_ids=last_req.output_ids[:cut], sampling_params=last_req.sampling_params,
                    origin_input_ids=last_req.origin_input_ids,
                    origin_input_ids_unpadded=last_req.origin_input_ids_unpadded)
            return original(last_req, req, session_params)

        return _concat_token_arrays

    patch(Session, "_concat_token_arrays", runtime, make)


def install_context_end_headroom(runtime: Runtime) -> None:
    """SGLang 0.5.23 gives a speculative decode 2 x ``speculative_num_draft_tokens`` KV slots
    past a request's committed length (``get_alloc_reserve_per_decode``: a double buffer for
    overlap scheduling's lag), but each request-to-token row only 4 + that many columns past
    the model's context (``get_req_to_token_extra_context_len``, at page size 1 and one draft
    branch: its own FIXME). A request still decoding within ``draft tokens - 4`` positions of
    the context's end (committed past context + 4 - draft tokens) then writes past its row:
    an IndexError on CPU, an out-of-bounds write on CUDA, and the scheduler is gone (NGRAM's
    too). Found with seeded sampling at a 320-token context (test_context_limit.py): greedy
    decoding's accepted lengths had stepped over the window. Rows get the reserve's width."""
    from sglang.srt.mem_cache import allocation_sizing, kv_cache_configurator

    def make(original):
        def get_req_to_token_extra_context_len():
            reserve = allocation_sizing.get_alloc_reserve_per_decode() + allocation_sizing.get_alloc_page_size() - 1
            return max(original(), reserve)

        return get_req_to_token_extra_context_len

    patch(kv_cache_configurator, "get_req_to_token_extra_context_len", runtime, make)


def install_draft_memory_reserve(runtime: Runtime) -> None:
    """SGLang gives its KV pool the whole budget ``--mem-fraction-static`` leaves; with a
    VeriCache worker in this process the pool gets what remains after VeriCache's compressed
    entries, dense draft buffers and compressed prefix cache (``spec.memory_reserve``), so a
    full pool does not run drafting out of device memory. The plan is kept on the runtime
    (``/server_info``'s ``vericache_memory``) and logged. A target worker's budget only: the
    worker is built before the pool (``Scheduler.init_model_worker``) and found by its model."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    def make(original):
        def _profile_available_bytes(self, pre_model_load_memory):
            budget = original(self, pre_model_load_memory)
            rt = _profile_available_bytes.runtime
            worker = next((w for w in list(rt.workers) if w.model_runner.model is self.model), None)
            if worker is None or not worker.vc.reserve_draft_memory or self.is_draft_worker or self.use_mla_backend:
                return budget
            plan = worker.speculator.plan_memory(budget, self.kv_cache_dtype)
            if plan is None:
                return budget
            rt.draft_memory = plan
            logger.info("VeriCache: %s", plan.describe())
            return plan.pool_bytes

        return _profile_available_bytes

    patch(KVCacheConfigurator, "_profile_available_bytes", runtime, make)


def install_deferred_rows(runtime: Runtime) -> None:
    """Staggered verifies leave some rows of a decode iteration without a verify: they
    accept 0 tokens (no bonus). SGLang's spec result processing assumes at least one per
    row; for such a row (and only for it) this keeps its verify count and draft-acceptance
    histogram as they were, skips the finish checks (nothing new to check: an EOS or stop
    string cannot appear without a token; a pending abort still finishes it) and sends no
    empty stream chunk; SGLang's server-level accept length (``avg_spec_accept_length``, the
    decode log) and generated-token count (throughput) count it as no verify and no token."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.managers.utils import GenerationBatchResult

    patch(SchedulerBatchResultProcessor, "_resolve_spec_v2_tokens", runtime, _keep_deferred_counts)
    patch(Req, "update_spec_correct_drafts_histogram", runtime, _histogram_without_deferred)
    patch(Req, "update_finish_state", runtime, _finish_state_skipping_deferred)
    patch(SchedulerOutputStreamer, "stream_output", runtime, _stream_without_deferred)
    patch(SchedulerMetricsReporter, "update_spec_metrics", runtime, _spec_metrics_without_deferred)
    patch(GenerationBatchResult, "get_num_generated_tokens", runtime, _generated_without_deferred)


def _keep_deferred_counts(resolve):
    """A deferred row's verify and correct drafts are taken back off its counts and the
    batch's, and the row is marked (``req.vericache_deferred``) for the hooks below."""
    def _resolve_spec_v2_tokens(self, result, batch):
        lens = result.accept_lens.tolist()
        deferred = [i for i, (req, n) in enumerate(zip(batch.reqs, lens))
                    if n == 0 and not (req.is_retracted or req.finished())]
        tokens = resolve(self, result, batch)
        for i in deferred:
            req = batch.reqs[i]
            req.spec_verify_ct -= 1
            req.spec_num_correct_drafts -= result.num_correct_drafts_per_req_cpu[i]
            req.vericache_deferred = True
            result.num_correct_drafts -= result.num_correct_drafts_per_req_cpu[i]
            result.num_correct_drafts_per_req_cpu[i] = 0
        # read just after by get_num_generated_tokens and update_spec_metrics, both handed the
        # whole batch size (SGLang counts a bonus token and a verify per row)
        result.vericache_deferred = self.metrics_reporter.vericache_deferred = len(deferred)
        return tokens

    return _resolve_spec_v2_tokens


def _generated_without_deferred(generated):
    """The generated-token count (throughput) leaves deferred rows out."""
    def get_num_generated_tokens(self, batch_size):
        return generated(self, batch_size - getattr(self, "vericache_deferred", 0))

    return get_num_generated_tokens


def _spec_metrics_without_deferred(spec_metrics):
    """The server-level accept length counts no verify for deferred rows."""
    def update_spec_metrics(self, bs, *args, **kwargs):
        bs -= getattr(self, "vericache_deferred", 0)
        self.vericache_deferred = 0
        spec_metrics(self, bs, *args, **kwargs)

    return update_spec_metrics


def _histogram_without_deferred(histogram):
    """A deferred row's draft-acceptance histogram is left as it was."""
    def update_spec_correct_drafts_histogram(self, num_correct_drafts):
        if num_correct_drafts >= 0:
            histogram(self, num_correct_drafts)

    return update_spec_correct_drafts_histogram


def _finish_state_skipping_deferred(finish_state):
    """No finish checks for a deferred row (no new token), unless an abort is pending."""
    def update_finish_state(self, new_accepted_len=1):
        if new_accepted_len == 0 and getattr(self, "vericache_deferred", False) and not self.to_finish:
            return
        finish_state(self, new_accepted_len)

    return update_finish_state


def _stream_without_deferred(stream):
    """No empty stream chunk for a deferred row (a finished one still gets its last)."""
    def stream_output(self, reqs, return_logprob, *args, **kwargs):
        if any(getattr(req, "vericache_deferred", False) for req in reqs):
            sent = []
            for req in reqs:
                if getattr(req, "vericache_deferred", False):
                    req.vericache_deferred = False
                    if not req.finished():
                        continue
                sent.append(req)
            reqs = sent
        return stream(self, reqs, return_logprob, *args, **kwargs)

    return stream_output


def install_keep_preempted_kv(runtime: Runtime) -> None:
    """Preempted requests keep their KV in the radix tree.

    When SGLang retracts a decoding request under memory pressure (or preempts it for a
    higher priority), it frees the request's KV without inserting it (``release_req``:
    "for preempted requests, we may want to insert into the tree"), so the request,
    requeued, recomputes its prompt and every token it had generated. Here the request's
    committed KV (prompt + verified tokens, never a draft's) is first inserted into the
    tree, as a finishing request's is; the tree then owns it unlocked, so the eviction
    that follows still frees what the batch needs (LRU: older prefixes go first), and with
    HiCache the tree's write-through has a host copy to load back. On resume the request
    matches its own tokens. Not for PD decode workers (SGLang offloads those itself),
    requests whose KV is skipped or never inserted (``skip_radix_cache_insert``, sessions),
    mamba trees, or callers that pass ``offload_kv=False`` (aborts, recompute paths)."""
    from sglang.srt import runtime_context
    from sglang.srt.managers import schedule_batch

    def make(original):
        def release_req(*, req, tree_cache, hisparse_coordinator=None, offload_kv=True, **kwargs):
            if (offload_kv and not req.finished() and req.kv.holds_kv and hisparse_coordinator is None
                    and runtime_context.get_disagg().disaggregation_mode != "decode" and tree_cache is not None
                    and tree_cache.supports_prefix_sharing() and not tree_cache.supports_mamba()
                    and not req.skip_radix_cache_insert and getattr(req, "session_id", None) is None):
                before = req.kv.cache_protected_len
                req.refresh_fill_ids()
                req.vericache_releasing = True  # a release's insert, also under a full-KV budget
                tree_cache.checkpoint(req, up_to=req.owned_kv_len())
                release_req.runtime.preempted_requests += 1
                release_req.runtime.preempted_kept_tokens += max(0, req.kv.cache_protected_len - before)
            return original(req=req, tree_cache=tree_cache, hisparse_coordinator=hisparse_coordinator,
                            offload_kv=offload_kv, **kwargs)

        return release_req

    patch(schedule_batch, "release_req", runtime, make)


def install_fetch_drafting(runtime: Runtime) -> None:
    """The scheduler's poll of a request waiting for its storage prefetch
    (``check_prefetch_progress``) lets this process's VeriCache worker draft for it; the
    waiting ``Req`` is found by rid from SGLang's ``_prefetch_kvcache``, which starts it.
    An aborted request is never polled again: ``_release_aborted_request`` (SGLang's abort
    of a waiting request goes through it) lets go of its drafting at once."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    def make_prefetch(start):
        def _prefetch_kvcache(self, req, *args, **kwargs):
            rt = _prefetch_kvcache.runtime
            if getattr(getattr(self.tree_cache, "cache_controller", None), "storage_backend", None) is not None:
                rt.storage_trees.add(self.tree_cache)  # SGLang's own tree too, not only backend `vericache`
            result = start(self, req, *args, **kwargs)
            if req.cache_request_handle in getattr(self.tree_cache, "ongoing_prefetch", {}):
                rt.prefetching[req.rid] = req
                while len(rt.prefetching) > 4096:  # requests aborted while they waited
                    rt.prefetching.pop(next(iter(rt.prefetching)))
            return result

        return _prefetch_kvcache

    def make_check(check):
        def check_prefetch_progress(self, request):
            rt = check_prefetch_progress.runtime
            ongoing = getattr(self, "ongoing_prefetch", {}).get(request)
            operation = getattr(ongoing, "operation", None) if ongoing else None
            hits = getattr(operation, "storage_hit_count", 0)
            fetched = check(self, request)
            req = rt.prefetching.pop(request.rid, None) if fetched else rt.prefetching.get(request.rid)
            if req is not None:
                loaded = getattr(operation, "completed_tokens", 0) if fetched else 0
                started = getattr(operation, "start_time", None)
                for worker in list(rt.workers):
                    drafter = worker.speculator.fetch_drafter
                    if drafter is not None:
                        if loaded and started is not None:  # the prefetch's speed: when a tier entry is worth reading
                            drafter.observe_fetch(loaded, time.monotonic() - started)
                        drafter.poll(req, fetched, hits)
            return fetched

        return check_prefetch_progress

    def make_release(release):
        def _release_aborted_request(self, req, *args, **kwargs):
            result = release(self, req, *args, **kwargs)
            rt = _release_aborted_request.runtime
            rt.prefetching.pop(req.rid, None)
            for worker in list(rt.workers):
                drafter = worker.speculator.fetch_drafter
                if drafter is not None:
                    drafter.forget(req.rid)  # its seeded entry and draft buffers, now
            return result

        return _release_aborted_request

    patch(UnifiedRadixCache, "check_prefetch_progress", runtime, make_check)
    patch(Scheduler, "_prefetch_kvcache", runtime, make_prefetch)
    patch(Scheduler, "_release_aborted_request", runtime, make_release)


def install_internal_state(runtime: Runtime) -> None:
    """``/server_info`` (``Engine.get_server_info()``) ``internal_states[i]["vericache"]``: the
    worker's counters and gauges (the same numbers ``/metrics`` has with --enable-metrics);
    ``["vericache_kernels"]``: the head layout the GPU kernels were warmed for and what
    their start-up warm-up did (``draft``: ``off: ...`` once a draft kernel failed);
    ``["vericache_windows"]``: the model's sliding-window layers and how they draft;
    ``["vericache_memory"]``: how the KV budget was split (install_draft_memory_reserve);
    ``["vericache_preempted"]``: preempted requests whose KV stayed in the tree, and the
    tokens it newly kept (any engine)."""
    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController

    def make(original):
        def _add_speculative(self, state):
            original(self, state)
            rt = _add_speculative.runtime
            speculator = getattr(getattr(self.scheduler, "draft_worker", None), "speculator", None)
            if speculator is not None:
                if speculator.tier is not None:  # its threads count between iterations too
                    speculator.stats.tier(speculator.tier)
                speculator.stats.gauge("captured_query_requests", len(speculator.queries))
                state["vericache"] = speculator.stats.snapshot()
                state["vericache_kernels"] = dict(speculator.kernels)
                from sgl_vericache.kernels import draft_kernels_failed, verify_kernel_failed  # no triton, no CUDA

                for key, failure in (("draft", draft_kernels_failed()), ("verify", verify_kernel_failed())):
                    if failure is not None:  # a launch failed while serving: on torch since
                        state["vericache_kernels"][key] = f"off: {failure}"
                state["vericache_windows"] = dict(speculator.window_layers)
            if rt.draft_memory is not None:
                state["vericache_memory"] = rt.draft_memory.as_dict()
            # every engine, speculation on or off (see install_keep_preempted_kv)
            state["vericache_preempted"] = {"requests": rt.preempted_requests, "kept_tokens": rt.preempted_kept_tokens}

        return _add_speculative

    patch(SchedulerInternalStateController, "_add_speculative", runtime, make)
