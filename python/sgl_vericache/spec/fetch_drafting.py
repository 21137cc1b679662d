"""Drafting while a waiting request's prefix streams in from a storage tier (no SGLang
imports): the paper's remote prefix reuse.

SGLang admits a request whose prefix is being prefetched from a HiCache storage tier only
once the prefetch is done; until then the scheduler polls it every iteration (the SGLang
seam's scheduler hooks call ``FetchDrafter.poll``). At each poll this drafts for it for
about ``STEP_SECONDS``: the prefix's compressed entry (VeriCache's compressed prefix cache
keeps entries after the full KV left the device and host, the eviction order the tiers
promise) seeds a draft store of its own. An entry the cache sent on to the storage tier is
read back first, on the tier's reader thread, and one this process never held is looked up
in the tier's index there; polls until it arrives draft nothing. The prompt's tokens past
the entry are fed through draft attention (teacher forcing: their provisional KV lives in
that store's round buffer only), then it drafts freely, up to
``--vericache-fetch-draft-tokens``. When the prefetch completes the drafts made so far are
queued (``DraftQueue``) and the request is admitted as usual: SGLang prefills the rest of
its prompt over the fetched full KV, and its first decode rounds verify the queued drafts
instead of drafting. Greedy requests only (a sampled round needs the draft distributions
of its own draws), and only requests whose prompt ids are the model's tokens (not
multimodal or ``input_embeds`` requests: ``placeholder_prompt``); one waiting request at a
time. Drafts are verify candidates only: output never changes.

Drafting ahead is optional, and it runs inside SGLang's scheduler loop: any error in one
request's job (out of device memory, a bug, a tier read that raised) is contained in
``poll``; the request is then admitted and served as without fetch drafting.

The request objects are SGLang's (``rid``, ``origin_input_ids``, ``output_ids``,
``sampling_params``, ``grammar``, ``to_finish``, ``finished()``, ``multimodal_inputs``,
``input_embeds`` are read); forward passes go through the owner's ``seam.passes``
(``DraftPasses``).
"""

from __future__ import annotations

import logging
import time

import torch

from sgl_vericache.mem_cache.compressed_tier import SpilledEntry, Throughput, worth_reading
from sgl_vericache.mem_cache.entry_format import INDEX_ANCHOR, index_anchors, move_entry
from sgl_vericache.spec.draft_queue import DraftQueue
from sgl_vericache.spec.drafter import CompressedKVStore, selects_per_step

logger = logging.getLogger(__name__)


def placeholder_prompt(req) -> bool:
    """Whether ``req.origin_input_ids`` hold placeholders, not the model's tokens: SGLang pads
    a multimodal request's media with hash ids from 1,000,000 up (``MM_PAD_SHIFT_VALUE``)
    and gives an ``input_embeds`` request ``[1] * len`` ids. Teacher-forced through a draft
    pass (a DECODE batch: no multimodal merge), they index past the embedding table (an
    IndexError on CPU, an out-of-bounds read on CUDA), and a placeholder is not the token
    the prompt holds there anyway."""
    return getattr(req, "multimodal_inputs", None) is not None or getattr(req, "input_embeds", None) is not None


class FetchJob:
    """One waiting request's drafting: its prompt past the compressed prefix teacher-forced
    (``forced``, from position ``start``), then free drafting; ``drafts[j]`` predicts output
    position ``j``."""

    def __init__(self, req, compressor, tokens, wanted, batch):
        self.req, self.compressor, self.tokens, self.wanted = req, compressor, tokens, wanted
        self.batch = batch  # the seam's one-request draft batch
        self.step = 0
        self.next = None  # the last step's argmax: the next step's input once forcing is done
        self.drafts = []
        self.polled = time.monotonic()
        # A Future of an entry read back from the storage tier, until seeded: its layers
        # (``entry_len`` tokens, a stub's read) or (length, layers) (``entry_len`` None, an
        # index lookup); ``fallback``: (length, layers) from the prefix cache if it finds none.
        self.entry, self.entry_len, self.fallback = None, None, None
        self.start, self.forced, self.steps = 0, tokens, 0

    def place(self, n: int, passes) -> None:
        """Draft from a compressed entry of the first ``n`` prompt tokens."""
        self.start, self.forced = n, self.tokens[n:]
        self.steps = len(self.tokens) - n + self.wanted - 1
        passes.place(self.batch, n)

    def arrived(self):
        """(length, layers) of the entry read from the tier (its Future done), or None."""
        result = self.entry.result()
        if result is not None and self.entry_len is not None:
            result = (self.entry_len, result)
        return result


class FetchDrafter:
    STEP_SECONDS = 0.02  # drafting per poll, so that a finished fetch is seen soon
    MAX_FORCED = 512  # prompt tokens past the compressed prefix it teacher-forces at most
    STALE_SECONDS = 0.5  # a job whose request stopped being polled (admitted elsewhere, aborted) is dropped

    def __init__(self, owner):
        """``owner``: the ``Speculator`` (its store, prefix cache, tier, plans, stats, seam)."""
        self.owner = owner
        self.store = CompressedKVStore(owner.store.compressor, owner.store.num_layers)
        self.queue = DraftQueue()
        self.job = None
        self._passed = set()  # rids polled and found unable to draft (no prefix entry, sampled, ...)
        self._error_logged = False  # an unexpected error is logged in full once, then at debug level
        self.full_speed = Throughput()  # of SGLang's storage prefetches: when a tier entry is worth reading
        self._bytes_per_token = None

    def observe_fetch(self, tokens: int, seconds: float) -> None:
        """SGLang's prefetch of ``tokens`` of full KV from the storage tier took ``seconds``."""
        self.full_speed.observe(tokens * self.bytes_per_token(), seconds)

    def bytes_per_token(self) -> int:
        """Bytes of full KV per token (every layer's keys and values); 0 if unknown."""
        if self._bytes_per_token is None:
            self._bytes_per_token = self.owner.seam.full_kv_bytes_per_token()
        return self._bytes_per_token

    def _worth_reading(self, stub, hit_tokens: int) -> bool:
        """Whether reading ``stub``'s entry back from the tier leaves time to draft before the
        ``hit_tokens`` of full KV the storage holds for the prefix have streamed in."""
        if stub.layers is not None:  # its write is still in flight: read from memory, no I/O
            return True
        per_token = self.bytes_per_token()
        if not per_token:  # cannot estimate: read, as without the rule
            return True
        return worth_reading(stub.nbytes, hit_tokens * per_token, self.owner.tier.read_speed, self.full_speed,
                             self.owner.vc.fetch_draft_tier_fraction)

    def poll(self, req, fetched: bool, hit_tokens: int) -> None:
        """The scheduler looked at waiting ``req``; ``fetched``: its prefetch is done;
        ``hit_tokens``: what the storage tier said it holds of the prefix (0 until its
        existence query answered: a request whose prefix is not there is not drafted for).
        Drafting ahead is an extra, so nothing it raises reaches the scheduler: out of device
        memory (its entry moved to the device, its draft passes), it lets go of its job,
        entries and queued drafts; any other error drops that one job (``_drop_failed``); the
        scheduler goes on (fetch drafting is off under tensor parallelism, so no rank waits
        for it)."""
        try:
            self._poll(req, fetched, hit_tokens)
        except torch.OutOfMemoryError as exc:
            self.clear()
            self.owner.stats.add("draft_out_of_memory", 1)
            logger.warning("VeriCache: drafting ahead of a prefix fetch ran out of device memory (%s); let go of "
                           "its entries and drafts", str(exc).split("\n")[0][:200])
        except Exception as exc:
            self._drop_failed(req, exc)

    def _drop_failed(self, req, exc: Exception) -> None:
        """Any other error (a bug, a request this code did not foresee) is one job's: that job
        goes (its seeded entry and draft buffers freed, nothing queued for it) and its request
        is not drafted for again; SGLang admits and serves it as without fetch drafting. The
        failing job is still ``self.job`` (``_finish`` lets go of it last); none: it failed
        while starting ``req``'s."""
        job, self.job = self.job, None
        self.store.clear()
        rid = req.rid if job is None else job.req.rid
        self.queue.drop(rid)
        self._pass(rid)
        self._error("drafting ahead of its prefix fetch failed; dropped that job", rid, exc)

    def _error(self, what: str, rid, exc: Exception) -> None:
        """Count a contained error; log it in full the first time (a bug to report), then at
        debug level only (a request pattern that hits it must not flood the log)."""
        self.owner.stats.add("fetch_draft_errors", 1)
        first, self._error_logged = not self._error_logged, True
        logger.log(logging.WARNING if first else logging.DEBUG, "VeriCache: request %s: %s (%s: %s)%s", rid, what,
                   type(exc).__name__, exc, "; later ones are logged at debug level" if first else "",
                   exc_info=exc if first else None)

    def _poll(self, req, fetched: bool, hit_tokens: int) -> None:
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
            self.owner.attach_tier()  # a new engine's first request may come before its first forward
            job = self.job = self._start(req, hit_tokens)
            if job is None:
                self._pass(req.rid)
                return
        job.polled = time.monotonic()
        self._run(job)

    def _pass(self, rid) -> None:
        """``rid`` is not drafted for (again) while it waits."""
        self._passed.add(rid)
        if len(self._passed) > 4096:
            self._passed.clear()

    def _start(self, req, hit_tokens: int):
        w = self.owner
        if placeholder_prompt(req) or req.finished() or req.grammar is not None or req.sampling_params.top_k != 1:
            return None
        plan = w.plan(req)
        if plan.error or req.to_finish is not None:
            return None
        tokens = [int(t) for t in req.origin_input_ids]
        w.weights_changed()
        n, layers = w.prefix_cache.match(tokens[:-1], plan.compressor, count=False)
        fallback = (n, layers) if n and len(tokens) - n <= self.MAX_FORCED else None
        # drafts for output positions 0 .. wanted-1 (position 0 is checked against the
        # token the prefill will sample; no use drafting past the request's last token)
        wanted = min(w.vc.fetch_draft_tokens, req.sampling_params.max_new_tokens or w.vc.fetch_draft_tokens)
        if wanted < 2:
            return None
        entry, entry_len = (self._tier_entry(tokens, plan.compressor, n, hit_tokens) if w.tier is not None
                            else (None, 0))
        if entry is None and fallback is None:
            return None
        w.stats.add("fetch_draft_requests", 1)
        job = FetchJob(req, plan.compressor, tokens, wanted, w.seam.passes.one_row(req))
        if entry is None:
            job.place(n, w.seam.passes)
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
        w = self.owner
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

        return w.tier.find(tokens[:-1], w.tier_key(compressor), longer_than, accept), None

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
        found, job.entry = self._arrived(job), None
        w = self.owner
        if found is not None and len(found[1]) != w.store.num_layers:
            found = None  # another model's entry (its key should have said so): never seed from it
        if found is None:  # gone from the tier, not that entry, or not worth reading
            if job.fallback is None:  # nothing to draft from
                self._pass(job.req.rid)
                self.job = None
                return False
            n, layers = job.fallback
        else:
            n, layers = found[0], move_entry(found[1], w.seam.device)
            w.prefix_cache.insert(job.tokens[:n], job.compressor, layers)
            if job.entry_len is None:
                w.stats.add("fetch_draft_tier_index_entries", 1)
        job.place(n, w.seam.passes)
        self._seed(job, layers)
        return True

    def _arrived(self, job):
        """``job.arrived()``; an error the tier's read carried in its Future (its reader
        thread contains its own, so a bug) is a miss: the job drafts from its fallback."""
        try:
            return job.arrived()
        except Exception as exc:
            self._error("reading its compressed entry back from the storage tier failed; taken as a miss",
                        job.req.rid, exc)
            return None

    def _run(self, job) -> None:
        if not self._entry_arrived(job):
            return
        w = self.owner
        t0 = time.perf_counter()
        done = job.step
        with torch.inference_mode(), w.seam.passes.run(job.batch, self.store) as forward:
            if job.step == 0 and len(job.forced) > 1 and not selects_per_step(job.compressor):
                # the prompt's tokens past the entry in one pass (they are known)
                logits = forward(job.forced, list(range(job.start, job.start + len(job.forced))),
                                 tokens_of_one=True)[-1:]
                job.next = int(torch.argmax(torch.nan_to_num(logits), dim=-1)[0])
                job.drafts.append(job.next)
                job.step = len(job.forced)
            while job.step < job.steps:
                s = job.step
                token = job.forced[s] if s < len(job.forced) else job.next
                job.next = int(torch.argmax(forward([token], [job.start + s]), dim=-1)[0])
                if s >= len(job.forced) - 1:
                    job.drafts.append(job.next)
                job.step += 1
                if time.perf_counter() - t0 >= self.STEP_SECONDS:
                    break
        w.stats.add("fetch_draft_steps", job.step - done)
        w.stats.add("fetch_draft_seconds", time.perf_counter() - t0)

    def _finish(self) -> None:
        """Queue the current job's drafts and let go of it (last, so that an error on the way
        is still that job's: ``_drop_failed``)."""
        job = self.job
        self.store.clear()
        w = self.owner
        found = self._arrived(job) if job.entry is not None and job.entry.done() else None
        if found is not None and len(found[1]) == w.store.num_layers:
            # read back too late to draft from, still worth keeping: the prefix is in use
            w.prefix_cache.insert(job.tokens[: found[0]], job.compressor, move_entry(found[1], w.seam.device))
        if job.drafts and not job.req.finished():
            self.queue.put(job.req.rid, job.drafts)
            w.stats.add("fetch_draft_tokens", len(job.drafts))
        self.job = None

    def forget(self, rid) -> None:
        """SGLang aborted waiting request ``rid``: its job (seeded entry, draft buffers) goes
        now, not when another waiting request is next polled (an aborted request is never
        polled again), and so do its queued drafts. A read of its entry still in flight
        finishes on the reader thread and is dropped."""
        if self.job is not None and self.job.req.rid == rid:
            self.job = None
            self.store.clear()
        self.queue.drop(rid)
        self._passed.discard(rid)

    def clear(self) -> None:
        self.job = None
        self.store.clear()
        self.queue.clear()
        self._passed.clear()
