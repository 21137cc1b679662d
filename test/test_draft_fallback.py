"""Where the draft kernels run, and what happens when one fails (sgl_vericache.kernels,
kernels/draft_round.py, spec/drafter.py), on a CPU: the chooser's reasons per device, a
launch that fails to compile mid-round (the round goes on on the torch twin, the kernels stay
off for the process), head dims the kernels refuse, and the dense buffers a kernel round
lets go. The kernels themselves run in kernel_checks.py; here a failing stand-in replaces
the launch, so the rounds never reach Triton."""

from __future__ import annotations

import logging

import pytest
import torch

from sgl_vericache import kernels
from sgl_vericache.mem_cache.compress import get_compressor
from sgl_vericache.spec.drafter import CompressedKVStore, kernels_on

H_Q, H_KV, D = 6, 2, 16
SCALE = D**-0.5


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of compute capability 9.0 as the chooser sees it, no failure yet."""
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    monkeypatch.delenv(kernels.VERIFY_DISABLE_ENV, raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(kernels, "_draft_failure", None)


def _out_of_shared_memory(*args, **kwargs):
    from triton.runtime.errors import OutOfResources

    raise OutOfResources(232448, 101376, "shared memory")


def test_the_chooser_names_why_a_device_drafts_on_torch(gpu, monkeypatch):
    """Kernels on an sm_80+ CUDA device with Triton; not on ROCm (its devices are "cuda" too,
    and the kernels decode with inline PTX), not before sm_80 (bf16 tensor cores), not on a
    CPU, not when switched off; each with its reason for /server_info."""
    assert kernels.draft_kernels_off("cuda") is None and kernels.verify_kernel_off("cuda:0") is None
    assert kernels.draft_attention_available("cuda") and kernels.verify_kernel_available("cuda")
    assert kernels.draft_kernels_off("cpu") == "draft attention runs on torch here"
    assert kernels.verify_kernel_off(torch.device("cpu")) == "verify attention runs on torch here"
    for capability in ((7, 5), (7, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        reason = f"compute capability {capability[0]}.{capability[1]}: the kernels need 8.0 or newer"
        assert kernels.draft_kernels_off("cuda").startswith(reason)
        assert kernels.verify_kernel_off("cuda").startswith(reason)
        assert not kernels.draft_attention_available("cuda") and not kernels.verify_kernel_available("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert kernels.draft_kernels_off("cuda").startswith("ROCm (HIP 6.2.41133)")
    assert not kernels.draft_attention_available("cuda") and not kernels.verify_kernel_available("cuda")
    assert not kernels_on(None, "cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    assert kernels.draft_kernels_off("cuda") == "SGL_VERICACHE_DRAFT_KERNELS=0"
    assert kernels.verify_kernel_off("cuda") is None


def test_draft_head_dims_are_powers_of_two_from_16_to_256(gpu):
    assert [d for d in (8, 16, 32, 64, 80, 96, 128, 256, 512, 1024) if kernels.draft_head_dim(d)] == [16, 32, 64,
                                                                                                     128, 256]
    from sgl_vericache.kernels import ops
    from sgl_vericache.kernels.packing import pack

    comp = get_compressor("full")
    k, v = torch.randn(40, H_KV, 512), torch.randn(40, H_KV, 512)
    packed = pack(comp, [comp.compress(k, v)])
    with pytest.raises(ValueError, match="head_dim from 16 to 256, got 512"):
        ops.decode_attention(packed, torch.randn(1, H_Q, 512), SCALE, packed.rows())
    # a store asked for the kernels drafts such heads on its dense path
    store = CompressedKVStore(comp, num_layers=1, draft_kernels=True)
    store.sync("r", 40, lambda _, a, b: (k[a:b], v[a:b]))
    store.begin_round(["r"], 1)
    assert store._kernel_round is None and store._round is not None


def _stores(methods, lengths, seed=0):
    """(dense store, kernel store) holding the same requests, rid i of methods[i]."""
    comps = {m: get_compressor(m, 4.0, **({"page_size": 8} if m == "quest" else {})) for m in methods}
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(n, H_KV, D, generator=g), torch.randn(n, H_KV, D, generator=g)) for n in lengths]
    queries = [torch.randn(8, H_Q, D, generator=g)] * 2
    stores = [CompressedKVStore(comps[methods[0]], num_layers=2, draft_kernels=flag) for flag in (False, True)]
    for store in stores:
        for rid, (m, (k, v)) in enumerate(zip(methods, kv)):
            store.sync(rid, k.shape[0], lambda _, a, b, k=k, v=v: (k[a:b], v[a:b]), compressor=comps[m],
                       queries=queries)
    return stores


def test_a_launch_that_fails_mid_round_drafts_on_torch_from_then_on(gpu, monkeypatch, caplog):
    """A kernel that fails to compile or launch (here: out of shared memory, at the round's
    second step) does not stop the server: that step and the rest of the round run on the
    torch twin, giving what the dense path gives (sinks, soft cap, Quest's per-step pages,
    several compressors in one batch), the failure is logged once, and every later round of
    every store takes the dense path."""
    from sgl_vericache.kernels import ops

    methods = ("kivi4", "streamingllm", "quest")
    dense, store = _stores(methods, (70, 23, 41))
    failing = {"on": False, "calls": 0}

    def launch(packed, q, *args, **kwargs):
        failing["calls"] += 1
        if failing["on"]:
            _out_of_shared_memory()
        return torch.zeros_like(q)  # steps before the failure: not compared

    monkeypatch.setattr(ops, "decode_attention", launch)
    g = torch.Generator().manual_seed(1)
    sinks, cap = torch.randn(H_Q, generator=g).to(torch.bfloat16), 2.0
    rids = [2, 0, 1]
    for st in (dense, store):
        st.begin_round(rids, 3)
    assert store._kernel_round is not None and dense._kernel_round is None
    with caplog.at_level(logging.WARNING, logger="sgl_vericache.kernels"):
        for step in range(3):
            failing["on"] = step == 1
            q = torch.randn(3, H_Q, D, generator=g)
            k_new, v_new = torch.randn(3, H_KV, D, generator=g), torch.randn(3, H_KV, D, generator=g)
            for layer in (0, 1):
                want = dense.attend(layer, q, k_new, v_new, SCALE, sinks, cap)
                got = store.attend(layer, q, k_new, v_new, SCALE, sinks, cap)
                if step:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step} layer {layer}")
    assert failing["calls"] == 3 * 2 + 1  # 3 groups at layer 0 and 1 of step 0, then the failing launch
    warned = [r.getMessage() for r in caplog.records if "dense torch path" in r.getMessage()]
    assert len(warned) == 1 and "OutOfResources: out of resource: shared memory" in warned[0], warned
    assert kernels.draft_kernels_failed().startswith("a draft kernel failed: OutOfResources")
    assert kernels.draft_kernels_off("cuda") == kernels.draft_kernels_failed()
    assert not kernels_on(None, "cuda") and not kernels_on(True, "cpu")
    store.begin_round(rids, 2)
    assert store._kernel_round is None and store._round is not None
    assert failing["calls"] == 7


def test_a_teacher_forced_launch_that_fails_gives_the_dense_result(gpu, monkeypatch):
    from sgl_vericache.kernels import ops

    dense, store = _stores(("kivi4",), (90,), seed=2)
    monkeypatch.setattr(ops, "decode_attention", _out_of_shared_memory)
    g = torch.Generator().manual_seed(3)
    q, k_new, v_new = torch.randn(4, H_Q, D, generator=g), torch.randn(4, H_KV, D, generator=g), torch.randn(
        4, H_KV, D, generator=g)
    outs = []
    for st in (dense, store):
        st.begin_round([0], 5)
        outs.append(torch.cat([st.attend_tokens(0, q[:3], k_new[:3], v_new[:3], SCALE, None, 2.0),
                               st.attend(0, q[3:], k_new[3:], v_new[3:], SCALE, None, 2.0)]))
    assert store._kernel_round is not None and store._kernel_round.failed
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), ValueError("a bug")])
def test_running_out_of_memory_and_bugs_are_not_taken_for_kernel_failures(gpu, monkeypatch, error):
    """Out of memory is the round's to handle (spec/round.py lets the entries go), and an
    error of ours is not hidden behind the torch path."""
    from sgl_vericache.kernels import ops

    def launch(*args, **kwargs):
        raise error

    _, store = _stores(("streamingllm",), (50,))
    monkeypatch.setattr(ops, "decode_attention", launch)
    store.begin_round([0], 1)
    with pytest.raises(type(error)):
        store.attend(0, torch.randn(1, H_Q, D), torch.randn(1, H_KV, D), torch.randn(1, H_KV, D), SCALE)
    assert kernels.draft_kernels_failed() is None


def test_a_kernel_round_lets_the_dense_buffers_go(gpu):
    """A dense round (a layout the kernels do not read, say) and then kernel rounds: the
    dense buffers, [B, H_kv, L + steps, D] per layer, K and V, are not held through them."""
    _, store = _stores(("kivi4", "snapkv"), (300, 200))
    store.draft_kernels = False
    store.begin_round([0, 1], 4)
    assert store._k_buf[0] is not None and store.buffer_nbytes() > 2 * 2 * 2 * H_KV * 300 * D * 4
    store.draft_kernels = True
    store.begin_round([0, 1], 4)
    assert store._kernel_round is not None
    assert all(b is None for b in store._k_buf + store._v_buf)
    assert store.buffer_nbytes() == store._kernel_round.nbytes()
    store.check_integrity()
