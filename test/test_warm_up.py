"""The draft kernels' start-up warm-up (spec/warm_up.py), as the worker wires it.

That the warm-up compiles every kernel variant later rounds launch is kernel_checks.py's
`warm-up` cases (store family: Triton's own cache keys, under the interpreter here and
compiled on a GPU); these tests cover what runs around it on any machine.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sgl_vericache.config import AUTO_CANDIDATES, VeriCacheConfig
from sgl_vericache.spec.round import Speculator
from sgl_vericache.spec.stats import Stats
from sgl_vericache.spec.warm_up import HeadLayout, warm_up

LAYOUT = HeadLayout(6, 2, 64, torch.float32, torch.float32)


class _Seam:
    def __init__(self, device="cpu", layout=LAYOUT, error=None):
        self.num_layers, self.device, self.layout, self.error = 2, device, layout, error
        self.windows = {}  # no sliding-window layers
        self.layout_calls = 0

    def abort(self, req, message, status=400):
        raise AssertionError(message)

    def kv_buffers(self, layer_id):  # no pool: no round runs here
        raise AssertionError(f"layer {layer_id}'s pool read outside a round")

    def head_layout(self):
        self.layout_calls += 1
        if self.error is not None:
            raise self.error
        return self.layout


def _speculator(seam, **config) -> Speculator:
    return Speculator(VeriCacheConfig(**config), seam, Stats(False), torch.Generator().manual_seed(0))


def test_the_configured_compressors_are_the_ones_plans_share():
    spec = _speculator(_Seam())
    got = spec.planner.configured_compressors()
    assert [c.name for c in got] == list(AUTO_CANDIDATES)
    assert all(a is b for a, b in zip(spec.planner.configured_compressors(), got))  # the planner's own
    named = _speculator(_Seam(), compressor="kivi2", compressor_options="group_size=16")
    (comp,) = named.planner.configured_compressors()
    assert comp.name == "kivi2" and comp.options["group_size"] == 16


def test_no_warm_up_where_drafting_runs_on_torch():
    """A CPU worker compiles nothing, but reads its head layout all the same (as a GPU one
    does, once SGLang has built the pool: the engine tests check it is there) and says why
    nothing was compiled."""
    seam = _Seam(device="cpu")
    spec = _speculator(seam)
    spec.warm_up_kernels()
    assert seam.layout_calls == 1
    assert spec.kernels == {"head_layout": str(LAYOUT), "draft": "off: draft attention runs on torch here",
                            "verify": "off: verify attention runs on torch here"}
    comps = _speculator(_Seam()).planner.configured_compressors()
    assert warm_up(comps, LAYOUT, torch.device("cpu")) is None
    assert warm_up(comps, LAYOUT, torch.device("cpu"), draft_kernels=False) is None


def test_a_failed_warm_up_is_logged_and_the_worker_goes_on(monkeypatch, caplog):
    monkeypatch.setattr("sgl_vericache.kernels.draft_kernels_off", lambda device: None)
    monkeypatch.setattr("sgl_vericache.kernels.verify_kernel_off", lambda device: "no GPU")
    seam = _Seam(device="cuda", error=RuntimeError("no heads here"))
    with caplog.at_level(logging.INFO, logger="sgl_vericache.spec.warm_up"):
        _speculator(seam).warm_up_kernels()
    assert seam.layout_calls == 1
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert failed and "streamingllm, kivi4" in failed[0].getMessage() and "no heads here" in caplog.text
    spec = _speculator(_Seam(device="cuda", error=RuntimeError("no heads here")))
    spec.warm_up_kernels()
    assert spec.kernels["head_layout"] == "unreadable: RuntimeError: no heads here"
    assert spec.kernels["draft"] == "compiled at first use (no head layout)"


def test_without_warm_up_the_kernels_compile_at_first_use(monkeypatch):
    monkeypatch.setattr("sgl_vericache.kernels.draft_kernels_off", lambda device: None)
    monkeypatch.setattr("sgl_vericache.kernels.verify_kernel_off", lambda device: None)
    monkeypatch.setattr("sgl_vericache.spec.warm_up.warm_up", lambda *a: pytest.fail("compiled"))
    spec = _speculator(_Seam(device="cuda"))
    spec.warm_up_kernels(compile_now=False)
    assert spec.kernels == {"head_layout": str(LAYOUT), "draft": "compiled at first use (not asked to)",
                            "verify": "compiled at first use (not asked to)"}


@pytest.mark.parametrize("compressor, windows", [("auto", {}), ("kivi2", {}), ("kivi2", {1: 8})])
def test_the_worker_warms_its_configured_compressors_with_its_layout(monkeypatch, caplog, compressor, windows):
    """The wiring around warm_up (which kernel_checks' warm-up cases run on the kernels, for
    every compressor): the planner's own compressor instances, the seam's layout and device,
    sliding-window layers' drafts when the model has such layers, and a line saying when
    they are ready."""
    calls = []

    def fake_warm_up(compressors, layout, device, windows=False):
        calls.append((compressors, layout, device, windows))
        return 1.5

    monkeypatch.setattr("sgl_vericache.kernels.draft_kernels_off", lambda device: None)
    monkeypatch.setattr("sgl_vericache.kernels.verify_kernel_off", lambda device: "no GPU")
    monkeypatch.setattr("sgl_vericache.spec.warm_up.warm_up", fake_warm_up)
    seam = _Seam(device="cuda")
    seam.windows = windows
    spec = _speculator(seam, compressor=compressor)
    with caplog.at_level(logging.INFO, logger="sgl_vericache.spec.warm_up"):
        spec.warm_up_kernels()
    ((compressors, layout, device, warm_windows),) = calls
    assert [a is b for a, b in zip(compressors, spec.planner.configured_compressors())] == [True] * len(compressors)
    assert layout == LAYOUT and device == "cuda" and warm_windows == bool(windows)
    names = ", ".join(AUTO_CANDIDATES) if compressor == "auto" else compressor
    names += " and sliding-window layers" if windows else ""
    assert f"draft kernels for {names} ready in 1.5 s" in caplog.text, caplog.text


def _a_gpu(monkeypatch, capability=(9, 0)):
    """The chooser sees a CUDA device of this compute capability, with no draft kernel failed yet."""
    from sgl_vericache import kernels

    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    monkeypatch.delenv(kernels.VERIFY_DISABLE_ENV, raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(kernels, "_draft_failure", None)


def test_a_failed_draft_warm_up_turns_the_draft_kernels_off(monkeypatch, caplog):
    """A draft kernel that fails to compile at start-up (out of shared memory on a smaller
    GPU, a ptxas error) would fail the same way in the first round: the drafts run on the
    dense torch path instead, from the start, and /server_info says why."""
    from triton.runtime.errors import OutOfResources

    from sgl_vericache import kernels
    from sgl_vericache.spec.drafter import kernels_on

    _a_gpu(monkeypatch)

    def failing_warm_up(compressors, layout, device, windows=False):
        raise OutOfResources(232448, 101376, "shared memory")

    monkeypatch.setattr("sgl_vericache.spec.warm_up.warm_up", failing_warm_up)
    monkeypatch.setattr("sgl_vericache.spec.warm_up.warm_verify", lambda *a: 0.5)
    spec = _speculator(_Seam(device="cuda"), compressor="kivi2")
    with caplog.at_level(logging.INFO, logger="sgl_vericache"):
        spec.warm_up_kernels()
    assert spec.kernels["draft"] == ("off: compiling the draft kernels for kivi2 failed: OutOfResources: out of "
                                     "resource: shared memory, Required: 232448, Hardware limit: 101376. Reducing "
                                     "block sizes or `num_stages` may help."), spec.kernels
    assert spec.kernels["verify"] == "ready in 0.5 s"
    assert not spec.store.kernels_on("cuda") and not kernels_on(True, "cuda")
    assert kernels.draft_kernels_off("cuda") == spec.kernels["draft"][len("off: "):]
    warned = [r.getMessage() for r in caplog.records if "dense torch path" in r.getMessage()]
    assert len(warned) == 1 and "compiling the draft kernels for kivi2 failed" in warned[0], warned


def test_a_draft_warm_up_out_of_memory_leaves_the_kernels_on(monkeypatch):
    """Running out of memory at start-up is not the kernels' failing: they compile at first use."""
    from sgl_vericache import kernels

    _a_gpu(monkeypatch)

    def failing_warm_up(compressors, layout, device, windows=False):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr("sgl_vericache.spec.warm_up.warm_up", failing_warm_up)
    monkeypatch.setattr("sgl_vericache.spec.warm_up.warm_verify", lambda *a: 0.5)
    spec = _speculator(_Seam(device="cuda"))
    spec.warm_up_kernels()
    assert spec.kernels["draft"] == "compiled at first use (warm-up failed: OutOfMemoryError: CUDA out of memory)"
    assert kernels.draft_kernels_failed() is None and spec.store.kernels_on("cuda")


def test_a_warm_up_round_that_falls_back_reports_the_drafts_off(monkeypatch):
    """A launch failing inside the warm-up's rounds is caught there, as in any round
    (KernelDraftRound, the window rounds): the warm-up then reports that the device drafts on
    torch (None) and the status names the failure."""
    from triton.runtime.errors import OutOfResources

    from sgl_vericache import kernels
    from sgl_vericache.kernels import ops

    _a_gpu(monkeypatch)
    launches = []

    def launch(*args, **kwargs):
        launches.append(1)
        raise OutOfResources(232448, 101376, "shared memory")

    monkeypatch.setattr(ops, "decode_attention", launch)
    comps = _speculator(_Seam(), compressor="kivi2").planner.configured_compressors()
    assert warm_up(comps, LAYOUT, torch.device("cpu"), draft_kernels=True, lengths=(120, 70), windows=True) is None
    assert len(launches) == 1 and kernels.draft_kernels_failed().startswith("a draft kernel failed: OutOfResources")

    monkeypatch.setattr("sgl_vericache.spec.warm_up.warm_up", lambda *a, **kw: None)
    spec = _speculator(_Seam(device="cuda"))
    spec.warm_up_kernels()
    assert spec.kernels["draft"] == f"off: {kernels.draft_kernels_failed()}"


def test_the_status_says_why_a_gpu_keeps_the_torch_path(monkeypatch):
    _a_gpu(monkeypatch, capability=(7, 5))
    monkeypatch.setattr("sgl_vericache.spec.warm_up.warm_up", lambda *a, **kw: pytest.fail("compiled"))
    spec = _speculator(_Seam(device="cuda"))
    spec.warm_up_kernels()
    reason = "off: compute capability 7.5: the kernels need 8.0 or newer (bf16 tensor cores)"
    assert spec.kernels["draft"] == reason and spec.kernels["verify"] == reason, spec.kernels


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_worker_warms_the_verify_kernel_for_its_longest_block(monkeypatch, caplog, deterministic):
    """On CUDA the verify kernel compiles at start-up too, for blocks of up to draft_len + 1
    tokens (the verify attention's path there), even with the drafts on torch; not in
    deterministic mode, whose verify keeps the torch path. A failure is logged, not raised."""
    calls = []

    def fake_warm_verify(layout, tokens, device):
        calls.append((layout, tokens, device))
        if tokens == 5:
            raise RuntimeError("no compiler here")
        return 0.5

    monkeypatch.setattr("sgl_vericache.kernels.draft_kernels_off", lambda device: "no GPU")
    monkeypatch.setattr("sgl_vericache.kernels.verify_kernel_off", lambda device: None)
    monkeypatch.setattr("sgl_vericache.spec.warm_up.warm_verify", fake_warm_verify)
    specs = []
    for draft_len in (12, 4):
        specs.append(_speculator(_Seam(device="cuda"), draft_len=draft_len, deterministic=deterministic))
        with caplog.at_level(logging.INFO, logger="sgl_vericache.spec.warm_up"):
            specs[-1].warm_up_kernels()
    if deterministic:
        assert calls == [], calls
        assert specs[0].kernels["verify"] == "off: deterministic mode verifies on torch"
        return
    assert specs[0].kernels["verify"] == "ready in 0.5 s", specs[0].kernels
    assert specs[1].kernels["verify"].startswith("compiled at first use (warm-up failed: RuntimeError: no compiler")
    assert calls == [(LAYOUT, 13, "cuda"), (LAYOUT, 5, "cuda")], calls
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and "verify kernel for blocks of up to 5 tokens" in failed[0], failed
    assert "the verify kernel for blocks of up to 13 tokens ready in 0.5 s" in caplog.text, caplog.text


def test_a_verify_kernel_that_fails_to_compile_at_start_verifies_on_torch(monkeypatch):
    """A compile failure (Triton's own error: a GPU short of shared memory for a variant)
    would fail again at the first round: verify takes its torch path from the start, and
    the status names why; a new verify backend starts on torch too."""
    from triton.runtime.errors import OutOfResources

    from sgl_vericache import kernels

    def failing(layout, tokens, device):
        raise OutOfResources(232448, 101376, "shared memory")

    monkeypatch.setattr(kernels, "_verify_failure", None)
    monkeypatch.setattr("sgl_vericache.kernels.draft_kernels_off", lambda device: "no GPU")
    monkeypatch.setattr("sgl_vericache.spec.warm_up.warm_verify", failing)
    monkeypatch.setattr(kernels, "_kernels_off", lambda device, env, what: None)  # a GPU that takes them
    spec = _speculator(_Seam(device="cuda"), draft_len=4)
    spec.warm_up_kernels()
    assert spec.kernels["verify"].startswith("off: compiling the verify kernel for blocks of up to 5 tokens failed: "
                                             "OutOfResources"), spec.kernels
    assert not kernels.verify_kernel_available("cuda") and kernels.verify_kernel_off("cuda").startswith("compiling")


def test_the_verify_warm_up_launches_each_query_rows_size_once(monkeypatch):
    """warm_verify's launches: per compile-time query-rows size that blocks of 1 .. tokens
    pick, one with a verify mask (as on CPU) and one without (CUDA's rounds: NGRAM's
    per-request mask layout is read as the chain); the kernel itself runs in kernel_checks'
    verify family."""
    from sgl_vericache.kernels import verify
    from sgl_vericache.spec.warm_up import warm_verify

    launched = []
    monkeypatch.setattr(verify, "verify_attention", lambda q, *a, **kw: launched.append(
        (q.shape[1], verify.query_rows(3, q.shape[1]), None if kw["mask"] is None else tuple(kw["mask"].shape))))
    monkeypatch.setattr("sgl_vericache.kernels.ops.warm_merges", lambda *a, **kw: None)
    warm_verify(LAYOUT, 17, torch.device("cpu"))  # group 3: 1-5 tokens 16 rows, 6-10 32, 11-17 64
    assert launched == [(1, 16, (1, 1, 1)), (1, 16, None), (6, 32, (1, 6, 6)), (6, 32, None),
                        (11, 64, (1, 11, 11)), (11, 64, None)], launched


def test_a_layout_that_does_not_divide_names_itself():
    with pytest.raises(ValueError, match="num_q_heads=6, num_kv_heads=4"):
        HeadLayout(6, 4, 64, torch.float32, torch.float32)


def test_the_worker_reads_its_layout_from_the_first_attention_layer():
    from sglang.srt.layers.radix_attention import RadixAttention

    from sgl_vericache.sglang.worker import WorkerSeam

    model = nn.Sequential(nn.Linear(4, 4), RadixAttention(num_heads=12, head_dim=128, scaling=0.1, num_kv_heads=4,
                                                          layer_id=3, logit_cap=50.0))
    buffers = {3: torch.empty(8, 4, 128, dtype=torch.float16)}
    seam = WorkerSeam.__new__(WorkerSeam)
    seam.model_runner = SimpleNamespace(model=model, token_to_kv_pool=SimpleNamespace(get_key_buffer=buffers.get),
                                        model_config=SimpleNamespace(dtype=torch.bfloat16))
    assert seam.head_layout() == HeadLayout(12, 4, 128, torch.float16, torch.bfloat16, logit_cap=50.0)
    model[0].sinks = nn.Parameter(torch.zeros(12))  # where gpt-oss / Granite-SWA keep theirs
    assert seam.head_layout() == HeadLayout(12, 4, 128, torch.float16, torch.bfloat16, logit_cap=50.0, sinks=True)
    seam.model_runner.model = nn.Linear(4, 4)
    assert seam.head_layout() is None


def test_the_warm_up_benchmark_runs_its_phases(tmp_path):
    """benchmark/bench_warm_up.py's code paths, under the interpreter (its numbers mean
    something only compiled, on a GPU: scripts/gpu_check.sh runs it there)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "warm.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(root / "benchmark" / "bench_warm_up.py"), "--smoke", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["compressors"] == list(AUTO_CANDIDATES)
    assert all(row[k] > 0 for k in ("cold", "restart", "cold_again", "restart_again", "verify_cold", "verify_restart",
                                    "verify_cold_again", "verify_restart_again"))
