"""The one module that reaches into SGLang internals (pinned: sglang==0.5.23).

Everything sgl_vericache needs from SGLang beyond its public entry points goes through
here, so a version bump is one file's work.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgl_vericache.config import VeriCacheConfig

logger = logging.getLogger(__name__)

SPEC_ALGORITHM = "VERICACHE"
_registered = False


def register_all() -> None:
    """Run once per SGLang process by the plugin entry point."""
    global _registered
    if _registered:
        return
    _registered = True
    from sgl_vericache import cpu_compat

    cpu_compat.install()


def apply_vericache_flags(vc: "VeriCacheConfig", argv: list[str]) -> list[str]:
    """Translate our config into SGLang flags (speculative algorithm etc.)."""
    return argv


def run_http_server(argv: list[str]) -> int:
    """Start SGLang's HTTP server with ``argv`` (SGLang flags only)."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(None, include_parent=False)
    return 0
