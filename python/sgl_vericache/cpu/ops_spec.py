"""Pure-torch versions of SGLang's speculative-tree ``sgl_kernel`` ops for the CPU engine.

A verify batch holds ``n = draft_token_num`` nodes per request; node 0 is the last
verified token (the root), the others are drafts. Trees travel in two encodings:

- ancestor masks: ``mask[b, i, j]`` is True when node j is node i or one of its ancestors;
- linked lists over node numbers: ``next_token[b, i]`` = first child of i,
  ``next_sibling[b, i]`` = next child of i's parent, -1 for none; ``retrive_index[b, i]``
  = ``b * n + i``, the node's row in the flattened verify batch.

Semantics follow the CUDA kernels in ``sglang/kernels/jit/include/sgl_kernel/speculative``
(``eagle.cuh``, ``ngram.cuh``) and their Triton twins in ``kernels/ops/speculative``.
"""

from __future__ import annotations

from typing import Callable

import torch


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
):
    """Greedy tree verification, in place. Walk from the root: at each level take the
    first child (in sibling order) whose draft token equals the target's argmax at the
    last accepted node; stop when none does or ``accept_index`` is full.

    Writes ``accept_index[b, :k+1]`` (global node rows, root first; the rest untouched),
    ``accept_token_num[b] = k`` (accepted drafts, bonus excluded), and
    ``predicts[row] = target_predict[row]`` for every accepted row (the token that follows
    it; at the last one this is the bonus token). Twin: ``VerifyTreeGreedy``."""
    # predicts: [bs*n] int32; accept_index: [bs, max_accept] int32; accept_token_num: [bs]
    # candidates, retrive_*, target_predict: [bs, n] int64
    bs, n = candidates.shape
    max_accept = accept_index.shape[1]
    cand, rows = candidates.tolist(), retrive_index.tolist()
    first_child, sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.flatten().tolist()
    accepted_paths = []
    for b in range(bs):
        path = [rows[b][0]]
        node = 0
        while len(path) < max_accept:
            node = first_child[b][node]
            while node != -1 and cand[b][node] != target[path[-1]]:
                node = sibling[b][node]
            if node == -1:
                break
            path.append(rows[b][node])
        accepted_paths.append(path)

    accept_token_num[:bs] = torch.tensor([len(p) - 1 for p in accepted_paths])
    flat_rows = [r for p in accepted_paths for r in p]
    slot_b = [b for b, p in enumerate(accepted_paths) for _ in p]
    slot_k = [k for p in accepted_paths for k in range(len(p))]
    accept_index[slot_b, slot_k] = torch.tensor(flat_rows, dtype=accept_index.dtype)
    predicts[flat_rows] = torch.tensor([target[r] for r in flat_rows], dtype=predicts.dtype)


def reconstruct_indices_from_tree_mask(
    tree_mask,
    verified_seq_len,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    batch_size,
    draft_token_num,
):
    """From NGRAM's ancestor mask, fill (in place) the verify positions and the linked
    lists. Node i's ancestors are the j < i with ``mask[b, i, j]``; its parent is the
    largest of them; its depth their count, so ``positions = seq_len + depth``. First
    child of t = smallest k > t having t as ancestor; next sibling of t = smallest k > t
    with the same parent (-1 for the root). Twin: ``reconstructIndicesFromTreeMask``."""
    # tree_mask: [>= bs*n*n] bool, row-major (b, i, j); verified_seq_len: [bs] int64
    # positions: [bs*n] int64; retrive_*: [bs, n] int64
    bs, n = batch_size, draft_token_num
    if bs == 0:
        return
    node = torch.arange(n)
    is_ancestor = tree_mask[: bs * n * n].view(bs, n, n).bool() & (node[None, :] < node[:, None])
    depth = is_ancestor.sum(-1)  # [bs, n]
    positions[: bs * n] = (depth + verified_seq_len[:bs, None].to(torch.int64)).flatten()
    retrive_index.copy_(torch.arange(bs * n).view(bs, n))

    parent = torch.where(is_ancestor, node, -1).amax(-1)  # [bs, n]
    later = node[:, None]  # row index k of is_ancestor[b, k, t]
    first_child = torch.where(is_ancestor, later, n).amin(1)  # [bs, n] over k
    retrive_next_token.copy_(torch.where(first_child < n, first_child, -1))

    same_parent = (parent[:, :, None] == parent[:, None, :]) & (later > node[None, :])
    next_sibling = torch.where(same_parent, later, n).amin(1)  # [bs, n] over k
    has_sibling = (parent >= 0) & (next_sibling < n)
    retrive_next_sibling.copy_(torch.where(has_sibling, next_sibling, -1))


FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


def _eagle_parents(selected, parent_list, topk):
    """Parent node of each draft node 1..n-1 of one request (0 = the root); None when the
    parent was not selected into the tree (the CUDA kernel warns and skips such a node)."""
    position_of = {}
    for pos, token_idx in enumerate(selected):
        position_of.setdefault(token_idx, pos)  # first match, like the kernel's scan
    parents = [0]  # node 0 (root) has no parent; placeholder keeps node numbering
    for i in range(1, len(selected) + 1):
        parent_tb = selected[i - 1] // topk
        if parent_tb == 0:
            parents.append(0)
        else:
            pos = position_of.get(parent_list[parent_tb])
            parents.append(None if pos is None else pos + 1)
    return parents


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
):
    """Build EAGLE's verify tree from the draft's top-k selection, in place. Node i >= 1
    is draft ``selected_index[b, i-1]``; its parent is the node holding token
    ``parent_list[b, selected_index[b, i-1] // topk]`` (the root when that quotient is 0).
    Links are pushed in reverse node order, so children end up in ascending order.
    ``retrive_next_token`` / ``_sibling`` must come in filled with -1. Mask row of node t
    (root column first, then the n-1 draft columns) marks t and its ancestors; FULL_MASK
    rows sit after each request's ``seq_len`` prefix columns, which are left as given.
    Twin: ``build_tree_efficient`` / ``build_tree_efficient_partial_packed``."""
    # parent_list: [bs, topk*(depth-1)+1]; selected_index: [bs, n-1]; all int64
    n = draft_token_num
    bs = verified_seq_len.numel()
    seq_lens = verified_seq_len.tolist()
    next_token, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    rows, pos_out = [], []
    for b in range(bs):
        parents = _eagle_parents(selected_index[b].tolist(), parent_list[b].tolist(), topk)
        for i in range(n - 1, 0, -1):
            p = parents[i]
            if p is None:
                continue
            if next_token[b][p] != -1:
                next_sibling[b][i] = next_token[b][p]
            next_token[b][p] = i
        for t in range(n):
            row, node, steps = [False] * n, t, 0
            row[0] = True
            while node not in (0, None) and steps < max(depth, 1):
                row[node], node, steps = True, parents[node], steps + 1
            rows.append(row)
            pos_out.append(seq_lens[b] + steps)

    retrive_index.copy_(torch.arange(bs * n).view(bs, n))
    retrive_next_token.copy_(torch.tensor(next_token).view(bs, n))
    retrive_next_sibling.copy_(torch.tensor(next_sibling).view(bs, n))
    positions[: bs * n] = torch.tensor(pos_out, dtype=positions.dtype)
    _write_tree_mask(tree_mask, torch.tensor(rows).view(bs, n, n), seq_lens, tree_mask_mode)


def _write_tree_mask(tree_mask, rows, seq_lens, mode):
    # rows: [bs, n, n] bool, columns = (root, draft nodes 1..n-1)
    bs, n, _ = rows.shape
    if mode == QLEN_ONLY_BITPACKING:
        assert n <= 32, "bit-packed tree masks hold at most 32 nodes"
        width = 4 if n > 16 else (2 if n > 8 else 1)
        bits = (rows.to(torch.int64) << torch.arange(n)).sum(-1)  # [bs, n]
        packed = torch.stack([(bits >> (8 * k)) & 0xFF for k in range(width)], -1)
        out = tree_mask.view(torch.uint8)
        old = out[: bs * n * width].view(bs, n, width).to(torch.int64)
        old[..., 0] = 0  # the kernel assigns byte 0 and ORs the others
        out[: bs * n * width] = (old | packed).to(torch.uint8).flatten()
        return
    if mode == QLEN_ONLY:
        tree_mask[: bs * n * n] = rows.flatten().to(tree_mask.dtype)
        return
    assert mode == FULL_MASK, f"unknown tree_mask_mode {mode}"
    seq = torch.tensor(seq_lens, dtype=torch.int64)  # [bs]
    req_start = n * n * torch.arange(bs) + n * (torch.cumsum(seq, 0) - seq)
    row_start = req_start[:, None] + (seq[:, None] + n) * torch.arange(n) + seq[:, None]
    idx = row_start[:, :, None] + torch.arange(n)  # [bs, n, n]
    tree_mask[idx.flatten()] = rows.flatten().to(tree_mask.dtype)


OPS: dict[str, Callable] = {
    "verify_tree_greedy_cpu": verify_tree_greedy_cpu,
    "reconstruct_indices_from_tree_mask": reconstruct_indices_from_tree_mask,
    "build_tree_kernel_efficient_cpu": build_tree_kernel_efficient_cpu,
}
