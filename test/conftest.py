"""Shared test fixtures: a real server started with ``python -m sgl_vericache.launch_server``
(one, shared by the modules in ``SERVER_MODULES``, which run one after the other), the
default model, the gpu marker's skip, the kernels' fallback check, and the fork servers that
in-process CPU engines start their processes from (fast_engine_start.py;
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


# The modules that share the launched server (the ``server`` fixture), in the order they run:
# test_server.py's last test stops it.
SERVER_MODULES = ("test_api_fuzz.py", "test_server.py")
_launched = []  # the shared server, while it is up


def pytest_collection_modifyitems(config, items):
    _run_server_modules_together(items)
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


def _run_server_modules_together(items: list) -> None:
    """Puts the items of ``SERVER_MODULES`` next to each other, in that order, where the
    first of them was. SGLang's ``Engine.shutdown()`` SIGKILLs every child process of the
    process it runs in (``kill_process_tree(os.getpid())``): an in-process engine shut down
    between two of these modules would take their server with it, silently."""
    shared = [item for item in items if item.path.name in SERVER_MODULES]
    if not shared:
        return
    first = items.index(shared[0])
    rest = [item for item in items if item.path.name not in SERVER_MODULES]
    shared.sort(key=lambda item: SERVER_MODULES.index(item.path.name))  # stable: each module's own order
    items[:] = rest[:first] + shared + rest[first:]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The server as a user starts it, with its metrics on (``--enable-metrics``): one for all
    of ``SERVER_MODULES`` (its start is ~40 s on 2 cores). Those run one after the other
    (``_run_server_modules_together``), and the server is stopped after the last of their
    items that ran (``pytest_runtest_teardown``), so it is never up beside in-process engines."""
    srv = ServerProcess(["--enable-metrics"], tmp_path_factory.mktemp("server") / "server.log")
    srv.wait_ready()
    _launched.append(srv)
    yield srv
    _stop_launched()


def _stop_launched() -> None:
    while _launched:
        _launched.pop().stop()  # also reaps what is left of a server that already exited


def pytest_runtest_teardown(item, nextitem):
    if _launched and (nextitem is None or nextitem.path.name not in SERVER_MODULES):
        _stop_launched()


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
