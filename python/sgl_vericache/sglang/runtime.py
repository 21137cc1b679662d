"""What VeriCache's SGLang hooks share inside one SGLang process.

SGLang builds the objects VeriCache extends (scheduler, radix tree, spec worker, attention
backends) separately, and several hooks must find each other's objects: the verify attention
waits for the worker's parked full KV, the radix tree loads it back before SGLang frees a
row, the scheduler's prefetch poll drafts with the worker. ``register_all`` makes one
``Runtime`` per process and hands it to every install; a hook reads and writes only the
runtime it was installed with (``patch`` below), never a module global, so a test can
install hooks with a runtime of its own.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable


class Runtime:
    def __init__(self):
        self.workers = weakref.WeakSet()  # VeriCache workers of this process (one per scheduler)
        self.radix_caches = weakref.WeakSet()  # `vericache` radix caches
        self.storage_trees = weakref.WeakSet()  # radix caches with a HiCache storage tier (any backend)
        self.prefetching = {}  # rid -> Req whose storage prefetch is in flight
        self.active_worker = None  # the worker inside its forward_batch_generation
        self.drafting = False  # True while a worker runs draft passes
        self.draft_weights = None  # the drafting worker's DraftWeights (None: the model's own)
        self.packed_linear = None  # cpu.linear.PackedLinear serving dense fp32 CPU products, or None
        self.parking = None  # the worker's FullKVParking, once built
        self.load_seconds = 0.0  # HiCache host -> device load time, running total
        self.preempted_requests = 0  # preempted requests whose KV stayed in the tree
        self.preempted_kept_tokens = 0  # tokens they newly put in the tree
        self.draft_memory = None  # spec.memory_reserve.DraftMemoryPlan the KV pool was sized by


def patch(owner, name: str, runtime: Runtime, make: Callable) -> Callable:
    """Install the hook ``make(original)`` as ``owner.name`` (a class's function, classmethod
    or staticmethod, or a module's function), once per process: ``make`` names the hook, and
    hooks of different names stack. The hook reads its state from its own ``runtime``
    attribute; installing it again only rebinds that to ``runtime``. Returns the hook."""
    raw = inspect.getattr_static(owner, name)
    wrapper = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    current = raw.__func__ if wrapper else raw
    key = make.__qualname__
    installed = current
    while getattr(installed, "_vericache", False):
        if installed._vericache_hook == key:
            installed.runtime = runtime
            return installed
        installed = installed.sglang_original
    hook = make(current)
    hook._vericache = True
    hook._vericache_hook = key
    hook.runtime = runtime
    hook.sglang_original = current
    setattr(owner, name, wrapper(hook) if wrapper else hook)
    return hook
