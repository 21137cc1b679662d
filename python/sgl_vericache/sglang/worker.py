"""The ``VERICACHE`` worker (imported when SGLang builds one: it imports SGLang's NGRAM worker).

Touches ``NGRAMWorker``, whose shape VERICACHE shares (no draft model, no draft KV, a linear
chain verified by the target): SGLang's NGRAM scheduling, verify pass, acceptance and KV
move run unchanged, and the worker replaces NGRAM's corpus lookup (``_prepare_draft_tokens``)
with a VeriCache round (``spec.round.Speculator``), or, when the adaptive controller says
so, runs SGLang's plain one-token decode step (``_prepare_for_speculative_decoding``). Also
NGRAM's verify buffers, kept per verify width (a round verifies as many tokens as its
longest draft needs), ``assign_extend_cache_locs`` (a plain step's KV slot) and the model
runner's pools, read through ``WorkerSeam``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import nullcontext

import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.runtime_context import (get_device, get_disagg, get_exec, get_memory, get_observability,
                                        get_schedule, get_spec)
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_worker import NGRAMWorker

from sgl_vericache.config import VeriCacheConfig
from sgl_vericache.sglang import attention, attention_layers, forward, penalties, radix, sampling, storage
from sgl_vericache.sglang.linear import build_draft_weights
from sgl_vericache.sglang.runtime import Runtime
from sgl_vericache.sglang.server import (check_cuda_graphs, check_deterministic, check_kv_cache_dtype, check_kv_pool,
                                         check_parallelism, check_request_entry,
                                         check_disaggregation, check_grammar_backend, check_parking_args,
                                         check_routed_experts, check_sampling)
from sgl_vericache.spec.ranks import first_rank_values
from sgl_vericache.spec.round import Speculator
from sgl_vericache.spec.round_batch import RoundBatch, device_clock, last_token
from sgl_vericache.spec.stats import Stats

logger = logging.getLogger(__name__)


class NoCorpus:
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



class WorkerSeam:
    """What the round needs that only SGLang can do, for one worker (see ``spec.round``)."""

    def __init__(self, worker, runtime: Runtime, draft_weights):
        self.worker = worker
        self.runtime = runtime
        self.model_runner = worker.model_runner
        self.device = worker.device
        self.num_layers = self.model_runner.model_config.num_hidden_layers
        self.context_len = self.model_runner.model_config.context_len  # positions verify may reach
        self.passes = forward.DraftPasses(self.model_runner, runtime, draft_weights)
        # layer id -> window, sliding-window layers only
        self.windows = attention_layers.sliding_windows(self.model_runner.model)
        from sglang.srt.distributed.parallel_state import get_tp_group

        self.tp_group = get_tp_group()
        self.tp_size = self.tp_group.world_size

    def agree(self, seconds) -> tuple:
        """Step times every tensor-parallel rank's planner takes alike: the first rank's."""
        return first_rank_values(seconds, self.tp_group)

    def agree_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """A sampled draft step's tokens, the first tensor-parallel rank's on every rank (the
        verify's inputs and the KV it writes must be alike; SGLang's sampled verify broadcasts
        its acceptance the same way). In place; a no-op on one rank."""
        return self.tp_group.broadcast(tokens, src=0)

    def read_kv(self, pool_row: int):
        """``read_kv(layer, start, end)`` over one request-to-token row of the full pool."""
        pool = self.model_runner.token_to_kv_pool
        slots_row = self.model_runner.req_to_token_pool.req_to_token[pool_row]

        def read_kv(layer_id, start, end):
            slots = slots_row[start:end].to(torch.int64)
            return pool.get_key_buffer(layer_id)[slots], pool.get_value_buffer(layer_id)[slots]

        return read_kv

    def slots(self, pool_row: int, start: int, end: int) -> torch.Tensor:
        """KV pool slots of positions ``start .. end - 1`` of one request-to-token row."""
        return self.model_runner.req_to_token_pool.req_to_token[pool_row, start:end]

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full KV pool's keys and values of one layer, [slots, H_kv, D] each."""
        pool = self.model_runner.token_to_kv_pool
        return pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)

    def abort(self, req, message: str, status: int = 400) -> None:
        """End ``req`` with ``status`` (400: a bad request) and ``message``; the rest of the
        batch goes on."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        req.to_finish = FINISH_ABORT(message, status, "BadRequestError" if status == 400 else "InternalServerError")

    def draft_penalty(self, batch, rows):
        """Penalties for a round's draft steps over ``rows`` of ``batch`` (None: none)."""
        return penalties.DraftPenalty.of(batch.sampling_info, rows, batch.reqs)

    def sampled_round(self, batch, rows, rng):
        return sampling.make_sampled_round(self.model_runner.sampler, batch, rows, rng)

    def build_parking(self, reserve_limit: int):
        return radix.build_parking(self.runtime, self.model_runner, reserve_limit)

    def storage_blobs(self):
        return storage.storage_blobs(self.runtime)

    def model_key(self) -> tuple:
        """The model, as a compressed entry in a shared storage tier must name it."""
        cfg = self.model_runner.model_config
        return (getattr(cfg, "model_path", ""), str(cfg.dtype), cfg.num_hidden_layers,
                cfg.get_total_num_kv_heads() if hasattr(cfg, "get_total_num_kv_heads") else None,
                getattr(cfg, "head_dim", None))

    def head_layout(self, kv_dtype=None):
        """This worker's attention heads and dtypes, as the draft kernels see them (their
        start-up warm-up, ``spec.warm_up``): from the model's first RadixAttention layer
        (its heads and logit soft cap), whether its attention has sinks, and the full KV
        pool (``kv_dtype``: the pool's dtype before the pool exists); None for a model
        without one."""
        from sglang.srt.layers.radix_attention import RadixAttention

        from sgl_vericache.sglang.attention_layers import has_attention_sinks, logit_cap
        from sgl_vericache.spec.warm_up import HeadLayout

        layer = next((m for m in self.model_runner.model.modules() if isinstance(m, RadixAttention)), None)
        if layer is None:
            return None
        if kv_dtype is None:
            kv_dtype = self.model_runner.token_to_kv_pool.get_key_buffer(layer.layer_id).dtype
        return HeadLayout(layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, kv_dtype,
                          self.model_runner.model_config.dtype, logit_cap(layer) or 0.0,
                          has_attention_sinks(self.model_runner.model))

    def kv_layouts(self) -> tuple:
        """(KV heads, head_dim) of each distinct shape of this rank's attention layers: what
        every compressor a request may get must serve (``Planner.serve_layouts``)."""
        from sglang.srt.layers.radix_attention import RadixAttention

        return tuple(sorted({(m.tp_k_head_num, m.qk_head_dim) for m in self.model_runner.model.modules()
                             if isinstance(m, RadixAttention)}))

    def full_kv_bytes_per_token(self) -> int:
        """Bytes of full KV per token (every layer's keys and values); 0 if the pool has no
        per-layer buffers to measure."""
        pool = self.model_runner.token_to_kv_pool
        bufs = list(getattr(pool, "k_buffer", ()) or ()) + list(getattr(pool, "v_buffer", ()) or ())
        return sum(b[0].numel() * b.element_size() for b in bufs if b.dim() > 0 and len(b))


def decode_graphs_on(model_runner) -> bool:
    """Whether the engine replays decode (and verify) forwards from CUDA graphs: a graph
    runner it built, or SGLang's resolved graph config (a capture it defers to later), not
    --disable-cuda-graph, which SGLang ranks below its per-phase selectors."""
    if getattr(model_runner, "decode_cuda_graph_runner", None) is not None:
        return True
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import get_exec

    config = getattr(getattr(get_exec(), "graph", None), "cuda_graph_config", None)
    return config is not None and config.decode.backend != Backend.DISABLED


class VeriCacheWorker(NGRAMWorker):
    """NGRAM's worker with VeriCache rounds in place of its corpus lookup: SGLang calls in
    (``forward_batch_generation``, ``_prepare_draft_tokens``, ...), the round goes out to
    ``self.speculator``. ``runtime`` is set by ``spec_algorithm`` before SGLang builds one."""

    runtime: Runtime = None

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
        self._last_decode_reqs = {}  # rid -> Req of the last decode iteration (rounds and plain steps)
        self._capturing = {}  # rid -> Req whose prompt queries were captured and not yet used
        self.plain = False  # this iteration decodes plainly (--vericache-adaptive chose no drafts)
        self.grammar_tree_host = None
        self.cuda_graphs = decode_graphs_on(self.model_runner)
        check_cuda_graphs(self.cuda_graphs, self.device)
        check_kv_cache_dtype(self.model_runner.kv_cache_dtype)
        attention_layers.check_attention(self.model_runner.model, self.model_runner.model_config, self.device)
        check_parallelism(getattr(server_args, "enable_dp_attention", False), getattr(server_args, "pp_size", 1),
                          getattr(server_args, "dcp_size", 1), getattr(server_args, "attn_cp_size", 1),
                          bool(getattr(server_args, "enable_prefill_cp", False)),
                          bool(getattr(getattr(get_exec(), "overlap", None), "enable_two_batch_overlap", False)))
        check_request_entry(getattr(server_args, "tokenizer_worker_num", 1),
                            bool(getattr(server_args, "smg_grpc_mode", False) or getattr(server_args, "grpc_mode", False)))
        check_sampling(get_exec().kernel.sampling_backend, bool(get_exec().features.enable_custom_logit_processor))
        check_routed_experts(bool(getattr(get_exec().features, "enable_return_routed_experts", False)))
        check_disaggregation(getattr(get_disagg(), "disaggregation_mode", None),
                             bool(getattr(server_args, "enable_pdmux", False)))
        check_grammar_backend(getattr(get_exec().kernel, "grammar_backend", None))
        self.vc = VeriCacheConfig.from_env() or VeriCacheConfig()
        check_deterministic(self.vc.deterministic, self.device)
        runtime = self.runtime
        draft_weights = build_draft_weights(self.vc.draft_weights, self.model_runner, runtime)
        self.seam = WorkerSeam(self, runtime, draft_weights)
        if self.seam.tp_group.world_size > 1 and self.vc.fetch_draft_tokens > 0:
            # its draft forwards run inside a time budget per poll: tensor-parallel ranks would
            # run different numbers of them and hang in their all-reduces
            logger.warning("VeriCache: fetch drafting (--vericache-fetch-draft-tokens) is off with tensor "
                           "parallelism (--tp-size %d)", self.seam.tp_group.world_size)
            self.vc = dataclasses.replace(self.vc, fetch_draft_tokens=0)
        rng = torch.Generator(device="cpu").manual_seed(int(server_args.random_seed or 0))
        self.speculator = Speculator(self.vc, self.seam, Stats(get_observability().enable_metrics), rng)
        # a compressor that cannot serve the model's heads (a KIVI group size that does not divide
        # head_dim) is refused here, and auto's candidates narrowed, not met at a first round
        self.speculator.planner.serve_layouts(self.seam.kv_layouts())
        self.ngram_corpus = NoCorpus(self.speculator.release_departed)
        self.verify_backend = None
        if self.vc.full_device_budget >= 0:
            check_parking_args(get_memory().radix_cache_backend, self.page_size)
        runtime.workers.add(self)

    def check_integrity(self):
        self.speculator.check_integrity(radix.CacheIntegrityError)

    def alloc_memory_pool(self, **kwargs):
        super().alloc_memory_pool(**kwargs)
        # SGLang builds this worker before the KV pool (Scheduler.init_model_worker): what
        # reads the pool runs from here on, not in __init__
        check_kv_pool(self.model_runner.token_to_kv_pool, self.model_runner.req_to_token_pool)
        self.speculator.warm_up_kernels(compile_now=self.vc.warm_up_kernels)
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

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        self.speculator.attach_tier()
        self.plain = False
        width = self.max_width
        if batch.forward_mode.is_decode():
            self._release_departed(batch)
            # a plain iteration lays out one token a row: its logprobs, grammar and hidden states
            # would be read at a round's row stride (a round of width 1 is a decode step)
            must_round = bool(batch.return_logprob or batch.has_grammar or getattr(batch, "return_hidden_states", False))
            width = self.speculator.begin_iteration(batch.reqs, batch.seq_lens_cpu.tolist(), self.max_width,
                                                    must_round=must_round)
            self.plain, width = width == 0, width or self.max_width
        self._set_width(width)
        try:
            result = self._forward(batch, on_publish, pp_proxy_tensors)
        finally:
            self._set_width(self.max_width)
        if width != self.max_width and result.next_draft_input is not None:
            forward.widen_draft_input(result.next_draft_input, len(batch.reqs), width, self.max_width)
        return result

    def _forward(self, batch, on_publish, pp_proxy_tensors):
        # SGLang's CPU attention (torch_native) has no TARGET_VERIFY path: run the
        # whole iteration with a backend that adds one and delegates the rest.
        if self.verify_backend is None:
            self.verify_backend = attention.make_verify_backend(self.model_runner, self.runtime, self.vc.deterministic)
        spec = self.speculator
        self._forget_finished_queries()
        windows = spec.query_windows(batch.reqs) if batch.forward_mode.is_extend() else ()
        capture = any(windows)
        if capture:
            self._capturing.update((req.rid, req) for req in batch.reqs)
        is_round = batch.forward_mode.is_decode() and not self.plain
        self.runtime.active_worker = self
        t0 = time.perf_counter()
        # the verify backend only for a round's verify: elsewhere SGLang's own, which some
        # models test for by class at prefill (Gemma 3 multimodal on Triton builds its image
        # tokens' bidirectional mask); a prefill whose queries SnapKV / H2O need keeps it too
        if is_round:
            scope = forward_context(ForwardContext(attn_backend=self.verify_backend))
        elif capture:
            scope = attention.capturing_queries(self.model_runner.attn_backend, spec.queries,
                                                [req.rid for req in batch.reqs], windows)
        else:
            scope = nullcontext()
        try:
            with scope:
                result = super().forward_batch_generation(batch, on_publish, pp_proxy_tensors)
        finally:
            self.runtime.active_worker = None
            deferred = spec.close_round()
            self.verify_backend.end_forward()
        if self.plain:
            # NGRAM's non-verify branch returns one token per row; the scheduler reads a
            # decode result at the round's row stride, as a round lays its tokens out
            result.next_token_ids = result.next_draft_input.accept_tokens
            spec.end_plain(device_clock(self.device) - t0, self.runtime.load_seconds)
            return result
        lens = result.accept_lens.tolist() if is_round and result.accept_lens is not None else None
        spec.count_round(batch.reqs, lens, deferred, time.perf_counter() - t0, self.runtime.load_seconds)
        return result

    def _prepare_for_speculative_decoding(self, batch):
        if not (self.plain and batch.forward_mode.is_decode()):
            return super()._prepare_for_speculative_decoding(batch)
        # A plain iteration: SGLang's one-token decode step. The spec scheduler already
        # reserved the KV slots after each request's committed tokens; take the first,
        # feed the last committed token, and leave the mode DECODE, so NGRAM's worker
        # runs the target's ordinary forward and sampler (its non-verify branch).
        bs = len(batch.reqs)
        batch.input_ids = torch.tensor([last_token(req) for req in batch.reqs], dtype=torch.int64,
                                       device=self.device)
        batch.out_cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=batch.seq_lens, end_offset=batch.seq_lens + 1, batch_size=bs, draft_token_num=1,
            device=self.device)
        batch.seq_lens = batch.seq_lens + 1
        batch.seq_lens_cpu = batch.seq_lens_cpu + 1
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        if getattr(batch, "orig_seq_lens", None) is not None:
            batch.orig_seq_lens = batch.orig_seq_lens + 1
        batch.spec_info = None  # the last round's relay carries no positions for a decode step

    def _release_departed(self, batch):
        """Requests that left the decode batch since the last decode iteration file their
        compressed entry (NGRAM reports departures only after verify rounds). A request is
        its ``Req``, not its rid: SGLang accepts a finished request's rid again (an agent
        reusing one for every turn), and a new request under it may arrive before any decode
        iteration saw the old one leave."""
        current = {req.rid: req for req in batch.reqs}
        gone = [rid for rid, req in self._last_decode_reqs.items() if current.get(rid) is not req]
        self._last_decode_reqs = current
        if gone:  # in rid order, not a set's (per-process string hashing): the prefix cache's
            # LRU order follows it, alike on every tensor-parallel rank
            self.speculator.release_departed(sorted(gone, key=str), reused={rid: current[rid] for rid in gone
                                                                           if rid in current})

    def _forget_finished_queries(self):
        """A request finished at its prefill (SGLang marks it after that forward) never
        drafts: its captured prompt queries (up to MAX_CAPTURED_QUERIES x layers x heads x
        head dim, on the device) go at the next forward instead of staying for ever."""
        spec = self.speculator
        finished = [rid for rid, req in self._capturing.items() if req.finished()]
        for rid in [r for r in self._capturing if r not in spec.queries] + finished:
            self._capturing.pop(rid, None)  # used by a round, or never will be
        spec.forget_queries(finished)

    def clear_cache_pool(self):
        self.speculator.clear()
        self._capturing.clear()
        self._prev_decode_rids = set()
        self._last_decode_reqs = {}

    def _update_ngram_corpus(self, batch):
        pass

    def _prepare_draft_tokens(self, batch):
        round_batch = RoundBatch(
            reqs=batch.reqs, verified=batch.seq_lens_cpu.tolist(), pool_rows=batch.req_pool_indices.tolist(),
            own_kv_start=[req.kv.cache_protected_len for req in batch.reqs],
            greedy=batch.sampling_info.is_all_greedy,
            verify_always=[bool(req.return_logprob) or req.grammar is not None for req in batch.reqs],
            source=batch)
        drafts = self.speculator.draft_round(round_batch, self.draft_token_num)
        self.verify_backend.skip_rows = frozenset(self.speculator.deferred)
        return drafts.tokens, drafts.mask

