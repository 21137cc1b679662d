"""Where a VeriCache round's setup time goes, on the real engine (CPU, SmolLM2-135M fp32).

A round's setup is ``Speculator.draft_round`` from ``t_sync`` to ``setup_seconds``: bringing
each row's compressed entry up to its verified length (a request's first round compresses its
whole prompt: ``_sync_store``, ``_seed_from_prefix``, ``CompressedKVStore.sync``), parking,
and laying out the draft buffers (``begin_round``). This script runs bench_adaptive's W3
shape: ``--requests`` prompts of ``--context`` tokens, their prefix cached by one warm-up
generate, then ``--new-tokens`` greedy tokens with each compressor at a fixed draft length,
and prints per round and phase:

  setup     the round's setup_seconds (what the controller sees)
  sync      _sync_store; of it: read (read_kv from SGLang's pool), seed (the prefix cache's
            match + insert, its sync excluded), comp (compress/append: sync minus read)
  layout    begin_round; of it: tails (materialize) and grow (buffer allocation)

The timers wrap the methods in this process before the engine is forked from it, so the
engine runs unmodified code (``VERICACHE_BENCH_SPAWN=1`` would lose them). ``--py-spy``
also records a py-spy flame graph (svg) of the scheduler process.

    python benchmark/profile_setup.py
    python benchmark/profile_setup.py --compressors kivi4 --context 2000 --py-spy /tmp/setup.svg
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "benchmark"))

from bench_decode import build_prompts  # noqa: E402
from bench_spec import CPU_ENV, EngineProc  # noqa: E402

_LOG = os.path.join(tempfile.gettempdir(), f"vericache_setup_{os.getpid()}.jsonl")
_acc: dict = defaultdict(float)  # this round's phase seconds, in the scheduler process


def _timed(cls, name: str, phase: str):
    """Wrap ``cls.name`` so its seconds add up in ``_acc[phase]``."""
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            _acc[phase] += time.perf_counter() - t0

    setattr(cls, name, wrapper)


def install_timers() -> None:
    import torch

    from sgl_vericache.spec import drafter, round as round_mod

    store, spec = drafter.CompressedKVStore, round_mod.Speculator
    for cls, name, phase in ((spec, "_sync_store", "sync"), (spec, "_seed_from_prefix", "seed"),
                             (spec, "_stage_full_kv", "park"), (store, "begin_round", "layout"),
                             (store, "_tails", "tails"), (store, "_grow", "grow")):
        _timed(cls, name, phase)
    sync = store.sync

    def timed_sync(self, rid, verified_len, read_kv, *args, **kw):
        def timed_read(*a):
            t0 = time.perf_counter()
            out = read_kv(*a)
            _acc["read"] += time.perf_counter() - t0
            return out

        t0 = time.perf_counter()
        try:
            return sync(self, rid, verified_len, timed_read, *args, **kw)
        finally:
            _acc["store_sync"] += time.perf_counter() - t0

    store.sync = timed_sync
    draft_round = spec.draft_round

    def timed_round(self, batch, width):
        _acc.clear()
        out = draft_round(self, batch, width)
        record = {"rows": len(batch.reqs), "verified": max(batch.verified), "setup": self.setup_seconds,
                  "draft": self.forward_seconds, "threads": torch.get_num_threads(), **_acc}
        with open(_LOG, "a") as f:
            f.write(json.dumps(record) + "\n")
        return out

    spec.draft_round = timed_round


def report(records: list[dict], label: str) -> None:
    cols = ("setup", "sync", "read", "store_sync", "seed", "park", "layout", "tails", "grow", "draft")
    threads = records[0]["threads"] if records else "?"
    print(f"\n{label}: {len(records)} rounds, {threads} torch threads in the scheduler "
          "(seconds; store_sync includes read; seed includes its own sync)")
    print("round rows verified " + " ".join(f"{c:>9}" for c in cols))
    for i, r in enumerate(records):
        if i < 3 or i == len(records) - 1:
            print(f"{i:5d} {r['rows']:4d} {r['verified']:8d} " + " ".join(f"{r.get(c, 0.0):9.4f}" for c in cols))
    steady = records[2:]
    if steady:
        print("steady mean (rounds 2..):  " + " ".join(f"{c}={sum(r.get(c, 0.0) for r in steady) / len(steady):.4f}"
                                                   for c in cols))


def main() -> None:
    from sgl_vericache.config import VeriCacheConfig
    from sgl_vericache.default_model import default_model_dir

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressors", default="kivi4,streamingllm")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--context", type=int, default=4000)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--draft-len", type=int, default=8)
    p.add_argument("--py-spy", default="", help="write a py-spy flame graph (svg) of the scheduler here")
    args = p.parse_args()

    from transformers import AutoTokenizer

    model = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    ids = build_prompts(tok, args.context, args.requests)
    install_timers()
    VeriCacheConfig(compressor="kivi4", draft_len=args.draft_len, adaptive=False).to_env()  # read by the child
    pool = int(args.requests * (args.context + args.new_tokens) * 1.3) + 2048
    engine = EngineProc(model, dict(CPU_ENV), speculative_algorithm="VERICACHE",
                        speculative_num_draft_tokens=args.draft_len + 1, speculative_ngram_max_bfs_breadth=1,
                        disable_overlap_schedule=True, max_total_tokens=pool)
    spy = None
    try:
        engine.wait_ready()
        greedy = {"temperature": 0, "ignore_eos": True}
        engine.generate(ids, [dict(greedy, max_new_tokens=1)] * len(ids))  # the prefix is cached after
        if args.py_spy:
            spy = subprocess.Popen(["py-spy", "record", "--subprocesses", "-r", "50", "-o", args.py_spy,
                                    "--pid", str(engine.proc.pid)])
        for name in args.compressors.split(","):
            custom = {"vericache_compressor": name, "vericache_draft_len": args.draft_len}
            open(_LOG, "w").close()
            _, seconds = engine.generate(ids, [dict(greedy, max_new_tokens=args.new_tokens, custom_params=custom)]
                                         * len(ids))
            with open(_LOG) as f:
                records = [json.loads(line) for line in f]
            report(records, f"{name} (generate {seconds:.2f} s)")
    finally:
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
        engine.shutdown()
        if os.path.exists(_LOG):
            os.unlink(_LOG)


if __name__ == "__main__":
    main()
