"""Remote prefix reuse: a request whose prefix SGLang is still fetching from a storage tier
drafts meanwhile from the prefix's compressed entry, and its first rounds verify those drafts.

Unit level: ``DraftQueue`` hands a request the drafts that follow its verified output only
while every earlier draft was right. End to end: agents whose conversations no longer fit
the device and host tiers find their prefix in a storage tier read at 10 MB/s (SGLang's file
backend behind ``benchmark/throttled_store.py``); the compressed entries stay in VeriCache's
prefix cache; the next turn drafts while its prefix streams in, and token ids equal
speculation off.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmark"


def test_draft_queue_serves_drafts_while_they_were_right():
    from sgl_vericache.spec.draft_queue import DraftQueue

    q = DraftQueue()
    q.put("a", [5, 6, 7, 8, 9])
    assert q.take("a", [5], 2) == [6, 7]  # first output token 5 was drafted right
    assert q.take("a", [5, 6, 7], 8) == [8, 9]  # the rest, fewer than asked
    assert q.take("a", [5, 6, 7, 8, 9], 2) is None and "a" not in q  # used up
    q.put("b", [1, 2, 3])
    assert q.take("b", [1, 4], 1) is None and "b" not in q  # output left the drafted path
    q.put("c", [1, 2])
    assert q.take("c", [3], 1) is None  # wrong from the first token: never used
    assert q.taken == 2 and q.dropped == 3
    assert q.take("missing", [1], 1) is None


def test_draft_queue_keeps_the_newest_requests():
    from sgl_vericache.spec.draft_queue import DraftQueue

    q = DraftQueue(capacity=2)
    for rid in "xyz":
        q.put(rid, [1, 2])
    assert "x" not in q and "y" in q and "z" in q and len(q) == 2
    q.put("y", [])  # nothing drafted: no queue
    assert "y" not in q
    with pytest.raises(ValueError, match="capacity 0"):
        DraftQueue(capacity=0)


def test_fetch_drafter_reads_a_tier_entry_only_when_it_lands_early():
    """The fetch drafter's wiring of ``worth_reading``: the full KV's bytes per token come
    from the worker's pool (through the seam), SGLang's prefetches teach it their speed, the
    tier's reads theirs."""
    from types import SimpleNamespace

    import torch

    from sgl_vericache.config import VeriCacheConfig
    from sgl_vericache.mem_cache.compress import get_compressor
    from sgl_vericache.mem_cache.compressed_tier import SpilledEntry, Throughput
    from sgl_vericache.sglang.worker import WorkerSeam
    from sgl_vericache.spec.fetch_drafting import FetchDrafter

    bufs = [torch.zeros(16, 3, 64) for _ in range(2)]  # 2 layers, 3 KV heads of 64, fp32
    tier = SimpleNamespace(read_speed=Throughput())
    seam = SimpleNamespace(model_runner=SimpleNamespace(token_to_kv_pool=SimpleNamespace(k_buffer=bufs,
                                                                                         v_buffer=bufs)))
    seam.full_kv_bytes_per_token = lambda: WorkerSeam.full_kv_bytes_per_token(seam)
    worker = SimpleNamespace(store=SimpleNamespace(compressor=get_compressor("kivi4"), num_layers=2), tier=tier,
                             seam=seam, vc=VeriCacheConfig())
    drafter = FetchDrafter(worker)
    per_token = 2 * 2 * 3 * 64 * 4
    assert drafter.bytes_per_token() == per_token
    full = 100 * per_token  # the storage holds 100 tokens of the prefix
    assert worker.vc.fetch_draft_tier_fraction == 0.25
    assert drafter._worth_reading(SpilledEntry(40, "k", nbytes=full // 5), 100)
    assert not drafter._worth_reading(SpilledEntry(40, "k", nbytes=full // 3), 100)
    # a stub whose write is in flight holds its entry: reading it costs no I/O
    assert drafter._worth_reading(SpilledEntry(40, "k", nbytes=full, layers=()), 100)
    # prefetches measured fast, tier reads slow: a fifth of the bytes no longer lands in time
    drafter.observe_fetch(100, 0.1)
    tier.read_speed.observe(per_token, 0.01)  # a tenth of the prefetch's speed
    assert drafter.full_speed.bytes_per_second == pytest.approx(per_token * 1000)
    assert not drafter._worth_reading(SpilledEntry(40, "k", nbytes=full // 5), 100)
    assert drafter._worth_reading(SpilledEntry(40, "k", nbytes=full // 50), 100)
    worker.vc = VeriCacheConfig(fetch_draft_tier_fraction=1.0)
    assert drafter._worth_reading(SpilledEntry(40, "k", nbytes=full * 10), 100)
    with pytest.raises(ValueError, match="fetch-draft-tier-fraction 1.5 is out of range"):
        VeriCacheConfig(fetch_draft_tier_fraction=1.5)


def test_fetch_drafting_out_of_memory_lets_go_instead_of_stopping_the_scheduler(caplog):
    """Drafting ahead runs inside the scheduler's prefetch check: out of device memory there
    (its draft passes, its entry moved to the device) it lets go of its job, entries and
    queued drafts, and poll returns, where the error reached the scheduler before."""
    from types import SimpleNamespace

    import torch

    from sgl_vericache.mem_cache.compress import get_compressor
    from sgl_vericache.spec.fetch_drafting import FetchDrafter
    from sgl_vericache.spec.stats import Stats

    owner = SimpleNamespace(store=SimpleNamespace(compressor=get_compressor("kivi4"), num_layers=2), stats=Stats(False))
    drafter = FetchDrafter(owner)
    drafter.queue.put("old", [1, 2, 3])
    job = SimpleNamespace(req=SimpleNamespace(rid="r", finished=lambda: False), polled=0.0)
    drafter.job = job

    def run(job):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    drafter._run = run
    drafter.poll(job.req, fetched=False, hit_tokens=100)
    assert drafter.job is None and "old" not in drafter.queue
    assert owner.stats.totals["draft_out_of_memory"] == 1 and "drafting ahead of a prefix fetch" in caplog.text
    assert owner.stats.totals["fetch_draft_errors"] == 0


def _drafter(**owner_kw):
    """A FetchDrafter over a stand-in worker (2 layers, kivi4, no tier) whose prefix cache
    records the prompts it was asked for."""
    from types import SimpleNamespace

    from sgl_vericache.config import VeriCacheConfig
    from sgl_vericache.mem_cache.compress import get_compressor
    from sgl_vericache.spec.fetch_drafting import FetchDrafter
    from sgl_vericache.spec.stats import Stats

    comp, asked = get_compressor("kivi4"), []

    def match(tokens, compressor, count=True):
        asked.append(list(tokens))
        return 0, None  # no entry: the job is not started, after the checks

    owner = SimpleNamespace(store=SimpleNamespace(compressor=comp, num_layers=2), stats=Stats(False),
                            vc=VeriCacheConfig(), tier=None, attach_tier=lambda: None, weights_changed=lambda: None,
                            plan=lambda req: SimpleNamespace(error=None, compressor=comp),
                            prefix_cache=SimpleNamespace(match=match), **owner_kw)
    return FetchDrafter(owner), asked


def _waiting(rid, ids, **kw):
    """A stand-in for SGLang's Req of a greedy request waiting for its prefix."""
    from types import SimpleNamespace

    params = SimpleNamespace(top_k=1, max_new_tokens=16, min_new_tokens=0)
    fields = dict(rid=rid, origin_input_ids=ids, output_ids=[], sampling_params=params, grammar=None, to_finish=None,
                  multimodal_inputs=None, input_embeds=None, finished=lambda: False)
    return SimpleNamespace(**{**fields, **kw})


def _seeded(drafter, tokens=40):
    """Give the drafter's own store an entry (as a job's seed does); its bytes."""
    import torch

    comp = drafter.owner.store.compressor
    layers = [comp.compress(torch.randn(tokens, 2, 16), torch.randn(tokens, 2, 16)) for _ in range(2)]
    drafter.store.seed(("fetch-draft", "x"), comp, layers, tokens)
    return drafter.store.nbytes()


def test_fetch_drafting_skips_multimodal_and_input_embeds_requests():
    """Their prompt ids are placeholders (a multimodal request's media: hash ids from
    1,000,000 up; input_embeds: [1] * len): teacher-forced, they read past the embedding
    table (IndexError on CPU, out of bounds on CUDA) inside the scheduler's prefetch check.
    No job starts for them; a text request gets as far as the prefix lookup."""
    from types import SimpleNamespace

    from sgl_vericache.spec.fetch_drafting import placeholder_prompt

    drafter, asked = _drafter()
    pad = 1_000_000 + (1 << 40)  # SGLang's MM_PAD_SHIFT_VALUE + a hash of the image
    image = _waiting("mm", [5, 6] + [pad] * 8 + [7, 8], multimodal_inputs=SimpleNamespace(mm_items=[]))
    embeds = _waiting("emb", [1] * 12, input_embeds=[[0.0] * 4] * 12)
    for req in (image, embeds):
        assert placeholder_prompt(req)
        drafter.poll(req, fetched=False, hit_tokens=100)
        assert drafter.job is None and req.rid in drafter._passed
    assert asked == []  # never looked up, never planned past the check
    text = _waiting("text", [5, 6, 7, 8])
    assert not placeholder_prompt(text)
    drafter.poll(text, fetched=False, hit_tokens=100)
    assert asked == [[5, 6, 7]] and drafter.job is None  # no entry to draft from: passed as before
    assert drafter.owner.stats.totals["fetch_draft_errors"] == 0


def test_an_error_in_one_fetch_draft_job_drops_that_job_only(caplog):
    """Fetch drafting is optional: an error it did not foresee (here the embedding's
    IndexError) drops that job (entry and draft buffers freed, nothing queued, never
    restarted), counts, logs a warning once, and poll returns; other requests' queued drafts
    stay, and the request goes on to be admitted as without fetch drafting."""
    import logging

    from sgl_vericache.spec.fetch_drafting import FetchJob

    drafter, asked = _drafter()
    drafter.queue.put("other", [1, 2, 3])
    req = _waiting("r", [5, 6, 7, 8])
    drafter.job = FetchJob(req, drafter.owner.store.compressor, [5, 6, 7, 8], 8, None)
    assert _seeded(drafter) > 0

    def run(job):
        raise IndexError("index out of range in self")

    drafter._run = run
    with caplog.at_level(logging.WARNING):
        drafter.poll(req, fetched=False, hit_tokens=100)
    assert drafter.job is None and drafter.store.nbytes() == 0 and "r" not in drafter.queue
    assert "other" in drafter.queue and "r" in drafter._passed
    assert drafter.owner.stats.totals["fetch_draft_errors"] == 1
    assert "IndexError: index out of range in self" in caplog.text
    drafter.poll(req, fetched=False, hit_tokens=100)  # not started again
    assert drafter.job is None and asked == []
    drafter.poll(req, fetched=True, hit_tokens=100)  # its prefetch done: admitted as usual, no drafts
    assert "r" not in drafter.queue
    # an error while starting a job is that request's; the second error is not logged again
    drafter.owner.plan = lambda r: (_ for _ in ()).throw(KeyError("plan"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        drafter.poll(_waiting("s", [5, 6, 7, 8]), fetched=False, hit_tokens=100)
    assert "s" in drafter._passed and drafter.owner.stats.totals["fetch_draft_errors"] == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_error_finishing_a_stale_job_is_that_jobs_not_the_polled_requests():
    from sgl_vericache.spec.fetch_drafting import FetchJob

    drafter, _ = _drafter()
    stale = _waiting("a", [5, 6, 7, 8])
    drafter.job = FetchJob(stale, drafter.owner.store.compressor, [5, 6, 7, 8], 8, None)
    drafter.job.drafts, drafter.job.polled = [9, 9], 0.0  # not polled for long: finished when another is

    def put(rid, tokens):
        raise RuntimeError("a bug queueing drafts")

    drafter.queue.put = put
    drafter.poll(_waiting("b", [5, 6, 7, 8]), fetched=False, hit_tokens=100)
    assert drafter.job is None and "a" in drafter._passed and "b" not in drafter._passed


def test_a_tier_read_that_raised_through_its_future_is_a_miss():
    """The tier's reader thread contains its own errors; should a Future still carry one
    (a bug), collecting it on the scheduler thread (``FetchJob.arrived``) is a miss: the job
    drafts from its fallback, or ends as one with nothing to draft from, and drafts made
    before a late read are still queued."""
    from concurrent.futures import Future

    from sgl_vericache.spec.fetch_drafting import FetchJob

    drafter, _ = _drafter()

    def failed():
        f = Future()
        f.set_exception(TypeError("KeptTokensLayer.__init__() got an unexpected keyword argument 'sink_count'"))
        return f

    req = _waiting("r", [5, 6, 7, 8])
    job = drafter.job = FetchJob(req, drafter.owner.store.compressor, [5, 6, 7, 8], 8, None)
    job.entry, job.entry_len = failed(), 3
    drafter.poll(req, fetched=False, hit_tokens=100)  # no fallback: nothing to draft from
    assert drafter.job is None and "r" in drafter._passed
    job = drafter.job = FetchJob(req, drafter.owner.store.compressor, [5, 6, 7, 8], 8, None)
    job.entry, job.drafts = failed(), [9, 10]
    drafter.poll(req, fetched=True, hit_tokens=100)  # the read came too late, and raised
    assert drafter.job is None and drafter.queue.take("r", [], 2) == [9, 10]
    assert drafter.owner.stats.totals["fetch_draft_errors"] == 2


def test_an_aborted_waiting_request_lets_go_of_its_job_at_once():
    """SGLang's abort of a waiting request (``_release_aborted_request``) frees its job's
    entry and draft buffers now: the request is never polled again, and the job would
    otherwise wait for another waiting request's poll."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler import Scheduler

    from sgl_vericache.sglang.runtime import Runtime
    from sgl_vericache.sglang.scheduler import install_fetch_drafting
    from sgl_vericache.spec.fetch_drafting import FetchJob

    drafter, _ = _drafter()
    req = _waiting("r", [5, 6, 7, 8], release_mm_inputs_on_abort=lambda: None, cache_request_handle=None,
                   session=None)
    drafter.job = FetchJob(req, drafter.owner.store.compressor, [5, 6, 7, 8], 8, None)
    assert _seeded(drafter) > 0
    drafter.queue.put("other", [1])
    drafter.forget("other-rid")  # not its job: kept
    assert drafter.job is not None and "other" in drafter.queue

    class Worker:  # the runtime keeps workers in a WeakSet
        speculator = SimpleNamespace(fetch_drafter=drafter)

    runtime, worker, finished = Runtime(), Worker(), []
    runtime.workers.add(worker)
    runtime.prefetching["r"] = req
    install_fetch_drafting(runtime)
    scheduler = SimpleNamespace(tree_cache=SimpleNamespace(finish=lambda *a: finished.append(a)))
    Scheduler._release_aborted_request(scheduler, req)
    assert finished and "r" not in runtime.prefetching  # SGLang's own release ran too
    assert drafter.job is None and drafter.store.nbytes() == 0 and "other" in drafter.queue


def test_throttled_store_reads_at_its_bandwidth(tmp_path):
    import torch

    sys.path.insert(0, str(BENCH))
    from sgl_vericache.cpu import compat as cpu_compat

    cpu_compat.install()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from throttled_store import ThrottledFile

    def config(extra):
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                    is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                    model_name="m", extra_config=extra)

    store = ThrottledFile(config({"file_storage_path": str(tmp_path), "throttle_mb_per_s": 10}))
    page = torch.arange(250_000, dtype=torch.float32)  # 1 MB
    assert store.batch_set(["p"], [page])
    out = torch.empty_like(page)
    t0 = time.perf_counter()
    got = store.batch_get(["p"], [out])
    assert time.perf_counter() - t0 >= 0.099 and torch.equal(got[0], page)
    assert store.bytes_read == 1_000_000
    with pytest.raises(ValueError, match="throttle_mb_per_s -1.0"):
        ThrottledFile(config({"file_storage_path": str(tmp_path), "throttle_mb_per_s": -1}))


ENGINE_KW = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True, dtype="float32",
                 log_level="warning", sleep_on_idle=True)
CONVERSATIONS, NEW_TOKENS = 5, 16


def _engine(model_path, **kw):
    import os

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sglang.srt.entrypoints.engine import Engine

    return Engine(model_path=str(model_path), **ENGINE_KW, **kw)


FIRST_TURNS, SECOND_TURNS = ((0, range(CONVERSATIONS)),), ((1, (0, 1)),)


def _conversations():
    return [[{"role": "system", "content": f"You are assistant number {c}. " + "Answer briefly. " * 130}]
            for c in range(CONVERSATIONS)]


def _trace(engine, tok, convs=None, rounds=FIRST_TURNS + SECOND_TURNS):
    """Five agents (a ~420-token system prompt each) take a turn each, then agents 0 and 1 a
    second one (``rounds``; ``convs`` carries the conversations from one call to the next).
    Returns per turn (output ids, cached_tokens_details, seconds)."""
    convs = _conversations() if convs is None else convs
    turns = []
    for rnd, agents in rounds:
        for c in agents:
            msgs = convs[c]
            msgs.append({"role": "user", "content": f"Round {rnd}: one fact about the number {rnd * 7 + c}."})
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
            t0 = time.monotonic()
            out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0})
            turns.append((out["output_ids"], out["meta_info"].get("cached_tokens_details") or {},
                          time.monotonic() - t0))
            msgs.append({"role": "assistant", "content": tok.decode(out["output_ids"], skip_special_tokens=True)})
    return turns


@pytest.fixture(scope="module")
def reference(default_model_path):
    """Engine A: speculation off, everything on the device."""
    from transformers import AutoTokenizer

    from sgl_vericache.config import VeriCacheConfig

    tok = AutoTokenizer.from_pretrained(default_model_path)
    VeriCacheConfig().to_env()
    engine = _engine(default_model_path, max_total_tokens=4096)
    try:
        return _trace(engine, tok)
    finally:
        engine.shutdown()


def _vericache_engine(model_path, store_dir, monkeypatch, compressed_cache_mb, radix_cache_backend,
                      tier_fraction=None):
    """Engine B: VERICACHE, a 1024-token device pool, a host tier of 2048 tokens, the
    throttled file store, the given radix cache backend."""
    from sgl_vericache.config import VeriCacheConfig

    backend = {} if radix_cache_backend is None else {"radix_cache_backend": radix_cache_backend}
    monkeypatch.syspath_prepend(str(BENCH))  # the scheduler imports throttled_store from here
    monkeypatch.setenv("VERICACHE_CHECK_INTEGRITY", "1")
    store = {"backend_name": "throttled_file", "module_path": "throttled_store", "class_name": "ThrottledFile",
             "file_storage_path": str(store_dir), "throttle_mb_per_s": 10}
    extra = {} if tier_fraction is None else {"fetch_draft_tier_fraction": tier_fraction}
    VeriCacheConfig(compressor="kivi4", ratio=4.0, draft_len=8, fetch_draft_tokens=32,
                    compressed_cache_mb=compressed_cache_mb, **extra).to_env()
    engine = _engine(model_path, speculative_algorithm="VERICACHE", speculative_num_draft_tokens=9,
                     speculative_ngram_max_bfs_breadth=1, disable_overlap_schedule=True, max_total_tokens=1024,
                     **backend, enable_hierarchical_cache=True, hicache_ratio=2.0,
                     hicache_io_backend="kernel", hicache_mem_layout="page_first",
                     hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(store),
                     hicache_storage_prefetch_policy="wait_complete")
    return engine


def _run(engine, tok, convs=None, rounds=FIRST_TURNS + SECOND_TURNS):
    """``_trace`` on ``engine``, then shut it down: (turns, VeriCache's counters)."""
    try:
        turns = _trace(engine, tok, convs, rounds)
        stats = engine.get_server_info()["internal_states"][0]["vericache"]
    finally:
        engine.shutdown()
    return turns, stats


def _vericache_trace(model_path, store_dir, monkeypatch, compressed_cache_mb, radix_cache_backend,
                     tier_fraction=None):
    """The whole trace on one engine B. Returns (turns, VeriCache's counters)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return _run(_vericache_engine(model_path, store_dir, monkeypatch, compressed_cache_mb, radix_cache_backend,
                                  tier_fraction), tok)


def _check(ours, reference, stats, capfd):
    fetch = {k: v for k, v in stats.items() if k.startswith(("fetch_draft", "compressed_tier", "compressed_prefix"))}
    with capfd.disabled():
        print("\nper turn (device/host/storage hit tokens, seconds):",
              [(d.get("device", 0), d.get("host", 0), d.get("storage", 0), round(s, 2)) for _, d, s in ours],
              "\ncounters:", fetch, flush=True)
    second = ours[CONVERSATIONS]  # agent 0's second turn
    assert second[1].get("storage", 0) > 400, second[1]  # its prefix came from the store
    assert fetch["fetch_draft_requests"] >= 1 and fetch["fetch_draft_tokens"] > 0, fetch
    assert fetch["fetch_draft_rounds"] >= 1 and fetch["fetch_draft_accepted"] > 0, fetch
    failures = [f"turn {i}: ours {o[:8]}... vs reference {r[:8]}..."
                for i, ((o, _, _), (r, _, _)) in enumerate(zip(ours, reference)) if o != r]
    assert len(ours) == len(reference) and not failures, "\n".join(failures)
    return fetch


def test_drafts_while_the_prefix_streams_in_from_storage(default_model_path, reference, tmp_path, monkeypatch,
                                                         capfd):
    """Five ~440-token conversations overflow the device and host tiers, so agent 0's
    second turn finds its prefix only in storage; SGLang holds it back while the prefix
    streams in, and B drafts for it meanwhile from the compressed entry its first turn left
    in the prefix cache (512 MiB: every entry stays on the device). Its first rounds
    verify those drafts. B's token ids must equal A's."""
    ours, stats = _vericache_trace(default_model_path, tmp_path / "kv", monkeypatch, compressed_cache_mb=512,
                                   radix_cache_backend="vericache")
    fetch = _check(ours, reference, stats, capfd)
    assert fetch["fetch_draft_tier_entries"] == 0 and fetch["compressed_tier_spilled_entries"] == 0, fetch


def test_drafts_from_a_compressed_entry_read_back_from_storage(default_model_path, reference, tmp_path,
                                                               monkeypatch, capfd):
    """The same trace on SGLang's own radix cache (no ``vericache`` backend) with a 1 MiB
    compressed prefix cache: every conversation's entry (about 8 MB for a 440-token kivi4
    prefix, fp32 residual window included) is larger than the budget, so the cache writes
    it to the file store SGLang's HiCache uses and keeps a stub. Agent 0's second turn reads its entry back
    (through the same 10 MB/s throttle; several times smaller than the full KV, so it
    arrives first), drafts from it while the full prefix streams in, and the drafts verify.
    Token ids equal A's. The entry (~0.4 of the full KV here) arrives too late for the
    default --vericache-fetch-draft-tier-fraction, so the test reads it always (1.0): it
    tests the read path, not the rule (``test_compressed_tier`` does)."""
    ours, stats = _vericache_trace(default_model_path, tmp_path / "kv", monkeypatch, compressed_cache_mb=1,
                                   radix_cache_backend=None, tier_fraction=1.0)
    fetch = _check(ours, reference, stats, capfd)
    assert fetch["compressed_tier_spilled_entries"] >= CONVERSATIONS, fetch
    assert fetch["compressed_prefix_spilled"] >= CONVERSATIONS, fetch  # the conversations' entries are stubs
    assert fetch["fetch_draft_tier_entries"] >= 1 and fetch["fetch_draft_tier_skipped"] == 0, fetch
    assert fetch["compressed_tier_fetches"] + fetch["compressed_tier_fetches_from_memory"] >= 1, fetch
    assert fetch["compressed_tier_fetch_corrupt"] == 0 and fetch["compressed_tier_spill_failures"] == 0, fetch
    assert list((tmp_path / "kv").glob("vericache-c-*")), "no compressed entry file in the store"


def test_a_new_engine_drafts_from_entries_an_earlier_one_stored(default_model_path, reference, tmp_path,
                                                                monkeypatch, capfd):
    """Engine B1 (1 MiB compressed cache: each conversation's entry goes to the file store,
    with its index record) takes the five first turns and stops. B2, a new engine on the same
    store, takes agents 0's and 1's second turns: their prefixes stream in from the store,
    and B2, whose compressed prefix cache starts empty, finds their compressed entries through
    the index (written by B1's process), reads them back and drafts while the prefix arrives.
    Read always (fraction 1.0), as in the test above. Token ids equal A's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    convs, store = _conversations(), tmp_path / "kv"
    make = dict(compressed_cache_mb=1, radix_cache_backend=None, tier_fraction=1.0)
    first, before = _run(_vericache_engine(default_model_path, store, monkeypatch, **make), tok, convs, FIRST_TURNS)
    assert before["compressed_tier_index_records"] >= 2, before  # agents 0 and 1 at least
    second, after = _run(_vericache_engine(default_model_path, store, monkeypatch, **make), tok, convs,
                         SECOND_TURNS)
    fetch = _check(first + second, reference, after, capfd)
    # both second turns look their entry up, the first one too (B2 has run no forward before it)
    assert fetch["fetch_draft_tier_lookups"] == 2 and fetch["fetch_draft_tier_index_entries"] >= 1, fetch
    assert fetch["compressed_tier_index_hits"] >= 1 and fetch["compressed_tier_fetch_corrupt"] == 0, fetch
