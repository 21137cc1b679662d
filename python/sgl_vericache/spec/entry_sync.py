"""The compressed entries' half of the ``Speculator`` (``spec/round.py``), no SGLang imports:
each round brings every drafting request's entry up to its verified tokens (a new request
starts from a cached compressed prefix when one matches), departing requests file theirs in
the compressed prefix cache, and entries evicted from that cache go to the storage tier.
The prompt queries SnapKV and H2O choose their keys by are kept here from prefill until a
request's first round.

``EntrySync`` is a mixin, the way SGLang splits its scheduler: its methods read the
``Speculator``'s state (``vc``, ``seam``, ``stats``, ``planner``, ``store``, ``prefix_cache``,
``reqs``, ``queries``, ``parking``, ``tier``, ``_tier_pending``, ``weights_gen``), which
``Speculator.__init__`` sets."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from sgl_vericache.cpu.linear import weights_generation
from sgl_vericache.spec.plan import Plan
from sgl_vericache.spec.round_batch import RoundBatch

logger = logging.getLogger(__name__)

STAND_IN = "streamingllm"  # drafts for a SnapKV / H2O request whose entry is rebuilt without its queries

# Prompt queries kept per request and layer for query-aware compressors (SnapKV votes
# with the last window_size of them; H2O accumulates attention over all it is given).
MAX_CAPTURED_QUERIES = 512


def kv_tokens(req, n: int) -> list[int]:
    """The first ``n`` tokens of a request whose KV is in the cache (prompt, then output)."""
    tokens = list(req.origin_input_ids[:n])
    if len(tokens) < n:
        tokens += list(req.output_ids[: n - len(tokens)])
    return tokens


def ids_name_kv(req) -> bool:
    """Whether ``req``'s token ids name its KV, so its compressed entries can be shared by
    them (the compressed prefix cache). An ``input_embeds`` request's ids are placeholders,
    ``[1] * len`` (any two of one length would match), and SGLang empties its output ids
    when it is retracted, so its tokens no longer even count its KV."""
    return getattr(req, "input_embeds", None) is None


def layer_queries(captured: Optional[dict], num_layers: int) -> Optional[list]:
    """Captured prompt queries ``{layer_id: [W, H_q, D]}`` -> one entry per layer (None: none)."""
    if captured is None:
        return None
    return [captured.get(layer_id) for layer_id in range(num_layers)]


class EntrySync:
    """The ``Speculator``'s compressed entries: synced each round, filed when a request
    departs, spilled to the storage tier."""

    # -- captured prompt queries ---------------------------------------------------------

    def query_windows(self, reqs) -> list[int]:
        """How many trailing prompt queries a prefill of ``reqs`` keeps of each (0: none), for
        their compressors (SnapKV reads its observation window, H2O every query it is
        given): at most MAX_CAPTURED_QUERIES a request and layer, held on the device until
        its first round."""
        return [min(plan.compressor.query_window or MAX_CAPTURED_QUERIES, MAX_CAPTURED_QUERIES)
                if plan.compressor.needs_queries else 0 for plan in self.planner.plan_arriving(reqs)]

    def forget_queries(self, rids) -> None:
        """Prompt queries captured for requests that will never draft (finished or aborted
        at their prefill: one token asked, an end token first). They are used and dropped at
        a request's first round, or when it leaves a decode batch; these never reach one."""
        for rid in rids:
            self.queries.pop(rid, None)
        self.stats.gauge("captured_query_requests", len(self.queries))

    # -- each round: entries up to the verified tokens ------------------------------------

    def _sync_store(self, batch: RoundBatch, plans: list[Plan], verifying: list[bool]) -> list[int]:
        """Bring each drafting request's compressed entry up to its verified tokens (a new
        one's from the prefix cache where it can). A parked
        request that does not verify this round drafts nothing: it is left as it is (its
        entry, if let go, is built again in the round it verifies in, whose load is within
        what parked requests hold reserved; loading every such request at once was not).
        An error in one request's compression (our bug) ends that request with a 500 and
        leaves the round to the rest (under tensor parallelism it still raises: one rank's
        error does not tell the others); running out of memory and parking's errors go to
        the caller. Returns the rows that failed (they draft nothing this round)."""
        failed = []
        for i, req in enumerate(batch.reqs):
            parked = self.parking is not None and self.parking.is_parked(req.rid)
            if parked and not verifying[i]:
                continue
            if parked and self.store.behind(req.rid, batch.verified[i], plans[i].compressor):
                # its entry is built again from its KV (let go after running out of memory, or
                # a new compressor): read where parking freed the slots, it would compress (and
                # file in the prefix cache) whatever now lies there. Rare: its KV comes back
                # first (it verifies this round: start_loads would load it anyway).
                self.parking.load_now(req.rid, batch.pool_rows[i])
                self.stats.add("full_kv_loads_for_rebuild", 1)
            try:
                self._sync_one(batch, plans, i)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                if getattr(self.seam, "tp_size", 1) > 1:
                    raise
                logger.exception("VeriCache: compressing request %s's KV failed", req.rid)
                self.store.release(req.rid)
                self.seam.abort(req, f"VeriCache could not compress this request's KV: {type(exc).__name__}: {exc}",
                                status=500)
                self.stats.add("sync_errors", 1)
                failed.append(i)
        return failed

    def _sync_one(self, batch: RoundBatch, plans: list[Plan], i: int) -> None:
        req = batch.reqs[i]
        read_kv = self.seam.read_kv(batch.pool_rows[i])
        queries, compressor = None, plans[i].compressor
        if self.store.rebuilds(req.rid, batch.verified[i], compressor):
            queries = layer_queries(self.queries.pop(req.rid, None), self.store.num_layers)
            if compressor.needs_queries and queries is None:
                plans[i] = self._without_queries(req, plans[i])
                compressor = plans[i].compressor
        if req.rid not in self.store:
            self._seed_from_prefix(req, batch.verified[i], compressor, read_kv)
        self.store.sync(req.rid, batch.verified[i], read_kv, compressor=compressor, queries=queries)

    def _without_queries(self, req, plan: Plan) -> Plan:
        """SnapKV and H2O choose the keys they keep by the prompt's last queries, which are
        captured at prefill and let go at the request's first round. An entry built again
        later (the entries let go after drafting ran out of memory, or ``auto`` moving the
        request to one of them) has none: the request drafts from StreamingLLM at its ratio
        from then on (before, compress raised in the scheduler and stopped it)."""
        cfg = dataclasses.replace(self.vc, compressor=STAND_IN, ratio=plan.compressor.ratio, compressor_options="")
        plan = plan._replace(compressor=cfg.build_compressor(STAND_IN))
        self.planner.plans[req.rid] = plan
        self.stats.add("query_free_rebuilds", 1)
        self.stats.planned(STAND_IN)
        return plan

    def _seed_from_prefix(self, req, verified: int, compressor, read_kv) -> None:
        """A new request whose verified tokens start with a cached prefix takes its
        compressed entry; sync() then compresses only the rest. Where SGLang's radix
        tree gave the request a longer shared prefix (a system prompt other requests
        also start with), the entry is first brought to that prefix and filed there,
        so later requests sharing it start from it (not for methods that choose keys
        from the prompt's last queries: a prefix has no queries of its own here)."""
        self.reqs[req.rid] = req
        if self.prefix_cache is None or not ids_name_kv(req):
            return
        self.weights_changed()
        tokens = kv_tokens(req, verified)
        n, layers = self.prefix_cache.match(tokens, compressor)
        if n:
            self.store.seed(req.rid, compressor, layers, n)
        shared = min(getattr(req, "cached_tokens", 0) or 0, verified)
        if shared > n and not compressor.needs_queries:
            self.store.sync(req.rid, shared, read_kv, compressor=compressor)
            self.prefix_cache.insert(tokens[:shared], compressor, self.store.entry(req.rid)[1])
        self.stats.prefix_cache(self.prefix_cache)

    # -- departures: the compressed prefix cache -----------------------------------------

    def _file_prefix(self, rid) -> None:
        """Keep a departing request's compressed entry for requests that extend its tokens."""
        req = self.reqs.pop(rid, None)
        have = self.store.entry(rid)
        if self.prefix_cache is None or req is None or have is None or self.weights_changed():
            return
        compressor, layers, n = have
        tokens = kv_tokens(req, n)
        if not ids_name_kv(req) or len(tokens) != n:
            return
        self.prefix_cache.insert(tokens, compressor, layers)
        self.stats.prefix_cache(self.prefix_cache)

    def weights_changed(self) -> bool:
        """Weights updated in place since the entries were made: they are stale."""
        if self.weights_gen == weights_generation():
            return False
        self.weights_gen = weights_generation()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return True

    # -- the storage tier behind the compressed prefix cache -----------------------------

    def attach_tier(self) -> None:
        """The storage tier behind the compressed prefix cache, once SGLang's tree exists:
        evicted entries go there, for drafting while a request's full prefix streams in
        from the same tier."""
        if not self._tier_pending:
            return
        self._tier_pending = False
        from sgl_vericache.mem_cache.compressed_tier import CompressedTier

        blobs = self.seam.storage_blobs()
        if blobs is None:
            return
        self.tier = CompressedTier(blobs)

        def spill(tokens, key, layers):  # entries of other weights never come back: the key says which
            return self.tier.spill(tokens, self.tier_key(key), layers)

        self.prefix_cache.spill = spill
        logger.info("VeriCache: compressed entries evicted from the prefix cache go to the storage tier (%s)",
                    type(blobs).__name__)

    def tier_key(self, compressor) -> tuple:
        """What names a compressed entry in the storage tier besides its tokens: the compressor,
        the weights' generation and the model (the tier outlives this process, and other engines
        may share it), so an entry is only ever read back by a drafter that made the same kind."""
        return compressor, self.weights_gen, self.seam.model_key()
