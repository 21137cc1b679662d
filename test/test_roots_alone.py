"""Rounds that verify their roots alone. One whose drafting runs out of device memory
(compressed entries and draft buffers live outside SGLang's KV pool): the compressed entries
go and the next iterations decode plainly; under tensor parallelism the error still
propagates. One at the context's last position (no room for drafts). In both, a batch that
samples keeps its SampledRound (SGLang's own verify acceptance commits argmax on CPU). The
real Speculator and CompressedKVStore on CPU; only the SGLang seam is a stand-in."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sgl_vericache.config import VeriCacheConfig
from sgl_vericache.spec import round as round_mod
from sgl_vericache.spec.round import RoundBatch, Speculator
from sgl_vericache.spec.stats import Stats

H_KV, D, LAYERS = 2, 16, 2


class _Passes:
    """Draft passes whose forward runs out of memory when ``oom`` is set, else answers
    logits whose argmax is token 5."""

    def __init__(self):
        self.oom = False

    def for_rows(self, source, keep):
        return keep

    @contextlib.contextmanager
    def run(self, draft_batch, store):
        def forward(tokens, positions):
            if self.oom:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            logits = torch.zeros(len(draft_batch), 50)
            logits[:, 5] = 1.0
            return logits

        yield forward


class _Seam:
    device, num_layers, context_len = "cpu", LAYERS, 4096
    windows = {}  # no sliding-window layers

    def __init__(self, tp_size=1):
        self.tp_size = tp_size
        self.passes = _Passes()
        self.kv = torch.randn(LAYERS, 2, 600, H_KV, D, generator=torch.Generator().manual_seed(0))
        self.sync_oom = False
        self.sampled_rows = []
        self.penalty_rows = []  # rows each round asked draft penalties for

    def draft_penalty(self, source, rows):
        self.penalty_rows.append(list(rows))
        return None

    def read_kv(self, pool_row):
        def read(layer_id, start, end):
            if self.sync_oom:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")
            return self.kv[layer_id, 0, start:end], self.kv[layer_id, 1, start:end]

        return read

    def agree(self, values):
        return tuple(values)

    def build_parking(self, reserve_limit):
        """The real parking over a pool of slots: batch row r's positions at slots r * 600 + i,
        the rest of the pool free for loads to land in."""
        from sgl_vericache.mem_cache.full_kv_parking import FullKVParking

        pool = torch.zeros(LAYERS, 2, 8 * 600, H_KV, D)
        req_to_token = torch.arange(4 * 600, dtype=torch.int32).reshape(4, 600)
        free = self.free = list(range(4 * 600, 8 * 600))  # a test may hold it at the reserved slots

        def alloc(n):
            if len(free) < n:
                return None
            out = torch.tensor(free[:n], dtype=torch.int64)
            del free[:n]
            return out

        parking = FullKVParking(lambda l: pool[l, 0], lambda l: pool[l, 1], LAYERS, req_to_token, alloc,
                                lambda slots: free.extend(slots.tolist()))
        parking.reserve_limit = reserve_limit
        return parking

    def abort(self, req, message, status=400):
        raise AssertionError(message)

    def sampled_round(self, source, rows, rng):
        self.sampled_rows.append(list(rows))
        return SimpleNamespace(rows=list(rows))


def _req(rid, prompt):
    params = SimpleNamespace(custom_params=None, temperature=0.0, sampling_seed=None)
    return SimpleNamespace(rid=rid, origin_input_ids=list(range(1, prompt + 1)), output_ids=[7],
                           sampling_params=params, cached_tokens=0)


def _speculator(seam, full_device_budget=-1, adaptive=False):
    vc = VeriCacheConfig(compressor="streamingllm", ratio=4.0, draft_len=4, adaptive=adaptive, compressed_cache_mb=0,
                         full_device_budget=full_device_budget)
    return Speculator(vc, seam, Stats(False), torch.Generator().manual_seed(0))


def _batch(reqs, greedy=True, verify_always=None):
    verified = [len(r.origin_input_ids) for r in reqs]
    return RoundBatch(reqs=reqs, verified=verified, pool_rows=list(range(len(reqs))), own_kv_start=[0] * len(reqs),
                      greedy=greedy, verify_always=verify_always or [False] * len(reqs), source=None)


def _round(spec, reqs, greedy=True):
    width = spec.begin_iteration(reqs, [len(r.origin_input_ids) for r in reqs], max_width=5)
    if not width:
        return None
    out = spec.draft_round(_batch(reqs, greedy), width)
    spec.close_round()
    return out


@pytest.mark.parametrize("where", ["sync", "draft"])
def test_a_round_out_of_memory_verifies_its_roots_then_pauses(where, caplog):
    seam = _Seam()
    spec = _speculator(seam)
    reqs = [_req("a", 300), _req("b", 200)]
    ok = _round(spec, reqs)
    assert ok.width == 5 and list(ok.tokens.reshape(2, 5)[0]) == [7, 5, 5, 5, 5]  # drafted: token 5
    assert len(spec.store) == 2 and spec.store.nbytes() > 0

    setattr(seam, "sync_oom", True) if where == "sync" else setattr(seam.passes, "oom", True)
    reqs.append(_req("c", 250))  # a new request: its entry is built this round (where sync runs out)
    failed = _round(spec, reqs)
    assert failed.width == 5 and (failed.tokens.reshape(3, 5) == 7).all(), failed.tokens  # roots alone
    assert spec.lens == [0, 0, 0] and spec.stats.totals["draft_out_of_memory"] == 1
    assert len(spec.store) == 0 and spec.store.nbytes() == 0  # every compressed entry let go
    assert "ran out of device memory" in caplog.text and "let go of" in caplog.text

    seam.sync_oom = seam.passes.oom = False
    verified = [300, 200, 250]
    assert spec.begin_iteration(reqs, verified, max_width=5, must_round=True) == 5  # logprobs / a grammar: a round
    spec.planner.undecided()  # (that iteration's round is not run here)
    plain = []
    for _ in range(round_mod.OUT_OF_MEMORY_PAUSE):
        plain.append(spec.begin_iteration(reqs, verified, max_width=5))
        spec.end_plain(0.01, 0.0)  # the worker's bookkeeping of a plain step (it raised without --vericache-adaptive)
    assert plain == [0] * round_mod.OUT_OF_MEMORY_PAUSE  # decoding plainly for a while, then drafting again
    again = _round(spec, reqs)
    assert list(again.tokens.reshape(3, 5)[2]) == [7, 5, 5, 5, 5] and len(spec.store) == 3


def test_paused_with_parked_full_kv_rounds_verify_their_roots_alone():
    """With a full-KV device budget, a plain step would attend over the slots parking freed
    (only a round loads parked KV back): the pause after running out of memory is rounds of
    width 1 (the roots alone, one token a row), no entry rebuilt, the parked request still
    parked, and drafting resumes after it."""
    seam = _Seam()
    spec = _speculator(seam, full_device_budget=0)
    reqs = [_req("a", 300), _req("b", 200)]
    first = _round(spec, reqs)
    assert first.width == 5 and spec.parking.is_parked("b") and not spec.parking.is_parked("a")
    seam.passes.oom = True
    failed = _round(spec, reqs)
    assert (failed.tokens.reshape(2, 5) == 7).all() and len(spec.store) == 0
    seam.passes.oom = False
    plain_before = spec.stats.totals.get("plain_iterations", 0)
    for _ in range(round_mod.OUT_OF_MEMORY_PAUSE):
        width = spec.begin_iteration(reqs, [300, 200], max_width=5)
        assert width == 1  # before: 0, a plain step with "b"'s KV parked and its slots freed
        out = spec.draft_round(_batch(reqs), width)
        assert list(out.tokens) == [7, 7] and spec.lens == [0, 0] and len(spec.store) == 0
        assert spec.parking.is_parked("b")
        spec.close_round()
    assert spec.stats.totals.get("plain_iterations", 0) == plain_before
    again = _round(spec, reqs)
    assert again.width == 5 and list(again.tokens.reshape(2, 5)[0]) == [7, 5, 5, 5, 5]
    # "b", still parked and not verifying, drafts nothing: its entry waits for a round it verifies
    # in (before, it was built from the slots parking had freed)
    assert list(spec.store._entries) == ["a"]


def test_a_sampled_round_out_of_memory_still_accepts_by_sampling():
    """A batch that samples must be accepted by its SampledRound (SGLang's own verify
    acceptance commits argmax on CPU): the roots-alone round gets one, with no drafting rows."""
    seam = _Seam()
    spec = _speculator(seam)
    seam.passes.oom = True
    reqs = [_req("a", 300)]
    width = spec.begin_iteration(reqs, [300], max_width=5)
    out = spec.draft_round(_batch(reqs, greedy=False), width)
    assert spec.sampled is not None and seam.sampled_rows[-1] == []
    assert (out.tokens == 7).all()
    spec.close_round()


def test_a_sampled_round_at_the_contexts_last_position_is_accepted_by_sampling():
    """No room for drafts (the round verifies its roots only): before, the round had no
    SampledRound and a sampling batch's token was SGLang's CPU argmax."""
    seam = _Seam()
    seam.context_len = 301  # position 300 is the last
    spec = _speculator(seam)
    reqs = [_req("a", 300)]
    width = spec.begin_iteration(reqs, [300], max_width=5)
    out = spec.draft_round(_batch(reqs, greedy=False), width)
    assert width == 1 and list(out.tokens) == [7] and spec.lens == [0]
    assert spec.sampled is not None and seam.sampled_rows[-1] == []
    spec.close_round()
    assert spec.sampled is None


def test_under_tensor_parallelism_the_error_propagates():
    seam = _Seam(tp_size=2)
    spec = _speculator(seam)
    seam.sync_oom = True
    reqs = [_req("a", 300)]
    width = spec.begin_iteration(reqs, [300], max_width=5)
    with pytest.raises(torch.OutOfMemoryError):
        spec.draft_round(_batch(reqs), width)
    assert spec.stats.totals["draft_out_of_memory"] == 0


def test_other_errors_are_not_taken_for_memory():
    seam = _Seam()
    spec = _speculator(seam)
    reqs = [_req("a", 300)]
    _round(spec, reqs)
    seam.passes.run = lambda *a: (_ for _ in ()).throw(RuntimeError("an index error in the draft"))
    width = spec.begin_iteration(reqs, [300], max_width=5)
    with pytest.raises(RuntimeError, match="index error"):
        spec.draft_round(_batch(reqs), width)
    assert len(spec.store) == 1 and np.isclose(spec.stats.totals["draft_out_of_memory"], 0)


def test_the_pause_books_nothing_against_an_earlier_batch():
    """With the adaptive controller on, the round that ran out of memory (a width-w verify of
    roots alone) and the plain steps of the pause are not learned from: before, the pause's
    steps were booked against the rows of the last batch the planner decided, and the failed
    round as a round of 0 drafts."""
    seam = _Seam()
    spec = _speculator(seam, adaptive=True)
    ctl = spec.planner.controller
    seen = []
    ctl.observe_plain = lambda rows, seconds: seen.append(("plain", [r.rid for r in rows]))
    ctl.observe_round = lambda rows, *args, **kwargs: seen.append(("round", [r.rid for r in rows]))
    reqs = [_req("a", 300), _req("b", 200)]

    def iteration(reqs, must_round=False):
        verified = [len(r.origin_input_ids) for r in reqs]
        width = spec.begin_iteration(reqs, verified, max_width=5, must_round=must_round)
        if not width:
            spec.end_plain(0.01, 0.0)
            return 0
        spec.draft_round(_batch(reqs), width)
        deferred = spec.close_round()
        spec.count_round(reqs, [1 + n for n in spec.lens], deferred, 0.02, 0.0)
        return width

    assert iteration(reqs, must_round=True) > 1 and seen == [("round", ["a", "b"])]
    seam.passes.oom = True
    assert iteration(reqs[:1], must_round=True) > 1  # drafting runs out of memory: roots alone
    assert seen == [("round", ["a", "b"])] and spec.stats.totals["draft_out_of_memory"] == 1
    seam.passes.oom = False
    assert [iteration(reqs) for _ in range(3)] == [0, 0, 0]
    assert seen == [("round", ["a", "b"])]  # the pause's plain steps: nothing learned


def test_penalized_requests_draft_min_new_tokens_ones_too():
    """Penalized requests draft (the seam penalizes each verified position as decoding
    would, and steers their drafts: the round asks it for the drafting rows' penalties).
    A request short of its min_new_tokens is penalized too (SGLang's fourth penalizer, its
    count per position in the seam) and drafts with its batch-mates, where it once emitted
    one token a round until the count was reached."""
    seam = _Seam()
    spec = _speculator(seam)
    drafted_rows = []
    for_rows = seam.passes.for_rows
    seam.passes.for_rows = lambda source, keep: drafted_rows.append(list(keep)) or for_rows(source, keep)
    plain, penalized, held = _req("a", 300), _req("b", 200), _req("c", 250)
    penalized.sampling_params.frequency_penalty = 0.5
    held.sampling_params.min_new_tokens = 3  # one output token so far (_req's 7)
    reqs = [plain, penalized, held]
    width = spec.begin_iteration(reqs, [300, 200, 250], max_width=5)
    out = spec.draft_round(_batch(reqs), width)
    assert spec.undrafted == () and spec.deferred == ()
    spec.close_round()
    assert out.width == 5 and spec.lens == [4, 4, 4] and drafted_rows == [[0, 1, 2]]
    assert seam.penalty_rows == [[0, 1, 2]]  # penalized rows draft: their penalties steer the round's drafts
    tokens = out.tokens.reshape(3, 5)
    assert list(tokens[0]) == [7, 5, 5, 5, 5] and list(tokens[2]) == [7, 5, 5, 5, 5]
    assert spec.begin_iteration([held], [250], max_width=5) == 5  # alone it drafts too
    spec.planner.undecided()
    for name, value in (("presence_penalty", 0.2), ("repetition_penalty", 1.1)):
        other = _req("d", 100)
        setattr(other.sampling_params, name, value)
        out = _round(spec, [plain, other])
        assert spec.lens == [4, 4], name
    _round(spec, [plain, _req("e", 100)])
    assert seam.penalty_rows[-1] == [0, 1] and len(seam.penalty_rows) == 3  # no penalized row: not asked


def test_penalized_requests_verify_in_every_round_under_a_full_kv_budget():
    """Staggered verifies leave a row out of a round, which emits nothing for it; SGLang
    would then count its last output token's penalty again at the next iteration. A
    penalized row verifies in every round, first, whatever the budget; of the others the
    longest waiting still always verifies (no one starves)."""
    from sgl_vericache.spec.round_batch import verifying_rows

    assert verifying_rows(100, [80, 80, 80], [0, 5, 0]) == [False, True, False]
    assert verifying_rows(100, [80, 80, 80], [0, 5, 0], [False, False, True]) == [False, True, True]
    assert verifying_rows(0, [80, 80], [9, 0], [True, True]) == [True, True]
    assert verifying_rows(200, [80, 80, 80], [0, 5, 0], [True, False, False]) == [True, True, False]
    seam = _Seam()
    spec = _speculator(seam, full_device_budget=0)
    reqs = [_req("a", 300), _req("b", 200), _req("c", 250)]
    reqs[1].sampling_params.repetition_penalty = 1.2
    deferred = []
    for _ in range(4):
        width = spec.begin_iteration(reqs, [300, 200, 250], max_width=5)
        spec.draft_round(_batch(reqs), width)
        assert spec.lens[1] == 4 and not spec.parking.is_parked("b")  # it drafts, and is never parked
        deferred.append(spec.close_round())
        spec.count_round(reqs, [1, 1, 1], deferred[-1], 0.01, 0.0)
    assert all(1 not in d and len(d) == 1 for d in deferred), deferred  # a and c take turns
    assert {0, 2} == set().union(*deferred)


def test_rows_with_logprobs_or_a_grammar_verify_every_round_while_the_rest_take_turns():
    """A batch with a logprob or grammar request used to verify every row, loading every
    parked request's KV at once while parked requests hold back only one round's loads:
    under memory pressure that load failed (ParkingError, the scheduler stopped). Now only
    those rows verify in every round (never parked); the others still take turns, and no
    round loads more than the parked requests held reserved before it."""
    seam = _Seam()
    spec = _speculator(seam, full_device_budget=0)
    reqs = [_req("a", 300), _req("b", 200), _req("c", 250), _req("d", 220)]
    always = [False, True, False, False]  # "b" returns logprobs
    deferred = []
    for _ in range(6):
        reserved = spec.parking.reserved_tokens if spec.parking is not None else 0
        loaded = spec.parking.stats.loaded_tokens if spec.parking is not None else 0
        width = spec.begin_iteration(reqs, [300, 200, 250, 220], max_width=5)
        spec.draft_round(_batch(reqs, verify_always=always), width)
        assert spec.lens[1] > 0 and not spec.parking.is_parked("b")  # it drafts, and verifies
        assert spec.parking.stats.loaded_tokens - loaded <= reserved
        deferred.append(spec.close_round())
        spec.count_round(reqs, [1, 1, 1, 1], deferred[-1], 0.01, 0.0)
    assert all(1 not in d and len(d) == 2 for d in deferred), deferred  # one of a, c, d verifies a round
    assert {0, 2, 3} == set().union(*deferred) and spec.parking.stats.loads > 0


def test_a_parked_requests_entry_is_rebuilt_from_its_loaded_kv():
    """A parked request's slots were freed: when its compressed entry must be built again
    (let go after running out of memory, or a new compressor under ``auto``), the sync
    read them anyway, compressing (and filing in the prefix cache) whatever lay there. Its
    KV is loaded back first now; an entry that is current reads nothing."""
    seam = _Seam()
    spec = _speculator(seam, full_device_budget=0)
    reqs = [_req("a", 300), _req("b", 200)]
    _round(spec, reqs)
    spec.close_round()
    assert spec.parking.is_parked("b")
    reads = []
    read_kv = seam.read_kv
    seam.read_kv = lambda row: (lambda layer, start, end: (reads.append((row, spec.parking.is_parked("b"))),
                                                            read_kv(row)(layer, start, end))[1])
    spec.waited["b"] = 0  # "a" verifies again: "b" stays parked
    spec.waited["a"] = 1
    _round(spec, reqs)
    spec.close_round()
    assert spec.parking.is_parked("b") and not [r for r in reads if r[0] == 1]  # its entry was current
    spec.store.release("b")  # as after running out of memory
    spec.waited["b"] = 5  # it verifies in this round (one that does not draft leaves its entry be)
    _round(spec, reqs)
    assert reads and all(not parked for row, parked in reads if row == 1), reads
    assert spec.stats.totals["full_kv_loads_for_rebuild"] == 1
    spec.close_round()


def test_a_sampled_round_tells_its_acceptance_each_rows_own_draft_length():
    """Rows past their own draft length are verified over padding: the round hands the
    SampledRound each row's length, so rejection rows accept the padding as a fixed
    proposal (test_sampled_round.py checks the distribution)."""
    class Seam(_Seam):
        def agree_tokens(self, tokens):
            return tokens

        def sampled_round(self, source, rows, rng):
            return SimpleNamespace(rows=list(rows), draw=lambda logits, positions: logits.argmax(-1))

    seam = Seam()
    spec = _speculator(seam)
    reqs = [_req("a", 300), _req("b", 200)]
    reqs[0].sampling_params.custom_params = {"vericache_draft_len": 1}
    width = spec.begin_iteration(reqs, [300, 200], max_width=5)
    spec.draft_round(_batch(reqs, greedy=False), width)
    assert spec.sampled.own_lens == [1, 4] and spec.lens == [1, 4]
    spec.close_round()


def test_a_snapkv_entry_rebuilt_without_its_queries_drafts_from_streamingllm():
    """SnapKV's prompt queries are let go at the request's first round. After drafting ran
    out of memory (every entry let go) the entry is built again without them: compress
    raised in the scheduler and stopped it. The request drafts from StreamingLLM at its
    ratio from then on."""
    seam = _Seam()
    vc = VeriCacheConfig(compressor="snapkv", ratio=4.0, draft_len=4, adaptive=False, compressed_cache_mb=0)
    spec = Speculator(vc, seam, Stats(False), torch.Generator().manual_seed(0))
    reqs = [_req("a", 300)]
    spec.queries["a"] = {layer: torch.randn(8, 4, D) for layer in range(LAYERS)}  # captured at its prefill
    _round(spec, reqs)
    spec.close_round()
    assert spec.store.entry("a")[0].name == "snapkv" and "a" not in spec.queries
    seam.passes.oom = True
    _round(spec, reqs)  # let go of every entry; the next iterations decode plainly
    spec.close_round()
    seam.passes.oom = False
    for _ in range(round_mod.OUT_OF_MEMORY_PAUSE):
        spec.begin_iteration(reqs, [300], max_width=5)
    out = _round(spec, reqs)
    assert list(out.tokens) == [7, 5, 5, 5, 5]  # drafting again
    assert spec.store.entry("a")[0].name == "streamingllm" and spec.plan(reqs[0]).compressor.name == "streamingllm"
    assert spec.store.entry("a")[0].ratio == 4.0 and spec.stats.totals["query_free_rebuilds"] == 1
    spec.close_round()
    _round(spec, reqs)  # kept: not rebuilt again
    assert spec.stats.totals["query_free_rebuilds"] == 1
    spec.close_round()


def test_input_embeds_requests_stay_out_of_the_compressed_prefix_cache():
    """An input_embeds request's ids are placeholders (``[1] * len``: any two of one length
    match), and SGLang empties its output ids when it is retracted: its departing entry was
    filed under fewer tokens than it holds, a ValueError in the scheduler. Such requests
    neither file entries nor take them; a text request still does."""
    seam = _Seam()
    vc = VeriCacheConfig(compressor="streamingllm", ratio=4.0, draft_len=4, compressed_cache_mb=64, adaptive=False)
    spec = Speculator(vc, seam, Stats(False), torch.Generator().manual_seed(0))
    embeds = _req("e", 100)
    embeds.origin_input_ids, embeds.input_embeds = [1] * 100, [[0.0]]
    embeds.output_ids = [7] * 8
    width = spec.begin_iteration([embeds], [108], max_width=5)
    spec.draft_round(_batch([embeds]), width)
    spec.close_round()
    embeds.output_ids = []  # retracted: SGLang's reset_for_retract
    spec.release_departed(["e"])
    assert spec.prefix_cache.num_entries == 0
    text = _req("t", 100)
    _round(spec, [text])
    spec.close_round()
    spec.release_departed(["t"])
    assert spec.prefix_cache.num_entries == 1
    again = _req("e2", 100)
    again.origin_input_ids, again.input_embeds = list(text.origin_input_ids), [[0.0]]
    _round(spec, [again])  # its ids match the text request's entry, its embeddings need not
    assert spec.prefix_cache.hits == 0 and spec.store.entry("e2")[2] == 100
    spec.close_round()


def test_an_error_compressing_one_requests_kv_ends_that_request_alone():
    """A compressor that raises for one request (a bug of ours) stopped the scheduler: that
    request now ends with a 500 and verifies its root alone; the others draft."""
    class Seam(_Seam):
        def __init__(self):
            super().__init__()
            self.aborted = []

        def abort(self, req, message, status=400):
            self.aborted.append((req.rid, status, message))

        def read_kv(self, pool_row):
            read = super().read_kv(pool_row)
            if pool_row == 1:
                return lambda layer, start, end: (_ for _ in ()).throw(RuntimeError("boom"))
            return read

    seam = Seam()
    spec = _speculator(seam)
    reqs = [_req("a", 300), _req("b", 200)]
    out = _round(spec, reqs)
    assert [(rid, status) for rid, status, _ in seam.aborted] == [("b", 500)]
    assert "RuntimeError: boom" in seam.aborted[0][2]
    assert spec.lens == [4, 0] and list(out.tokens.reshape(2, 5)[1]) == [7, 7, 7, 7, 7]
    assert "a" in spec.store and "b" not in spec.store and spec.stats.totals["sync_errors"] == 1
    spec.close_round()


def test_entries_let_go_are_rebuilt_in_the_round_their_parked_request_verifies():
    """After drafting ran out of memory every entry is gone. A parked request that does not
    verify drafts nothing, so its entry waits for the round it verifies in: loading every
    parked request to rebuild its entry at once took more slots than parked requests hold
    reserved (one round's loads), and under memory pressure raised ParkingError."""
    seam = _Seam()
    spec = _speculator(seam, full_device_budget=0)
    reqs = [_req("a", 300), _req("b", 200), _req("c", 250), _req("d", 220)]

    def iteration():
        width = spec.begin_iteration(reqs, [300, 200, 250, 220], max_width=5)
        spec.draft_round(_batch(reqs), width)
        deferred = spec.close_round()
        spec.count_round(reqs, [1] * 4, deferred, 0.01, 0.0)
        # memory pressure: SGLang gives everything but the parked requests' reserved slots to
        # other requests (and retracts some where that is short); free slots = reserved
        in_use = set(seam.free) | set(spec.parking.req_to_token.flatten().tolist())
        spare = [slot for slot in range(4 * 600, 8 * 600) if slot not in in_use]
        seam.free[:] = (seam.free + spare)[:spec.parking.reserved_tokens]

    for _ in range(3):
        iteration()
    seam.passes.oom = True
    iteration()
    seam.passes.oom = False
    for _ in range(round_mod.OUT_OF_MEMORY_PAUSE):
        iteration()
    assert len(spec.parking.parked) == 3 and len(spec.store) == 0
    for k in range(4):  # each round rebuilds the one parked request that verifies in it
        iteration()
        assert spec.stats.totals["full_kv_loads_for_rebuild"] == min(k + 1, 3)
    assert len(spec.store) == 4


def test_a_finished_requests_rid_sent_again_is_a_new_request():
    """SGLang accepts a finished request's rid again (an agent reusing one for every turn).
    When the new request arrived before any decode iteration saw the old one leave, its
    round extended the old request's entry, and at its departure the old request's tokens
    were filed with the new entry: a ValueError in the scheduler. The worker tells requests
    apart by their Req, and the planner re-plans a rid whose request changed."""
    from sgl_vericache.sglang.worker import VeriCacheWorker

    seam = _Seam()
    vc = VeriCacheConfig(compressor="streamingllm", ratio=4.0, draft_len=4, compressed_cache_mb=64, adaptive=False)
    spec = Speculator(vc, seam, Stats(False), torch.Generator().manual_seed(0))
    worker = SimpleNamespace(speculator=spec, _last_decode_reqs={})

    def iteration(reqs):
        VeriCacheWorker._release_departed(worker, SimpleNamespace(reqs=reqs))
        _round(spec, reqs)

    first = _req("agent", 100)
    first.sampling_params.custom_params = {"vericache_draft_len": 2}
    iteration([first])
    assert spec.plan(first).draft_len == 2
    second = _req("agent", 400)  # the same rid, before any iteration without it
    iteration([second])
    assert spec.reqs["agent"] is second and spec.store.entry("agent")[2] == 400
    plan = spec.plan(second)
    assert plan.draft_len == 4  # its own plan, not the first request's override
    iteration([_req("other", 50)])  # it leaves: its entry is filed under its own tokens
    from sgl_vericache.spec.entry_sync import kv_tokens

    assert "agent" not in spec.store
    assert spec.prefix_cache.match(kv_tokens(second, 400), plan.compressor)[0] == 400
    assert spec.prefix_cache.match(kv_tokens(first, 100), plan.compressor)[0] == 100  # and the first's under its own
