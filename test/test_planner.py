"""The Planner (spec/plan.py), without SGLang: what it keeps per request (plans, compressor
trials) as requests arrive, finish at their prefill or are aborted while their prefix is
fetched; and how draft steps are priced (learned costs independent of the string-hash seed,
padded on the dense CPU path only, as the Speculator's store reads them)."""

from __future__ import annotations

import pytest

from sgl_vericache.spec.adaptive import Controller, Row


class _Params:
    def __init__(self, max_new_tokens):
        self.custom_params, self.max_new_tokens = None, max_new_tokens


class _Req:
    """The parts of SGLang's Req the Planner reads."""

    def __init__(self, rid, prompt_len, max_new_tokens=64):
        self.rid, self.origin_input_ids, self.output_ids = rid, [1] * prompt_len, []
        self.sampling_params = _Params(max_new_tokens)
        self.done = False

    def finished(self):
        return self.done


def _planner():
    from sgl_vericache.config import VeriCacheConfig
    from sgl_vericache.spec.plan import Planner
    from sgl_vericache.spec.stats import Stats

    vc = VeriCacheConfig(compressor="auto", adaptive=True)
    return Planner(vc, Stats(False), lambda *a, **k: None, vc.build_compressor())


def test_planner_forgets_requests_that_finish_at_their_prefill():
    """A request with one new token (bench_adaptive's cache warm-ups) finishes at its prefill and
    never joins a decode batch, so no departure reports it: its plan, and a compressor trial it
    held, must still go."""
    planner = _planner()
    warm = [_Req(f"w{i}", 4000, max_new_tokens=1) for i in range(4)]
    planner.plan_arriving(warm)
    for req in warm:
        req.done = True
    real = [_Req(f"r{i}", 4000) for i in range(4)]
    planner.plan_arriving(real)
    assert set(planner.plans) == {r.rid for r in real}, set(planner.plans)
    # a trial is held by the request that makes it (it was held by None: freed only by time)
    assert all(who in planner.plans for who, _ in planner.controller.exploring.values()), planner.controller.exploring
    planner.decide(real, [4000] * 4, (), False)
    assert not planner.unseen and planner.rows[0].remaining == 64


def test_planner_forgets_a_request_aborted_while_its_prefix_was_fetched():
    """Fetch drafting plans a request while its prefix is still read from a tier, before any
    prefill; aborted then, it never joins a batch and no departure reports it: its plan goes
    at the next iteration, while one still waiting keeps its plan."""
    planner = _planner()
    waiting, aborted = _Req("waiting", 4000), _Req("aborted", 4000)
    planner.plan(waiting)
    planner.plan(aborted)
    aborted.done = True
    running = [_Req("r0", 1000)]
    planner.plan_arriving(running)
    planner.decide(running, [1000], (), False)
    assert set(planner.plans) == {"waiting", "r0"}, set(planner.plans)
    assert set(planner.unseen) == {"waiting"}


def test_planner_prices_arrivals_beside_the_running_batch_not_a_finished_one():
    planner = _planner()
    first = [_Req(f"a{i}", 500) for i in range(2)]
    planner.plan_arriving(first)
    planner.decide(first, [500, 500], (), False)
    assert len(planner._running()) == 2
    for req in first:
        req.done = True
    assert planner._running() == []


_COSTS_UNDER_A_HASH_SEED = """
import json
from sgl_vericache.spec.step_costs import Costs, Row
c = Costs()
c.observe_setup([Row("a", 4000, 1000, "h2o")], 0.004)  # one compressor measured before
rows = [Row("s1", 4000, 1000, "streamingllm"), Row("s2", 4000, 1000, "streamingllm"),
        Row("s3", 4000, 1000, "streamingllm"), Row("k", 4000, 4000, "kivi4")]
c.observe_setup(rows, 0.05)
c.observe_build(rows[2:], 1.3)
c.observe_residual(rows, 0.9, 0.7)
print(json.dumps([c.setup_per_row, c.build_per_ktok, sorted(map(str, c.residual.items()))], sort_keys=True))
"""


def test_learned_costs_do_not_depend_on_the_processs_string_hashing():
    """Tensor-parallel ranks are separate processes, each with its own string-hash seed: the
    costs they learn from the same samples must be equal, or their planners decide apart (a
    round on one rank, a plain step on another) and hang in their all-reduces. A compressor
    not measured yet starts from the others' mean, so an update in a set's order was not."""
    import os
    import subprocess
    import sys

    outs = set()
    for seed in range(4):
        env = dict(os.environ, PYTHONHASHSEED=str(seed))
        r = subprocess.run([sys.executable, "-c", _COSTS_UNDER_A_HASH_SEED], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.add(r.stdout)
    assert len(outs) == 1, outs


def test_draft_steps_are_priced_padded_on_the_dense_path_only():
    """The CPU path's dense draft buffers pad every row to the longest; the GPU kernels read
    each row's own entry. A kivi4 row beside seven droppers' rows at 8k: padded, every row
    reads the quantizer's 8k tokens; on the kernels, the droppers read their own 2k."""
    rows = [Row("q", 8000, 8000, "kivi4")] + [Row(f"d{i}", 8000, 2000, "streamingllm") for i in range(7)]
    padded, own = Controller(max_draft_len=16), Controller(max_draft_len=16, padded_drafts=False)
    assert padded.costs.draft.base_x(rows)[2] == pytest.approx(64.0)
    assert own.costs.draft.base_x(rows)[2] == pytest.approx(22.0)
    assert own.costs.draft.predict(rows) < padded.costs.draft.predict(rows)


def test_the_speculator_prices_drafts_as_its_store_reads_them():
    from types import SimpleNamespace

    import torch

    from sgl_vericache.config import VeriCacheConfig
    from sgl_vericache.spec.round import Speculator
    from sgl_vericache.spec.stats import Stats

    seam = SimpleNamespace(device="cpu", num_layers=2, context_len=4096, windows={}, abort=None)
    spec = Speculator(VeriCacheConfig(adaptive=True, compressed_cache_mb=0), seam, Stats(False),
                      torch.Generator().manual_seed(0))
    assert spec.planner.controller.costs.draft.padded  # the CPU path: dense, padded buffers
    spec.store.draft_kernels = True  # the kernels (CI reaches them under the interpreter)
    assert spec.store.kernels_on("cpu")
