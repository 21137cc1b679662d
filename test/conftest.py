"""Shared test fixtures: a real server started with ``python -m sgl_vericache.launch_server``
(one per module), the default model, the gpu marker's skip, the kernels' fallback check, and
the fork servers that in-process CPU engines start their processes from (fast_engine_start.py;
``VERICACHE_TEST_SPAWN=1`` turns it off)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark"))
from server_process import ServerProcess, free_port  # noqa: E402,F401  (tests import them from here)


def pytest_configure(config):
    # in-process CPU engines fork their scheduler and detokenizer from a server that imported
    # SGLang once, instead of importing it twice per engine (fast_engine_start.py)
    from fast_engine_start import install

    install()


def pytest_terminal_summary(terminalreporter):
    from fast_engine_start import started

    if started["forked"] or started["spawned"]:
        terminalreporter.write_line("engine processes started in this process: {forked} forked from {servers} fork "
                                    "server(s), {spawned} spawned (fast_engine_start.py)".format(**started))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (gpu marker); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from sgl_vericache.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server as a user starts it: no arguments at all. One per module, not per session:
    SGLang's ``Engine.shutdown()`` SIGKILLs every child process of the process it runs in
    (``kill_process_tree(os.getpid())``), so the first in-process engine a later module shuts
    down would take a session-long server with it, silently."""
    srv = ServerProcess([], tmp_path_factory.mktemp("server") / "server.log")
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _kernels_did_not_fall_back():
    """A draft or verify kernel that fails to launch turns itself off for the process, and
    attention runs on its torch twin (kernels.turn_draft_kernels_off, turn_verify_kernel_off):
    a test comparing the two would then pass without the kernel having run. Tests that make a
    launch fail on purpose set the flag back (monkeypatch), which this sees undone."""
    yield
    kernels = sys.modules.get("sgl_vericache.kernels")
    for name in ("_draft_failure", "_verify_failure"):
        failure = getattr(kernels, name, None)
        if failure is not None:
            setattr(kernels, name, None)
            pytest.fail(f"a kernel fell back to torch in this test: {failure}")
