"""``python -m sgl_vericache.launch_server``: SGLang's HTTP server (native and
OpenAI-compatible APIs) with VeriCache, serving the embedded default model unless
``--model-path`` says otherwise.

Our ``--vericache-*`` flags are parsed and validated here; every other flag goes to
SGLang unchanged. On a machine without CUDA the CPU engine's flags are filled in
(torch_native attention, no CUDA graphs, fp32, a small KV budget) unless given, and the
scheduler sleeps while it has no request (``--sleep-on-idle``): SGLang's scheduler polls
for requests otherwise, one core at 100% for as long as the server is up, and on a CPU
that core is one the engine's own threads run on. A request wakes it at once (it waits on
the request sockets).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

# Spawned SGLang processes re-import this module first: keep the CPU compat hook at top.
from sgl_vericache.cpu import compat as cpu_compat

cpu_compat.install()

from sgl_vericache import config as vc_config  # noqa: E402
from sgl_vericache.default_model import DefaultModelError, ensure_default_model  # noqa: E402

CPU_DEFAULTS = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--dtype": "float32",
    "--max-total-tokens": "32768",
}
CPU_DEFAULT_SWITCHES = ("--disable-cuda-graph", "--sleep-on-idle")
COMMON_DEFAULTS = {"--host": "127.0.0.1"}


class LaunchError(ValueError):
    """A bad command line; the message names the flag and what is accepted."""


def _has_flag(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_model_path(argv: list[str]) -> list[str]:
    """Fill in the default model, or check that a local --model-path exists."""
    path = _flag_value(argv, "--model-path") or _flag_value(argv, "--model")
    if path is None:
        return ["--model-path", str(ensure_default_model())] + argv
    looks_local = path.startswith(("/", ".", "~")) or os.path.exists(path) or path.count("/") != 1
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise LaunchError(
            f"--model-path {path!r}: no such model directory; give a directory holding a HF "
            "checkpoint (config.json + weights), a hub id like 'org/name' when online, or omit "
            "the flag for the embedded default model"
        )
    return argv


def apply_device_defaults(argv: list[str], on_gpu: bool) -> list[str]:
    defaults = dict(COMMON_DEFAULTS)
    if not on_gpu:
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        defaults.update(CPU_DEFAULTS)
        argv = argv + [s for s in CPU_DEFAULT_SWITCHES if not _has_flag(argv, s)]
    for flag, value in defaults.items():
        if not _has_flag(argv, flag):
            argv = argv + [flag, value]
    return argv


def build_sglang_argv(argv: Sequence[str]) -> tuple[vc_config.VeriCacheConfig, list[str]]:
    """Split and complete the command line: (our config, SGLang's argv)."""
    try:
        vc, rest = vc_config.parse_known(argv)
        if vc.enable:
            vc.build_compressor()  # bad ratio / method options fail here, named
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    on_gpu = cuda_available()
    rest = apply_device_defaults(resolve_model_path(list(rest)), on_gpu)
    from sgl_vericache.sglang.server import apply_vericache_flags

    try:  # flags VeriCache cannot serve with (a quantized KV pool, a parking budget's backend)
        rest = apply_vericache_flags(vc, rest)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    return vc, rest


def print_help() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_vericache.launch_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    vc_config.add_cli_args(parser)
    parser.print_help()
    print("\nSGLang server flags (all pass through):\n")
    from sglang.srt.server_args import ServerArgs

    sglang_parser = argparse.ArgumentParser(prog="", add_help=False)
    ServerArgs.add_cli_args(sglang_parser)
    sglang_parser.print_help()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return 0
    try:
        vc, sglang_argv = build_sglang_argv(argv)
    except (LaunchError, DefaultModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    vc.to_env()  # reaches every spawned SGLang process
    from sgl_vericache.sglang.server import run_http_server

    return run_http_server(sglang_argv)


if __name__ == "__main__":
    sys.exit(main())
