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
    return argv + [
        "--speculative-algorithm", SPEC_ALGORITHM,
        "--speculative-num-draft-tokens", str(vc.draft_len + 1),
        "--speculative-ngram-max-bfs-breadth", "1",
        "--disable-overlap-schedule",
    ]


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
    from sglang.srt.runtime_context import get_device, get_schedule, get_spec
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from sgl_vericache.config import VeriCacheConfig, request_config

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
            self._plans = {}  # rid -> (compressor, draft_len) for this request
            self._queries = {}  # rid -> per-layer last prompt queries, until compressed
            self._compressors = {}  # VeriCacheConfig -> compressor (shared, stateless)
            self.ngram_corpus = _NoCorpus(self._release_departed)
            self._draft_backend = None
            self._verify_backend = None

        def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
            # SGLang's CPU attention (torch_native) has no TARGET_VERIFY path: run the
            # whole iteration with a backend that adds one and delegates the rest.
            if self._verify_backend is None:
                self._verify_backend = _make_verify_backend(self.model_runner)
            capture = batch.forward_mode.is_extend() and self._needs_queries(batch)
            self._verify_backend.capture = self._queries if capture else None
            self._verify_backend.capture_rids = [req.rid for req in batch.reqs] if capture else None
            with forward_context(ForwardContext(attn_backend=self._verify_backend)):
                return super().forward_batch_generation(batch, on_publish, pp_proxy_tensors)

        def _needs_queries(self, batch):
            return any(self._plan(req)[0].needs_queries for req in batch.reqs)

        def _release_departed(self, rids):
            for rid in rids:
                self.store.release(rid)
                self._plans.pop(rid, None)
                self._queries.pop(rid, None)

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

        def clear_cache_pool(self):
            self.store.clear()
            self._prev_decode_rids = set()

        def _update_ngram_corpus(self, batch):
            pass

        def _prepare_draft_tokens(self, batch):
            bs = len(batch.reqs)
            n = self.draft_token_num
            verified = batch.seq_lens_cpu.tolist()
            plans = [self._plan(req) for req in batch.reqs]
            self._sync_store(batch, verified, plans)
            roots = [_last_token(req) for req in batch.reqs]
            steps = max(draft_len for _, draft_len in plans)
            drafts = self._draft(batch, roots, verified, steps)  # [bs, steps]
            drafts = _pad_drafts(drafts, [draft_len for _, draft_len in plans], n - 1)
            tokens = np.concatenate([np.asarray(roots, dtype=np.int64)[:, None], drafts], axis=1)
            chain = np.tril(np.ones((n, n), dtype=bool))
            mask = np.broadcast_to(chain, (bs, n, n)).reshape(-1).copy()
            return tokens.reshape(-1), mask

        def _sync_store(self, batch, verified, plans):
            pool = self.model_runner.token_to_kv_pool
            req_to_token = self.model_runner.req_to_token_pool.req_to_token
            pool_rows = batch.req_pool_indices.tolist()
            for i, req in enumerate(batch.reqs):
                slots_row = req_to_token[pool_rows[i]]

                def read_kv(layer_id, start, end, row=slots_row):
                    slots = row[start:end].to(torch.int64)
                    return pool.get_key_buffer(layer_id)[slots], pool.get_value_buffer(layer_id)[slots]

                queries = None
                if req.rid not in self.store:
                    queries = _layer_queries(self._queries.pop(req.rid, None), self.store.num_layers)
                self.store.sync(req.rid, verified[i], read_kv, compressor=plans[i][0], queries=queries)

        def _draft(self, batch, roots, verified, steps):
            bs = len(batch.reqs)
            if self._draft_backend is None:
                self._draft_backend = _make_draft_backend(self.model_runner, self.store)
            self._draft_backend.rids = [req.rid for req in batch.reqs]
            fb = ForwardBatch.init_new(batch, self.model_runner, return_hidden_states_before_norm=False)
            fb.forward_mode = ForwardMode.DECODE
            fb.out_cache_loc = None
            tokens = torch.tensor(roots, dtype=torch.int64, device=self.device)
            base = torch.tensor(verified, dtype=torch.int64, device=self.device)
            out = torch.empty((bs, steps), dtype=torch.int64)
            with forward_context(ForwardContext(attn_backend=self._draft_backend), forward_batch=fb):
                for step in range(steps):
                    fb.input_ids = tokens
                    fb.positions = base + step
                    logits = self.model_runner.forward(fb).logits_output.next_token_logits
                    tokens = torch.argmax(logits, dim=-1)
                    out[:, step] = tokens.cpu()
            return out.numpy()

    return VeriCacheWorker


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


def _pad_drafts(drafts: np.ndarray, draft_lens: list[int], width: int) -> np.ndarray:
    """[bs, steps] drafts -> [bs, width]: a request's tokens past its own draft length
    repeat its last real draft token. Padding is verified like any draft token, so it
    can never change the output; it only fills the fixed verify width."""
    bs = drafts.shape[0]
    out = np.empty((bs, width), dtype=np.int64)
    for i, draft_len in enumerate(draft_lens):
        out[i, :draft_len] = drafts[i, :draft_len]
        out[i, draft_len:] = drafts[i, draft_len - 1]
    return out


def _last_token(req) -> int:
    return int(req.output_ids[-1]) if len(req.output_ids) else int(req.origin_input_ids[-1])


def _make_draft_backend(model_runner, store):
    import torch
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    class _DraftAttentionBackend(AttentionBackend):
        """Decode-only attention over the compressed entries; never writes the KV pool."""

        def __init__(self):
            super().__init__()
            self.req_to_token_pool = model_runner.req_to_token_pool
            self.token_to_kv_pool = model_runner.token_to_kv_pool
            self.device = model_runner.device
            self.rids: list = []

        def init_forward_metadata(self, forward_batch):
            pass

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
            q = q.reshape(-1, hq, d)  # [bs, H_q, D]
            k = k.reshape(-1, hkv, d)
            v = v.reshape(-1, hkv, layer.v_head_dim)
            outs = [
                store.attend(rid, layer.layer_id, q[i : i + 1], k[i : i + 1], v[i : i + 1], layer.scaling)
                for i, rid in enumerate(self.rids)
            ]
            return torch.cat(outs).reshape(-1, hq * layer.v_head_dim)

        def forward_extend(self, *args, **kwargs):
            raise RuntimeError("VeriCache draft attention runs decode steps only")

    return _DraftAttentionBackend()


def _make_verify_backend(model_runner):
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
        prefix = seq_lens[b]
        slots = req_to_token[rows[b], : prefix + n].to(torch.int64)
        keys, values = k_cache[slots], v_cache[slots]  # [prefix + n, H_kv, D]
        visible = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=q.device), tree[b]], dim=1)
        o = F.scaled_dot_product_attention(
            q[b].transpose(0, 1).float(), keys.transpose(0, 1).float(), values.transpose(0, 1).float(),
            attn_mask=visible, scale=layer.scaling, enable_gqa=hq != keys.shape[1],
        )  # [H_q, n, Dv]
        out[b] = o.transpose(0, 1).to(out.dtype)
    return out.reshape(bs * n, hq * dv)


def _verify_tree_mask(forward_batch, bs, n, device):
    import torch

    mask = getattr(forward_batch.spec_info, "custom_mask", None)
    if mask is None or mask.numel() != bs * n * n:
        return torch.tril(torch.ones(n, n, dtype=torch.bool, device=device)).expand(bs, n, n)
    return mask.reshape(bs, n, n).to(torch.bool)
