"""Soak under faults (issue 26): clients against one VeriCache server for minutes while the
tiers under it fail, and every request accounted for.

The server (``python -m sgl_vericache.launch_server``, ``VERICACHE_CHECK_INTEGRITY=1``):
HiCache with a host tier and a Mooncake store on loopback (``mooncake_master`` started
here), ``--vericache-full-device-budget 1024`` (verifies staggered, full KV parked in host
memory), draft length 8, a 4096-token device pool and a 1 MiB compressed prefix cache, so
that prefixes spill.

The load, per client, drawn with a seeded RNG: multi-turn agent conversations (a shared
system prompt and growing tool results), greedy, seeded and unseeded sampled requests,
streams, streams the client drops after the first chunk, grammar-constrained (JSON schema,
regex), per-request compressors and draft lengths (``custom_params``), OpenAI chat, and
the bad requests of test/fuzz_corpus.json (each must be refused with a 4xx).

The faults, spread over the run, each ``--fault-rounds`` times: the Mooncake master killed
and restarted (every key gone), a quarter of the store's pages corrupted (objects replaced
by zeros of the same size, found through the master's ``/get_all_keys``), the store stalled (its master
SIGSTOPped for a few seconds), ``/flush_cache`` (new requests held back until the server is
idle: SGLang flushes only then), and a weight reload from disk
(``/update_weights_from_disk``, the same checkpoint).

The load (its request kinds, how a request's end is counted) is ``soak_load.py``.

The report: requests sent / completed / refused (4xx) / failed (5xx or an error event) /
lost (neither a complete answer nor an error: the target is 0) / dropped by the client;
p50 / p99 latency; the server's memory (RSS of its processes) at start and end; after the
load, the server idle with integrity checks on, alive and answering (a failed check or a
leaked KV slot, host page or compressed-cache byte stops it); then every greedy and seeded
output replayed on a speculation-off server (``--no-vericache-enable``) and compared by
token ids.

    .venv/bin/python benchmark/bench_soak.py --quick
    .venv/bin/python benchmark/bench_soak.py --minutes 30 --clients 32 --out benchmark/results/soak_30m.json
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import ROOT, first_divergence, provenance  # noqa: E402
from server_process import ServerProcess, free_port  # noqa: E402
from soak_load import REPLAYED, run_load, summarize  # noqa: E402

# log lines of a failed check: ours, SGLang's idle pool checks (strict), a dead scheduler
INTEGRITY_SIGNS = ("CacheIntegrityError", "memory leak", "double free", "use-after-free", "Scheduler hit an exception")
# in this order: once the store has filled, pages corrupted and then the tiers above flushed,
# so that the next turns read their prefixes back from the store (and meet corrupt pages);
# the master's restart (every key gone) comes last
FAULTS = ("reload_weights", "corrupt_pages", "flush_cache", "slow_store", "kill_master")


@dataclass
class SoakConfig:
    minutes: float = 2.5
    clients: int = 4
    seed: int = 0
    fault_rounds: int = 1
    max_total_tokens: int = 4096  # device KV pool (host tier 2x): the agents' prefixes do not fit
    full_device_budget: int = 1024
    draft_len: int = 8  # the server's --vericache-draft-len (per-request overrides draw up to it)
    compressed_cache_mb: int = 1
    max_new_tokens: int = 10
    deterministic: bool = False  # --vericache-deterministic on both servers (row-invariant kernels)
    request_timeout_s: float = 600.0
    replay: bool = True
    replay_limit: int = 0  # replay at most this many answers, every kind in turn (0: all)
    faults: bool = True


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---------------------------------------------------------------- processes


class Master:
    """``mooncake_master`` on loopback, in a session of its own; killed, restarted, stalled."""

    def __init__(self, log_dir: Path):
        self.binary = str(Path(sys.executable).parent / "mooncake_master")
        self.port, self.http_port = free_port(), free_port()
        self.log_path = log_dir / "mooncake_master.log"
        self.proc = None
        self.start()

    def start(self) -> None:
        cmd = [self.binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}", f"--metrics_port={self.http_port}",
               "--enable_http_metadata_server=false"]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not port_open(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not come up: {self.log_path}")
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=30)

    def keys(self) -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/get_all_keys", timeout=10) as r:
            return [k for k in r.read().decode().splitlines() if k]

    def extra_config(self) -> dict:
        return {"master_server_address": f"127.0.0.1:{self.port}", "protocol": "tcp",
                "metadata_server": "P2PHANDSHAKE", "global_segment_size": 512 << 20, "local_hostname": "127.0.0.1"}


def server_args(cfg: SoakConfig, master: Master | None) -> list[str]:
    args = ["--max-total-tokens", str(cfg.max_total_tokens), "--enable-metrics"]
    if cfg.deterministic:
        args.append("--vericache-deterministic")
    if master is None:  # the reference: speculation off, no tiers
        return args + ["--no-vericache-enable", "--sleep-on-idle"]
    return args + [
        "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "kernel",
        "--hicache-mem-layout", "page_first", "--hicache-storage-backend", "mooncake",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps(master.extra_config()),
        "--vericache-full-device-budget", str(cfg.full_device_budget), "--vericache-draft-len", str(cfg.draft_len),
        "--vericache-compressed-cache-mb", str(cfg.compressed_cache_mb),
    ]


# ---------------------------------------------------------------- faults


class Faults:
    """The fault schedule and what each fault did, run on a thread of its own."""

    def __init__(self, server: ServerProcess, master: Master, model_path: str, cfg: SoakConfig, start: float):
        self.server, self.master, self.model_path, self.cfg = server, master, model_path, cfg
        span = cfg.minutes * 60
        names = [name for _ in range(cfg.fault_rounds) for name in FAULTS]
        self.schedule = [(start + span * (0.1 + 0.8 * (i + 0.5) / len(names)), name) for i, name in enumerate(names)]
        self.log: list[dict] = []
        self.store = None  # a Mooncake client of our own, to corrupt pages with

    def run(self, gate) -> None:
        self.gate = gate
        for at, name in self.schedule:
            time.sleep(max(0.0, at - time.monotonic()))
            t0 = time.monotonic()
            try:
                detail = getattr(self, name)()
            except Exception as exc:  # a fault that could not be injected is reported, not fatal
                detail = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            self.log.append({"fault": name, "at_s": round(t0 - self.schedule[0][0], 1),
                             "seconds": round(time.monotonic() - t0, 2), **detail})

    def flush_cache(self, patience_s: float = 300.0) -> dict:
        """SGLang flushes only an idle server (400 otherwise): new requests are held back and
        the flush retried until the requests in flight finish (as an operator would)."""
        deadline, attempts = time.monotonic() + patience_s, 0
        self.gate.clear()
        try:
            while True:
                attempts += 1
                r = requests.post(self.server.url + "/flush_cache", timeout=300)
                if r.status_code == 200 or time.monotonic() > deadline:
                    return {"status": r.status_code, "attempts": attempts, "flushed": r.status_code == 200}
                time.sleep(0.5)
        finally:
            self.gate.set()

    def reload_weights(self) -> dict:
        r = requests.post(self.server.url + "/update_weights_from_disk", json={"model_path": self.model_path},
                          timeout=600)
        return {"status": r.status_code, "weights_updated": "Weights were updated" in r.text or r.status_code == 200,
                "answer": r.text[:200]}

    def kill_master(self) -> dict:
        self.master.kill()
        self.store = None  # its master is gone
        time.sleep(5)
        self.master.start()
        return {"down_s": 5}

    def slow_store(self) -> dict:
        """The store stalls: its master stops answering for a few seconds (SIGSTOP)."""
        self.master.proc.send_signal(signal.SIGSTOP)
        time.sleep(4)
        self.master.proc.send_signal(signal.SIGCONT)
        return {"stalled_s": 4}

    def corrupt_pages(self, share: float = 0.25, limit: int = 256) -> dict:
        """Replace a ``share`` of the KV page objects (at most ``limit``) by zeros of the same
        size (their digests, ``*_vcsum``, untouched): a read must see the mismatch and recompute."""
        pages = [k for k in self.master.keys() if k.endswith(("_k", "_v"))]
        if not pages:
            return {"corrupted": 0, "pages_in_store": 0}
        store = self._store()
        count = min(limit, max(16, int(share * len(pages))), len(pages))
        chosen = random.Random(len(self.log)).sample(pages, count)
        corrupted = 0
        for key in chosen:
            size = len(store.get(key))
            if size and store.remove(key, True) == 0 and store.put(key, bytes(size)) == 0:
                corrupted += 1
        return {"corrupted": corrupted, "pages_in_store": len(pages)}

    def _store(self):
        if self.store is None:
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
            code = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "",
                               f"127.0.0.1:{self.master.port}")
            if code != 0:
                raise RuntimeError(f"Mooncake client setup returned {code}")
            self.store = store
        return self.store


# ---------------------------------------------------------------- the run


def metrics(url: str, prefixes=("vericache:tier_", "sglang:num_running_reqs")) -> dict:
    try:
        text = requests.get(url + "/metrics", timeout=30).text
    except requests.RequestException:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(prefixes):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0) + float(value)
    return out


def after_load(server: ServerProcess, idle_s: float = 20.0) -> dict:
    """Idle with integrity checks on (a violation or leak stops the server), then answer."""
    time.sleep(idle_s)
    alive = server.alive()
    log = server.log_path.read_text(errors="replace")
    problems = [line[:300] for line in log.splitlines()
                if any(m in line for m in INTEGRITY_SIGNS)]
    return {"idle_s": idle_s, "alive_after_idle": alive, "health_generate_ok": server.healthy(),
            "integrity_problems": problems[:10], "ok": alive and not problems}


def spread(records: list[dict], limit: int) -> list[dict]:
    """At most ``limit`` records (0: all), taking every kind in turn, in recorded order."""
    if not limit or len(records) <= limit:
        return records
    by_kind: dict[str, list] = {}
    for rec in records:
        by_kind.setdefault(rec["kind"], []).append(rec)
    queues, chosen = list(by_kind.values()), []
    while len(chosen) < limit:
        for queue in queues:
            if queue and len(chosen) < limit:
                chosen.append(queue.pop(0))
    return chosen


def replay(records: list[dict], url: str, clients: int = 3) -> dict:
    """Each recorded greedy / seeded answer against speculation off: token ids equal?"""
    results: list[dict] = [None] * len(records)

    def work(start: int):
        for i in range(start, len(records), clients):
            rec = records[i]
            r = requests.post(url + rec["path"], json=rec["body"], timeout=600)
            ids = r.json().get("output_ids") if r.status_code == 200 else None
            results[i] = {"kind": rec["kind"], "identical": ids == rec["output_ids"],
                          "first_divergence": None if ids is None else first_divergence(rec["output_ids"], ids),
                          "status": r.status_code}

    threads = [threading.Thread(target=work, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_kind = {}
    for res in results:
        k = by_kind.setdefault(res["kind"], {"replayed": 0, "identical": 0})
        k["replayed"] += 1
        k["identical"] += res["identical"]
    return {"replayed": len(results), "identical": sum(r["identical"] for r in results), "by_kind": by_kind,
            "differing": [r for r in results if not r["identical"]][:20]}


# SGLang's HiCache refuses to start unless this much host memory stays free besides its pool
# (pool_host/base.py HICACHE_HOST_MEMORY_RESERVE_BYTES, 10 GiB) and the pool (~0.4 GB here)
HOST_MEMORY_NEEDED_GIB = 10.5


class NotEnoughHostMemory(RuntimeError):
    """This machine cannot start a HiCache server now (other work holds its memory)."""


def check_host_memory() -> None:
    import psutil

    available = psutil.virtual_memory().available / 1024 ** 3
    if available < HOST_MEMORY_NEEDED_GIB:
        raise NotEnoughHostMemory(f"{available:.1f} GiB of host memory available; SGLang's HiCache keeps 10 GiB "
                                  f"free besides its pool, so the soak needs {HOST_MEMORY_NEEDED_GIB} GiB")


def run_soak(cfg: SoakConfig, out: Path | None, log_dir: Path) -> dict:
    from sgl_vericache.default_model import ensure_default_model

    check_host_memory()
    model_path = str(ensure_default_model())
    master = Master(log_dir)
    env = {"VERICACHE_CHECK_INTEGRITY": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
           "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    server = ServerProcess(server_args(cfg, master), log_dir / "server.log", env)
    reference = None
    result = {"config": asdict(cfg), **provenance(model_path), "logs": str(log_dir)}
    try:
        server.wait_ready(900)
        result["rss_mb_start"] = server.rss_mb()
        t0 = time.monotonic()
        faults = Faults(server, master, model_path, cfg, t0)
        outcomes = run_load(server.url, cfg, faults.run if cfg.faults else None)
        result["load_seconds"] = round(time.monotonic() - t0, 1)
        result["rss_mb_end"] = server.rss_mb() if server.alive() else None
        result["requests"] = summarize(outcomes)
        result["faults"] = faults.log
        result["tier_metrics"] = metrics(server.url)
        if cfg.replay:  # started now: it boots while the soak server idles, never during the load
            reference = ServerProcess(server_args(cfg, None), log_dir / "reference.log")
        result["integrity"] = after_load(server)
        records = [{"kind": o.kind, **o.replay} for o in outcomes if o.replay is not None and o.kind in REPLAYED]
        result["replay_recorded"] = len(records)
        records = spread(records, cfg.replay_limit)
        if reference is not None:
            server.stop()
            reference.wait_ready(900)
            result["replay"] = replay(records, reference.url)
    finally:
        server.stop()
        if reference is not None:
            reference.stop()
        master.kill()
    result["verdict"] = verdict(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def verdict(result: dict) -> dict:
    req, rep = result.get("requests", {}), result.get("replay", {})
    checks = {
        "nothing_lost": req.get("lost") == 0,
        "nothing_failed": req.get("failed") == 0,
        "bad_requests_refused": not req.get("bad_requests_not_refused"),
        "good_requests_served": not req.get("good_requests_refused"),
        "integrity": result.get("integrity", {}).get("ok", False),
        "outputs_identical": bool(rep) and rep.get("identical") == rep.get("replayed"),
        "every_fault_injected": not result["config"]["faults"] or (
            {f["fault"] for f in result.get("faults", []) if "error" not in f} == set(FAULTS)),
    }
    return {**checks, "pass": all(checks.values())}


def one_line(result: dict) -> str:
    r, rep, v = result["requests"], result.get("replay", {}), result["verdict"]
    return (f"soak {result['config']['minutes']} min x {result['config']['clients']} clients: sent {r['sent']}, "
            f"completed {r['completed']}, refused {r['refused']}, failed {r['failed']}, lost {r['lost']}, "
            f"dropped {r['dropped']}; p50 {r['latency_s']['p50']} s p99 {r['latency_s']['p99']} s; "
            f"RSS {result.get('rss_mb_start')} -> {result.get('rss_mb_end')} MB; "
            f"identical {rep.get('identical')}/{rep.get('replayed')}; faults {len(result['faults'])}; "
            f"{'PASS' if v['pass'] else 'FAIL ' + str([k for k, ok in v.items() if not ok and k != 'pass'])}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2.5 minutes, 4 clients, each fault once (the default "
                   "without --minutes / --clients; names the result soak_quick.json)")
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--clients", type=int, default=None)
    p.add_argument("--fault-rounds", type=int, default=None, help="times each fault is injected (default: "
                   "1 up to 10 minutes, then one more per 10 minutes, at least 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true", help="--vericache-deterministic on both servers")
    p.add_argument("--no-replay", action="store_true", help="skip the speculation-off replay")
    p.add_argument("--no-faults", action="store_true", help="the same load without faults (a control)")
    p.add_argument("--replay-limit", type=int, default=0, help="replay at most this many greedy/seeded answers "
                   "on the speculation-off server, every kind in turn (default 0: all)")
    p.add_argument("--out", type=Path, default=None, help="JSON result (default benchmark/results/soak*.json)")
    args = p.parse_args(argv)
    minutes = args.minutes if args.minutes is not None else 2.5
    clients = args.clients or (4 if minutes <= 5 else 32)
    rounds = args.fault_rounds or (1 if minutes <= 10 else max(2, int(minutes // 10) + 1))
    cfg = SoakConfig(minutes=minutes, clients=clients, seed=args.seed, fault_rounds=rounds,
                     deterministic=args.deterministic, replay=not args.no_replay, faults=not args.no_faults,
                     replay_limit=args.replay_limit)
    quick = args.quick and args.minutes is None and args.clients is None
    name = "soak_quick" if quick else f"soak_{minutes:g}m_{clients}c"
    out = args.out or ROOT / "benchmark" / "results" / f"{name}.json"
    log_dir = Path(tempfile.mkdtemp(prefix="vericache-soak-"))
    result = run_soak(cfg, out, log_dir)
    print(one_line(result))
    print(f"wrote {out}; logs in {log_dir}")
    return 0 if result["verdict"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
