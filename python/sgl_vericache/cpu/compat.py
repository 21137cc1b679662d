"""CPU compatibility for SGLang's CPU engine when no usable ``sgl_kernel`` is present.

SGLang imports ``sgl_kernel`` at import time. Its CPU build is not on PyPI, and the CUDA
wheel (``sglang-kernel``) fails to import without ``libcuda.so.1``. For a dense Llama
model on a CPU without AMX, SGLang's CPU path calls plain torch ops, so only the import
*names* are needed. This module installs an import hook that:

- loads the real ``sgl_kernel`` when it imports (then this module does nothing);
- on a machine with a CUDA driver, where the real package should import, does nothing
  either (unless ``SGLANG_USE_CPU_ENGINE=1``): a broken CUDA install raises its own import
  error there, rather than serving pure-torch stand-ins to a GPU engine;
- otherwise serves a stand-in package: every attribute is an op whose call either runs a
  pure-torch implementation from ``sgl_vericache.cpu.ops`` or raises ``CpuKernelUnavailable``
  naming the op (and the module it was imported from).

The hook is installed by ``install()``: from the ``.pth`` file that scripts/setup.sh
writes into the virtual environment (so spawned SGLang processes get it too) and from
``sgl_vericache.launch_server``. It never imports torch until an op is called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from typing import Callable

logger = logging.getLogger(__name__)

PACKAGE = "sgl_kernel"
# Submodules of the real package that are plain Python data definitions (no compiled
# ops): the stand-in loads them from the installed package's own files.
PURE_PYTHON_SUBMODULES = frozenset({"scalar_type", "version"})
DISABLE_ENV = "VERICACHE_DISABLE_CPU_COMPAT"


class CpuKernelUnavailable(NotImplementedError):
    """An sgl_kernel op was called that has no pure-torch implementation here."""


def implemented_ops() -> dict[str, Callable]:
    """Name -> pure-torch implementation (``sgl_vericache.cpu.ops``; imports torch)."""
    from sgl_vericache.cpu import ops as cpu_ops

    return cpu_ops.OPS


# --- the stand-in package ---------------------------------------------------------------


def _missing_op(qualname: str) -> Callable:
    def op(*args, **kwargs):
        raise CpuKernelUnavailable(
            f"sgl_kernel op {qualname!r} was called, but no usable sgl_kernel is installed "
            f"(the CUDA wheel needs a GPU; SGLang's CPU build is not on PyPI) and "
            f"sgl_vericache.cpu.ops implements only {sorted(implemented_ops())}. "
            f"Use --attention-backend torch_native on CPU, or install a real sgl_kernel."
        )

    op.__name__ = qualname.rsplit(".", 1)[-1]
    op.__qualname__ = qualname
    op._sgl_vericache_missing = True
    return op


class _StandInModule(types.ModuleType):
    """A module whose unknown attributes are ops (implemented or refusing)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        qualname = f"{self.__name__}.{name}"
        value = implemented_ops().get(name) or _missing_op(qualname)
        setattr(self, name, value)
        return value


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []  # a package, so `sgl_kernel.x.y` imports resolve here too
        module.__version__ = "0.0.0+sgl_vericache_cpu_compat"
        module._sgl_vericache_stand_in = True
        return module

    def exec_module(self, module):
        if module.__name__ == PACKAGE:
            _register_torch_ops()


# Ops SGLang reaches as ``torch.ops.sgl_kernel.<name>`` (after ``import sgl_kernel``), with
# their schemas; defined on the first import of the stand-in.
TORCH_OPS = {
    "murmur_hash32_cpu": "(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor",
}
_torch_library = None


def _register_torch_ops() -> None:
    global _torch_library
    if _torch_library is not None:
        return
    import torch

    _torch_library = torch.library.Library(PACKAGE, "FRAGMENT")
    for name, schema in TORCH_OPS.items():
        _torch_library.define(name + schema)
        _torch_library.impl(name, implemented_ops()[name], "CPU")


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the stand-in for ``sgl_kernel`` (and submodules) if the real one fails."""

    def __init__(self) -> None:
        self.use_stand_in: bool | None = None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        if self.use_stand_in is None:
            self.use_stand_in = not _real_kernel_imports() and _stand_in_wanted()
            if self.use_stand_in:
                logger.info("sgl_kernel is not usable here; serving the CPU stand-in")
        if not self.use_stand_in:
            return None
        real_file = _real_pure_python_file(fullname)
        if real_file is not None:
            return importlib.util.spec_from_file_location(fullname, real_file)
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=True)


def _stand_in_wanted() -> bool:
    """Whether a failed import of the real package means a CPU machine (no CUDA driver, or
    SGLang's CPU engine asked for), which the stand-in serves."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" or not _cuda_driver_present():
        return True
    logger.warning("sgl_kernel failed to import on a machine with a CUDA driver: not serving the CPU stand-in "
                   "(SGLANG_USE_CPU_ENGINE=1 runs SGLang's CPU engine); the import error follows")
    return False


def _cuda_driver_present() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _real_pure_python_file(fullname: str) -> str | None:
    parts = fullname.split(".")
    if len(parts) != 2 or parts[1] not in PURE_PYTHON_SUBMODULES:
        return None
    spec = importlib.machinery.PathFinder.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], parts[1] + ".py")
    return path if os.path.isfile(path) else None


def _real_kernel_imports() -> bool:
    """Import the real package with the hook out of the way; leave no trace on failure."""
    finder = _installed_finder()
    sys.meta_path.remove(finder)
    try:
        importlib.import_module(PACKAGE)
        return True
    except Exception as exc:  # ImportError, OSError (missing libcuda), RuntimeError
        logger.debug("real sgl_kernel failed to import: %s", exc)
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]
        return False
    finally:
        sys.meta_path.insert(0, finder)


def _installed_finder() -> _Finder | None:
    return next((f for f in sys.meta_path if isinstance(f, _Finder)), None)


def install() -> None:
    """Install the import hook (idempotent). ``VERICACHE_DISABLE_CPU_COMPAT=1`` opts out."""
    if os.environ.get(DISABLE_ENV) == "1" or _installed_finder() is not None:
        return
    if PACKAGE in sys.modules:
        return  # already imported for real; nothing to cover
    sys.meta_path.insert(0, _Finder())


def stand_in_active() -> bool:
    module = sys.modules.get(PACKAGE)
    return bool(module is not None and getattr(module, "_sgl_vericache_stand_in", False))
