"""The pure-torch sgl_kernel CPU ops (sgl_vericache.cpu.ops) on small hand-built inputs,
against hand-derived outputs or a plain loop written from the CUDA/Triton twin; and the
stand-in that serves them as ``sgl_kernel`` on a CPU machine (never on a GPU one). Fast."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from sgl_vericache.cpu.ops import OPS

# --- KV pool ----------------------------------------------------------------------------


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer():
    k = torch.arange(8 * 2 * 3, dtype=torch.float32).view(8, 2, 3)
    v = torch.arange(8 * 5, dtype=torch.int16).view(8, 5)  # other dtype and row size
    buffers = [k, v]
    expected = [b.clone() for b in buffers]
    tgt, src = torch.tensor([1, 2, 6]), torch.tensor([2, 6, 7])  # overlapping sets
    for e in expected:
        e[tgt] = e[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    OPS["copy_all_layer_kv_cache_cpu"](ptrs, strides, tgt, src)
    for b, e in zip(buffers, expected):
        assert torch.equal(b, e)


def test_copy_all_layer_kv_cache_empty_is_noop():
    k = torch.ones(4, 2)
    ptrs = torch.tensor([k.data_ptr()], dtype=torch.uint64)
    OPS["copy_all_layer_kv_cache_cpu"](ptrs, torch.tensor([8]), torch.empty(0, dtype=torch.int64),
                                       torch.empty(0, dtype=torch.int64))
    assert torch.equal(k, torch.ones(4, 2))


# --- req_to_token <-> out_cache_loc -----------------------------------------------------

REQ_POOL = torch.tensor([2, 0, 3])
START = torch.tensor([1, 4, 0])
END = torch.tensor([3, 7, 0])  # lengths 2, 3, 0


def test_assign_req_to_token_pool_scatters_windows():
    table = torch.zeros(4, 8, dtype=torch.int32)
    locs = torch.tensor([11, 12, 21, 22, 23], dtype=torch.int64)
    OPS["assign_req_to_token_pool_cpu"](REQ_POOL, table, START, END, locs, 8)
    expected = torch.zeros(4, 8, dtype=torch.int32)
    expected[2, 1:3] = torch.tensor([11, 12])
    expected[0, 4:7] = torch.tensor([21, 22, 23])
    assert torch.equal(table, expected)


def test_assign_extend_cache_locs_gathers_windows_leaving_tail():
    table = torch.arange(32, dtype=torch.int32).view(4, 8)
    out = torch.full((7,), -5, dtype=torch.int64)
    OPS["assign_extend_cache_locs_cpu"](REQ_POOL, table, START, END, out, 8)
    assert out.tolist() == [17, 18, 4, 5, 6, -5, -5]


def test_assign_extend_cache_locs_loop_reference():
    rng = random.Random(0)
    table = torch.randint(0, 1000, (6, 16), dtype=torch.int32)
    for _ in range(20):
        bs = rng.randint(1, 5)
        rpi = torch.tensor(rng.sample(range(6), bs))
        start = torch.tensor([rng.randint(0, 10) for _ in range(bs)])
        end = start + torch.tensor([rng.randint(0, 6) for _ in range(bs)])
        out = torch.zeros(int((end - start).sum()), dtype=torch.int64)
        OPS["assign_extend_cache_locs_cpu"](rpi, table, start, end, out, 16)
        ref = [int(table[r, c]) for r, s, e in zip(rpi, start, end) for c in range(s, e)]
        assert out.tolist() == ref


def test_assign_draft_cache_locs_contiguous():
    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    out = torch.zeros(2 * 2 * 3, dtype=torch.int64)  # bs 2, topk 2, steps 3
    OPS["assign_draft_cache_locs_contiguous_cpu"](torch.tensor([3, 1]), table,
                                                  torch.tensor([2, 4]), out, 10, 2, 3)
    assert out.tolist() == [32, 33, 34, 35, 36, 37, 14, 15, 16, 17, 18, 19]


# --- accept bookkeeping -----------------------------------------------------------------


def test_fill_accept_out_cache_loc_compacts_accepted_slots():
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1], [6, 7, 8]], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 109)
    accept_out = torch.zeros(9, dtype=torch.int64)
    OPS["fill_accept_out_cache_loc_cpu"](accept_index, out_cache_loc, accept_out)
    assert accept_out.tolist() == [100, 102, 104, 106, 107, 108, 0, 0, 0]


def test_fill_bonus_tokens_takes_last_accepted():
    accept_tokens = torch.tensor([5, 6, 7, 8, 15, 16, 17, 18], dtype=torch.int32)
    bonus = torch.zeros(2, dtype=torch.int32)
    OPS["fill_bonus_tokens_cpu"](accept_tokens, torch.tensor([3, 1], dtype=torch.int32), bonus, 4)
    assert bonus.tolist() == [7, 15]


# --- tree verification ------------------------------------------------------------------
# One tree, n = 5 nodes: 0 (root) -> 1 -> 3, 0 -> 2 -> 4. Children in ascending order.
TREE_MASK = torch.tensor([
    [1, 0, 0, 0, 0],
    [1, 1, 0, 0, 0],
    [1, 0, 1, 0, 0],
    [1, 1, 0, 1, 0],
    [1, 0, 1, 0, 1],
], dtype=torch.bool)
TREE_NEXT_TOKEN = [1, 3, 4, -1, -1]
TREE_NEXT_SIBLING = [-1, 2, -1, -1, -1]
TREE_DEPTH = [0, 1, 1, 2, 2]


def _verify(candidates, target, max_accept, next_token=TREE_NEXT_TOKEN,
            next_sibling=TREE_NEXT_SIBLING):
    bs, n = len(candidates), len(candidates[0])
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, max_accept), -1, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    OPS["verify_tree_greedy_cpu"](
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
        candidates=torch.tensor(candidates),
        retrive_index=torch.arange(bs * n).view(bs, n),
        retrive_next_token=torch.tensor([next_token] * bs),
        retrive_next_sibling=torch.tensor([next_sibling] * bs),
        target_predict=torch.tensor(target))
    return predicts.tolist(), accept_index.tolist(), accept_num.tolist()


def test_verify_tree_greedy_takes_matching_sibling_then_bonus():
    # candidates: node tokens (root's own token is irrelevant); target[i] = argmax after node i
    candidates = [[9, 10, 20, 11, 21]]
    target = [[20, 0, 21, 0, 33]]  # root -> 20 (node 2), node 2 -> 21 (node 4), bonus 33
    predicts, accept_index, accept_num = _verify(candidates, target, max_accept=5)
    assert accept_num == [2]
    assert accept_index == [[0, 2, 4, -1, -1]]
    assert predicts == [20, 0, 21, 0, 33]


def test_verify_tree_greedy_rejects_all_drafts():
    predicts, accept_index, accept_num = _verify([[9, 10, 20, 11, 21]], [[77, 1, 2, 3, 4]], 5)
    assert (accept_num, accept_index, predicts) == ([0], [[0, -1, -1, -1, -1]], [77, 0, 0, 0, 0])


def test_verify_tree_greedy_stops_at_accept_width_and_uses_global_rows():
    # two requests, linear chains 0 -> 1 -> 2 -> 3; request 1 matches everything
    chain_next, chain_sib = [1, 2, 3, -1], [-1, -1, -1, -1]
    candidates = [[0, 5, 6, 7], [0, 5, 6, 7]]
    target = [[5, 9, 0, 0], [5, 6, 7, 8]]
    predicts, accept_index, accept_num = _verify(candidates, target, 3, chain_next, chain_sib)
    assert accept_num == [1, 2]  # request 1 capped by max_accept = 3 (root + 2 drafts)
    assert accept_index == [[0, 1, -1], [4, 5, 6]]
    assert predicts == [5, 9, 0, 0, 5, 6, 7, 0]


# --- tree encodings ---------------------------------------------------------------------


def _reconstruct(mask, seq_lens):
    bs, n = mask.shape[0], mask.shape[1]
    positions = torch.full((bs * n,), -9, dtype=torch.int64)
    index, next_token, next_sibling = torch.full((3, bs, n), -9, dtype=torch.int64)
    OPS["reconstruct_indices_from_tree_mask"](mask.flatten(), torch.tensor(seq_lens), positions,
                                              index, next_token, next_sibling, bs, n)
    return positions.view(bs, n), index, next_token, next_sibling


def test_reconstruct_indices_from_tree_mask_hand_tree():
    mask = torch.stack([TREE_MASK, torch.tril(torch.ones(5, 5, dtype=torch.bool))])  # tree, chain
    positions, index, next_token, next_sibling = _reconstruct(mask, [7, 3])
    assert positions.tolist() == [[7 + d for d in TREE_DEPTH], [3, 4, 5, 6, 7]]
    assert index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert next_token.tolist() == [TREE_NEXT_TOKEN, [1, 2, 3, 4, -1]]
    assert next_sibling.tolist() == [TREE_NEXT_SIBLING, [-1] * 5]


def _reference_links(mask):
    """Loop reference written from reconstructIndicesFromTreeMask (ngram.cuh)."""
    n = mask.shape[0]
    depth, next_token, next_sibling = [], [], []
    for t in range(n):
        ancestors = [i for i in range(t) if mask[t, i]]
        parent = max(ancestors, default=-1)
        depth.append(len(ancestors))
        next_token.append(next((i for i in range(t + 1, n) if mask[i, t]), -1))
        sibling = -1
        if parent != -1:
            for i in range(t + 1, n):
                if mask[i, parent] and not any(mask[i, j] for j in range(parent + 1, i)):
                    sibling = i
                    break
        next_sibling.append(sibling)
    return depth, next_token, next_sibling


def _random_tree_mask(n, rng):
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]  # parent index < own index
    mask = torch.zeros(n, n, dtype=torch.bool)
    for t in range(n):
        node = t
        while node != -1:
            mask[t, node], node = True, parents[node]
    return mask


def test_reconstruct_indices_from_tree_mask_loop_reference():
    rng = random.Random(1)
    for n in (1, 2, 4, 8, 12):
        masks = torch.stack([_random_tree_mask(n, rng) for _ in range(3)])
        positions, _, next_token, next_sibling = _reconstruct(masks, [0, 5, 9])
        for b, seq_len in enumerate([0, 5, 9]):
            depth, ref_next, ref_sib = _reference_links(masks[b])
            assert positions[b].tolist() == [seq_len + d for d in depth]
            assert next_token[b].tolist() == ref_next
            assert next_sibling[b].tolist() == ref_sib


# EAGLE tree, topk 2, 2 steps, 4 verify nodes. Draft step 0 scores tokens 0, 1 (children of
# the root); step 1 scores 2 + 2 * p + c (child c of step-0 token p), so index // topk - 1
# is the expanded step-0 token p, found through parent_list = [root, 0, 1].
# selected [0, 1, 2]: node 1 = token 0, node 2 = token 1, node 3 = token 2 (child of node 1).
EAGLE_PARENT_LIST = [[-1, 0, 1]]
EAGLE_SELECTED = [[0, 1, 2]]
EAGLE_QLEN_MASK = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]


def _build_tree(mode, seq_lens, mask):
    bs, n = len(seq_lens), 4
    positions = torch.empty(bs * n, dtype=torch.int64)
    index, next_token, next_sibling = torch.full((3, bs, n), -1, dtype=torch.int64)
    OPS["build_tree_kernel_efficient_cpu"](
        torch.tensor(EAGLE_PARENT_LIST * bs), torch.tensor(EAGLE_SELECTED * bs),
        torch.tensor(seq_lens), mask, positions, index, next_token, next_sibling, 2, 2, n, mode)
    return positions.tolist(), index.tolist(), next_token.tolist(), next_sibling.tolist()


def test_build_tree_kernel_efficient_qlen_only():
    mask = torch.zeros(2 * 16, dtype=torch.bool)
    positions, index, next_token, next_sibling = _build_tree(1, [5, 2], mask)
    assert mask.view(2, 4, 4).int().tolist() == [EAGLE_QLEN_MASK] * 2
    assert positions == [5, 6, 6, 7, 2, 3, 3, 4]
    assert index == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert next_token == [[1, 3, -1, -1]] * 2
    assert next_sibling == [[-1, 2, -1, -1]] * 2
    # the NGRAM encoding of the same tree gives the same links and positions
    rec_positions, _, rec_next, rec_sib = _reconstruct(mask.view(2, 4, 4), [5, 2])
    assert (rec_positions.flatten().tolist(), rec_next.tolist(), rec_sib.tolist()) == (
        positions, next_token, next_sibling)


def test_build_tree_kernel_efficient_full_mask_keeps_prefix_columns():
    seq_lens = [2, 1]
    mask = torch.ones(sum(4 * (s + 4) for s in seq_lens), dtype=torch.bool)
    _build_tree(0, seq_lens, mask)
    first = mask[: 4 * 6].view(4, 6)
    second = mask[4 * 6:].view(4, 5)
    assert first[:, :2].all() and second[:, :1].all()  # prefix columns untouched
    assert first[:, 2:].int().tolist() == EAGLE_QLEN_MASK
    assert second[:, 1:].int().tolist() == EAGLE_QLEN_MASK


def test_build_tree_kernel_efficient_bitpacked():
    mask = torch.full((4,), 0xF0, dtype=torch.uint8)  # byte 0 is assigned, not OR-ed
    _build_tree(2, [0], mask)
    assert mask.tolist() == [0b0001, 0b0011, 0b0101, 0b1011]


@pytest.mark.parametrize("name", ["rotate_input_ids_cpu"])
def test_unimplemented_ops_are_absent(name):
    """Ops off the NGRAM / EAGLE verify path stay refusing stubs (cpu_compat)."""
    assert name not in OPS


def _murmur3_x86_32(data: bytes) -> int:
    """Textbook MurmurHash3_x86_32 (seed 0), byte by byte: the reference for the op."""
    import struct

    h = 0
    for i in range(0, len(data), 4):
        k = struct.unpack("<I", data[i : i + 4])[0]
        k = (k * 0xCC9E2D51) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        k = (k * 0x1B873593) & 0xFFFFFFFF
        h ^= k
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_murmur_hash32_matches_textbook_murmur3():
    import struct

    from sgl_vericache.cpu.ops import murmur_hash32_cpu

    seeds = torch.tensor([0, 42, 2**62 + 12345, -7, 2**63 - 1])
    positions = torch.tensor([0, 1, 100, 70000, 2**31 + 5])
    cols = torch.tensor([0, 1, 7, 49151, 128255])
    out = murmur_hash32_cpu(seeds, positions, cols)
    assert out.shape == (5, 5) and out.dtype == torch.uint32
    for i in range(5):
        for j in range(5):
            s = int(seeds[i]) & (2**64 - 1)
            block = struct.pack("<IIII", s & 0xFFFFFFFF, s >> 32, int(positions[i]) & 0xFFFFFFFF, int(cols[j]))
            assert int(out[i, j]) == _murmur3_x86_32(block), (i, j)


# --- the stand-in: sgl_kernel served by these ops on a CPU machine ---------------------------


def test_cpu_stand_in_serves_ops_and_refuses_unknown_ones():
    code = (
        "import sgl_kernel, torch\n"
        "from sgl_vericache.cpu import compat as cpu_compat\n"
        "if not cpu_compat.stand_in_active():\n"
        "    print('REAL'); raise SystemExit\n"
        "x = torch.randn(4, 8); w = torch.ones(8)\n"
        "torch.testing.assert_close(sgl_kernel.rmsnorm(x, w, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))\n"
        "from sgl_kernel import fancy_gemm_cpu\n"
        "try:\n"
        "    fancy_gemm_cpu(x)\n"
        "except cpu_compat.CpuKernelUnavailable as e:\n"
        "    print('REFUSED', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    if "REAL" in r.stdout:
        pytest.skip("a real sgl_kernel imports here; the stand-in is inactive")
    assert "REFUSED" in r.stdout and "'sgl_kernel.fancy_gemm_cpu'" in r.stdout


def test_a_gpu_machine_gets_sgl_kernels_own_import_error_not_the_stand_in(monkeypatch):
    """Where a CUDA driver loads, a real sgl_kernel that fails to import is a broken install:
    its own error surfaces, instead of pure-torch stand-ins served to a GPU engine (or a later
    "use torch_native on CPU"). SGLang's CPU engine, asked for, still gets the stand-in."""
    from sgl_vericache.cpu import compat

    monkeypatch.setattr(compat, "_real_kernel_imports", lambda: False)
    monkeypatch.setattr(compat, "_cuda_driver_present", lambda: True)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert compat._Finder().find_spec("sgl_kernel") is None
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert compat._Finder().find_spec("sgl_kernel") is not None
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    monkeypatch.setattr(compat, "_cuda_driver_present", lambda: False)  # a CPU machine
    assert compat._Finder().find_spec("sgl_kernel") is not None
