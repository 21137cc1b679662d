"""fast_engine_start.py, the tests' fork server for engine processes, without an engine:
a child it forks runs in the environment and with the stdout of the moment, a change of
environment that imports could read gets a server of its own (the least recently used idle
one giving way past MAX_SERVERS, a spawn when every one has a live child), and SGLang's
shutdown kill spares the servers, not their children."""

import os
import subprocess
import sys
from pathlib import Path

TEST = Path(__file__).resolve().parent

SCRIPT = r'''
import json, multiprocessing as mp, os, sys, time
import psutil
sys.path.insert(0, sys.argv[1])
import fast_engine_start as fes

fes.PRELOAD = ["fast_engine_start"]  # SGLang's import is not what is tested here
fes.install()
ctx = mp.get_context("spawn")  # what SGLang's engine asks for

def report(path, wait):
    print("child stdout", os.environ.get("VERICACHE_X"), flush=True)
    with open(path, "w") as f:
        json.dump({"parent": os.getppid(), "x": os.environ.get("VERICACHE_X"),
                   "retract": os.environ.get("SGLANG_TEST_RETRACT")}, f)
    time.sleep(wait)

def run(name, wait=0.0, join=True):
    path = os.path.join(sys.argv[2], name)
    p = ctx.Process(target=report, args=(path, wait))
    p.start()
    if join:
        p.join()
        assert p.exitcode == 0, p.exitcode
        return json.load(open(path))
    while not os.path.exists(path) or not os.path.getsize(path):
        time.sleep(0.05)
    return p, json.load(open(path))

def server():
    return list(fes._servers.values())[-1]._forkserver_pid  # the one used last

if __name__ == "__main__":
    me = os.getpid()
    fes.MAX_SERVERS = 2
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    out = {"gpu_engine": run("a")}
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    out["first"] = run("b")
    first = server()
    os.environ["VERICACHE_X"] = "later"
    out["run_time_key"] = run("c")
    out["same_server"] = server() == first
    os.environ["SGLANG_TEST_RETRACT"] = "1"
    out["import_key"] = run("d")
    second = server()
    os.kill(first, 0)  # the first server is kept
    busy, out["busy"] = run("e", wait=30, join=False)
    os.environ["SGLANG_TEST_RETRACT"] = "0"
    busy2, out["third_key"] = run("f", wait=30, join=False)
    third = server()
    out["first_stopped"] = not psutil.pid_exists(first)  # idle and least recently used: it made way
    os.environ["SGLANG_TEST_RETRACT"] = "1"
    out["own_busy_server"] = run("g")
    os.environ["SGLANG_TEST_RETRACT"] = "2"
    out["all_busy"] = run("h")
    from sglang.srt.utils.common import kill_process_tree  # what Engine.shutdown calls

    fes._sparing_the_server(kill_process_tree)(os.getpid(), include_parent=False, wait_timeout=20)
    busy.join(5)
    busy2.join(5)
    out["busy_killed"] = busy.exitcode is not None and busy2.exitcode is not None
    os.kill(second, 0)  # the servers outlived the kill
    os.kill(third, 0)
    out.update(me=me, servers=[first, second, third], started=fes.started)
    print("RESULT " + json.dumps(out), flush=True)
'''


def test_children_fork_from_a_server_in_their_environment(tmp_path):
    import json

    script = tmp_path / "children.py"  # a file: spawned children import their target from it
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "VERICACHE_TEST_SPAWN"}  # a run that spawns tests this too
    proc = subprocess.run([sys.executable, str(script), str(TEST), str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    me, (first, second, third) = out["me"], out["servers"]
    assert len({me, first, second, third}) == 4
    assert out["gpu_engine"]["parent"] == me  # not a CPU engine: spawned
    assert out["first"]["parent"] == first
    assert out["run_time_key"] == {"parent": first, "x": "later", "retract": None} and out["same_server"]
    assert out["import_key"] == {"parent": second, "x": "later", "retract": "1"}
    assert out["busy"]["parent"] == second
    # MAX_SERVERS = 2 run: the first, idle and least recently used, made way for a third
    assert out["third_key"] == {"parent": third, "x": "later", "retract": "0"} and out["first_stopped"]
    assert out["own_busy_server"]["parent"] == second  # a live child does not keep its own key away
    # both servers have a live child: an engine in a fourth environment is spawned
    assert out["all_busy"] == {"parent": me, "x": "later", "retract": "2"}
    assert out["busy_killed"]
    assert out["started"] == {"forked": 6, "spawned": 2, "servers": 3}
    assert proc.stdout.count("child stdout") == 8, proc.stdout  # every child wrote to our stdout
