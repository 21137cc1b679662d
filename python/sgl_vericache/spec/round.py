"""The VeriCache round, top to bottom (no SGLang imports).

Each decode iteration of a batch is one round per request:

1. **plan** (``spec/plan.py``): each request's compressor and draft length (the server's,
   its own ``custom_params``, or, with ``--vericache-adaptive``, the controller's; the
   controller may also make the iteration plain decoding, and then none of what follows
   runs); a bad override aborts that request alone;
2. **sync** (``spec/entry_sync.py``): each request's compressed entry is brought up to its
   verified length (a new request starts from a cached compressed prefix when one matches
   and compresses the rest);
3. **stagger** (``--vericache-full-device-budget``): which rows verify this round; the
   others' full KV is parked in host memory and the verifying rows' parked KV starts
   streaming back layer by layer;
4. **draft**: ``steps`` forward passes of the target model whose attention reads the
   compressed entries (greedy argmax, or a ``SampledRound``'s draws); rows whose drafts were
   made while their prefix was fetched take those instead;
5. **verify, accept, commit**: SGLang's verify pass over the full KV, its acceptance (ours
   for sampled batches: ``SampledRound.accept``) and its KV move; the seam then calls
   ``close_round`` and ``count_round`` with what was accepted.

Departed requests file their compressed entry in the prefix cache for the requests (the next
turn of a conversation) that extend their tokens.

The ``Speculator`` owns VeriCache's per-worker state. Everything only SGLang can do goes
through ``seam`` (``sgl_vericache.sglang.worker.WorkerSeam``): reading a row of the full KV,
running draft forward passes, aborting a request, the storage tier's blob store, the
parking of full KV. Requests are SGLang's ``Req`` objects; this module reads ``rid``,
``origin_input_ids``, ``output_ids``, ``cached_tokens`` and ``sampling_params.custom_params``.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import numpy as np
import torch

from sgl_vericache.config import VeriCacheConfig
from sgl_vericache.cpu.linear import weights_generation
from sgl_vericache.mem_cache.compressed_prefix import CompressedPrefixCache
from sgl_vericache.spec.drafter import CompressedKVStore
from sgl_vericache.spec.entry_sync import EntrySync
from sgl_vericache.spec.fetch_drafting import FetchDrafter
from sgl_vericache.spec.plan import Plan, Planner, penalized, verifies_every_round
from sgl_vericache.spec.round_batch import RoundBatch, RoundDrafts, device_clock, last_token, pad_drafts, verifying_rows
from sgl_vericache.spec.stats import Stats
from sgl_vericache.spec.window_draft import WindowedDraft

logger = logging.getLogger(__name__)

# plain decoding iterations after a round's drafting ran out of device memory (its
# compressed entries were dropped; they are rebuilt when rounds resume)
OUT_OF_MEMORY_PAUSE = 64


class Speculator(EntrySync):
    """VeriCache's state and steps for one worker (its compressed entries' methods:
    ``spec.entry_sync.EntrySync``)."""

    def __init__(self, vc: VeriCacheConfig, seam, stats: Stats, rng: torch.Generator):
        self.vc = vc
        self.seam = seam
        self.stats = stats
        self.rng = rng  # rejection sampling's draws
        self.store = CompressedKVStore(vc.build_compressor(), seam.num_layers)
        self.prefix_cache = CompressedPrefixCache(vc.compressed_cache_mb << 20) if vc.compressed_cache_mb > 0 else None
        self.reqs = {}  # rid -> Req, to file its compressed entry by token ids when it departs
        self.weights_gen = weights_generation()
        self.queries = {}  # rid -> per-layer last prompt queries, until compressed
        self.waited = {}  # rid -> rounds in a row it drafted without verifying (staggered verifies)
        self.deferred = ()  # batch rows that draft but do not verify this round
        self.undrafted = ()  # rows that verify this round with no drafts: they accept one token
        self.queued_rows = ()  # batch rows whose drafts this round were made while they waited
        self.sampled = None  # this round's SampledRound, when its batch samples
        self.parking = None  # FullKVParking, built at the first round when a budget is set
        self.fetch_drafter = None  # drafting while SGLang fetches a waiting request's prefix
        if vc.fetch_draft_tokens > 0 and self.prefix_cache is not None:
            self.fetch_drafter = FetchDrafter(self)
        self.tier = None  # CompressedTier: evicted compressed entries in the storage tier
        # attached at the first forward or fetch-draft poll (SGLang's tree exists by then)
        self._tier_pending = self.fetch_drafter is not None
        # and, adaptive, the controller, which prices draft steps as the store's path reads them
        self.planner = Planner(vc, stats, seam.abort, self.store.compressor,
                               padded_drafts=not self.store.kernels_on(seam.device))
        # the GPU kernels: the head layout they were warmed for and what the warm-up did (warm_up_kernels)
        self.kernels = {"head_layout": None, "draft": "not warmed yet", "verify": "not warmed yet"}
        self.lens, self.draft_seconds = (), 0.0  # what this round drafted, per row, and how long it took
        # of that round: seconds bringing compressed entries and draft buffers up to date (the
        # first round of a request compresses its whole prompt), and of its draft forwards alone
        self.setup_seconds = self.forward_seconds = 0.0
        self.paused = 0  # plain iterations left after drafting ran out of device memory
        self.roots_alone = False  # this round, paused so, verifies its roots alone (parked full KV)
        # sliding-window layers draft over the full KV pool's last window tokens (spec/window_draft.py),
        # unless full KV may be parked in host memory
        self.windowed = None
        if seam.windows and vc.full_device_budget < 0:
            self.windowed = WindowedDraft(self.store, seam.windows, seam.kv_buffers)
        # /server_info's vericache_windows: how this model's sliding-window layers draft
        drafts = "over the full KV pool" if self.windowed is not None else (
            "over compressed entries: full KV may be parked in host memory (--vericache-full-device-budget)")
        self.window_layers = {"layers": len(seam.windows), "windows": sorted(set(seam.windows.values())),
                              "drafts": drafts if seam.windows else "none"}

    def plan_memory(self, budget_bytes: int, kv_dtype: torch.dtype):
        """How SGLang's KV budget is split between its pool and this worker's compressed
        entries, dense draft buffers and prefix cache (``spec.memory_reserve``); None for a
        model without an attention layer. Called once, before the pool exists."""
        from sgl_vericache.kernels import draft_attention_available, draft_head_dim
        from sgl_vericache.spec.memory_reserve import plan_draft_memory

        layout = self.seam.head_layout(kv_dtype)
        if layout is None:
            return None
        kernels = draft_attention_available(self.seam.device) and draft_head_dim(layout.head_dim)
        prefix_bytes = 0 if self.prefix_cache is None else self.prefix_cache.budget_bytes
        return plan_draft_memory(budget_bytes, self.planner.configured_compressors(), layout.num_kv_heads,
                                 layout.head_dim, kv_dtype, prefix_bytes, dense_buffers=not kernels)

    def warm_up_kernels(self, compile_now: bool = True) -> None:
        """Compile the draft kernels for the configured compressors and the verify kernel for
        blocks up to draft_len + 1 tokens now, not in the first requests' rounds
        (``warm_up.warm_up_kernels``); what happened goes to ``kernels``. Runs once the KV
        pool exists (the worker's alloc_memory_pool)."""
        from sgl_vericache.spec import warm_up

        warm_up.warm_up_kernels(self.kernels, self.seam.device, self.planner.configured_compressors(),
                                self.windowed is not None, self.vc.draft_len, self.vc.deterministic,
                                self.seam.head_layout, compile_now)

    # -- per request ---------------------------------------------------------------------

    def plan(self, req) -> Plan:
        return self.planner.plan(req)

    def release_departed(self, rids, reused: Optional[dict] = None) -> None:
        """Requests that left: their entries are filed and released. ``reused``: rid -> the
        new request that now has it (a finished request's rid sent again), whose own plan
        and captured prompt queries stay."""
        reused = reused or {}
        for rid in rids:
            self._file_prefix(rid)
            self.store.release(rid)
            if rid in reused:
                self.planner.forget(rid, unless=reused[rid])
            else:
                self.planner.forget(rid)
                self.queries.pop(rid, None)
            self.waited.pop(rid, None)
            if self.fetch_drafter is not None:
                self.fetch_drafter.queue.drop(rid)

    def clear(self) -> None:
        self.queries.clear()
        self.store.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.reqs.clear()
        if self.fetch_drafter is not None:
            self.fetch_drafter.clear()

    # -- the round -----------------------------------------------------------------------

    def draft_lens(self, reqs, verified: Sequence[int]) -> list[int]:
        """Per row: the tokens it drafts this round, its plan's draft length cut so that every
        position the round verifies stays inside the model's context (the batch verifies at
        one width, so the row nearest the context's end bounds them all; 0 at its last
        position)."""
        room = min(self.seam.context_len - 1 - n for n in verified)
        return [max(0, min(self.planner.draft_len(self.plan(req)), room)) for req in reqs]

    def begin_iteration(self, reqs, verified: Sequence[int], max_width: int, must_round: bool = False) -> int:
        """Decide a decode iteration: 0 = plain decoding (no drafts, SGLang's one-token step),
        else the width each request verifies (root + the batch's longest draft). ``must_round``:
        the batch returns logprobs or follows a grammar (SGLang's bookkeeping for those expects
        a round)."""
        queued = self.fetch_drafter.queue if self.fetch_drafter is not None else ()
        if self.paused and not must_round:  # drafting ran out of device memory a moment ago
            self.paused -= 1
            self.planner.undecided()
            if self.vc.full_device_budget < 0:
                self.stats.add("plain_iterations", 1)
                return 0
            # Parked full KV comes back only in a round (a plain step would attend over the
            # slots parking freed): the round verifies its roots alone, one token a row.
            self.roots_alone = True
            self.stats.add("spec_iterations", 1)
            return 1
        if not self.planner.decide(reqs, verified, queued, must_round):
            self.stats.add("plain_iterations", 1)
            return 0
        self.stats.add("spec_iterations", 1)
        return min(max_width, 1 + max(self.draft_lens(reqs, verified)))

    def end_plain(self, seconds: float, load_seconds: float) -> None:
        """A plain decoding iteration took ``seconds`` (every tensor-parallel rank's planner
        takes the first rank's: ``seam.agree``)."""
        (seconds,) = self.seam.agree((seconds,))
        self.planner.plain_done(seconds)
        self.stats.end_iteration(load_seconds)

    def draft_round(self, batch: RoundBatch, width: int) -> RoundDrafts:
        """Steps 1-4 for one decode iteration: every row's root and drafts, padded to ``width``.
        Drafting that runs out of device memory (compressed entries and draft buffers live
        outside SGLang's pool) leaves the round with its roots alone: see ``_out_of_memory``."""
        bs = len(batch.reqs)
        plans = [self.plan(req) for req in batch.reqs]
        lens = self.draft_lens(batch.reqs, batch.verified)
        if any(n < self.planner.draft_len(plan) for n, plan in zip(lens, plans)):
            self.stats.add("context_limited_rounds", 1)  # cut short so no position passes the context
        t_sync = time.perf_counter()
        failed = self.roots_alone  # paused after running out of memory: no entries, no drafts
        verifying = self._verifying_rows(batch)
        try:
            if not failed:
                for i in self._sync_store(batch, plans, verifying):
                    lens[i] = 0  # ended with a 500: its root alone
        except torch.OutOfMemoryError as exc:
            if not self._out_of_memory(exc):
                raise
            failed = True
        if self.vc.full_device_budget >= 0:
            self._stage_full_kv(batch, verifying)
        self.setup_seconds, self.layout_seconds = device_clock(self.seam.device) - t_sync, 0.0
        self.deferred = tuple(i for i, v in enumerate(verifying) if not v)
        roots = [last_token(req) for req in batch.reqs]
        steps = max(lens)
        queued = {} if failed else self._queued_drafts(batch, lens, verifying)
        t0 = time.perf_counter()
        drafts = None
        if not failed:
            try:
                drafts = self._draft(batch, roots, steps, queued, lens)  # [bs, steps]
            except torch.OutOfMemoryError as exc:
                if not self._out_of_memory(exc):
                    raise
        if drafts is None:  # nothing drafted: the roots stand in, verify decodes one token a row
            drafts, lens = np.repeat(np.asarray(roots, dtype=np.int64)[:, None], steps, axis=1), [0] * bs
            self._begin_sampling(batch, [])
        self.draft_seconds = time.perf_counter() - t0
        self.forward_seconds = self.draft_seconds - self.layout_seconds
        self.setup_seconds += self.layout_seconds
        self.lens = [n if v else 0 for n, v in zip(lens, verifying)]
        # padded with their roots, rows without drafts would accept any repeat of their last token
        # the target predicts: several tokens an iteration for a request at the context's last
        # position. They accept their root's token alone.
        self.undrafted = tuple(i for i, (n, v) in enumerate(zip(self.lens, verifying)) if v and not n)
        self.stats.drafted(self.draft_seconds, sum(self.lens), steps)
        if self.sampled is not None:  # rejection rows accept their padding as a fixed proposal
            self.sampled.own_lens = list(lens)
        drafts = pad_drafts(drafts, lens, width - 1)
        tokens = np.concatenate([np.asarray(roots, dtype=np.int64)[:, None], drafts], axis=1)
        chain = np.tril(np.ones((width, width), dtype=bool))
        mask = np.broadcast_to(chain, (bs, width, width)).reshape(-1).copy()
        return RoundDrafts(tokens.reshape(-1), mask, width)

    def _begin_sampling(self, batch: RoundBatch, rows: list[int]) -> None:
        """The round's SampledRound for a batch that samples (``rows``: those that draft), even
        a round with no drafts (the context's last position, or one out of memory): SGLang's
        own verify acceptance, used without one, commits argmax on CPU."""
        self.sampled = None if batch.greedy else self.seam.sampled_round(batch.source, rows, self.rng)

    def _out_of_memory(self, exc: BaseException) -> bool:
        """Drafting ran out of device memory: the compressed entries (and the prefix cache's)
        are let go and the next OUT_OF_MEMORY_PAUSE iterations decode plainly (with parked
        full KV, ``--vericache-full-device-budget``: rounds that verify their roots alone, since
        only a round loads parked KV back); this round verifies its roots alone (one token a
        row, exactly as plain decoding). Under tensor
        parallelism every rank must run the same forwards, and one rank's allocator does not
        tell the others: False there (the caller raises, as before)."""
        if getattr(self.seam, "tp_size", 1) > 1:
            return False
        entries, mb = len(self.store), self.store.nbytes() / 2**20
        self.store.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.fetch_drafter is not None:
            self.fetch_drafter.clear()
        self.paused = OUT_OF_MEMORY_PAUSE
        self.planner.undecided()  # a width-w verify of roots alone: not a round of what was decided
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.stats.add("draft_out_of_memory", 1)
        logger.warning("VeriCache: drafting ran out of device memory (%s); let go of %d compressed entries (%.0f MB) "
                       "and the compressed prefix cache; the next %d iterations decode without drafts",
                       str(exc).split("\n")[0][:200], entries, mb, OUT_OF_MEMORY_PAUSE)
        return True

    def close_round(self) -> set:
        """After the iteration's forward, whatever happened: the round's transient state
        goes. Returns the rows that were deferred."""
        deferred, self.deferred, self.undrafted = set(self.deferred), (), ()
        self.sampled, self.roots_alone = None, False
        if self.parking is not None:
            self.parking.finish()
        return deferred

    def count_round(self, reqs, accept_lens: Optional[list], deferred: set, seconds: float,
                    load_seconds: float) -> None:
        """Step 5's bookkeeping, after SGLang's verify: ``accept_lens`` per row (bonus
        included; None for a forward that was no round), ``seconds`` the iteration took,
        ``load_seconds`` the process's running total of HiCache load time."""
        if accept_lens is not None:
            forward_seconds, seconds, setup_seconds = self.seam.agree((self.forward_seconds, seconds,
                                                                       self.setup_seconds))
            self.planner.round_done(reqs, self.lens, accept_lens, forward_seconds, seconds, setup_seconds)
            self.stats.verified(seconds, [n for i, n in enumerate(accept_lens) if i not in deferred])
            self.stats.add("deferred_rows", len(deferred))
            for i, req in enumerate(reqs):
                self.waited[req.rid] = self.waited.get(req.rid, 0) + 1 if i in deferred else 0
            self.stats.add("fetch_draft_accepted", sum(accept_lens[i] - 1 for i in self.queued_rows))
        self.queued_rows = ()
        self.stats.end_iteration(load_seconds)
        if self.tier is not None:
            self.stats.tier(self.tier)

    def _verifying_rows(self, batch: RoundBatch) -> list[bool]:
        """Which rows verify this round (``verifying_rows``). Some verify in every round:
        penalized rows, min_new_tokens' included (``verifies_every_round``:
        SGLang adds their last output token to their penalty state once an iteration, so an
        iteration that emitted nothing for them would count that token again), and rows that return
        logprobs or follow a grammar (``batch.verify_always``: SGLang's logprob and grammar
        bookkeeping has only ever run with a token from such a row every iteration). They
        are never parked, so a round loads at most what the stagger picks, within what the
        parked requests hold reserved; the batch's other rows still take turns."""
        own = [n - start for n, start in zip(batch.verified, batch.own_kv_start)]
        waited = [self.waited.get(req.rid, 0) for req in batch.reqs]
        forced = [always or verifies_every_round(req) for req, always in zip(batch.reqs, batch.verify_always)]
        return verifying_rows(self.vc.full_device_budget, own, waited, forced)

    def _stage_full_kv(self, batch: RoundBatch, verifying: list[bool]) -> None:
        """At a round's start (compressed entries already synced): park the own full KV
        of rows that do not verify this round, give the parked rows that do their slots
        back and start copying their KV in, layer by layer, while the drafts run;
        verify waits per layer."""
        if self.parking is None:
            self.parking = self.seam.build_parking(self.vc.full_device_budget)
        parking = self.parking
        for i, req in enumerate(batch.reqs):
            if not verifying[i] and not parking.is_parked(req.rid):
                parking.park(req.rid, batch.pool_rows[i], batch.own_kv_start[i], batch.verified[i])
        parking.start_loads({req.rid: batch.pool_rows[i] for i, req in enumerate(batch.reqs) if verifying[i]})
        self.stats.parking(parking.stats)

    def _queued_drafts(self, batch: RoundBatch, lens: list[int], verifying: list[bool]) -> dict:
        """Rows (verifying this round, in an all-greedy batch) whose drafts were made
        ahead while their prefix was fetched: row -> its drafts for this round."""
        if self.fetch_drafter is None or not len(self.fetch_drafter.queue) or not batch.greedy:
            return {}
        queued = {}
        for i, req in enumerate(batch.reqs):
            if verifying[i] and req.rid in self.fetch_drafter.queue:
                tokens = self.fetch_drafter.queue.take(req.rid, req.output_ids, lens[i])
                if tokens:
                    queued[i] = tokens
        self.stats.add("fetch_draft_rounds", len(queued))
        self.queued_rows = tuple(queued)
        return queued

    def _draft(self, batch: RoundBatch, roots: list[int], steps: int, queued: dict, lens: list[int]) -> np.ndarray:
        """[bs, steps] drafts. Rows deferred this round, and rows whose draft length is 0
        (the context's last position), draft nothing (their roots stand
        in); rows with drafts made ahead (queued) take those; the rest draft ``steps``
        tokens, one forward pass over the compressed entries per step."""
        bs = len(batch.reqs)
        deferred = set(self.deferred)
        keep = [i for i in range(bs) if i not in deferred and i not in queued and lens[i] > 0]
        drafts = np.repeat(np.asarray(roots, dtype=np.int64)[:, None], steps, axis=1)
        for i, tokens in queued.items():
            drafts[i, :len(tokens)] = tokens
            drafts[i, len(tokens):] = tokens[-1]
        self._begin_sampling(batch, keep if steps else [])
        if not keep or not steps:
            return drafts
        t0 = time.perf_counter()
        self.store.begin_round([batch.reqs[i].rid for i in keep], steps,
                               unread=self.windowed.windows if self.windowed is not None else ())
        self.layout_seconds = device_clock(self.seam.device) - t0  # a new or rebuilt entry lays out whole
        passes = self.seam.passes
        draft_batch = passes.for_rows(batch.source, keep)
        device = self.seam.device
        tokens = torch.tensor([roots[i] for i in keep], dtype=torch.int64, device=device)
        positions = torch.tensor([batch.verified[i] for i in keep], dtype=torch.int64, device=device)
        # on the device: one copy to the host after the last step, not a wait at every step
        out = torch.empty((len(keep), steps), dtype=torch.int64, device=device)
        source = self.store
        if self.windowed is not None:
            widest = self.windowed.widest
            verified = [batch.verified[i] for i in keep]
            self.windowed.begin_round([self.seam.slots(batch.pool_rows[i], max(0, n - widest), n)
                                       for i, n in zip(keep, verified)], verified, steps)
            source = self.windowed
        try:
            # penalized requests' drafts are steered by their penalties (the verify applies them exactly)
            penalized_rows = any(penalized(batch.reqs[i]) for i in keep)
            penalty = self.seam.draft_penalty(batch.source, keep) if penalized_rows else None
            with passes.run(draft_batch, source) as forward:
                for step in range(steps):
                    logits = forward(tokens, positions + step)  # [rows, V]
                    if penalty is not None:
                        logits = penalty.apply(logits)
                    if self.sampled is None:
                        tokens = torch.argmax(logits, dim=-1)
                    else:
                        tokens = self.seam.agree_tokens(self.sampled.draw(logits, positions + step).contiguous())
                    if penalty is not None:
                        penalty.count(tokens)
                    out[:, step] = tokens
        finally:
            if self.windowed is not None:
                self.windowed.end_round()
        drafts[keep] = out.cpu().numpy()
        return drafts

    # -- integrity -----------------------------------------------------------------------

    def check_integrity(self, integrity_error=AssertionError) -> None:
        """The compressed side: every request's entry and the prefix cache's tree."""
        self.store.check_integrity()
        if self.parking is not None:
            self.parking.check_integrity()
            if self.parking.parked:
                raise integrity_error(f"{len(self.parking.parked)} parked requests at an idle point")
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
