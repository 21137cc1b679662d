"""SGLang's hierarchical cache (HiCache) on a CPU device pool, and its load timing.

Touches ``pool_host.mha.MHATokenToKVPoolHost`` (``__init__``, ``backup_from_device_all_layer``,
``load_to_device_per_layer``: a CPU device pool gets an unpinned host pool and index copies,
SGLang's copy kernels being CUDA-only) and ``HiCacheController.start_loading`` (timed, as
``vericache:full_kv_load_seconds``); full KV parked in the host pool has its copies' indices
placed by the controller's ``move_indices``, as its own copies do.
"""

from __future__ import annotations

import inspect
import time

import torch

from sgl_vericache.sglang.runtime import Runtime, patch


def install_cpu_hicache(runtime: Runtime) -> None:
    """Let ``--enable-hierarchical-cache`` run when the device KV pool lives in CPU memory.

    SGLang's host pool pins its memory through CUDA (``pin_memory=True`` by default, and the
    pool builder does not pass it), and imports its device<->host copy kernels from
    ``sgl_kernel.kvcacheio`` only on CUDA/HIP. For a CPU device pool the host pool is built
    unpinned, and the two MHA copies HiCache makes (all layers device->host on backup, one
    layer host->device on load) are index copies between the device pool's per-layer
    buffers and the host pool's per-layer views (``layer_first`` and ``page_first``
    layouts). Pools on an accelerator are left on SGLang's code."""
    from sglang.srt.mem_cache.pool_host import mha

    cls = mha.MHATokenToKVPoolHost

    def on_cpu(pool) -> bool:
        return torch.device(pool._transfer_device).type == "cpu"

    def check_layout(pool) -> None:
        if pool.layout not in ("layer_first", "page_first"):
            raise ValueError(
                f"--hicache-mem-layout {pool.layout} is not supported with a CPU device pool; "
                "use layer_first or page_first (with --hicache-io-backend kernel)")

    def make_init(init):
        signature = inspect.signature(init)

        def __init__(self, buffer_info, *args, **kwargs):
            bound = signature.bind(self, buffer_info, *args, **kwargs)
            if torch.device(buffer_info.device).type == "cpu":
                bound.arguments["pin_memory"] = False  # pinning needs a CUDA driver
            init(*bound.args, **bound.kwargs)
            if on_cpu(self):
                check_layout(self)

        return __init__

    def make_backup(backup):
        def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
            if not on_cpu(self):
                return backup(self, device_pool, host_indices, device_indices, io_backend)
            for i in range(self.layer_num):
                self.k_data_refs[i][host_indices] = self.device_k_buffers[i][device_indices]
                self.v_data_refs[i][host_indices] = self.device_v_buffers[i][device_indices]

        return backup_from_device_all_layer

    def make_load(load):
        def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                     *, is_draft=False):
            if not on_cpu(self):
                return load(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                            is_draft=is_draft)
            if not is_draft and not 0 <= layer_id < self.target_layer_num:
                return
            self.device_k_buffers[layer_id][device_indices] = self.k_data_refs[layer_id][host_indices]
            self.device_v_buffers[layer_id][device_indices] = self.v_data_refs[layer_id][host_indices]

        return load_to_device_per_layer

    patch(cls, "__init__", runtime, make_init)
    patch(cls, "backup_from_device_all_layer", runtime, make_backup)
    patch(cls, "load_to_device_per_layer", runtime, make_load)
    install_load_timing(runtime)


def install_load_timing(runtime: Runtime) -> None:
    """Time HiCache's host -> device loads (``HiCacheController.start_loading``), counted as
    ``vericache:full_kv_load_seconds``. With a CPU device pool the copy runs inside that
    call, before the forward that needs it: the time the forward waited for full KV. On an
    accelerator the call only queues the copy on a transfer stream (the forward then waits
    per layer on the device), so the counter there is queueing time only."""
    from sglang.srt.managers.cache_controller import HiCacheController

    def make(original):
        def start_loading(self):
            t0 = time.perf_counter()
            try:
                return original(self)
            finally:
                start_loading.runtime.load_seconds += time.perf_counter() - t0

        return start_loading

    patch(HiCacheController, "start_loading", runtime, make)


def parking_host_pool(tree, device_pool):
    """HiCache's host KV pool, when the engine has one, as a place to park full KV."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from sgl_vericache.mem_cache.full_kv_parking import HostPoolStore

    controller = getattr(tree, "cache_controller", None)
    host = getattr(controller, "mem_pool_host", None)
    pools = [e.host_pool for e in host.entries] if hasattr(host, "entries") else [host]
    kv = next((p for p in pools if isinstance(p, MHATokenToKVPoolHost)), None)
    if kv is None:
        return None
    place_backup, place_load = index_placement(controller, kv)
    engine = getattr(controller, "l2_transfer_engine", None)
    on_cuda = torch.device(getattr(device_pool, "device", "cpu")).type == "cuda"
    stream = getattr(engine, "device_to_host_stream", None) if on_cuda else None
    return HostPoolStore(kv, device_pool, controller.io_backend, place_backup, place_load, backup_stream=stream)


def index_placement(controller, kv_pool):
    """Where the host pool's copies want their indices, as HiCache's controller places them
    before its own copies (``HiCacheController.move_indices``): for its kernels the host
    indices on the device (its allocator keeps them in CPU memory), for direct copies the
    device indices on the host and both in host order. Its write path keeps CPU host
    indices for a page_first pool's staged write-back kernel (``_move_write_operation``),
    so a backup there does too. Returns (for a backup, for a load)."""

    def place_load(host_indices, device_indices):
        return controller.move_indices(host_indices, device_indices)

    def place_backup(host_indices, device_indices):
        if (controller.io_backend == "kernel" and kv_pool.layout == "page_first"
                and getattr(kv_pool, "can_use_write_back_jit", False)):
            return host_indices, device_indices
        return controller.move_indices(host_indices, device_indices)

    return place_backup, place_load
