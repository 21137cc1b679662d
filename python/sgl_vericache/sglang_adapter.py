"""The one module that reaches into SGLang internals (pinned: sglang==0.5.23).

Everything sgl_vericache needs from SGLang beyond its public entry points goes through
here, so a version bump is one file's work:

- ``VERICACHE`` registered as a speculative algorithm. It rides SGLang's NGRAM verify
  path (no draft model; a linear-chain TARGET_VERIFY pass over the full KV, SGLang's
  accept / sample / KV-move code), and replaces NGRAM's corpus lookup with drafting by
  the target model itself over the compressed KV.
- the draft attention backend (``_make_draft_backend``): the attention backend the draft forward passes use; it reads
  the compressed entries (``spec.drafter.CompressedKVStore``) and never writes the pool.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:
    from sgl_vericache.config import VeriCacheConfig

logger = logging.getLogger(__name__)

SPEC_ALGORITHM = "VERICACHE"
_registered = False


def register_all() -> None:
    """Run once per SGLang process by the plugin entry point."""
    global _registered
    if _registered:
        return
    _registered = True
    from sgl_vericache import cpu_compat

    cpu_compat.install()
    _register_spec_algorithm()
    _install_seeded_sampling()
    _install_cpu_hicache()
    _install_cpu_extend_attention()
    _register_radix_cache_backend()
    _install_tier_checksums()
    _install_draft_weights()
    _install_weight_update_hook()
    _install_internal_state()
    _install_deferred_rows()
    from sgl_vericache.config import VeriCacheConfig

    vc = VeriCacheConfig.from_env() or VeriCacheConfig()
    if vc.keep_preempted_kv:
        _install_keep_preempted_kv()
    if vc.deterministic:
        _install_row_invariant_forward()
    else:
        _install_cpu_linear(vc.cpu_linear)


def apply_vericache_flags(vc: "VeriCacheConfig", argv: list[str]) -> list[str]:
    """Translate our config into SGLang flags (the speculative algorithm and its width)."""
    if not vc.enable:
        return argv
    for flag in ("--speculative-algorithm", "--speculative-num-draft-tokens"):
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise ValueError(
                f"{flag} is set by VeriCache (use --vericache-draft-len); pass --no-vericache-enable "
                "to use another speculative algorithm"
            )
    extra = []
    if vc.full_device_budget >= 0:
        extra = _parking_flags(argv)
    return argv + extra + [
        "--speculative-algorithm", SPEC_ALGORITHM,
        "--speculative-num-draft-tokens", str(vc.draft_len + 1),
        "--speculative-ngram-max-bfs-breadth", "1",
        "--disable-overlap-schedule",
    ]


def _flag_value(argv: list[str], flag: str):
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _check_parking_args(backend, page_size) -> None:
    """--vericache-full-device-budget parks through the `vericache` radix backend's release
    hooks and rewrites one-token slots: refuse other backends and pages."""
    if backend != RADIX_BACKEND:
        raise ValueError(f"--vericache-full-device-budget needs --radix-cache-backend {RADIX_BACKEND}, "
                         f"not {backend!r}")
    if str(page_size) != "1":
        raise ValueError(f"--vericache-full-device-budget needs --page-size 1, not {page_size!r}")


def _parking_flags(argv: list[str]) -> list[str]:
    """The flags a server with a full-KV device budget needs (the radix backend, if unset)."""
    backend = _flag_value(argv, "--radix-cache-backend")
    _check_parking_args(backend or RADIX_BACKEND, _flag_value(argv, "--page-size") or 1)
    return [] if backend else ["--radix-cache-backend", RADIX_BACKEND]


def run_http_server(argv: list[str]) -> int:
    """Start SGLang's HTTP server with ``argv`` (SGLang flags only)."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(None, include_parent=False)
    return 0


# --- the speculative algorithm ------------------------------------------------------------


def _register_spec_algorithm() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

    if get_spec(SPEC_ALGORITHM) is not None:
        return

    class VeriCacheSpecAlgo(CustomSpecAlgo):
        # SGLang dispatches NGRAM's scheduling, relay and verify-input branches on
        # is_ngram(); VERICACHE has the same shape (no draft model, no draft KV,
        # linear chain verified by the target), so it takes those branches.
        def is_ngram(self) -> bool:
            return True

        def has_draft_kv(self) -> bool:
            return False

        # Called on every algorithm but missing from CustomSpecAlgo in 0.5.23.
        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def get_platform_worker_cls(self):
            return None

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                              needs_confidence_relay=False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

        def handle_server_args(self, server_args) -> None:
            from sglang.srt.arg_groups.speculative_hook import _handle_ngram

            _handle_ngram(server_args)

    SpeculativeAlgorithm.register(
        SPEC_ALGORITHM, spec_class=VeriCacheSpecAlgo, supports_overlap=False
    )(lambda server_args: _worker_class())


_WORKER_CLASS = None


def _worker_class():
    global _WORKER_CLASS
    if _WORKER_CLASS is None:
        _WORKER_CLASS = _build_worker_class()
    return _WORKER_CLASS


class _NoCorpus:
    """Stands in for NGRAM's n-gram corpus; departing requests release their entries."""

    def __init__(self, on_departed):
        self._on_departed = on_departed

    def synchronize(self):
        pass

    def reset(self):
        pass

    def batch_put(self, *_):
        pass

    def erase_match_state(self, rids):
        self._on_departed(rids)


def _build_worker_class():
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.runtime_context import get_device, get_memory, get_observability, get_schedule, get_spec
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from sgl_vericache.config import VeriCacheConfig, request_config
    from sgl_vericache.cpu_linear import weights_generation

    class VeriCacheWorker(NGRAMWorker):
        def __init__(self, server_args, gpu_id, nccl_port, target_worker, **_):
            BaseSpecWorker.__init__(self)
            self.server_args = server_args
            self.enable_overlap = not get_schedule().disable_overlap_schedule
            self._target_worker = target_worker
            self.model_runner = target_worker.model_runner
            self.page_size = get_schedule().page_size
            self.draft_token_num = get_spec().speculative_num_draft_tokens
            self.speculative_num_draft_tokens = self.draft_token_num
            self.max_trie_depth = 1
            self.topk = 1
            self.speculative_num_steps = self.draft_token_num
            self.device = get_device().device
            self.adaptive_controller = None
            self._prev_decode_rids = set()
            self.grammar_tree_host = None
            self.vc = VeriCacheConfig.from_env() or VeriCacheConfig()
            self.store = _build_store(self.vc, self.model_runner)
            self.prefix_cache = _build_prefix_cache(self.vc)
            self._reqs = {}  # rid -> Req, to file its compressed entry by token ids when it departs
            self._weights_gen = weights_generation()
            self._plans = {}  # rid -> (compressor, draft_len) for this request
            self._queries = {}  # rid -> per-layer last prompt queries, until compressed
            self._compressors = {}  # VeriCacheConfig -> compressor (shared, stateless)
            self.ngram_corpus = _NoCorpus(self._release_departed)
            self._draft_backend = None
            self._verify_backend = None
            self._round = None  # this round's sampled-draft state (_SampledRound), if any
            self._rng = torch.Generator(device="cpu").manual_seed(int(server_args.random_seed or 0))
            self.stats = _Stats(get_observability().enable_metrics)
            self.draft_weights = _build_draft_weights(self.vc.draft_weights, self.model_runner)
            self.parking = None  # FullKVParking, built at the first round when a budget is set
            self._waited = {}  # rid -> rounds in a row it drafted without verifying (staggered verifies)
            self._deferred = ()  # batch rows that draft but do not verify this round
            self._queued_rows = ()  # batch rows whose drafts this round were made while they waited
            # Drafting while SGLang fetches a waiting request's prefix from a storage tier.
            self.fetch_drafter = None
            self.tier = None  # CompressedTier: evicted compressed entries in the storage tier
            if self.vc.fetch_draft_tokens > 0 and self.prefix_cache is not None:
                self.fetch_drafter = _FetchDrafter(self)
                _install_fetch_drafting()
            # attached at the first forward or fetch-draft poll (SGLang's tree exists by then)
            self._tier_pending = self.fetch_drafter is not None
            if self.vc.full_device_budget >= 0:
                _check_parking_args(get_memory().radix_cache_backend, self.page_size)
            _install_verify_sampler()
            if self.vc.full_device_budget >= 0:
                _install_narrowed_verify(self)
            _LIVE_WORKERS.add(self)

        def check_integrity(self):
            """The compressed side: every request's entry and the prefix cache's tree."""
            self.store.check_integrity()
            if self.parking is not None:
                self.parking.check_integrity()
                if self.parking.parked:
                    raise CacheIntegrityError(f"{len(self.parking.parked)} parked requests at an idle point")
            if self.prefix_cache is not None:
                self.prefix_cache.check_integrity()

        def alloc_memory_pool(self, **kwargs):
            super().alloc_memory_pool(**kwargs)
            # NGRAM sizes its verify buffers for one fixed width; keep one set per width
            # so that a round verifies only as many tokens as its longest draft needs.
            self.max_width = self.draft_token_num
            before = dict(vars(self))
            self._init_preallocated_tensors()
            names = [k for k, v in vars(self).items() if before.get(k) is not v]
            self._width_buffers = {self.max_width: {k: getattr(self, k) for k in names}}

        def _set_width(self, width):
            """Verify ``width`` tokens per request this round (root + drafts)."""
            buffers = self._width_buffers.get(width)
            if buffers is None:
                names = list(self._width_buffers[self.max_width])
                self.draft_token_num = width
                self._init_preallocated_tensors()
                buffers = self._width_buffers[width] = {k: getattr(self, k) for k in names}
            for name, value in buffers.items():
                setattr(self, name, value)
            self.draft_token_num = self.speculative_num_draft_tokens = width

        def _round_width(self, batch):
            return min(self.max_width, 1 + max(draft_len for _, draft_len in map(self._plan, batch.reqs)))

        def attach_tier(self):
            """The storage tier behind the compressed prefix cache, once SGLang's tree exists."""
            if self._tier_pending:
                self._tier_pending = False
                self.tier = _attach_compressed_tier(self)

        def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
            self.attach_tier()
            is_round = batch.forward_mode.is_decode()
            width = self._round_width(batch) if is_round else self.max_width
            self._set_width(width)
            try:
                result = self._forward(batch, on_publish, pp_proxy_tensors)
            finally:
                self._set_width(self.max_width)
            if width != self.max_width and result.next_draft_input is not None:
                _widen_draft_input(result.next_draft_input, len(batch.reqs), width, self.max_width)
            return result

        def _forward(self, batch, on_publish, pp_proxy_tensors):
            # SGLang's CPU attention (torch_native) has no TARGET_VERIFY path: run the
            # whole iteration with a backend that adds one and delegates the rest.
            if self._verify_backend is None:
                self._verify_backend = _make_verify_backend(self.model_runner, self.vc.deterministic)
            capture = batch.forward_mode.is_extend() and self._needs_queries(batch)
            self._verify_backend.capture = self._queries if capture else None
            self._verify_backend.capture_rids = [req.rid for req in batch.reqs] if capture else None
            global _ACTIVE_WORKER
            is_round = batch.forward_mode.is_decode()
            _ACTIVE_WORKER = self
            t0 = time.perf_counter()
            try:
                with forward_context(ForwardContext(attn_backend=self._verify_backend)):
                    result = super().forward_batch_generation(batch, on_publish, pp_proxy_tensors)
            finally:
                _ACTIVE_WORKER = None
                self._round = None
                deferred, self._deferred = set(self._deferred), ()
                self._verify_backend.skip_rows = ()
                if self.parking is not None:
                    self.parking.finish()
            if is_round and result.accept_lens is not None:
                lens = result.accept_lens.tolist()
                self.stats.verified(time.perf_counter() - t0, [n for i, n in enumerate(lens) if i not in deferred])
                self.stats.add("deferred_rows", len(deferred))
                for i, req in enumerate(batch.reqs):
                    self._waited[req.rid] = self._waited.get(req.rid, 0) + 1 if i in deferred else 0
                self.stats.add("fetch_draft_accepted", sum(lens[i] - 1 for i in self._queued_rows))
            self._queued_rows = ()
            self.stats.end_iteration()
            if self.tier is not None:
                self.stats.tier(self.tier)
            return result

        def _parking(self):
            if self.parking is None:
                self.parking = _build_parking(self.model_runner)
                self.parking.reserve_limit = self.vc.full_device_budget
            return self.parking

        def _verifying_rows(self, batch, verified):
            """Staggered verifies under a full-KV device budget: which rows verify this
            round. Requests that waited longest go first; one verifies when its own full KV
            (``[cache_protected_len, verified)``) fits in what is left of the budget, and the
            first always does, so every round makes progress and no request starves. The
            others draft, stay parked and emit nothing this round. Without a budget, and in
            batches that return logprobs or follow a grammar (SGLang's bookkeeping for those
            expects a token per row), every row verifies."""
            bs = len(batch.reqs)
            if self.vc.full_device_budget < 0 or batch.return_logprob or batch.has_grammar:
                return [True] * bs
            own = [n - req.kv.cache_protected_len for req, n in zip(batch.reqs, verified)]
            order = sorted(range(bs), key=lambda i: -self._waited.get(batch.reqs[i].rid, 0))
            left, chosen = self.vc.full_device_budget, [False] * bs
            for k, i in enumerate(order):
                if k == 0 or own[i] <= left:
                    chosen[i] = True
                    left = max(0, left - own[i])
            return chosen

        def _stage_full_kv(self, batch, verified, verifying):
            """At a round's start (compressed entries already synced): park the own full KV
            of rows that do not verify this round, give the parked rows that do their slots
            back and start copying their KV in, layer by layer, while the drafts run;
            verify waits per layer."""
            parking = self._parking()
            rows = batch.req_pool_indices.tolist()
            for i, req in enumerate(batch.reqs):
                if not verifying[i] and not parking.is_parked(req.rid):
                    parking.park(req.rid, rows[i], req.kv.cache_protected_len, verified[i])
            parking.start_loads({req.rid: rows[i] for i, req in enumerate(batch.reqs) if verifying[i]})
            self._park_stats()

        def _park_stats(self):
            s = self.parking.stats
            for name, total in (("full_kv_parked_tokens", s.parked_tokens), ("full_kv_loaded_tokens", s.loaded_tokens),
                                ("full_kv_bytes_to_host", s.bytes_to_host),
                                ("full_kv_bytes_to_device", s.bytes_to_device),
                                ("full_kv_wait_seconds", s.wait_seconds),
                                ("full_kv_copy_seconds", s.load_seconds),
                                ("full_kv_parks", s.parks), ("full_kv_parks_in_host_pool", s.parks_in_host_pool)):
                self.stats.add(name, total - self.stats.totals[name])

        def verify_sample(self, verify_input, batch, logits_output, grammar_mask):
            """Acceptance for a batch that samples (see ``_sample_verify``)."""
            return _sample_verify(self, verify_input, batch, logits_output, grammar_mask)

        def _needs_queries(self, batch):
            return any(self._plan(req)[0].needs_queries for req in batch.reqs)

        def _release_departed(self, rids):
            for rid in rids:
                self._file_prefix(rid)
                self.store.release(rid)
                self._plans.pop(rid, None)
                self._queries.pop(rid, None)
                self._waited.pop(rid, None)
                if self.fetch_drafter is not None:
                    self.fetch_drafter.queue.drop(rid)

        def _plan(self, req):
            """(compressor, draft_len) for a request; bad overrides abort it with a 400."""
            plan = self._plans.get(req.rid)
            if plan is None:
                try:
                    cfg = request_config(req.sampling_params.custom_params, self.vc)
                    key = (cfg.compressor, cfg.ratio, cfg.compressor_options)
                    if key not in self._compressors:
                        self._compressors[key] = cfg.build_compressor()
                    plan = (self._compressors[key], cfg.draft_len)
                except ValueError as exc:
                    req.to_finish = FINISH_ABORT(str(exc), 400, "BadRequestError")
                    plan = (self.store.compressor, 1)
                self._plans[req.rid] = plan
            return plan

        def _file_prefix(self, rid):
            """Keep a departing request's compressed entry for requests that extend its tokens."""
            req = self._reqs.pop(rid, None)
            have = self.store.entry(rid)
            if self.prefix_cache is None or req is None or have is None or self._weights_changed():
                return
            compressor, layers, n = have
            self.prefix_cache.insert(_kv_tokens(req, n), compressor, layers)
            self.stats.prefix_cache(self.prefix_cache)

        def _weights_changed(self):
            """Weights updated in place since the entries were made: they are stale."""
            if self._weights_gen == weights_generation():
                return False
            self._weights_gen = weights_generation()
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            return True

        def clear_cache_pool(self):
            self.store.clear()
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            self._reqs.clear()
            self._prev_decode_rids = set()
            if self.fetch_drafter is not None:
                self.fetch_drafter.clear()

        def _update_ngram_corpus(self, batch):
            pass

        def _prepare_draft_tokens(self, batch):
            bs = len(batch.reqs)
            n = self.draft_token_num
            verified = batch.seq_lens_cpu.tolist()
            plans = [self._plan(req) for req in batch.reqs]
            # NGRAM reports requests that left the decode batch after this round's verify;
            # file theirs now, so that a request extending one (the next turn) finds it.
            departed = self._prev_decode_rids - {req.rid for req in batch.reqs}
            if departed:
                self._release_departed(departed)
            self._sync_store(batch, verified, plans)
            verifying = self._verifying_rows(batch, verified)
            if self.vc.full_device_budget >= 0:
                self._stage_full_kv(batch, verified, verifying)
            self._deferred = tuple(i for i, v in enumerate(verifying) if not v)
            self._verify_backend.skip_rows = frozenset(self._deferred)
            roots = [_last_token(req) for req in batch.reqs]
            steps = max(draft_len for _, draft_len in plans)
            queued = self._queued_drafts(batch, plans, verifying)
            t0 = time.perf_counter()
            drafts = self._draft(batch, roots, verified, steps, queued)  # [bs, steps]
            self.stats.drafted(time.perf_counter() - t0, sum(d for (_, d), v in zip(plans, verifying) if v))
            drafts = _pad_drafts(drafts, [draft_len for _, draft_len in plans], n - 1)
            tokens = np.concatenate([np.asarray(roots, dtype=np.int64)[:, None], drafts], axis=1)
            chain = np.tril(np.ones((n, n), dtype=bool))
            mask = np.broadcast_to(chain, (bs, n, n)).reshape(-1).copy()
            return tokens.reshape(-1), mask

        def _kv_reader(self, row):
            """``read_kv(layer, start, end)`` over one request-to-token row of the full pool."""
            pool = self.model_runner.token_to_kv_pool
            slots_row = self.model_runner.req_to_token_pool.req_to_token[row]

            def read_kv(layer_id, start, end):
                slots = slots_row[start:end].to(torch.int64)
                return pool.get_key_buffer(layer_id)[slots], pool.get_value_buffer(layer_id)[slots]

            return read_kv

        def _sync_store(self, batch, verified, plans):
            pool_rows = batch.req_pool_indices.tolist()
            for i, req in enumerate(batch.reqs):
                read_kv = self._kv_reader(pool_rows[i])

                queries = None
                if req.rid not in self.store:
                    queries = _layer_queries(self._queries.pop(req.rid, None), self.store.num_layers)
                    self._seed_from_prefix(req, verified[i], plans[i][0], read_kv)
                self.store.sync(req.rid, verified[i], read_kv, compressor=plans[i][0], queries=queries)

        def _seed_from_prefix(self, req, verified, compressor, read_kv):
            """A new request whose verified tokens start with a cached prefix takes its
            compressed entry; sync() then compresses only the rest. Where SGLang's radix
            tree gave the request a longer shared prefix (a system prompt other requests
            also start with), the entry is first brought to that prefix and filed there,
            so later requests sharing it start from it (not for methods that choose keys
            from the prompt's last queries: a prefix has no queries of its own here)."""
            self._reqs[req.rid] = req
            if self.prefix_cache is None:
                return
            self._weights_changed()
            tokens = _kv_tokens(req, verified)
            n, layers = self.prefix_cache.match(tokens, compressor)
            if n:
                self.store.seed(req.rid, compressor, layers, n)
            shared = min(getattr(req, "cached_tokens", 0) or 0, verified)
            if shared > n and not compressor.needs_queries:
                self.store.sync(req.rid, shared, read_kv, compressor=compressor)
                self.prefix_cache.insert(tokens[:shared], compressor, self.store.entry(req.rid)[1])
            self.stats.prefix_cache(self.prefix_cache)

        def _queued_drafts(self, batch, plans, verifying):
            """Rows (verifying this round, in an all-greedy batch) whose drafts were made
            ahead while their prefix was fetched: row -> its drafts for this round."""
            if self.fetch_drafter is None or not len(self.fetch_drafter.queue) \
                    or not batch.sampling_info.is_all_greedy:
                return {}
            queued = {}
            for i, req in enumerate(batch.reqs):
                if verifying[i] and req.rid in self.fetch_drafter.queue:
                    tokens = self.fetch_drafter.queue.take(req.rid, req.output_ids, plans[i][1])
                    if tokens:
                        queued[i] = tokens
            self.stats.add("fetch_draft_rounds", len(queued))
            self._queued_rows = tuple(queued)
            return queued

        def _draft(self, batch, roots, verified, steps, queued=None):
            bs = len(batch.reqs)
            if self._draft_backend is None:
                self._draft_backend = _make_draft_backend(self.model_runner, self.store)
            info = batch.sampling_info
            # Rows deferred this round (staggered verifies) draft nothing; rows with drafts
            # made ahead (queued) take those.
            queued = queued or {}
            deferred = set(self._deferred)
            keep = [i for i in range(bs) if i not in deferred and i not in queued]
            drafts = np.repeat(np.asarray(roots, dtype=np.int64)[:, None], steps, axis=1)  # deferred: unused
            for i, tokens in queued.items():
                drafts[i, :len(tokens)] = tokens
                drafts[i, len(tokens):] = tokens[-1]
            if not keep:
                return drafts
            self.store.begin_round([batch.reqs[i].rid for i in keep], steps)
            fb = ForwardBatch.init_new(batch, self.model_runner, return_hidden_states_before_norm=False)
            fb.forward_mode = ForwardMode.DECODE
            fb.out_cache_loc = None
            if len(keep) < bs:
                _narrow_rows(fb, keep, bs)
            tokens = torch.tensor([roots[i] for i in keep], dtype=torch.int64, device=self.device)
            base = torch.tensor([verified[i] for i in keep], dtype=torch.int64, device=self.device)
            out = torch.empty((len(keep), steps), dtype=torch.int64)
            self._round = None if info.is_all_greedy else _SampledRound(self, batch, keep)
            global _DRAFT_WEIGHTS, _DRAFTING
            _DRAFT_WEIGHTS, _DRAFTING = self.draft_weights, True
            try:
                with forward_context(ForwardContext(attn_backend=self._draft_backend), forward_batch=fb):
                    self._draft_steps(fb, tokens, base, out, steps)
            finally:
                _DRAFT_WEIGHTS, _DRAFTING = None, False
            if len(keep) == bs:
                return out.numpy()
            drafts[keep] = out.numpy()
            return drafts

        def _draft_steps(self, fb, tokens, base, out, steps):
            for step in range(steps):
                fb.input_ids = tokens
                fb.positions = base + step
                logits = self.model_runner.forward(fb).logits_output.next_token_logits
                if self.draft_weights is not None:  # an fp16 overflow must not reach the sampler
                    logits = torch.nan_to_num(logits)
                if self._round is None:
                    tokens = torch.argmax(logits, dim=-1)
                else:
                    tokens = self._round.draw(logits, fb.positions)
                out[:, step] = tokens.cpu()

    return VeriCacheWorker


def _narrow_rows(fb, keep: list, bs: int, width: int = 1) -> None:
    """A decode (``width`` 1) or target-verify (``width`` tokens a row) ForwardBatch of ``bs``
    rows -> the rows ``keep``, in place: every per-row tensor and list (leading dimension
    ``bs``) and every per-token tensor (leading dimension ``bs * width``: input ids,
    positions, KV write slots) is indexed, ``batch_size``, ``seq_lens_sum`` and the count of
    real tokens follow. The draft passes narrow to the rows that verify (their attention
    reads only the compressed entries, row order: the store's round); the verify forward
    too (``_install_narrowed_verify``)."""
    import dataclasses

    import torch

    idx = torch.tensor(keep, dtype=torch.int64)
    tok = (idx[:, None] * width + torch.arange(width)).reshape(-1)
    for f in dataclasses.fields(fb):
        value = getattr(fb, f.name)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == bs:
            setattr(fb, f.name, value[idx.to(value.device)])
        elif width > 1 and isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == bs * width:
            setattr(fb, f.name, value[tok.to(value.device)])
        elif isinstance(value, list) and len(value) == bs:
            setattr(fb, f.name, [value[i] for i in keep])
    fb.batch_size = len(keep)
    if fb.seq_lens_cpu is not None:
        fb.seq_lens_sum = int(fb.seq_lens_cpu.sum())
    real = getattr(fb, "num_token_non_padded", None)
    if isinstance(real, torch.Tensor) and real.dim() == 0:
        fb.num_token_non_padded = torch.tensor(len(keep) * width, dtype=real.dtype, device=real.device)
    if getattr(fb, "num_token_non_padded_cpu", None) is not None:
        fb.num_token_non_padded_cpu = len(keep) * width


def _install_narrowed_verify(worker) -> None:
    """Staggered verifies: run a round's verify forward over the rows that verify only. A
    deferred row's logits are never used (it accepts 0 tokens), so projections, MLP and LM
    head over its draft block were wasted work. SGLang builds the verify
    ForwardBatch inside its worker, so the model runner's ``forward`` is wrapped for this
    worker's runner: a target-verify batch with deferred rows is run as a narrowed copy,
    and the logits are laid back out over every row (deferred rows' left at 0, never
    sampled). Logprob batches (no deferred rows there) and CUDA-graph runners (fixed
    shapes) run whole."""
    import copy

    import torch

    runner = worker.model_runner
    original = runner.forward
    graphs = not getattr(worker.server_args, "disable_cuda_graph", True)

    def forward(forward_batch, *args, **kwargs):
        deferred = worker._deferred
        if not deferred or graphs or not forward_batch.forward_mode.is_target_verify():
            return original(forward_batch, *args, **kwargs)
        bs = forward_batch.batch_size
        width = forward_batch.input_ids.shape[0] // bs
        skipped = set(deferred)
        keep = [i for i in range(bs) if i not in skipped]
        narrow = copy.copy(forward_batch)
        _narrow_rows(narrow, keep, bs, width)
        mask = getattr(forward_batch.spec_info, "custom_mask", None)
        if mask is not None and mask.numel() == bs * width * width:
            narrow.spec_info = copy.copy(forward_batch.spec_info)
            narrow.spec_info.custom_mask = mask.reshape(bs, -1)[torch.tensor(keep, device=mask.device)].reshape(-1)
        backend = worker._verify_backend
        skip, backend.skip_rows = backend.skip_rows, ()  # row numbers of the whole batch
        try:
            out = original(narrow, *args, **kwargs)
        finally:
            backend.skip_rows = skip
        logits = out.logits_output
        rows = torch.tensor(keep, device=logits.next_token_logits.device)
        for name, value in list(vars(logits).items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == len(keep) * width:
                whole = value.new_zeros((bs, width) + tuple(value.shape[1:]))
                whole[rows] = value.reshape((len(keep), width) + tuple(value.shape[1:]))
                setattr(logits, name, whole.reshape((bs * width,) + tuple(value.shape[1:])))
        worker.stats.add("verify_rows_skipped", len(deferred))
        return out

    runner.forward = forward


def _build_draft_weights(mode: str, model_runner):
    """The draft passes' weight copies (None: the model's own), checked against the device."""
    from sgl_vericache.spec.draft_weights import DraftWeights, resolve_mode

    mode, max_rows = resolve_mode(mode, model_runner.model_config.dtype)
    logger.info("VeriCache draft weights: %s%s", mode, "" if max_rows is None else f" up to {max_rows} rows per product")
    if mode == "model":
        return None
    model_linear = _PACKED_LINEAR.linear if _PACKED_LINEAR is not None else None
    weights = DraftWeights(mode, max_rows, model_linear) if model_linear else DraftWeights(mode, max_rows)
    weights.check_device(model_runner.device)
    return weights


def _attach_compressed_tier(worker):
    """Behind the worker's compressed prefix cache, the HiCache storage tier SGLang runs
    (when it has one VeriCache can write blobs to): evicted entries go there, for drafting
    while a request's full prefix streams in from the same tier. None without one."""
    from sgl_vericache.mem_cache.compressed_tier import CompressedTier

    tree = next(iter(_TREE_CACHES), None) or next(iter(_STORAGE_TREES), None)
    backend = getattr(getattr(tree, "cache_controller", None), "storage_backend", None)
    blobs = _blob_store(backend) if backend is not None else None
    if blobs is None:
        if backend is not None:
            logger.info("VeriCache: compressed entries stay on the device: the storage backend %s takes no blobs",
                        type(backend).__name__)
        return None
    tier = CompressedTier(blobs)

    def spill(tokens, key, layers):  # entries of other weights never come back: the key says which
        return tier.spill(tokens, _tier_key(worker, key), layers)

    worker.prefix_cache.spill = spill
    logger.info("VeriCache: compressed entries evicted from the prefix cache go to the storage tier (%s)",
                type(blobs).__name__)
    return tier


def _tier_key(worker, compressor):
    """What names a compressed entry in the storage tier besides its tokens: the compressor,
    the weights' generation and the model (the tier outlives this process, and other engines
    may share it), so an entry is only ever read back by a drafter that made the same kind."""
    cfg = worker.model_runner.model_config
    model = (getattr(cfg, "model_path", ""), str(cfg.dtype), cfg.num_hidden_layers,
             cfg.get_total_num_kv_heads() if hasattr(cfg, "get_total_num_kv_heads") else None,
             getattr(cfg, "head_dim", None))
    return compressor, worker._weights_gen, model


class _FileBlobs:
    """Blobs in SGLang's file storage backend (a file each, beside its pages; reads through
    the backend's ``batch_get``, so a throttled subclass throttles them too)."""

    def __init__(self, backend):
        self.backend = backend

    def put(self, key, data):
        import torch

        return bool(self.backend.set(key, torch.frombuffer(bytearray(data), dtype=torch.uint8)))

    def get(self, key, nbytes):
        import torch

        if nbytes <= 0 or not self.backend.exists(key):  # index probes miss often: no warning for each
            return None
        (page,) = self.backend.batch_get([key], [torch.empty(nbytes, dtype=torch.uint8)])
        return None if page is None else page.numpy().tobytes()


class _MooncakeBlobs:
    """Blobs in Mooncake's store (``put`` / ``get`` of bytes, beside SGLang's zero-copy pages)."""

    def __init__(self, store):
        self.store = store

    def put(self, key, data):  # keys name their content (a digest): one already there is this entry
        return self.store.put(key, data) == 0 or self.store.is_exist(key) == 1

    def get(self, key, nbytes):
        data = self.store.get(key)
        return data or None


def _blob_store(backend):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageFailureInjector

    core = backend
    for _ in range(4):  # under VeriCache's page checksums and SGLang's fault injector
        if isinstance(core, HiCacheStorageFailureInjector):
            core = core._backend
        elif _checked_cls is not None and isinstance(core, _checked_cls):
            core = core.inner
        else:
            break
    if isinstance(core, HiCacheFile):
        return _FileBlobs(core)
    if type(core).__name__ == "MooncakeStore" and hasattr(getattr(core, "store", None), "put"):
        return _MooncakeBlobs(core.store)
    return None


def _build_prefix_cache(vc: "VeriCacheConfig"):
    from sgl_vericache.mem_cache.compressed_prefix import CompressedPrefixCache

    return CompressedPrefixCache(vc.compressed_cache_mb << 20) if vc.compressed_cache_mb > 0 else None


def _kv_tokens(req, n: int) -> list[int]:
    """The first ``n`` tokens of a request whose KV is in the cache (prompt, then output)."""
    tokens = list(req.origin_input_ids[:n])
    if len(tokens) < n:
        tokens += list(req.output_ids[: n - len(tokens)])
    return tokens


def _build_store(vc: "VeriCacheConfig", model_runner):
    from sgl_vericache.spec.drafter import CompressedKVStore

    return CompressedKVStore(vc.build_compressor(), model_runner.model_config.num_hidden_layers)


# Prompt queries kept per request and layer for query-aware compressors (SnapKV votes
# with the last window_size of them; H2O accumulates attention over all it is given).
MAX_CAPTURED_QUERIES = 512


def _layer_queries(captured, num_layers):
    if captured is None:
        return None
    return [captured.get(layer_id) for layer_id in range(num_layers)]


def _capture_queries(backend, q, layer, forward_batch):
    """Keep the trailing prompt queries of each request in an extend batch."""
    import torch

    q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)  # [tokens, H_q, D]
    lens = forward_batch.extend_seq_lens_cpu
    lens = lens.tolist() if hasattr(lens, "tolist") else list(lens)
    start = 0
    for rid, n in zip(backend.capture_rids, lens):
        per_layer = backend.capture.setdefault(rid, {})
        prev = per_layer.get(layer.layer_id)
        new = q[start : start + n].detach().clone()
        joined = new if prev is None else torch.cat([prev, new])
        per_layer[layer.layer_id] = joined[-MAX_CAPTURED_QUERIES:]
        start += n


def _widen_draft_input(info, bs: int, width: int, max_width: int) -> None:
    """A round verified at ``width`` < the server's: the result's next-round input keeps
    SGLang's fixed row stride (``max_width``), which batch filtering and merging assume;
    the result's own output tokens stay at the round's stride, as the result says."""
    import torch

    tokens = info.accept_tokens.reshape(bs, width)
    padded = torch.zeros((bs, max_width), dtype=tokens.dtype, device=tokens.device)
    padded[:, :width] = tokens
    info.accept_tokens = padded.flatten()
    info.draft_token_num = info.num_tokens_per_req = info.num_tokens_for_logprob_per_req = max_width


def _pad_drafts(drafts: np.ndarray, draft_lens: list[int], width: int) -> np.ndarray:
    """[bs, steps] drafts -> [bs, width]: a request's tokens past its own draft length
    repeat its last real draft token. Padding is verified like any draft token, so it
    can never change the output; it only fills the round's verify width (the batch's
    longest draft + 1)."""
    bs = drafts.shape[0]
    out = np.empty((bs, width), dtype=np.int64)
    for i, draft_len in enumerate(draft_lens):
        out[i, :draft_len] = drafts[i, :draft_len]
        out[i, draft_len:] = drafts[i, draft_len - 1]
    return out


def _last_token(req) -> int:
    return int(req.output_ids[-1]) if len(req.output_ids) else int(req.origin_input_ids[-1])


def _make_draft_backend(model_runner, store):
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    class _DraftAttentionBackend(AttentionBackend):
        """Decode-only attention over the compressed entries; never writes the KV pool."""

        def __init__(self):
            super().__init__()
            self.req_to_token_pool = model_runner.req_to_token_pool
            self.token_to_kv_pool = model_runner.token_to_kv_pool
            self.device = model_runner.device
            self.tokens_of_one = False  # True: the rows are consecutive tokens of one request (attend_tokens)

        def init_forward_metadata(self, forward_batch):
            pass

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
            attend = store.attend_tokens if self.tokens_of_one else store.attend
            out = attend(
                layer.layer_id,
                q.reshape(-1, hq, d),  # [bs, H_q, D], row b = batch.reqs[b] (begin_round's order)
                k.reshape(-1, hkv, d),
                v.reshape(-1, hkv, layer.v_head_dim),
                layer.scaling,
            )
            return out.reshape(-1, hq * layer.v_head_dim)

        def forward_extend(self, *args, **kwargs):
            raise RuntimeError("VeriCache draft attention runs decode steps only")

    return _DraftAttentionBackend()


class _FetchJob:
    """One waiting request's drafting: its prompt past the compressed prefix teacher-forced
    (``forced``, from position ``start``), then free drafting; ``drafts[j]`` predicts output
    position ``j``."""

    def __init__(self, req, compressor, tokens, wanted, forward_batch):
        self.req, self.compressor, self.tokens, self.wanted = req, compressor, tokens, wanted
        self.fb = forward_batch
        self.step = 0
        self.next = None  # the last step's argmax: the next step's input once forcing is done
        self.drafts = []
        self.polled = time.monotonic()
        # A Future of an entry read back from the storage tier, until seeded: its layers
        # (``entry_len`` tokens, a stub's read) or (length, layers) (``entry_len`` None, an
        # index lookup); ``fallback``: (length, layers) from the prefix cache if it finds none.
        self.entry, self.entry_len, self.fallback = None, None, None
        self.place(0)

    def place(self, n: int) -> None:
        """Draft from a compressed entry of the first ``n`` prompt tokens."""
        self.start, self.forced = n, self.tokens[n:]
        self.steps = len(self.tokens) - n + self.wanted - 1
        fb = self.fb
        fb.seq_lens, fb.positions, fb.seq_lens_sum = fb.seq_lens * 0 + n + 1, fb.positions * 0 + n, n + 1
        fb.seq_lens_cpu = fb.seq_lens_cpu * 0 + n + 1

    def arrived(self):
        """(length, layers) of the entry read from the tier (its Future done), or None."""
        result = self.entry.result()
        if result is not None and self.entry_len is not None:
            result = (self.entry_len, result)
        return result


class _FetchDrafter:
    """Drafting for requests SGLang holds back while their prefix streams in from a HiCache
    storage tier (the paper's remote prefix reuse).

    SGLang admits a request whose prefix is being prefetched from storage only once the
    prefetch is done; until then the scheduler polls it every iteration. At each poll (see
    ``_install_fetch_drafting``) this drafts for it for about ``STEP_SECONDS``: the prefix's
    compressed entry (VeriCache's compressed prefix cache keeps entries after the full KV
    left the device and host, the eviction order the tiers promise) seeds a draft store of
    its own (an entry the cache sent on to the storage tier is read back first, on the
    tier's reader thread, and one this process never held is looked up in the tier's index
    there: polls until it arrives draft nothing); the prompt's tokens past
    the entry are fed one by one through draft attention
    (teacher forcing: their provisional KV lives in that store's round buffer only), then it
    drafts freely, up to ``--vericache-fetch-draft-tokens``. When the prefetch completes the
    drafts made so far are queued (``DraftQueue``) and the request is admitted as usual:
    SGLang prefills the rest of its prompt over the fetched full KV, and its first decode
    rounds verify the queued drafts instead of drafting. Greedy requests only (a sampled
    round needs the draft distributions of its own draws); one waiting request at a time.
    Drafts are verify candidates only: output never changes."""

    STEP_SECONDS = 0.02  # drafting per poll, so that a finished fetch is seen soon
    MAX_FORCED = 512  # prompt tokens past the compressed prefix it teacher-forces at most
    STALE_SECONDS = 0.5  # a job whose request stopped being polled (admitted elsewhere, aborted) is dropped

    def __init__(self, worker):
        from sgl_vericache.spec.draft_queue import DraftQueue
        from sgl_vericache.spec.drafter import CompressedKVStore

        self.worker = worker
        self.store = CompressedKVStore(worker.store.compressor, worker.store.num_layers)
        self.backend = None  # built at the first job: the model runner's pools exist by then
        self.queue = DraftQueue()
        self.job = None
        self._passed = set()  # rids polled and found unable to draft (no prefix entry, sampled, ...)
        from sgl_vericache.mem_cache.compressed_tier import Throughput

        self.full_speed = Throughput()  # of SGLang's storage prefetches: when a tier entry is worth reading
        self._bytes_per_token = None

    def observe_fetch(self, tokens: int, seconds: float) -> None:
        """SGLang's prefetch of ``tokens`` of full KV from the storage tier took ``seconds``."""
        self.full_speed.observe(tokens * self.bytes_per_token(), seconds)

    def bytes_per_token(self) -> int:
        """Bytes of full KV per token on this worker (every layer's keys and values); 0 if its
        pool has no per-layer buffers to measure."""
        if self._bytes_per_token is None:
            pool = self.worker.model_runner.token_to_kv_pool
            bufs = list(getattr(pool, "k_buffer", ()) or ()) + list(getattr(pool, "v_buffer", ()) or ())
            self._bytes_per_token = sum(b[0].numel() * b.element_size() for b in bufs if b.dim() > 0 and len(b))
        return self._bytes_per_token

    def _worth_reading(self, stub, hit_tokens: int) -> bool:
        """Whether reading ``stub``'s entry back from the tier leaves time to draft before the
        ``hit_tokens`` of full KV the storage holds for the prefix have streamed in."""
        from sgl_vericache.mem_cache.compressed_tier import worth_reading

        w = self.worker
        if stub.layers is not None:  # its write is still in flight: read from memory, no I/O
            return True
        per_token = self.bytes_per_token()
        if not per_token:  # cannot estimate: read, as without the rule
            return True
        return worth_reading(stub.nbytes, hit_tokens * per_token, w.tier.read_speed, self.full_speed,
                             w.vc.fetch_draft_tier_fraction)

    def poll(self, req, fetched: bool, hit_tokens: int) -> None:
        """The scheduler looked at waiting ``req``; ``fetched``: its prefetch is done;
        ``hit_tokens``: what the storage tier said it holds of the prefix (0 until its
        existence query answered: a request whose prefix is not there is not drafted for)."""
        if fetched:
            self._passed.discard(req.rid)
            if self.job is not None and self.job.req is req:
                self._finish()
            return
        job = self.job
        if job is not None and job.req is not req:
            if time.monotonic() - job.polled < self.STALE_SECONDS and not job.req.finished():
                return  # drafting for another waiting request
            self._finish()
            job = None
        if job is None:
            if req.rid in self._passed or hit_tokens <= 0:
                return
            self.worker.attach_tier()  # a new engine's first request may come before its first forward
            job = self.job = self._start(req, hit_tokens)
            if job is None:
                self._passed.add(req.rid)
                if len(self._passed) > 4096:
                    self._passed.clear()
                return
        job.polled = time.monotonic()
        self._run(job)

    def _start(self, req, hit_tokens: int):
        import torch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

        w = self.worker
        if req.finished() or req.grammar is not None or req.sampling_params.top_k != 1:
            return None
        if self.backend is None:
            self.backend = _make_draft_backend(w.model_runner, self.store)
        compressor, _ = w._plan(req)
        if req.to_finish is not None:
            return None
        tokens = [int(t) for t in req.origin_input_ids]
        w._weights_changed()
        n, layers = w.prefix_cache.match(tokens[:-1], compressor, count=False)
        fallback = (n, layers) if n and len(tokens) - n <= self.MAX_FORCED else None
        # drafts for output positions 0 .. wanted-1 (position 0 is checked against the
        # token the prefill will sample; no use drafting past the request's last token)
        wanted = min(w.vc.fetch_draft_tokens, req.sampling_params.max_new_tokens or w.vc.fetch_draft_tokens)
        if wanted < 2:
            return None
        entry, entry_len = self._tier_entry(tokens, compressor, n, hit_tokens) if w.tier is not None else (None, 0)
        if entry is None and fallback is None:
            return None
        one = torch.ones(1, dtype=torch.int64, device=w.device)
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=1, input_ids=one,
                          req_pool_indices=one * 0, seq_lens=one, out_cache_loc=None, seq_lens_sum=1,
                          positions=one * 0, seq_lens_cpu=torch.ones(1, dtype=torch.int64),
                          capture_hidden_mode=CaptureHiddenMode.NULL)
        w.stats.add("fetch_draft_requests", 1)
        job = _FetchJob(req, compressor, tokens, wanted, fb)
        if entry is None:
            job.place(n)
            self._seed(job, layers)
        else:
            job.entry, job.entry_len, job.fallback = entry, entry_len, fallback
        return job

    def _tier_entry(self, tokens, compressor, n, hit_tokens):
        """A read, on the tier's reader thread, of an entry longer than the ``n`` prompt
        tokens the prefix cache holds one for: a stub's (the cache sent it to the tier) or,
        with no stub, one the tier's index knows (written by an earlier process, or another
        engine on the same store). (its Future, its length; None for an index lookup), or
        (None, 0): nothing to read, or not worth reading (``--vericache-fetch-draft-tier-fraction``)."""
        from sgl_vericache.mem_cache.compressed_tier import INDEX_ANCHOR, SpilledEntry, index_anchors

        w = self.worker
        spilled_n, stub = w.prefix_cache.match_spilled(tokens[:-1], compressor)
        if spilled_n > n:
            if len(tokens) - spilled_n > self.MAX_FORCED:
                return None, 0
            if not self._worth_reading(stub, hit_tokens):
                w.stats.add("fetch_draft_tier_skipped", 1)
                return None, 0
            w.stats.add("fetch_draft_tier_entries", 1)
            return w.tier.fetch(tokens[:spilled_n], stub), spilled_n
        # an index lookup delays drafting: only for an entry at least INDEX_ANCHOR tokens
        # longer than one in hand, and close enough to the prompt's end to draft from
        longer_than = max(n + INDEX_ANCHOR - 1 if n else 0, len(tokens) - self.MAX_FORCED - 1)
        if not index_anchors(len(tokens) - 1, longer_than):
            return None, 0
        w.stats.add("fetch_draft_tier_lookups", 1)

        def accept(num_tokens, nbytes):  # on the reader thread, once the entry's size is known
            return self._worth_reading(SpilledEntry(num_tokens, "", nbytes=nbytes), hit_tokens)

        return w.tier.find(tokens[:-1], _tier_key(w, compressor), longer_than, accept), None

    def _seed(self, job, layers) -> None:
        key = ("fetch-draft", job.req.rid)
        self.store.clear()
        self.store.seed(key, job.compressor, layers, job.start)
        self.store.begin_round([key], job.steps)

    def _entry_arrived(self, job) -> bool:
        """Whether ``job`` can draft: its compressed entry is seeded (read back from the
        tier now if it just arrived; promoted into the prefix cache). False while the read
        is in flight; a miss or a corrupt entry ends the job."""
        if job.entry is None:
            return True
        if not job.entry.done():
            return False
        from sgl_vericache.mem_cache.compressed_tier import move_entry

        found, job.entry = job.arrived(), None
        w = self.worker
        if found is not None and len(found[1]) != w.store.num_layers:
            found = None  # another model's entry (its key should have said so): never seed from it
        if found is None:  # gone from the tier, not that entry, or not worth reading
            if job.fallback is None:  # nothing to draft from
                self._passed.add(job.req.rid)
                self.job = None
                return False
            n, layers = job.fallback
        else:
            n, layers = found[0], move_entry(found[1], w.device)
            w.prefix_cache.insert(job.tokens[:n], job.compressor, layers)
            if job.entry_len is None:
                w.stats.add("fetch_draft_tier_index_entries", 1)
        job.place(n)
        self._seed(job, layers)
        return True

    def _run(self, job) -> None:
        import torch
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        from sgl_vericache.spec.drafter import selects_per_step

        global _DRAFT_WEIGHTS, _DRAFTING
        if not self._entry_arrived(job):
            return
        w, fb = self.worker, job.fb
        t0 = time.perf_counter()
        done = job.step
        _DRAFT_WEIGHTS, _DRAFTING = w.draft_weights, True
        try:
            with torch.inference_mode(), forward_context(ForwardContext(attn_backend=self.backend), forward_batch=fb):
                if job.step == 0 and len(job.forced) > 1 and not selects_per_step(job.compressor):
                    # the prompt's tokens past the entry in one pass (they are known)
                    self.backend.tokens_of_one = True
                    try:
                        fb.input_ids = torch.tensor(job.forced, dtype=torch.int64, device=w.device)
                        fb.positions = torch.arange(job.start, job.start + len(job.forced), dtype=torch.int64,
                                                    device=w.device)
                        logits = w.model_runner.forward(fb).logits_output.next_token_logits[-1:]
                    finally:
                        self.backend.tokens_of_one = False
                    job.next = int(torch.argmax(torch.nan_to_num(logits), dim=-1)[0])
                    job.drafts.append(job.next)
                    job.step = len(job.forced)
                while job.step < job.steps:
                    s = job.step
                    token = job.forced[s] if s < len(job.forced) else job.next
                    fb.input_ids = torch.tensor([token], dtype=torch.int64, device=w.device)
                    fb.positions = torch.tensor([job.start + s], dtype=torch.int64, device=w.device)
                    logits = w.model_runner.forward(fb).logits_output.next_token_logits
                    if w.draft_weights is not None:
                        logits = torch.nan_to_num(logits)
                    job.next = int(torch.argmax(logits, dim=-1)[0])
                    if s >= len(job.forced) - 1:
                        job.drafts.append(job.next)
                    job.step += 1
                    if time.perf_counter() - t0 >= self.STEP_SECONDS:
                        break
        finally:
            _DRAFT_WEIGHTS, _DRAFTING = None, False
        w.stats.add("fetch_draft_steps", job.step - done)
        w.stats.add("fetch_draft_seconds", time.perf_counter() - t0)

    def _finish(self) -> None:
        job, self.job = self.job, None
        self.store.clear()
        found = job.arrived() if job.entry is not None and job.entry.done() else None
        if found is not None and len(found[1]) == self.worker.store.num_layers:
            from sgl_vericache.mem_cache.compressed_tier import move_entry

            # read back too late to draft from, still worth keeping: the prefix is in use
            self.worker.prefix_cache.insert(job.tokens[: found[0]], job.compressor,
                                            move_entry(found[1], self.worker.device))
        if job.drafts and not job.req.finished():
            self.queue.put(job.req.rid, job.drafts)
            self.worker.stats.add("fetch_draft_tokens", len(job.drafts))

    def clear(self) -> None:
        self.job = None
        self.store.clear()
        self.queue.clear()
        self._passed.clear()


def _install_fetch_drafting() -> None:
    """The scheduler's poll of a request waiting for its storage prefetch
    (``check_prefetch_progress``) lets this process's VeriCache worker draft for it; the
    waiting ``Req`` is found by rid from SGLang's ``_prefetch_kvcache``, which starts it."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    check = UnifiedRadixCache.check_prefetch_progress
    if getattr(check, "_vericache", False):
        return
    start = Scheduler._prefetch_kvcache

    def _prefetch_kvcache(self, req, *args, **kwargs):
        if getattr(getattr(self.tree_cache, "cache_controller", None), "storage_backend", None) is not None:
            _STORAGE_TREES.add(self.tree_cache)  # SGLang's own tree too, not only backend `vericache`
        result = start(self, req, *args, **kwargs)
        if req.cache_request_handle in getattr(self.tree_cache, "ongoing_prefetch", {}):
            _PREFETCHING[req.rid] = req
            while len(_PREFETCHING) > 4096:  # requests aborted while they waited
                _PREFETCHING.pop(next(iter(_PREFETCHING)))
        return result

    def check_prefetch_progress(self, request):
        ongoing = getattr(self, "ongoing_prefetch", {}).get(request)
        operation = getattr(ongoing, "operation", None) if ongoing else None
        hits = getattr(operation, "storage_hit_count", 0)
        fetched = check(self, request)
        req = _PREFETCHING.pop(request.rid, None) if fetched else _PREFETCHING.get(request.rid)
        if req is not None:
            loaded = getattr(operation, "completed_tokens", 0) if fetched else 0
            started = getattr(operation, "start_time", None)
            for worker in list(_LIVE_WORKERS):
                if worker.fetch_drafter is not None:
                    if loaded and started is not None:  # the prefetch's speed: when a tier entry is worth reading
                        worker.fetch_drafter.observe_fetch(loaded, time.monotonic() - started)
                    worker.fetch_drafter.poll(req, fetched, hits)
        return fetched

    check_prefetch_progress._vericache = True
    UnifiedRadixCache.check_prefetch_progress = check_prefetch_progress
    Scheduler._prefetch_kvcache = _prefetch_kvcache


_PREFETCHING = {}  # rid -> Req whose storage prefetch is in flight (this scheduler process)


def _make_verify_backend(model_runner, deterministic=False):
    """The target's attention backend plus a TARGET_VERIFY path: each request's draft
    queries attend over its full verified KV (all visible) and the draft block under the
    verify mask (a linear chain for VERICACHE: causal). Computed in fp32 per request."""
    import torch
    import torch.nn.functional as F
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    inner = model_runner.attn_backend

    class _VerifyBackend(AttentionBackend):
        def __init__(self):
            super().__init__()
            self.inner = inner
            self.req_to_token_pool = model_runner.req_to_token_pool
            self.token_to_kv_pool = model_runner.token_to_kv_pool
            self.capture = None  # rid -> {layer_id: queries}, set per extend batch
            self.capture_rids = None
            self.deterministic = deterministic
            self.skip_rows = ()  # rows deferred this round (staggered verifies): no attention

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def init_forward_metadata(self, forward_batch):
            self.inner.init_forward_metadata(forward_batch)

        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if not forward_batch.forward_mode.is_target_verify():
                if self.capture is not None and forward_batch.forward_mode.is_extend():
                    _capture_queries(self, q, layer, forward_batch)
                return self.inner.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            if save_kv_cache:
                self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
            return _verify_attention(self, q, layer, forward_batch)

    return _VerifyBackend()


def _verify_attention(backend, q, layer, forward_batch):
    import torch
    import torch.nn.functional as F

    hq, d, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
    if _PARKING[0] is not None:
        _PARKING[0].wait_layer(layer.layer_id)  # parked full KV copied back for this layer
    bs = forward_batch.batch_size
    q = q.reshape(bs, -1, hq, d)  # [bs, n, H_q, D]
    n = q.shape[1]
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    seq_lens = forward_batch.seq_lens.tolist()
    rows = forward_batch.req_pool_indices.tolist()
    tree = _verify_tree_mask(forward_batch, bs, n, q.device)  # [bs, n, n]
    out = q.new_empty((bs, n, hq, dv))
    for b in range(bs):
        if b in backend.skip_rows:  # its full KV stays parked; its logits are not used
            out[b] = 0
            continue
        prefix = seq_lens[b]
        slots = req_to_token[rows[b], : prefix + n].to(torch.int64)
        keys, values = k_cache[slots], v_cache[slots]  # [prefix + n, H_kv, D]
        if backend.deterministic:
            out[b] = _decode_shaped_rows(q[b], keys, values, prefix, layer.scaling, hq != keys.shape[1])
            continue
        visible = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=q.device), tree[b]], dim=1)
        o = F.scaled_dot_product_attention(
            q[b].transpose(0, 1).float(), keys.transpose(0, 1).float(), values.transpose(0, 1).float(),
            attn_mask=visible, scale=layer.scaling, enable_gqa=hq != keys.shape[1],
        )  # [H_q, n, Dv]
        out[b] = o.transpose(0, 1).to(out.dtype)
    return out.reshape(bs * n, hq * dv)


def _decode_shaped_rows(q, keys, values, prefix, scale, gqa):
    """Deterministic mode: verify row j computed exactly as SGLang's torch_native decode
    computes a one-token step at that position (same call, shapes and strides), so its
    output is bit-equal to decode's. Valid for a linear chain (row j sees the prefix and
    rows 0..j). q: [n, H_q, D]; keys/values: [prefix + n, H_kv, D]."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    rows = []
    for j in range(q.shape[0]):
        end = prefix + j + 1
        o = scaled_dot_product_attention(
            q[j : j + 1].movedim(0, 1).unsqueeze(0),  # [1, H_q, 1, D]
            keys[:end].movedim(0, 1).unsqueeze(0),
            values[:end].movedim(0, 1).unsqueeze(0),
            attn_mask=None, enable_gqa=gqa, scale=scale, is_causal=False,
        )
        rows.append(o.squeeze(0).movedim(1, 0))  # [1, H_q, Dv]
    return torch.cat(rows)


def _verify_tree_mask(forward_batch, bs, n, device):
    import torch

    mask = getattr(forward_batch.spec_info, "custom_mask", None)
    if mask is None or mask.numel() != bs * n * n:
        return torch.tril(torch.ones(n, n, dtype=torch.bool, device=device)).expand(bs, n, n)
    return mask.reshape(bs, n, n).to(torch.bool)


# --- seeded sampling on the torch sampler ------------------------------------------------


def _install_seeded_sampling() -> None:
    """Make ``sampling_seed`` work with SGLang's pytorch sampling backend.

    SGLang draws position-keyed samples (a hash of seed, position and token id turned into
    Gumbel noise) only under ``--enable-deterministic-inference``, which refuses the CPU
    attention backend. Here every batch sampled by the pytorch backend carries a seed per
    request: the request's ``sampling_seed``, or a random seed drawn once per request. The
    draw for output position i then depends only on (seed, i) and the distribution, with
    speculation on or off, which is what lets VeriCache's seeded mode be token-identical.
    Requests without a seed are still sampled at random (their seed is random).

    SGLang's seeded top-k/top-p sampler keys its noise on sorted ranks and refuses min-p;
    ``_seeded_per_row_sampling`` makes a seeded row's draw depend on that row alone."""
    import random

    from sglang.srt.runtime_context import get_exec
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    if getattr(SamplingBatchInfo.from_schedule_batch, "_vericache", False):
        return
    original = SamplingBatchInfo.from_schedule_batch.__func__

    def from_schedule_batch(cls, batch, vocab_size):
        import torch

        info = original(cls, batch, vocab_size)
        if info.sampling_seed is None and get_exec().kernel.sampling_backend == "pytorch":
            seeds = []
            for req in batch.reqs:
                seed = req.sampling_params.sampling_seed
                if seed is None:
                    seed = getattr(req, "_vericache_seed", None)
                    if seed is None:
                        seed = req._vericache_seed = random.getrandbits(62)
                seeds.append(seed)
            info.sampling_seed = torch.tensor(seeds, dtype=torch.int64, device=info.temperatures.device)
        return info

    from_schedule_batch._vericache = True
    SamplingBatchInfo.from_schedule_batch = classmethod(from_schedule_batch)

    _seeded_per_row_sampling()


def _seeded_per_row_sampling() -> None:
    """Seeded top-k/top-p/min-p sampling whose draw depends only on the request's own row.

    SGLang's seeded torch sampler keys its Gumbel noise on the token id when no request in
    the batch filters, but on the *rank* in the sorted distribution when any request does;
    the same seeded request then draws different tokens depending on its batch-mates (and
    it refuses min-p). Here a seeded filtering batch zeroes each row's filtered-out tokens
    (``spec.accept.filter_probs``: a row without filters is left untouched) and draws with
    SGLang's own unfiltered seeded sampler, keyed on (seed, position, token id): the same
    distribution, and a row's draw no longer depends on the other rows."""
    from sglang.srt.layers import sampler as sampler_mod

    from sgl_vericache.spec.accept import filter_probs

    original = sampler_mod.top_k_top_p_min_p_sampling_from_probs_torch
    if getattr(original, "_vericache", False):
        return

    def sample(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions, **kwargs):
        if sampling_seed is None:
            return original(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions, **kwargs)
        min_ps = min_ps if need_min_p_sampling else 0.0
        if kwargs.get("return_filtered_probs"):  # SGLang's own path (sampling-mask capture), min-p applied first
            kept = filter_probs(probs, -1, 1.0, min_ps)
            return original(kept, top_ks, top_ps, min_ps, False, sampling_seed, positions, **kwargs)
        kept = filter_probs(probs, top_ks, top_ps, min_ps)
        return sampler_mod.sampling_from_probs_torch(kept, sampling_seed, positions)

    sample._vericache = True
    sample.__wrapped__ = original
    sampler_mod.top_k_top_p_min_p_sampling_from_probs_torch = sample


# --- SGLang's hierarchical cache (HiCache) on a CPU device pool --------------------------


def _install_cpu_extend_attention() -> None:
    """``torch_native`` extends (prefills) compute only the new tokens' rows
    (``cpu_attention.extend_attention``) instead of a causal attention over prefix + new
    rows of which the prefix rows are thrown away. Every engine that loads the plugin gets
    it, speculation on or off. Encoder, cross-attention and sliding-window layers keep
    SGLang's code."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sgl_vericache.cpu_attention import extend_attention

    original = TorchNativeAttnBackend._run_sdpa_forward_extend
    if getattr(original, "_vericache", False):
        return

    def run_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                   extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                   causal=False, is_cross_attn=False, sliding_window_size=None):
        if encoder_lens is not None or is_cross_attn or (sliding_window_size is not None and sliding_window_size > -1):
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                            is_cross_attn, sliding_window_size)
        return extend_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                extend_prefix_lens, extend_seq_lens, scaling=scaling, enable_gqa=enable_gqa,
                                causal=causal)

    run_extend._vericache = True
    run_extend.sglang_original = original
    TorchNativeAttnBackend._run_sdpa_forward_extend = run_extend


def _install_cpu_hicache() -> None:
    """Let ``--enable-hierarchical-cache`` run when the device KV pool lives in CPU memory.

    SGLang's host pool pins its memory through CUDA (``pin_memory=True`` by default, and the
    pool builder does not pass it), and imports its device<->host copy kernels from
    ``sgl_kernel.kvcacheio`` only on CUDA/HIP. For a CPU device pool the host pool is built
    unpinned, and the two MHA copies HiCache makes (all layers device->host on backup, one
    layer host->device on load) are index copies between the device pool's per-layer
    buffers and the host pool's per-layer views (``layer_first`` and ``page_first``
    layouts). Pools on an accelerator are left on SGLang's code."""
    import inspect

    import torch
    from sglang.srt.mem_cache.pool_host import mha

    cls = mha.MHATokenToKVPoolHost
    if getattr(cls, "_vericache_cpu", False):
        return
    init, backup, load = cls.__init__, cls.backup_from_device_all_layer, cls.load_to_device_per_layer
    signature = inspect.signature(init)

    def on_cpu(pool) -> bool:
        return torch.device(pool._transfer_device).type == "cpu"

    def check_layout(pool) -> None:
        if pool.layout not in ("layer_first", "page_first"):
            raise ValueError(
                f"--hicache-mem-layout {pool.layout} is not supported with a CPU device pool; "
                "use layer_first or page_first (with --hicache-io-backend kernel)")

    def __init__(self, buffer_info, *args, **kwargs):
        bound = signature.bind(self, buffer_info, *args, **kwargs)
        if torch.device(buffer_info.device).type == "cpu":
            bound.arguments["pin_memory"] = False  # pinning needs a CUDA driver
        init(*bound.args, **bound.kwargs)
        if on_cpu(self):
            check_layout(self)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        if not on_cpu(self):
            return backup(self, device_pool, host_indices, device_indices, io_backend)
        for i in range(self.layer_num):
            self.k_data_refs[i][host_indices] = self.device_k_buffers[i][device_indices]
            self.v_data_refs[i][host_indices] = self.device_v_buffers[i][device_indices]

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                 *, is_draft=False):
        if not on_cpu(self):
            return load(self, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft)
        if not is_draft and not 0 <= layer_id < self.target_layer_num:
            return
        self.device_k_buffers[layer_id][device_indices] = self.k_data_refs[layer_id][host_indices]
        self.device_v_buffers[layer_id][device_indices] = self.v_data_refs[layer_id][host_indices]

    cls.__init__ = __init__
    cls.backup_from_device_all_layer = backup_from_device_all_layer
    cls.load_to_device_per_layer = load_to_device_per_layer
    cls._vericache_cpu = True
    _time_full_kv_loads()


_LIVE_WORKERS = weakref.WeakSet()  # VeriCache workers of this process, for the integrity check
_LOAD_SECONDS = [0.0]  # scheduler-process total, read into the worker's counters each iteration


def _time_full_kv_loads() -> None:
    """Time HiCache's host -> device loads (``HiCacheController.start_loading``), counted as
    ``vericache:full_kv_load_seconds``. With a CPU device pool the copy runs inside that
    call, before the forward that needs it: the time the forward waited for full KV. On an
    accelerator the call only queues the copy on a transfer stream (the forward then waits
    per layer on the device), so the counter there is queueing time only."""
    from sglang.srt.managers.cache_controller import HiCacheController

    original = HiCacheController.start_loading
    if getattr(original, "_vericache", False):
        return

    def start_loading(self):
        t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            _LOAD_SECONDS[0] += time.perf_counter() - t0

    start_loading._vericache = True
    HiCacheController.start_loading = start_loading


_PREEMPTED = [0, 0]  # [requests, tokens] a preempted request left in the radix tree (this process)


def _install_deferred_rows() -> None:
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

    resolve = SchedulerBatchResultProcessor._resolve_spec_v2_tokens
    if getattr(resolve, "_vericache", False):
        return
    histogram = Req.update_spec_correct_drafts_histogram
    finish_state = Req.update_finish_state
    stream = SchedulerOutputStreamer.stream_output
    spec_metrics = SchedulerMetricsReporter.update_spec_metrics
    generated = GenerationBatchResult.get_num_generated_tokens

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

    def get_num_generated_tokens(self, batch_size):
        return generated(self, batch_size - getattr(self, "vericache_deferred", 0))

    def update_spec_metrics(self, bs, *args, **kwargs):
        bs -= getattr(self, "vericache_deferred", 0)
        self.vericache_deferred = 0
        spec_metrics(self, bs, *args, **kwargs)

    def update_spec_correct_drafts_histogram(self, num_correct_drafts):
        if num_correct_drafts >= 0:
            histogram(self, num_correct_drafts)

    def update_finish_state(self, new_accepted_len=1):
        if new_accepted_len == 0 and getattr(self, "vericache_deferred", False) and not self.to_finish:
            return
        finish_state(self, new_accepted_len)

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

    _resolve_spec_v2_tokens._vericache = True
    SchedulerBatchResultProcessor._resolve_spec_v2_tokens = _resolve_spec_v2_tokens
    Req.update_spec_correct_drafts_histogram = update_spec_correct_drafts_histogram
    Req.update_finish_state = update_finish_state
    SchedulerOutputStreamer.stream_output = stream_output
    SchedulerMetricsReporter.update_spec_metrics = update_spec_metrics
    GenerationBatchResult.get_num_generated_tokens = get_num_generated_tokens


def _install_keep_preempted_kv() -> None:
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

    original = schedule_batch.release_req
    if getattr(original, "_vericache", False):
        return

    def release_req(*, req, tree_cache, hisparse_coordinator=None, offload_kv=True, **kwargs):
        if (offload_kv and not req.finished() and req.kv.holds_kv and hisparse_coordinator is None
                and runtime_context.get_disagg().disaggregation_mode != "decode" and tree_cache is not None
                and tree_cache.supports_prefix_sharing() and not tree_cache.supports_mamba()
                and not req.skip_radix_cache_insert and getattr(req, "session_id", None) is None):
            before = req.kv.cache_protected_len
            req.refresh_fill_ids()
            req.vericache_releasing = True  # a release's insert, also under a full-KV budget
            tree_cache.checkpoint(req, up_to=req.owned_kv_len())
            _PREEMPTED[0] += 1
            _PREEMPTED[1] += max(0, req.kv.cache_protected_len - before)
        return original(req=req, tree_cache=tree_cache, hisparse_coordinator=hisparse_coordinator,
                        offload_kv=offload_kv, **kwargs)

    release_req._vericache = True
    schedule_batch.release_req = release_req


_PARKING = [None]  # this scheduler process's FullKVParking (one VeriCache worker per process)
_TREE_CACHES = weakref.WeakSet()  # `vericache` radix caches of this process
_STORAGE_TREES = weakref.WeakSet()  # radix caches with a HiCache storage tier, seen by the scheduler


def _build_parking(model_runner):
    """Parking over the target's KV pool; its reserved slots are taken out of the allocator's
    available size, so SGLang's admission and decode checks never hand them out."""
    from sgl_vericache.mem_cache.full_kv_parking import FullKVParking, ParkingError

    tree = next(iter(_TREE_CACHES))  # the worker checked at start: backend `vericache`, page size 1
    pool, alloc = model_runner.token_to_kv_pool, model_runner.token_to_kv_pool_allocator
    if not hasattr(pool, "k_buffer") or tree.supports_mamba() or tree.supports_swa():
        raise ParkingError(f"--vericache-full-device-budget supports a plain MHA KV pool, not {type(pool).__name__}"
                           " (hybrid SWA / mamba trees keep other state per token)")

    def make_room(n):
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        evict_from_tree_cache(tree, n)

    parking = FullKVParking(pool.get_key_buffer, pool.get_value_buffer, pool.layer_num,
                            model_runner.req_to_token_pool.req_to_token, alloc.alloc, alloc.free, make_room,
                            host_pool=_parking_host_pool(tree, pool))
    available = alloc.available_size
    alloc.available_size = lambda: available() - parking.reserved_tokens
    _PARKING[0] = parking
    return parking


def _parking_host_pool(tree, device_pool):
    """HiCache's host KV pool, when the engine has one, as a place to park full KV."""
    from sgl_vericache.mem_cache.full_kv_parking import HostPoolStore
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    controller = getattr(tree, "cache_controller", None)
    host = getattr(controller, "mem_pool_host", None)
    pools = [e.host_pool for e in host.entries] if hasattr(host, "entries") else [host]
    kv = next((p for p in pools if isinstance(p, MHATokenToKVPoolHost)), None)
    return None if kv is None else HostPoolStore(kv, device_pool, controller.io_backend)


def _load_parked(req) -> None:
    """Before SGLang reads a request's row to free or insert it (it finished, was aborted or
    preempted while its KV was parked): copy its KV back first."""
    parking = _PARKING[0]
    if parking is not None and parking.is_parked(req.rid):
        parking.load_now(req.rid, req.kv.req_pool_idx)
        for worker in list(_LIVE_WORKERS):
            if worker.parking is parking:
                worker._park_stats()


# --- the `vericache` radix cache backend ------------------------------------------------

RADIX_BACKEND = "vericache"
CHECK_INTEGRITY_ENV = "VERICACHE_CHECK_INTEGRITY"


class CacheIntegrityError(AssertionError):
    """A prefix cache, its device KV allocator or its host pool is inconsistent."""


_radix_cache_class = None


def vericache_radix_cache_class():
    """SGLang's UnifiedRadixCache (HiCache included) plus ``check_integrity()``."""
    global _radix_cache_class
    if _radix_cache_class is not None:
        return _radix_cache_class
    import torch
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from sgl_vericache.config import VeriCacheConfig

    class VeriCacheRadixCache(UnifiedRadixCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _TREE_CACHES.add(self)
            # Under a full-KV device budget a running request's prompt stays its own: see checkpoint().
            self.prompts_owned = (VeriCacheConfig.from_env() or VeriCacheConfig()).full_device_budget >= 0

        def claim_kv_row(self, req):
            # SGLang's release of a request's row starts here (it finished, was aborted or
            # preempted); a checkpoint that follows is the release's insert.
            _load_parked(req)
            req.vericache_releasing = True
            return super().claim_kv_row(req)

        def checkpoint(self, req, *, up_to, **kwargs):
            """SGLang publishes a running request's prefill into the tree after each extend
            (so concurrent requests can share it) and locks it there. Under
            ``--vericache-full-device-budget`` that publish is skipped: the prompt's computed
            KV stays the request's own, so between its verifies it is parked in host memory
            with the rest of its KV instead of pinning device memory in the tree. It enters
            the tree when the request leaves (finished, aborted or preempted), as generated
            tokens always do; a prefix already in the tree when the request arrived is
            shared as before. Cost: requests running at the same time do not share each
            other's prompts."""
            releasing = req.__dict__.pop("vericache_releasing", False)
            if self.prompts_owned and not releasing and not req.finished():
                return  # SGLang's caller moves the request's prefix_len on, published or not
            _load_parked(req)
            return super().checkpoint(req, up_to=up_to, **kwargs)

        def check_integrity(self) -> dict:
            """Check the tree and the pools it indexes; valid when no request is running
            (SGLang's idle point). Raises ``CacheIntegrityError`` listing every violation;
            returns the sizes it checked. Checks: SGLang's tree invariants (structure, leaf
            sets, LRU lists, sizes, lock counts, parent/child tier state); no device KV slot
            held by two tree nodes, by the padding slot, or also on the allocator's free
            list; the allocator's free list without duplicates; tree + free slots = pool;
            the host pool's free list without duplicates, never marked in use, and free +
            in use = pool."""
            problems = []
            try:
                self.sanity_check()
            except AssertionError as e:
                problems.append(f"tree: {e}")
            alloc = self.token_to_kv_pool_allocator
            page = alloc.page_size
            tree = self.all_values_flatten().to(torch.int64).cpu()
            if torch.unique(tree).numel() != tree.numel():
                problems.append(f"{tree.numel() - torch.unique(tree).numel()} device slots held by two tree nodes")
            if (tree == 0).any():
                problems.append("the padding slot 0 is in the tree")
            free = alloc.get_all_free_pages().to(torch.int64).cpu()
            if torch.unique(free).numel() != free.numel():
                problems.append(f"device allocator: {free.numel() - torch.unique(free).numel()} pages freed twice")
            stale = torch.unique(tree // page)[torch.isin(torch.unique(tree // page), free)]
            if stale.numel():
                problems.append(f"{stale.numel()} tree pages are on the free list: {stale[:8].tolist()}")
            if not self.protected_size() and tree.numel() + alloc.available_size() != alloc.size:
                problems.append(f"device slots: {tree.numel()} in tree + {alloc.available_size()} free "
                                f"!= pool {alloc.size}")
            report = {"device_tree_tokens": int(tree.numel()), "device_free_tokens": int(alloc.available_size()),
                      "evictable_tokens": int(self.evictable_size()), "protected_tokens": int(self.protected_size())}
            host = getattr(getattr(self, "cache_controller", None), "mem_pool_host", None)
            host_pools = [e.host_pool for e in host.entries] if hasattr(host, "entries") else [host]
            for i, pool in enumerate(p for p in host_pools if p is not None and hasattr(p, "slot_used")):
                with pool.lock:
                    host_free = torch.cat([pool.free_slots.cpu(), *[r.cpu() for r in pool.release_slots]])
                    in_use = int(pool.slot_used.sum())
                    if torch.unique(host_free).numel() != host_free.numel():
                        problems.append(f"host pool {i}: slots freed twice")
                    if pool.slot_used[host_free].any():
                        problems.append(f"host pool {i}: {int(pool.slot_used[host_free].sum())} free slots marked in use")
                    if in_use + host_free.numel() != pool.logical_size:
                        problems.append(f"host pool {i}: {in_use} in use + {host_free.numel()} free "
                                        f"!= {pool.logical_size}")
                report[f"host{i}_used_tokens"] = in_use
                report[f"host{i}_free_tokens"] = int(host_free.numel())
            if problems:
                raise CacheIntegrityError("; ".join(problems))
            return report

    _radix_cache_class = VeriCacheRadixCache
    return VeriCacheRadixCache


def _register_radix_cache_backend() -> None:
    """``--radix-cache-backend vericache``: the cache above, with HiCache attached exactly as
    SGLang's default chain does. With ``VERICACHE_CHECK_INTEGRITY=1`` the scheduler runs
    ``check_integrity()`` at every idle check and stops on a violation."""
    import os

    from sglang.srt.managers.scheduler_components import invariant_checker
    from sglang.srt.mem_cache import registry

    if RADIX_BACKEND not in registry.registered_radix_cache_backends():
        registry.register_radix_cache_backend(
            RADIX_BACKEND,
            lambda ctx: registry.create_unified_radix_cache(ctx, cache_class=vericache_radix_cache_class()))

    checker = invariant_checker.SchedulerInvariantChecker
    original = checker._check_tree_cache
    if getattr(original, "_vericache", False):
        return

    def _check_tree_cache(self):
        original(self)
        if os.environ.get(CHECK_INTEGRITY_ENV) != "1":
            return
        check = getattr(self.tree_cache, "check_integrity", None)
        if check is not None:
            check()
        for worker in list(_LIVE_WORKERS):  # this scheduler's VeriCache worker, if any
            worker.check_integrity()

    _check_tree_cache._vericache = True
    checker._check_tree_cache = _check_tree_cache


# --- checksummed storage tiers -----------------------------------------------------------


def _install_tier_checksums() -> None:
    """Wrap every HiCache storage backend SGLang creates (``--hicache-storage-backend``) in
    ``_ChecksummedStorage`` when the VeriCache config asks for it (``--vericache-tier-
    checksums``, on by default): pages carry digests, and a page read back wrong is a miss."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    create = StorageBackendFactory.__dict__["create_backend"].__func__
    if getattr(create, "_vericache", False):
        return

    def create_backend(cls, backend_name, storage_config, mem_pool_host, **kwargs):
        from sgl_vericache.config import VeriCacheConfig

        backend = create(cls, backend_name, storage_config, mem_pool_host, **kwargs)
        vc = VeriCacheConfig.from_env()
        if vc is None or not vc.tier_checksums:
            return backend
        return checked_storage(backend_name, backend, storage_config)

    create_backend._vericache = True
    StorageBackendFactory.create_backend = classmethod(create_backend)


def checked_storage(backend_name, backend, storage_config):
    """``backend`` (a HiCacheStorage) behind digest checks kept in the same tier. Supported:
    SGLang's ``file`` backend (digests as files beside the pages) and ``mooncake`` (digests
    as store objects); any other backend is refused with the way out."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageFailureInjector

    from sgl_vericache.mem_cache.tier_integrity import FileDigests, KeyValueDigests, PageVerifier, TierStats

    core = backend._backend if isinstance(backend, HiCacheStorageFailureInjector) else backend
    if isinstance(core, HiCacheFile):
        digests, zero_copy = FileDigests(core.file_path, core._get_suffixed_key), False
    elif type(core).__name__ == "MooncakeStore" and isinstance(getattr(core, "mha_suffix", None), str):
        suffix = core.mla_suffix if core.is_mla_backend else core.mha_suffix
        digests = KeyValueDigests(core.store, lambda key: f"{core._tag_keys([key])[0]}_{suffix}_vcsum")
        zero_copy = True
    else:
        raise ValueError(
            f"--vericache-tier-checksums supports the 'file' and 'mooncake' HiCache storage backends "
            f"(mooncake without head splitting), not {backend_name!r}; pass --no-vericache-tier-checksums "
            f"to use {backend_name!r} without page checksums")
    stats = TierStats(bool(getattr(storage_config, "enable_storage_metrics", False)))
    return _checked_storage_class()(backend, PageVerifier(digests, stats, backend_name), zero_copy)


_checked_cls = None


def _checked_storage_class():
    global _checked_cls
    if _checked_cls is not None:
        return _checked_cls
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    class _ChecksummedStorage(HiCacheStorage):
        """A HiCache storage backend whose pages are verified on the way back. SGLang's
        cache controller calls either the generic page API (``batch_set`` / ``batch_get``
        with page tensors: the file backend) or the zero-copy one (``batch_set_v1`` /
        ``batch_get_v1`` with host-pool indices: Mooncake); both are checked. A call that
        raises (store unreachable, I/O error) is counted and answered as a miss."""

        def __init__(self, inner, verifier, zero_copy):
            self.inner = inner
            self.verifier = verifier
            self.stats = verifier.stats
            self.zero_copy = zero_copy

        def __getattr__(self, name):  # anything else (metrics, layout queries) as the backend has it
            if name == "inner":
                raise AttributeError(name)
            return getattr(self.inner, name)

        def _guard(self, what, miss, fn, *args):
            try:
                return fn(*args)
            except Exception as exc:
                self.stats.add("errors")
                logger.warning("VeriCache: %s %s failed (%s: %s); treated as a miss", self.verifier.tier, what,
                               type(exc).__name__, exc)
                return miss

        # registration and housekeeping go straight through
        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host
            self.inner.register_mem_pool_host(mem_pool_host)

        def register_mem_host_pool_v2(self, host_pool, host_pool_name):
            self.inner.register_mem_host_pool_v2(host_pool, host_pool_name)

        def on_host_pools_registered(self):
            self.inner.on_host_pools_registered()

        def clear(self):
            return self.inner.clear()

        def get_stats(self):
            return self.inner.get_stats()

        def close(self):
            if hasattr(self.inner, "close"):
                self.inner.close()

        # existence: only pages that are there and carry a digest
        def exists(self, key):
            return self.batch_exists([key]) == 1

        def batch_exists(self, keys, extra_info=None):
            present = self._guard("exists", 0, self.inner.batch_exists, keys, extra_info)
            return self._guard("digest lookup", 0, self.verifier.checkable, keys, present)

        # generic page API (page tensors)
        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
            existed = self._existing(keys)
            ok = self._guard("write", False, self.inner.batch_set, keys, values, target_locations, target_sizes)
            if not ok:
                return False
            return all(self._guard("digest write", [False], self.verifier.record, keys, values,
                                   [True] * len(keys), existed))

        def set(self, key, value=None, target_location=None, target_sizes=None):
            return self.batch_set([key], [value], target_location, target_sizes)

        def batch_get(self, keys, target_locations=None, target_sizes=None):
            pages = self._guard("read", None, self.inner.batch_get, keys, target_locations, target_sizes)
            if not isinstance(pages, list):
                return [None] * len(keys)
            good = self._guard("verify", [False] * len(keys), self.verifier.verify, keys, pages,
                               [p is not None for p in pages])
            return [p if g else None for p, g in zip(pages, good)]

        def get(self, key, target_location=None, target_sizes=None):
            return self.batch_get([key], [target_location], target_sizes)[0]

        # zero-copy API (host-pool indices)
        def _host_pages(self, keys, host_indices):
            pool = self.mem_pool_host
            return [pool.get_data_page(int(host_indices[i * pool.page_size]), flat=True) for i in range(len(keys))]

        def _existing(self, keys):
            """Per key: already in the tier? (Backends skip writing such a page, so its
            stored bytes, and its digest, are the earlier writer's.)"""
            return [self._guard("exists", 0, self.inner.batch_exists, [key]) == 1 for key in keys]

        def batch_set_v1(self, keys, host_indices, extra_info=None):
            existed = self._existing(keys)
            stored = self._guard("write", [False] * len(keys), self.inner.batch_set_v1, keys, host_indices,
                                 extra_info)
            return self._guard("digest write", [False] * len(keys), self.verifier.record, keys,
                               self._host_pages(keys, host_indices), stored, existed)

        def batch_get_v1(self, keys, host_indices, extra_info=None):
            loaded = self._guard("read", [False] * len(keys), self.inner.batch_get_v1, keys, host_indices,
                                 extra_info)
            return self._guard("verify", [False] * len(keys), self.verifier.verify, keys,
                               self._host_pages(keys, host_indices), loaded)

        # v2 (side pools of hybrid models): passed through unverified; dense models use none
        def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
            return self.inner.batch_exists_v2(keys, pool_transfers, extra_info)

        def batch_get_v2(self, transfers, extra_info=None):
            return self.inner.batch_get_v2(transfers, extra_info)

        def batch_set_v2(self, transfers, extra_info=None):
            return self.inner.batch_set_v2(transfers, extra_info)

    _checked_cls = _ChecksummedStorage
    return _ChecksummedStorage


# --- deterministic mode: row-invariant linear layers -------------------------------------

# Every matrix product with a weight runs on blocks of exactly this many rows (the last one
# zero-padded), so a row's result never depends on how many rows share the call: a
# one-token decode step and a verify pass of draft_len + 1 tokens give bit-equal rows.
ROW_BLOCK = 16


def _row_invariant_linear(x, weight, bias=None):
    import torch
    import torch.nn.functional as F

    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    pad = (-m) % ROW_BLOCK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    out = torch.cat([F.linear(rows[i : i + ROW_BLOCK], weight, bias) for i in range(0, m + pad, ROW_BLOCK)])
    return out[:m].reshape(*lead, weight.shape[0])


def _row_invariant_mode():
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class RowInvariantMatmul(TorchFunctionMode):
        """Routes weight products (F.linear, and matmul/mm against a 2-D right operand,
        as the lm_head does) through ``_row_invariant_linear``."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.linear and not kwargs:
                return _row_invariant_linear(*args)
            if func in (torch.matmul, torch.mm, torch.Tensor.matmul) and not kwargs and len(args) == 2:
                a, b = args
                if isinstance(b, torch.Tensor) and b.dim() == 2 and a.dim() >= 2:
                    return _row_invariant_linear(a, b.t())
            return func(*args, **kwargs)

    return RowInvariantMatmul()


def _install_row_invariant_forward() -> None:
    """``--vericache-deterministic``: every forward of the model runner that produces output
    logits or committed KV (prefill, decode, verify) uses row-invariant weight products.
    Attention is made row-invariant separately (``_verify_attention`` computes each verify
    row as a decode step would). Draft passes run as usual: their tokens are proposals that
    verify recomputes, so only acceptance, never output, can depend on their rounding."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    if getattr(ModelRunner.forward, "_vericache", False):
        return
    original = ModelRunner.forward

    def forward(self, *args, **kwargs):
        if _DRAFTING:
            return original(self, *args, **kwargs)
        with _row_invariant_mode():
            return original(self, *args, **kwargs)

    forward._vericache = True
    ModelRunner.forward = forward
    logger.info("VeriCache deterministic mode: row-invariant weight products (blocks of %d rows)", ROW_BLOCK)


# --- reduced-precision weights for the draft passes --------------------------------------

_DRAFT_WEIGHTS = None  # the worker's DraftWeights while it runs draft passes, else None
_DRAFTING = False  # True while the worker runs draft passes
_PACKED_LINEAR = None  # cpu_linear.PackedLinear serving the engine's fp32 CPU weight products, or None


def _install_cpu_linear(mode: str) -> None:
    """``--vericache-cpu-linear``: route the engine's dense fp32 CPU weight products (SGLang's
    unquantized linear layers and its plain lm_head product) through prepacked oneDNN
    weights. Applies to every forward, speculation on or off (``draft_apply`` below)."""
    global _PACKED_LINEAR
    from sgl_vericache.cpu_linear import PackedLinear, packed_linear_available

    if mode == "torch" or (mode == "auto" and not packed_linear_available()):
        _PACKED_LINEAR = None
        return
    if _PACKED_LINEAR is None:
        _PACKED_LINEAR = PackedLinear()  # mode packed without oneDNN raises, naming the way out


def _install_internal_state() -> None:
    """``/server_info`` (``Engine.get_server_info()``) ``internal_states[i]["vericache"]``: the
    worker's counters and gauges (the same numbers ``/metrics`` has with --enable-metrics);
    ``["vericache_preempted"]``: preempted requests whose KV stayed in the tree, and the
    tokens it newly kept (any engine)."""
    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController

    original = SchedulerInternalStateController._add_speculative
    if getattr(original, "_vericache", False):
        return

    def _add_speculative(self, state):
        original(self, state)
        stats = getattr(getattr(self.scheduler, "draft_worker", None), "stats", None)
        if isinstance(stats, _Stats):
            tier = getattr(self.scheduler.draft_worker, "tier", None)
            if tier is not None:  # its threads count between iterations too
                stats.tier(tier)
            state["vericache"] = {**stats.totals, **stats.gauges}
        # every engine, speculation on or off (see _install_keep_preempted_kv)
        state["vericache_preempted"] = {"requests": _PREEMPTED[0], "kept_tokens": _PREEMPTED[1]}

    _add_speculative._vericache = True
    SchedulerInternalStateController._add_speculative = _add_speculative


def _install_weight_update_hook() -> None:
    """Weight copies we make (draft fp16/int8 copies, packed weights) are rebuilt after
    SGLang updates the model's weights in place (update_weights_from_disk / _tensor / ...)."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from sgl_vericache.cpu_linear import weights_updated

    for name in dir(WeightUpdater):
        method = getattr(WeightUpdater, name)
        if not (name.startswith(("update_weights", "load_weights", "receive_weights")) or name == "end_weight_update"):
            continue
        if not callable(method) or getattr(method, "_vericache", False):
            continue

        def hooked(self, *args, _method=method, **kwargs):
            try:
                return _method(self, *args, **kwargs)
            finally:
                weights_updated()

        hooked._vericache = True
        hooked.__name__ = name
        setattr(WeightUpdater, name, hooked)


def _install_draft_weights() -> None:
    """While a VERICACHE worker drafts with ``--vericache-draft-weights fp16|int8``, SGLang's
    unquantized linear layers and its lm_head product use ``DraftWeights.linear`` (a cheaper
    copy of the same weights); every other forward (prefill, decode, verify) is untouched."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessor, should_apply_lm_head_quant_method
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    if getattr(UnquantizedLinearMethod.apply, "_vericache", False):
        return
    apply, lm_head = UnquantizedLinearMethod.apply, LogitsProcessor._compute_lm_head

    def draft_apply(self, layer, x, bias=None):
        if _DRAFT_WEIGHTS is not None:
            return _DRAFT_WEIGHTS.linear(x, layer.weight, bias)
        if (_PACKED_LINEAR is not None and not getattr(layer, "use_intel_amx_backend", False)
                and type(layer.weight.data) is torch.Tensor and _PACKED_LINEAR.serves(x, layer.weight, bias)):
            return _PACKED_LINEAR.linear(x, layer.weight, bias)
        return apply(self, layer, x, bias)

    def draft_lm_head(self, hidden_states, head, embedding_bias=None, **kwargs):
        plain = (not hasattr(head, "set_lora") and hasattr(head, "weight")
                 and not should_apply_lm_head_quant_method(head, getattr(head, "quant_method", None)))
        if _DRAFT_WEIGHTS is not None and plain:
            logits = _DRAFT_WEIGHTS.linear(hidden_states, head.weight)
            return logits if embedding_bias is None else logits + embedding_bias
        if (_PACKED_LINEAR is not None and plain and not self.use_fp32_lm_head
                and not getattr(head, "use_intel_amx_backend", False) and self.rl_on_policy_target is None
                and _PACKED_LINEAR.serves(hidden_states, head.weight)):
            return _PACKED_LINEAR.linear(hidden_states, head.weight)  # SGLang's plain branch: matmul, no bias
        return lm_head(self, hidden_states, head, embedding_bias, **kwargs)

    draft_apply._vericache = draft_lm_head._vericache = True
    UnquantizedLinearMethod.apply = draft_apply
    LogitsProcessor._compute_lm_head = draft_lm_head


# --- sampling: drafts and acceptance for batches that do not decode greedily --------------

_ACTIVE_WORKER = None  # the VeriCacheWorker inside its forward_batch_generation


def _install_verify_sampler() -> None:
    """NGRAM's verify calls ``eagle_sample``, which on CPU always commits argmax. For a
    VERICACHE batch that samples, acceptance goes to the worker instead; everything else
    (greedy batches, other algorithms) keeps SGLang's function."""
    import torch
    from sglang.srt.speculative import ngram_worker

    original = ngram_worker.eagle_sample
    if getattr(original, "_vericache", False):
        return

    def eagle_sample(verify_input, batch, logits_output, grammar_mask=None, *args, **kwargs):
        worker = _ACTIVE_WORKER
        if worker is None or worker._round is None or batch.sampling_info.is_all_greedy:
            out = original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)
        else:
            out = worker.verify_sample(verify_input, batch, logits_output, grammar_mask)
        if worker is not None and worker._deferred:  # rows that did not verify accept nothing
            _, accept_lens, accept_index = out
            rows = torch.tensor(worker._deferred, dtype=torch.int64, device=accept_lens.device)
            accept_lens[rows] = 0
            accept_index[rows] = -1
        return out

    eagle_sample._vericache = True
    ngram_worker.eagle_sample = eagle_sample


def _expand(t, repeat):
    import torch

    return None if t is None else torch.repeat_interleave(t, repeat, dim=0)


def _sampler_draw(sampler, logits, info, repeat, positions):
    """The tokens SGLang's own sampler would draw from ``logits`` (one row per position;
    each request's parameters repeated ``repeat`` times), through its own code: temperature,
    softmax, then its pytorch-backend top-k/top-p/min-p sampling with the batch's seeds
    at ``positions``. Equal logits give equal tokens to a non-speculative decode step."""
    import types

    import torch
    from sglang.srt.layers import sampler as sampler_mod

    x = logits.clone()
    x.div_(_expand(info.temperatures, repeat))
    probs = torch.softmax(x, dim=-1) if sampler.enable_deterministic else sampler_mod.sampler_softmax(x)
    rows = types.SimpleNamespace(
        sampling_mask_batch_indices=None,
        sampling_seed=_expand(info.sampling_seed, repeat),
        top_ks=_expand(info.top_ks, repeat),
        top_ps=_expand(info.top_ps, repeat),
        min_ps=_expand(info.min_ps, repeat),
        need_min_p_sampling=info.need_min_p_sampling,
        max_top_k=getattr(info, "max_top_k", None),
    )
    simple = not (info.need_top_p_sampling or info.need_top_k_sampling or info.need_min_p_sampling)
    tokens, _ = sampler._sample_from_probs(probs, rows, positions, simple)
    return tokens.to(torch.int64)


class _SampledRound:
    """Per-round drafting state for a batch that samples.

    Rows come in two kinds. *Matched* rows (a ``sampling_seed`` given, or greedy) draft
    with SGLang's sampler over the draft logits at the same (seed, position) the target
    will use, and are verified by comparing each draft token with the target's own draw:
    token-identical to non-speculative seeded sampling. *Rejection* rows (no seed) draft
    by sampling q (the draft distribution under the request's temperature/top-k/top-p)
    and are verified by speculative rejection sampling: the output is distributed exactly
    as non-speculative sampling."""

    def __init__(self, worker, batch, rows):
        from sgl_vericache.spec.accept import sampling_probs

        self.worker = worker
        self.rows = rows  # the batch rows that draft, in the order of the draft logits
        self.info = batch.sampling_info
        self._sampling_probs = sampling_probs
        greedy = (self.info.top_ks.view(-1) == 1).tolist()
        seeded = [req.sampling_params.sampling_seed is not None for req in batch.reqs]
        self.matched = [g or s for g, s in zip(greedy, seeded)]
        if self.info.sampling_seed is None:  # no seeds in this batch: match greedy rows only
            self.matched = greedy
        self.q_steps = []  # per step: [bs, V] draft distributions (rejection rows; others unused)

    def draw(self, logits, positions):
        """One draft step: ``logits`` [drafting rows, V] -> their tokens. The draft
        distributions are kept by batch row ([bs, V]; rows that do not draft stay 0)."""
        import torch

        tokens = torch.empty(logits.shape[0], dtype=torch.int64)
        match = [j for j, r in enumerate(self.rows) if self.matched[r]]
        reject = [j for j, r in enumerate(self.rows) if not self.matched[r]]
        q = None
        if match:
            local, rows = torch.tensor(match), torch.tensor([self.rows[j] for j in match])
            tokens[local] = _sampler_draw(self.worker.model_runner.sampler, logits[local],
                                          _RowView(self.info, rows), 1, positions[local])
        if reject:
            local, rows = torch.tensor(reject), torch.tensor([self.rows[j] for j in reject])
            q = torch.zeros((len(self.matched), logits.shape[1]), dtype=torch.float32)
            q[rows] = self._probs(logits[local], rows, 1)
            tokens[local] = torch.multinomial(q[rows], 1, generator=self.worker._rng).view(-1)
        self.q_steps.append(q)
        return tokens

    def _probs(self, logits, idx, repeat):
        info = self.info
        pick = lambda t: _expand(t[idx], repeat)  # noqa: E731
        return self._sampling_probs(
            logits.float(), pick(info.temperatures).view(-1), pick(info.top_ks).view(-1),
            pick(info.top_ps).view(-1), pick(info.min_ps).view(-1),
        )


class _RowView:
    """A SamplingBatchInfo restricted to some rows (the fields the sampler reads)."""

    def __init__(self, info, idx):
        for name in ("temperatures", "top_ks", "top_ps", "min_ps", "sampling_seed"):
            value = getattr(info, name)
            setattr(self, name, None if value is None else value[idx])
        for name in ("need_top_p_sampling", "need_top_k_sampling", "need_min_p_sampling", "max_top_k"):
            setattr(self, name, getattr(info, name, None))


def _sample_verify(worker, verify_input, batch, logits_output, grammar_mask):
    """Acceptance for a VERICACHE verify pass over a sampling batch; returns what SGLang's
    ``eagle_sample`` returns: (predict [bs*n] int32, accept_lens [bs] int32 incl. the bonus,
    accept_index [bs, n] int32 rows into the verify pass, -1 past the accepted ones)."""
    import torch

    from sgl_vericache.spec.accept import chain_match, rejection_sample_chain

    rnd = worker._round
    info = batch.sampling_info
    bs, n = len(batch.reqs), verify_input.draft_token_num
    logits = logits_output.next_token_logits
    # The same relaxed penalties and logit bias SGLang's verify applies, and the grammar.
    if info.acc_additive_penalties is not None:
        logits.add_(torch.repeat_interleave(info.acc_additive_penalties, n, dim=0))
    if info.acc_scaling_penalties is not None:
        from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

        apply_scaling_penalties(logits, torch.repeat_interleave(info.acc_scaling_penalties, n, dim=0))
    if info.logit_bias is not None:
        logits.add_(torch.repeat_interleave(info.logit_bias, n, dim=0))
    if grammar_mask is not None:
        grammar_mask.apply(logits)

    candidates = verify_input.draft_token.reshape(bs, n).to(torch.int64).cpu()
    logits = logits.reshape(bs, n, -1)
    positions = verify_input.positions.reshape(bs, n).to(torch.int64)
    num_acc = torch.zeros(bs, dtype=torch.int64)
    tokens = torch.full((bs, n), -1, dtype=torch.int64)
    max_accept = torch.full((bs,), n - 1, dtype=torch.int64)

    deferred = set(worker._deferred)  # staggered verifies: rows that accept nothing this round
    match_rows = [i for i, m in enumerate(rnd.matched) if m and i not in deferred]
    if match_rows:
        idx = torch.tensor(match_rows)
        targets = _sampler_draw(worker.model_runner.sampler, logits[idx].reshape(len(idx) * n, -1),
                                _RowView(info, idx), n, positions[idx].reshape(-1)).view(len(idx), n)
        k, toks = chain_match(candidates[idx], targets.cpu(), max_accept[idx])
        num_acc[idx], tokens[idx] = k, toks
    rej_rows = [i for i, m in enumerate(rnd.matched) if not m and i not in deferred]
    if rej_rows:
        idx = torch.tensor(rej_rows)
        r = len(rej_rows)
        p = rnd._probs(logits[idx].reshape(r * n, -1), idx, n).view(r, n, -1)
        q = torch.zeros((r, n - 1, p.shape[-1]), dtype=torch.float32)
        for j in range(n - 1):
            step_q = rnd.q_steps[j] if j < len(rnd.q_steps) else None
            if step_q is not None:
                q[:, j] = step_q[idx]
            # Columns past a request's own draft length repeat its last draft token, a
            # deterministic proposal: one-hot q (also where no q was recorded).
            pad = q[:, j].sum(-1) == 0
            if pad.any():
                q[pad, j] = 0.0
                q[pad, j, candidates[idx[pad], j + 1]] = 1.0
        k, toks = rejection_sample_chain(candidates[idx], p, q, max_accept[idx], generator=worker._rng)
        num_acc[idx], tokens[idx] = k, toks

    device = logits.device
    predict = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    for b in range(bs):
        if b in deferred:  # eagle_sample's wrapper gives it accept length 0
            continue
        k = int(num_acc[b])
        rows = torch.arange(b * n, b * n + k + 1)
        accept_index[b, : k + 1] = rows.to(torch.int32)
        predict[rows] = tokens[b, : k + 1].to(torch.int32)
    accept_lens = (num_acc + 1).to(torch.int32)
    return predict.to(device), accept_lens.to(device), accept_index.to(device)


# --- counters -------------------------------------------------------------------------


class _Stats:
    """Server-level VeriCache counters. With ``--enable-metrics`` they are Prometheus
    counters on SGLang's /metrics (``vericache:*``); always kept as plain totals too."""

    NAMES = {
        "rounds": "Verify rounds (one per request per iteration that verified it)",
        "deferred_rows": "Request-iterations that drafted but did not verify: staggered verifies kept their "
                         "full KV parked (--vericache-full-device-budget)",
        "verify_rows_skipped": "Deferred rows left out of a greedy round's verify forward (no projections, "
                               "MLP or LM head for them)",
        "drafted_tokens": "Draft tokens proposed to verify (each request's own draft length)",
        "accepted_tokens": "Draft tokens accepted by verify",
        "emitted_tokens": "Tokens emitted by verify rounds (accepted + bonus)",
        "draft_seconds": "Wall time spent drafting over compressed KV",
        "verify_seconds": "Wall time of verify passes incl. acceptance and KV commit",
        "full_kv_load_seconds": "Seconds spent loading full KV from the host tier before a forward "
                                "(CPU device pool: the forward waits for all of it)",
        "full_kv_parked_tokens": "Tokens of running requests' full KV parked in host memory at a round's start "
                                 "(--vericache-full-device-budget)",
        "full_kv_loaded_tokens": "Parked tokens copied back to the device for a verify",
        "full_kv_bytes_to_host": "Bytes of full KV parked in host memory",
        "full_kv_bytes_to_device": "Bytes of parked full KV copied back to the device",
        "full_kv_wait_seconds": "Seconds verify waited for parked full KV still being copied back",
        "full_kv_parks": "Requests parked at a round's start because they do not verify in it",
        "full_kv_parks_in_host_pool": "Requests parked in HiCache's host KV pool (the rest: in tensors of "
                                      "VeriCache's own, when there is no host pool or it is full)",
        "full_kv_copy_seconds": "Seconds the background copies of parked full KV back to the device took "
                                "(on CUDA: queueing on the side stream only)",
        "fetch_draft_requests": "Waiting requests that drafted while their prefix streamed in from a storage tier "
                                "(--vericache-fetch-draft-tokens)",
        "fetch_draft_steps": "Draft forward steps run for waiting requests (prompt tokens teacher-forced + drafts)",
        "fetch_draft_seconds": "Wall time of those steps (the scheduler would otherwise poll the prefetch idle)",
        "fetch_draft_tokens": "Drafts made while waiting and queued for the request's first rounds",
        "fetch_draft_rounds": "Verify rounds whose drafts were made while the request waited for its prefix",
        "fetch_draft_accepted": "Queued drafts (made while waiting) accepted by verify",
        "compressed_prefix_lookups": "New requests looked up in the compressed prefix cache",
        "compressed_prefix_hits": "New requests that started from a cached compressed prefix entry",
        "compressed_prefix_hit_tokens": "Verified tokens whose compressed KV came from the prefix cache",
        "compressed_prefix_inserted": "Compressed entries filed in the prefix cache",
        "compressed_prefix_evicted": "Compressed entries evicted from the prefix cache (LRU, byte budget)",
        "fetch_draft_tier_entries": "Waiting requests whose compressed entry was read back from the storage tier",
        "fetch_draft_tier_skipped": "Waiting requests whose compressed entry was in the storage tier but not read: "
                                    "expected to arrive too late to draft from (--vericache-fetch-draft-tier-fraction)",
        "fetch_draft_tier_lookups": "Waiting requests that looked their prefix up in the storage tier's index of "
                                    "compressed entries (no entry known in this process)",
        "fetch_draft_tier_index_entries": "Waiting requests that drafted from an entry found through that index",
        "compressed_tier_index_records": "Index records written beside compressed entries (found by any process)",
        "compressed_tier_index_failures": "Index records the storage tier refused or failed to write",
        "compressed_tier_index_lookups": "Lookups of a prefix in the storage tier's index",
        "compressed_tier_index_probes": "Index records asked for by those lookups",
        "compressed_tier_index_hits": "Lookups that read back an entry",
        "compressed_tier_index_skipped": "Lookups that found an entry but did not read it: expected too late "
                                         "(--vericache-fetch-draft-tier-fraction)",
        "compressed_tier_spilled_entries": "Compressed entries evicted from the prefix cache and written to the "
                                           "storage tier",
        "compressed_tier_spilled_bytes": "Bytes of those entries as stored (encoded, with their digest)",
        "compressed_tier_spill_failures": "Compressed entries the storage tier refused or failed to write",
        "compressed_tier_spills_dropped": "Evicted entries dropped, not written: too many bytes already waiting",
        "compressed_tier_fetches": "Compressed entries read back from the storage tier",
        "compressed_tier_fetched_bytes": "Bytes read back",
        "compressed_tier_fetch_seconds": "Seconds those reads took (on the tier's reader thread)",
        "compressed_tier_fetch_misses": "Reads the tier had no entry for (evicted there)",
        "compressed_tier_fetch_corrupt": "Reads whose bytes failed the entry's digest (a miss)",
        "compressed_tier_fetches_from_memory": "Reads answered before the entry's write had finished (no I/O)",
    }
    GAUGES = {
        "compressed_prefix_bytes": "Bytes of compressed KV held by the prefix cache",
        "compressed_prefix_entries": "Entries held by the prefix cache",
        "compressed_prefix_spilled": "Entries the prefix cache knows to be in the storage tier (stubs)",
    }

    def __init__(self, enable_metrics: bool):
        self.totals = {name: 0.0 for name in self.NAMES}
        self.gauges = {name: 0.0 for name in self.GAUGES}
        self._prom = {}
        if enable_metrics:
            from prometheus_client import Counter, Gauge

            for name, doc in self.NAMES.items():
                self._prom[name] = Counter(f"vericache:{name}", doc)
            for name, doc in self.GAUGES.items():
                self._prom[name] = Gauge(f"vericache:{name}", doc)
        self._pending_draft = 0.0

    def add(self, name, value):
        self.totals[name] += value
        if name in self._prom and value:
            self._prom[name].inc(value)

    def drafted(self, seconds, tokens):
        self._pending_draft = seconds
        self.add("draft_seconds", seconds)
        self.add("drafted_tokens", tokens)

    def verified(self, seconds, accept_lens):
        lens = [int(x) for x in accept_lens]
        self.add("verify_seconds", max(seconds - self._pending_draft, 0.0))
        self.add("rounds", len(lens))
        self.add("emitted_tokens", sum(lens))
        self.add("accepted_tokens", sum(lens) - len(lens))
        self._pending_draft = 0.0

    def end_iteration(self):
        self._pending_draft = 0.0
        self.add("full_kv_load_seconds", _LOAD_SECONDS[0] - self.totals["full_kv_load_seconds"])

    def tier(self, tier):
        """Bring the ``compressed_tier_*`` counters up to the storage tier's own totals."""
        for name, total in tier.snapshot().items():
            self.add("compressed_tier_" + name, total - self.totals["compressed_tier_" + name])

    def prefix_cache(self, cache):
        """Bring the prefix-cache counters up to the cache's own totals."""
        for name, total in (("compressed_prefix_lookups", cache.lookups), ("compressed_prefix_hits", cache.hits),
                            ("compressed_prefix_hit_tokens", cache.hit_tokens),
                            ("compressed_prefix_inserted", cache.inserted),
                            ("compressed_prefix_evicted", cache.evicted)):
            self.add(name, total - self.totals[name])
        for name, value in (("compressed_prefix_bytes", cache.nbytes), ("compressed_prefix_entries", cache.num_entries),
                            ("compressed_prefix_spilled", cache.num_spilled)):
            self.gauges[name] = value
            if name in self._prom:
                self._prom[name].set(value)
