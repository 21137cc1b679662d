"""Server-level VeriCache counters and gauges (no SGLang imports).

With ``--enable-metrics`` they are Prometheus counters on SGLang's ``/metrics``
(``vericache:*``); they are always kept as plain totals too, which ``/server_info``
reports (``internal_states[0]["vericache"]``).
"""

from __future__ import annotations


class Stats:
    """Counters (``NAMES``) and gauges (``GAUGES``), named as on ``/metrics`` less the
    ``vericache:`` prefix."""

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
        "full_kv_wait_seconds": "Seconds verify waited for parked full KV still being copied back (on CUDA the "
                                "host's time only, near 0: the wait is the GPU's)",
        "full_kv_parks": "Requests parked at a round's start because they do not verify in it",
        "full_kv_parks_in_host_pool": "Requests parked in HiCache's host KV pool (the rest: in tensors of "
                                      "VeriCache's own, when there is no host pool or it is full)",
        "sync_errors": "Requests ended with a 500 because compressing their KV raised (a bug, contained to the "
                       "request)",
        "query_free_rebuilds": "SnapKV / H2O requests whose entry was built again without their prompt queries "
                               "(let go at their first round): they draft from StreamingLLM from then on",
        "full_kv_loads_for_rebuild": "Parked requests loaded back before a round's drafts because their compressed "
                                     "entry was built again from their full KV (let go after running out of memory, "
                                     "or a new compressor)",
        "full_kv_copy_seconds": "Seconds the background copies of parked full KV back to the device took "
                                "(on CUDA: their GPU time from timing events, once completed)",
        "fetch_draft_requests": "Waiting requests that drafted while their prefix streamed in from a storage tier "
                                "(--vericache-fetch-draft-tokens)",
        "fetch_draft_steps": "Draft forward steps run for waiting requests (prompt tokens teacher-forced + drafts)",
        "fetch_draft_seconds": "Wall time of those steps (the scheduler would otherwise poll the prefetch idle)",
        "fetch_draft_tokens": "Drafts made while waiting and queued for the request's first rounds",
        "fetch_draft_rounds": "Verify rounds whose drafts were made while the request waited for its prefix",
        "fetch_draft_accepted": "Queued drafts (made while waiting) accepted by verify",
        "fetch_draft_errors": "Unexpected errors contained in drafting ahead of a prefix fetch: the request's job was "
                              "dropped (served as without fetch drafting), or its tier entry taken as a miss",
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
        "compressed_tier_fetch_corrupt": "Reads whose bytes failed the entry's digest or could not be decoded (a miss)",
        "compressed_tier_fetch_other_format": "Reads of an entry in another format (another entry format version, or "
                                              "layer fields this build does not have): a miss, not decoded",
        "compressed_tier_fetches_from_memory": "Reads answered before the entry's write had finished (no I/O)",
        "compressed_tier_read_errors": "Reads or index lookups that raised on the tier's reader thread (a bug; a miss)",
        "plain_iterations": "Decode iterations the adaptive controller ran as plain decoding (no drafts, one token "
                            "per request)",
        "spec_iterations": "Decode iterations that ran a VeriCache round",
        "predicted_step_seconds": "The adaptive controller's predicted seconds of the iterations it decided",
        "measured_step_seconds": "The measured seconds of those iterations (its predictions' calibration)",
        "compressor_switches": "Requests moved to another compressor by --vericache-compressor auto",
        "context_limited_rounds": "Rounds whose drafts were cut so that no verified position passes the model's "
                                  "context",
        "draft_out_of_memory": "Rounds whose drafting ran out of device memory: they verified their roots alone, "
                               "the compressed entries were let go and the next iterations decoded plainly",
    }
    GAUGES = {
        "compressed_prefix_bytes": "Bytes of compressed KV held by the prefix cache",
        "compressed_prefix_entries": "Entries held by the prefix cache",
        "compressed_prefix_spilled": "Entries the prefix cache knows to be in the storage tier (stubs)",
        "captured_query_requests": "Requests holding prompt queries captured at their prefill for a query-aware "
                                   "compressor (SnapKV, H2O), until their first round uses them",
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
            self._prom["draft_steps"] = Counter(
                "vericache:round_draft_steps", "Rounds per number of draft steps they ran (the chosen draft length)",
                ["steps"])
            self._prom["compressor_requests"] = Counter(
                "vericache:compressor_requests", "Requests planned per compressor method (the server's or a "
                "request's own custom_params)", ["compressor"])
        self.compressor_requests = {}  # method name -> requests planned with it
        self.draft_steps = {}  # draft steps a round ran -> rounds (0: no drafts, e.g. the context's end)
        self._pending_draft = 0.0

    def add(self, name, value):
        self.totals[name] += value
        if name in self._prom and value:
            self._prom[name].inc(value)

    def planned(self, compressor_name: str) -> None:
        """A request was planned to draft from ``compressor_name``."""
        self.compressor_requests[compressor_name] = self.compressor_requests.get(compressor_name, 0) + 1
        if "compressor_requests" in self._prom:
            self._prom["compressor_requests"].labels(compressor=compressor_name).inc()

    def drafted(self, seconds, tokens, steps=None):
        self._pending_draft = seconds
        self.add("draft_seconds", seconds)
        self.add("drafted_tokens", tokens)
        if steps is not None:
            self.draft_steps[steps] = self.draft_steps.get(steps, 0) + 1
            if "draft_steps" in self._prom:
                self._prom["draft_steps"].labels(steps=str(steps)).inc()

    def verified(self, seconds, accept_lens):
        lens = [int(x) for x in accept_lens]
        self.add("verify_seconds", max(seconds - self._pending_draft, 0.0))
        self.add("rounds", len(lens))
        self.add("emitted_tokens", sum(lens))
        self.add("accepted_tokens", sum(lens) - len(lens))
        self._pending_draft = 0.0

    def end_iteration(self, full_kv_load_seconds: float):
        """``full_kv_load_seconds``: the process's running total of HiCache's load time."""
        self._pending_draft = 0.0
        self.add("full_kv_load_seconds", full_kv_load_seconds - self.totals["full_kv_load_seconds"])

    def parking(self, stats):
        """Bring the ``full_kv_*`` counters up to a ``FullKVParking``'s own totals."""
        for name, total in (("full_kv_parked_tokens", stats.parked_tokens),
                            ("full_kv_loaded_tokens", stats.loaded_tokens),
                            ("full_kv_bytes_to_host", stats.bytes_to_host),
                            ("full_kv_bytes_to_device", stats.bytes_to_device),
                            ("full_kv_wait_seconds", stats.wait_seconds),
                            ("full_kv_copy_seconds", stats.load_seconds),
                            ("full_kv_parks", stats.parks), ("full_kv_parks_in_host_pool", stats.parks_in_host_pool)):
            self.add(name, total - self.totals[name])

    def snapshot(self) -> dict:
        """Every counter's total and every gauge's value (``/server_info``)."""
        return {**self.totals, **self.gauges, "compressor_requests": dict(self.compressor_requests),
                "draft_steps": {str(k): v for k, v in sorted(self.draft_steps.items())}}

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
            self.gauge(name, value)

    def gauge(self, name: str, value) -> None:
        self.gauges[name] = value
        if name in self._prom:
            self._prom[name].set(value)
