"""In-process test engines start in ~9 s instead of ~22 s on 2 cores. Not a pytest module.

An SGLang engine starts its scheduler and detokenizer with multiprocessing's "spawn", and
each imports SGLang afresh: ~12 s of CPU apiece, most of an engine's start-up here, and the
suite starts ~30 engines in its own process. While this is installed (conftest.py does it),
a CPU engine's children come instead from a multiprocessing fork server that imported
SGLang's scheduler and detokenizer once, in the environment the engine had when it started
them, and has run nothing else (no torch thread pool, no GPU). Each child is a fork of it
that first takes the test process's environment and stdout/stderr of the moment (pytest's
capture of the running test), then runs its target. The code and settings are the engine's
own; only the import is shared (benchmark/bench_spec.py's ``engine_context`` does the same
for the benchmarks' engines).

- **Environment.** Imports can read the environment, so a server imports in exactly the
  child's, up to the keys only read at run time (``RUN_TIME_ONLY``: this project's switches,
  SGLang's per-engine run id, pytest's current test name). An engine whose environment
  differs otherwise (``SGLANG_TEST_RETRACT``, deterministic mode, metrics) gets a server of
  its own, started in its environment; up to ``MAX_SERVERS`` stay up (~1.1 GB each, idle),
  the least recently used one without live children giving way to a new one. When every
  one has a live child, the engine is spawned as before. Engines that are not CPU engines
  (``SGLANG_USE_CPU_ENGINE=1``) are spawned.
- **Shutdown.** SGLang's ``Engine.shutdown()`` SIGKILLs every descendant of the process it
  runs in; the servers (and multiprocessing's resource tracker) are spared, the engine's
  processes (a server's children) are not. A server dies with the test process
  (``PR_SET_PDEATHSIG``), and an engine's processes with it.
- ``VERICACHE_TEST_SPAWN=1`` spawns every child, as SGLang does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from multiprocessing import context, forkserver, popen_forkserver

PRELOAD = ["fast_engine_start", "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager"]
SPAWN_ENV = "VERICACHE_TEST_SPAWN"
SERVER_ENV = "VERICACHE_TEST_FORK_SERVER"  # set in the fork server's own environment only
RUN_TIME_ONLY = ("VERICACHE_", "SGL_VERICACHE_", "SGLANG_RUN_ID", "PYTEST_CURRENT_TEST")

MAX_SERVERS = 3  # servers kept up, each holding SGLang's import (~1.1 GB idle)

_servers: dict[frozenset, forkserver.ForkServer] = {}  # by the environment each imported in, least recent use first
started = {"forked": 0, "spawned": 0, "servers": 0}  # this process's children, for the session's summary

if os.environ.pop(SERVER_ENV, None) == "1":  # imported by a fork server, as a preload
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def install() -> None:
    """From now on, CPU engines' spawned children are forks of a preloaded server."""
    if os.environ.get(SPAWN_ENV) == "1" or sys.platform != "linux" or getattr(context.SpawnProcess._Popen,
                                                                                  "forks", False):
        return
    spawn_popen = context.SpawnProcess._Popen

    def _Popen(process_obj):
        server = _server_for(_key(os.environ)) if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" else None
        if server is None:
            started["spawned"] += 1
            return spawn_popen(process_obj)
        started["forked"] += 1
        process_obj._target = _InEnv(dict(os.environ), process_obj._target)
        default = forkserver.connect_to_new_process  # what popen_forkserver's launch calls
        forkserver.connect_to_new_process = server.connect_to_new_process
        try:
            return popen_forkserver.Popen(process_obj)
        finally:
            forkserver.connect_to_new_process = default

    _Popen.forks = True
    context.SpawnProcess._Popen = staticmethod(_Popen)


def _key(env) -> frozenset:
    return frozenset((k, v) for k, v in env.items() if not k.startswith(RUN_TIME_ONLY))


def _server_for(key: frozenset) -> forkserver.ForkServer | None:
    """The running server that imported in this environment, started if need be; None if
    MAX_SERVERS others run and each has a live child (a live engine's processes)."""
    server = _servers.pop(key, None)
    if server is None:
        if len(_servers) >= MAX_SERVERS:
            idle = next((k for k, s in _servers.items() if not _busy(s)), None)
            if idle is None:
                return None
            _servers.pop(idle)._stop()  # childless, it sees its "alive" pipe close and exits
        server = forkserver.ForkServer()
        server.set_forkserver_preload(PRELOAD)
    _servers[key] = server
    before = server._forkserver_pid
    os.environ[SERVER_ENV] = "1"
    try:
        server.ensure_running()  # a server found dead is started again
    finally:
        os.environ.pop(SERVER_ENV, None)
    started["servers"] += server._forkserver_pid != before
    engine = sys.modules.get("sglang.srt.entrypoints.engine")
    if engine is not None and not getattr(engine.kill_process_tree, "spares_fork_server", False):
        engine.kill_process_tree = _sparing_the_server(engine.kill_process_tree)
    return server


def _busy(server: forkserver.ForkServer) -> bool:
    """Whether the server has a child that has not exited (an engine's process)."""
    import psutil

    def live(child) -> bool:
        try:
            return child.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    try:
        return any(map(live, psutil.Process(server._forkserver_pid).children()))
    except psutil.NoSuchProcess:
        return False


def _sparing_the_server(kill):
    """SGLang's kill_process_tree, which spares this process's fork servers and resource
    tracker when it is asked for every descendant of this process: each other child's tree
    and the servers' children are killed, as before."""

    def kill_process_tree(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
        if parent_pid != os.getpid() or include_parent or skip_pid is not None:
            return kill(parent_pid, include_parent=include_parent, skip_pid=skip_pid, wait_timeout=wait_timeout)
        import psutil
        from multiprocessing import resource_tracker

        spared = {s._forkserver_pid for s in _servers.values()} | {resource_tracker._resource_tracker._pid}
        for child in psutil.Process().children():
            kill(child.pid, include_parent=child.pid not in spared, wait_timeout=wait_timeout)

    kill_process_tree.spares_fork_server = True
    return kill_process_tree


class _InEnv:
    """A child's target, run with the parent's environment and stdout/stderr as they were
    when it started (the server's are those of the test that started the server)."""

    def __init__(self, env: dict[str, str], target):
        self.env, self.target = env, target

    def __getstate__(self):
        popen = context.get_spawning_popen()  # the forkserver Popen pickling this child
        stdio = [popen.DupFd(popen.duplicate_for_child(fd)) for fd in (1, 2)]
        return {"env": self.env, "target": self.target, "stdio": stdio}

    def __setstate__(self, state):
        self.env, self.target, self.stdio = state["env"], state["target"], state["stdio"]

    def __call__(self, *args, **kwargs):
        for fd, dup in zip((1, 2), self.stdio):
            os.dup2(dup.detach(), fd)
        os.environ.clear()
        os.environ.update(self.env)
        return self.target(*args, **kwargs)
