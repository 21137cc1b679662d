"""The ``vericache`` radix cache backend: SGLang's unified radix cache (HiCache attached the
same way) plus an integrity check and the hooks full-KV parking needs.

Touches ``UnifiedRadixCache`` (subclassed: ``claim_kv_row`` and ``checkpoint``, where SGLang
releases or publishes a request's KV), the radix-cache backend registry
(``--radix-cache-backend vericache``), ``SchedulerInvariantChecker._check_tree_cache`` (the
idle-time check runs ours with ``VERICACHE_CHECK_INTEGRITY=1``), the KV allocator's
``available_size`` (parked requests' reserved slots are never promised to anyone else) and
``evict_from_tree_cache``.
"""

from __future__ import annotations

import os

import torch
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sgl_vericache.config import VeriCacheConfig
from sgl_vericache.sglang.hicache import parking_host_pool
from sgl_vericache.sglang.runtime import Runtime, patch
from sgl_vericache.sglang.server import RADIX_BACKEND

CHECK_INTEGRITY_ENV = "VERICACHE_CHECK_INTEGRITY"


class CacheIntegrityError(AssertionError):
    """A prefix cache, its device KV allocator or its host pool is inconsistent."""


class VeriCacheRadixCache(UnifiedRadixCache):
    """SGLang's UnifiedRadixCache (HiCache included) plus ``check_integrity()`` and the
    release hooks full-KV parking needs. Its ``runtime`` (a class attribute, set by
    ``install_radix_cache_backend``) is the one each tree registers with; None: a runtime of
    the tree's own (unit tests)."""

    runtime = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runtime = type(self).runtime or Runtime()
        self.runtime.radix_caches.add(self)
        # Under a full-KV device budget a running request's prompt stays its own: see checkpoint().
        self.prompts_owned = (VeriCacheConfig.from_env() or VeriCacheConfig()).full_device_budget >= 0

    def claim_kv_row(self, req):
        # SGLang's release of a request's row starts here (it finished, was aborted or
        # preempted); a checkpoint that follows is the release's insert.
        load_parked(self.runtime, req)
        req.vericache_releasing = True
        detached = super().claim_kv_row(req)
        if detached:  # a streaming session keeps the row: no release follows
            req.__dict__.pop("vericache_releasing", None)
        return detached

    def on_release(self, req, *, checkpointed: bool) -> None:
        # The release is over. A retraction or a preemption releases without a checkpoint,
        # and the flag would have made the request's first publish after it resumes count
        # as a release's insert: locked in the tree under a full-KV device budget.
        req.__dict__.pop("vericache_releasing", None)
        super().on_release(req, checkpointed=checkpointed)

    def checkpoint(self, req, *, up_to, **kwargs):
        """SGLang publishes a running request's prefill into the tree after each extend
        (so concurrent requests can share it) and locks it there. Under
        ``--vericache-full-device-budget`` that publish is skipped: the prompt's computed
        KV stays the request's own, so between its verifies it is parked in host memory
        with the rest of its KV instead of pinning device memory in the tree. It enters
        the tree when the request leaves (finished, aborted or preempted), as generated
        tokens always do; a prefix already in the tree when the request arrived is
        shared as before. Cost: requests running at the same time do not share each
        other's prompts."""
        releasing = req.__dict__.pop("vericache_releasing", False)
        if self.prompts_owned and not releasing and not req.finished():
            return  # SGLang's caller moves the request's prefix_len on, published or not
        load_parked(self.runtime, req)
        return super().checkpoint(req, up_to=up_to, **kwargs)

    def check_integrity(self) -> dict:
        """Check the tree and the pools it indexes; valid when no request is running
        (SGLang's idle point). Raises ``CacheIntegrityError`` listing every violation;
        returns the sizes it checked. Checks: SGLang's tree invariants (structure, leaf
        sets, LRU lists, sizes, lock counts, parent/child tier state); no device KV slot
        held by two tree nodes, by the padding slot, or also on the allocator's free
        list; the allocator's free list without duplicates; tree + free slots = pool;
        the host pool's free list without duplicates, never marked in use, and free +
        in use = pool."""
        problems = []
        try:
            self.sanity_check()
        except AssertionError as e:
            problems.append(f"tree: {e}")
        alloc = self.token_to_kv_pool_allocator
        page = alloc.page_size
        tree = self.all_values_flatten().to(torch.int64).cpu()
        if torch.unique(tree).numel() != tree.numel():
            problems.append(f"{tree.numel() - torch.unique(tree).numel()} device slots held by two tree nodes")
        if (tree == 0).any():
            problems.append("the padding slot 0 is in the tree")
        free = alloc.get_all_free_pages().to(torch.int64).cpu()
        if torch.unique(free).numel() != free.numel():
            problems.append(f"device allocator: {free.numel() - torch.unique(free).numel()} pages freed twice")
        stale = torch.unique(tree // page)[torch.isin(torch.unique(tree // page), free)]
        if stale.numel():
            problems.append(f"{stale.numel()} tree pages are on the free list: {stale[:8].tolist()}")
        if not self.protected_size() and tree.numel() + alloc.available_size() != alloc.size:
            problems.append(f"device slots: {tree.numel()} in tree + {alloc.available_size()} free "
                            f"!= pool {alloc.size}")
        report = {"device_tree_tokens": int(tree.numel()), "device_free_tokens": int(alloc.available_size()),
                  "evictable_tokens": int(self.evictable_size()), "protected_tokens": int(self.protected_size())}
        host = getattr(getattr(self, "cache_controller", None), "mem_pool_host", None)
        host_pools = [e.host_pool for e in host.entries] if hasattr(host, "entries") else [host]
        for i, pool in enumerate(p for p in host_pools if p is not None and hasattr(p, "slot_used")):
            with pool.lock:
                host_free = torch.cat([pool.free_slots.cpu(), *[r.cpu() for r in pool.release_slots]])
                in_use = int(pool.slot_used.sum())
                if torch.unique(host_free).numel() != host_free.numel():
                    problems.append(f"host pool {i}: slots freed twice")
                if pool.slot_used[host_free].any():
                    problems.append(f"host pool {i}: {int(pool.slot_used[host_free].sum())} free slots marked in use")
                if in_use + host_free.numel() != pool.logical_size:
                    problems.append(f"host pool {i}: {in_use} in use + {host_free.numel()} free "
                                    f"!= {pool.logical_size}")
            report[f"host{i}_used_tokens"] = in_use
            report[f"host{i}_free_tokens"] = int(host_free.numel())
        if problems:
            raise CacheIntegrityError("; ".join(problems))
        return report


def install_radix_cache_backend(runtime: Runtime) -> None:
    """``--radix-cache-backend vericache``: the cache above, with HiCache attached exactly as
    SGLang's default chain does. With ``VERICACHE_CHECK_INTEGRITY=1`` the scheduler runs
    ``check_integrity()`` at every idle check, and each VeriCache worker's, and stops on a
    violation."""
    from sglang.srt.managers.scheduler_components import invariant_checker
    from sglang.srt.mem_cache import registry

    cls = VeriCacheRadixCache
    cls.runtime = runtime
    if RADIX_BACKEND not in registry.registered_radix_cache_backends():
        registry.register_radix_cache_backend(
            RADIX_BACKEND, lambda ctx: registry.create_unified_radix_cache(ctx, cache_class=cls))

    def make(original):
        def _check_tree_cache(self):
            original(self)
            if os.environ.get(CHECK_INTEGRITY_ENV) != "1":
                return
            check = getattr(self.tree_cache, "check_integrity", None)
            if check is not None:
                check()
            for worker in list(_check_tree_cache.runtime.workers):  # this scheduler's VeriCache worker, if any
                worker.check_integrity()

        return _check_tree_cache

    patch(invariant_checker.SchedulerInvariantChecker, "_check_tree_cache", runtime, make)


def build_parking(runtime: Runtime, model_runner, reserve_limit: int):
    """Full-KV parking over the target's KV pool; its reserved slots are taken out of the
    allocator's available size, so SGLang's admission and decode checks never hand them out."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    from sgl_vericache.mem_cache.full_kv_parking import FullKVParking, ParkingError

    tree = next(iter(runtime.radix_caches))  # the worker checked at start: backend `vericache`, page size 1
    pool, alloc = model_runner.token_to_kv_pool, model_runner.token_to_kv_pool_allocator
    if not hasattr(pool, "k_buffer") or tree.supports_mamba() or tree.supports_swa():
        raise ParkingError(f"--vericache-full-device-budget supports a plain MHA KV pool, not {type(pool).__name__}"
                           " (hybrid SWA / mamba trees keep other state per token)")
    parking = FullKVParking(pool.get_key_buffer, pool.get_value_buffer, pool.layer_num,
                            model_runner.req_to_token_pool.req_to_token, alloc.alloc, alloc.free,
                            lambda n: evict_from_tree_cache(tree, n), host_pool=parking_host_pool(tree, pool))
    parking.reserve_limit = reserve_limit
    available = alloc.available_size
    alloc.available_size = lambda: available() - parking.reserved_tokens
    runtime.parking = parking
    return parking


def load_parked(runtime: Runtime, req) -> None:
    """Before SGLang reads a request's row to free or insert it (it finished, was aborted or
    preempted while its KV was parked): copy its KV back first."""
    parking = runtime.parking
    if parking is not None and parking.is_parked(req.rid):
        parking.load_now(req.rid, req.kv.req_pool_idx)
        for worker in list(runtime.workers):
            if worker.speculator.parking is parking:
                worker.speculator.stats.parking(parking.stats)
