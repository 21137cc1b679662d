"""VERICACHE speculative decoding against speculation off, in one process, on SGLang.

Two offline engines live side by side (SmolLM2-135M-Instruct by default, CPU, fp32,
greedy): one with speculation off and one VERICACHE engine whose draft length cap is the
largest draft length benchmarked; each request picks its compressor (at ratio 4) and its
draft length through ``custom_params``. Per compressor the off arm runs once over the
prompts and then the VERICACHE arm once per draft length, so every tok/s ratio compares
runs made minutes apart on the same (shared, noisy) machine. Prompts run one at a time
(batch 1) unless ``--batch`` says otherwise; tok/s is output tokens over the wall time of
the generate calls (prefill included, the same for both arms).

Per (compressor, draft_len), from SGLang's per-request ``meta_info``:
  acc_len_hist     tokens per verify round (accepted drafts + the bonus token) -> rounds,
                   summed over requests. This IS a per-round histogram: SGLang keeps a
                   per-request ``spec_correct_drafts_histogram`` (correct drafts -> rounds).
  mean_acc_len     mean of that distribution (tokens per verify round).
  tokens_per_verify  output tokens / verify rounds: SGLang's ``spec_accept_length``. It also
                   counts the prefill's first token, and loses what max_new_tokens or EOS cut
                   from the last round, so it sits a little above or below mean_acc_len.
  acc_rate         accepted drafts / drafted tokens, drafted = draft_len per round. The
                   engine pads a request's draft past its own draft_len with its last draft
                   token up to the round's verify width (the longest draft in the batch + 1);
                   padding that happens to verify is counted
                   in pad_accepted, not in acc_rate. (SGLang's own ``spec_accept_rate``
                   divides by the engine's width, not the request's draft_len.)
  identical        outputs whose token ids equal the off arm's (with the first divergent index
                   of each that does not).

    python benchmark/bench_spec.py --quick
    python benchmark/bench_spec.py                      # full: benchmark/results/spec.json + .png
    python benchmark/bench_spec.py --medium --out benchmark/results/spec.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "test"))
from prompts import prompt_set  # noqa: E402

COMPRESSORS = ("full", "kivi4", "kivi2", "int8", "fp8", "streamingllm", "snapkv", "h2o", "quest")
STATE_COUNTERS = ("rounds", "deferred_rows", "verify_rows_skipped", "draft_seconds", "verify_seconds", "full_kv_parked_tokens",
                  "full_kv_loaded_tokens", "full_kv_wait_seconds")
ENGINE_KW = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True, dtype="float32",
                 max_total_tokens=8192, log_level="warning", sleep_on_idle=True, random_seed=0)


@dataclass(frozen=True)
class BenchConfig:
    mode: str
    compressors: tuple[str, ...]
    draft_lens: tuple[int, ...]
    prompts_per_category: int  # test/prompts.py: chat, code, JSON tool call
    max_new_tokens: int
    num_prompts: int = 0  # 0: every prompt of the set; else its first num_prompts
    ratio: float = 4.0
    batch: int = 1
    full_device_budget: int = -1  # VERICACHE arm's --vericache-full-device-budget (staggered verifies); -1 off
    out: str = "benchmark/results/spec.json"


PRESETS = {
    "quick": BenchConfig("quick", ("kivi4", "streamingllm"), (4, 16), 1, 32, num_prompts=2,
                         out="benchmark/results/spec_quick.json"),
    # what fits ~35 min on the shared 2-core machine (~1.5 tok/s per request under load)
    "medium": BenchConfig("medium", COMPRESSORS, (1, 4, 16, 30), 1, 48, batch=3),
    "full": BenchConfig("full", COMPRESSORS, (1, 4, 16, 30), 2, 128),
}


# ---------------------------------------------------------------- engines


CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}  # read by SGLang at import time (its device checks)


_IMPORT_ENV: dict | None = None  # os.environ when this process imported SGLang for forking


def engine_context(env: dict):
    """The multiprocessing context for an engine child with environment ``env``. On Linux
    the engines are forked from this process after it has imported SGLang once, so no
    engine process pays its own ~12 s import of SGLang, most of an engine's start-up on 2
    cores (bench_spec --quick, two engines to ready: 57 s spawned, 22 s forked, measured side
    by side with one matrix shard alive). What runs is the same code on the same settings; only the import is
    shared. SGLang reads some variables at import time (``SGLANG_USE_CPU_ENGINE``,
    ``SGLANG_TEST_RETRACT``, ...), so a child whose ``env`` differs from this process's
    environment at that import is spawned. The parent imports SGLang without our plugin
    registered and never touches torch's thread pools or a GPU before forking.
    ``VERICACHE_BENCH_SPAWN=1`` spawns every engine."""
    global _IMPORT_ENV
    if sys.platform != "linux" or os.environ.get("VERICACHE_BENCH_SPAWN") == "1":
        return mp.get_context("spawn")
    if _IMPORT_ENV is None:
        if "sglang.srt.entrypoints.engine" in sys.modules:  # imported before we could set CPU_ENV
            return mp.get_context("spawn")
        if any({**os.environ, **CPU_ENV}.get(k) != v for k, v in env.items()):
            return mp.get_context("spawn")  # this child could not be forked: no import for nothing
        os.environ.update(CPU_ENV)  # before the import: SGLang reads it there
        import sglang.srt.entrypoints.engine  # noqa: F401  the shared import

        _IMPORT_ENV = dict(os.environ)
    if any(_IMPORT_ENV.get(k) != v for k, v in env.items()):
        return mp.get_context("spawn")
    return mp.get_context("fork")


def _start_child(env: dict, forked: bool) -> None:
    """First thing in an engine child: its environment, and, when it was forked, SGLang's
    own subprocesses (scheduler, detokenizer) forked too (SGLang's engine asks for spawn,
    which would import SGLang again in each)."""
    os.environ.update(env)
    if forked:
        set_method = mp.set_start_method
        mp.set_start_method = lambda method, force=False: set_method("fork", force=True)
        mp.set_start_method("fork")


class EngineProc:
    """An SGLang offline Engine in a child process of its own. SGLang 0.5.23 keeps its
    runtime context (the speculative config included) per process, so an off engine and a
    VERICACHE engine in one process read each other's settings; the tokenizer manager of
    the off engine then fails on spec fields it never receives."""

    def __init__(self, model_path: str, env: dict, **engine_kw):
        self._start(_engine_main, model_path, env, engine_kw)

    def _start(self, target, model_path: str, env: dict, engine_kw: dict) -> None:
        ctx = engine_context(env)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, model_path, env, engine_kw,
                                                     ctx.get_start_method() == "fork"))
        self.proc.start()
        child.close()  # the child's end lives in the child only: its death ends our recv

    def wait_ready(self) -> None:
        self._reply()

    def generate(self, input_ids, sampling_params) -> tuple[list[dict], float]:
        """(outputs, seconds the engine's generate call took, timed inside the child)."""
        self.conn.send(("generate", input_ids, sampling_params))
        return self._reply()

    def vericache_state(self) -> dict:
        """The engine's VeriCache counters and gauges as ``/server_info`` reports them (no
        metrics needed); {} (bench_decode's child: None) for an engine without VERICACHE."""
        self.conn.send(("state",))
        return self._reply()

    def flush_cache(self) -> bool:
        """Empty the engine's prefix cache, so that the next run prefills cold. SGLang
        flushes only when idle, and a scheduler may still be retiring the last batch for a
        moment after ``generate`` returned (bench_adaptive's W2 warm pass at 4 agents: a flush
        right after it was refused once): retried for up to 10 s."""
        deadline = time.monotonic() + 10.0
        while True:
            self.conn.send(("flush",))
            flushed = self._reply()
            if flushed or time.monotonic() > deadline:
                return flushed
            time.sleep(0.2)

    def request_shutdown(self) -> None:
        """Ask the child to shut its engine down, without waiting (``shutdown`` waits)."""
        if self.proc.is_alive() and not getattr(self, "_shutdown_sent", False):
            self._shutdown_sent = True
            try:
                self.conn.send(("shutdown",))
            except (BrokenPipeError, OSError):
                pass

    def shutdown(self) -> None:
        """Ask the child to shut its engine down; one that does not answer within two
        minutes (still starting, or its scheduler died) is terminated, then killed."""
        if self.proc.is_alive():
            self.request_shutdown()
            self.proc.join(120)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def _reply(self):
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            self.proc.join(10)
            raise RuntimeError(f"engine process {self.proc.pid} died (exit code {self.proc.exitcode}) "
                               "without an answer; its output above says why") from None
        if kind == "error":
            raise RuntimeError(f"engine process failed:\n{payload}")
        return payload


def _engine_main(conn, model_path: str, env: dict, engine_kw: dict, forked: bool = False) -> None:
    import traceback

    _start_child(env, forked)
    try:
        from sglang.srt.entrypoints.engine import Engine

        engine = Engine(model_path=model_path, **{**ENGINE_KW, **engine_kw})  # engine_kw may override
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    try:
        while (msg := conn.recv())[0] in ("generate", "state", "flush"):
            if msg[0] == "state":
                conn.send(("ok", engine.get_server_info()["internal_states"][0].get("vericache", {})))
                continue
            if msg[0] == "flush":
                result = engine.flush_cache()
                conn.send(("ok", bool(getattr(result, "success", result))))
                continue
            try:
                t0 = time.perf_counter()
                outs = engine.generate(input_ids=msg[1], sampling_params=msg[2])
                seconds = time.perf_counter() - t0
                conn.send(("ok", ([{"output_ids": o["output_ids"], "meta_info": o["meta_info"]} for o in outs],
                                  seconds)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        engine.shutdown()


def start_engines(model_path: str, max_draft_len: int, full_device_budget: int = -1) -> tuple[EngineProc, EngineProc]:
    from sgl_vericache.config import VeriCacheConfig

    env = dict(CPU_ENV)
    off = EngineProc(model_path, env)
    VeriCacheConfig(compressor="kivi4", ratio=4.0, draft_len=max_draft_len,
                    full_device_budget=full_device_budget).to_env()  # read by the child
    parking = {"radix_cache_backend": "vericache"} if full_device_budget >= 0 else {}
    spec = EngineProc(model_path, env, speculative_algorithm="VERICACHE",
                      speculative_num_draft_tokens=max_draft_len + 1, speculative_ngram_max_bfs_breadth=1,
                      disable_overlap_schedule=True, **parking)
    for engine in (off, spec):
        engine.wait_ready()
    return off, spec


def chat_ids(model_path: str, prompts) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
            for _, m in prompts]


def generate(engine, ids, cfg: BenchConfig, compressor=None, draft_len=None) -> list[dict]:
    """One record per prompt: output ids, spec counters, and the seconds of its batch."""
    params = {"max_new_tokens": cfg.max_new_tokens, "temperature": 0}
    if compressor is not None:
        params["custom_params"] = {"vericache_compressor": compressor, "vericache_ratio": cfg.ratio,
                                   "vericache_draft_len": draft_len}
    records = []
    for start in range(0, len(ids), cfg.batch):
        chunk = ids[start:start + cfg.batch]
        outs, seconds = engine.generate(chunk, [params] * len(chunk))
        records += [_record(o, seconds / len(chunk)) for o in outs]
    return records


def _record(out: dict, seconds: float) -> dict:
    meta = out["meta_info"]
    finish = meta.get("finish_reason") or {}
    if finish.get("type") == "abort":
        raise RuntimeError(f"request aborted: {finish.get('message')}")
    return {"output_ids": list(out["output_ids"]), "completion_tokens": meta["completion_tokens"],
            "seconds": seconds, "verify_ct": meta.get("spec_verify_ct", 0),
            "correct_drafts": meta.get("spec_num_correct_drafts", 0),
            "correct_drafts_hist": list(meta.get("spec_correct_drafts_histogram") or []),
            "spec_accept_length": meta.get("spec_accept_length")}


# ---------------------------------------------------------------- metrics


def first_divergence(ours: list[int], ref: list[int]):
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def tok_per_s(records) -> float:
    return sum(r["completion_tokens"] for r in records) / max(1e-9, sum(r["seconds"] for r in records))


def spec_metrics(records, ref_ids, draft_len: int) -> dict:
    hist = {}  # correct drafts in a round -> rounds, over all requests
    for r in records:
        for k, rounds in enumerate(r["correct_drafts_hist"]):
            hist[k] = hist.get(k, 0) + rounds
    rounds = sum(hist.values())
    accepted = sum(min(k, draft_len) * c for k, c in hist.items())
    divergent = {i: first_divergence(r["output_ids"], ref) for i, (r, ref) in enumerate(zip(records, ref_ids))}
    return {
        "acc_len_hist": {str(k + 1): c for k, c in sorted(hist.items()) if c},
        "mean_acc_len": sum((k + 1) * c for k, c in hist.items()) / max(1, rounds),
        "acc_rate": accepted / max(1, rounds * draft_len),
        "pad_accepted": sum(max(0, k - draft_len) * c for k, c in hist.items()),
        "tokens_per_verify": sum(r["completion_tokens"] for r in records) / max(1, sum(r["verify_ct"] for r in records)),
        "verify_rounds": rounds,
        "output_tokens": sum(r["completion_tokens"] for r in records),
        "per_request_accept_length": [r["spec_accept_length"] for r in records],
        "tok_s": tok_per_s(records),
        "identical": sum(d is None for d in divergent.values()),
        "divergent": {str(i): d for i, d in divergent.items() if d is not None},
        "seconds": sum(r["seconds"] for r in records),
    }


# ---------------------------------------------------------------- run


def run_block(engines, ids, ref_ids, cfg: BenchConfig, compressor: str, log, off_records=None) -> list[dict]:
    """The off arm once (unless given), then VERICACHE with ``compressor`` at every draft length."""
    off, spec = engines
    off_records = off_records or generate(off, ids, cfg)
    off_tok_s = tok_per_s(off_records)
    off_same = sum(first_divergence(r["output_ids"], ref) is None for r, ref in zip(off_records, ref_ids))
    rows = []
    for draft_len in cfg.draft_lens:
        before = spec.vericache_state()
        m = spec_metrics(generate(spec, ids, cfg, compressor, draft_len), ref_ids, draft_len)
        after = spec.vericache_state()
        row = {"compressor": compressor, "ratio": cfg.ratio, "draft_len": draft_len, **m,
               "off_tok_s": off_tok_s, "tok_s_ratio": m["tok_s"] / off_tok_s, "off_repeat_identical": off_same,
               "vericache_counters": {k: after[k] - before.get(k, 0) for k in STATE_COUNTERS if k in after}}
        rows.append(row)
        log(f"{compressor:>12} d={draft_len:<2} acc_len {m['mean_acc_len']:5.2f}  acc_rate {m['acc_rate']:.3f}  "
            f"tok/verify {m['tokens_per_verify']:5.2f}  tok/s {m['tok_s']:5.2f} vs off {off_tok_s:5.2f} "
            f"(x{row['tok_s_ratio']:.2f})  identical {m['identical']}/{len(ids)}"
            + (f"  DIVERGENT {m['divergent']}" if m["divergent"] else ""))
    return rows


def run(cfg: BenchConfig, model_path: str, save) -> dict:
    """The whole matrix; ``save(result)`` after every compressor (``complete`` False until the end)."""
    t_start = time.time()
    log = make_log(t_start)
    prompts = prompt_set(cfg.prompts_per_category)[:cfg.num_prompts or None]
    ids = chat_ids(model_path, prompts)
    log(f"{cfg.mode}: {len(ids)} prompts x {cfg.max_new_tokens} tokens (batch {cfg.batch}), compressors "
        f"{list(cfg.compressors)}, draft lens {list(cfg.draft_lens)}; starting two engines")
    engines = start_engines(model_path, max(cfg.draft_lens), cfg.full_device_budget)
    try:
        t_up = time.time()
        log(f"engines up in {t_up - t_start:.0f} s; warm-up, then the off arm's reference run")
        warm = dataclasses.replace(cfg, max_new_tokens=8)
        generate(engines[0], ids[:1], warm)
        generate(engines[1], ids[:1], warm, cfg.compressors[0], cfg.draft_lens[0])
        t_gen = time.time()
        ref_records = generate(engines[0], ids, cfg)
        ref_ids = [r["output_ids"] for r in ref_records]
        result = describe(cfg, model_path, prompts, ids, ref_ids)
        for i, compressor in enumerate(cfg.compressors):
            result["results"] += run_block(engines, ids, ref_ids, cfg, compressor, log,
                                           off_records=ref_records if i == 0 else None)
            now = time.time()
            result["wall_s"] = {"engine_start": t_up - t_start, "generation": now - t_gen, "total": now - t_start}
            result["complete"] = i == len(cfg.compressors) - 1
            save(result)
    finally:
        for engine in engines:
            engine.shutdown()
    return result


def describe(cfg: BenchConfig, model_path: str, prompts, ids, ref_ids) -> dict:
    return {
        "mode": cfg.mode, "complete": False, "config": dataclasses.asdict(cfg), **provenance(model_path),
        "prompts": [{"name": name, "prompt_tokens": len(i), "off_output_tokens": len(r)}
                    for (name, _), i, r in zip(prompts, ids, ref_ids)],
        "context_lengths": {"prompt_tokens_max": max(map(len, ids)), "max_new_tokens": cfg.max_new_tokens,
                            "context_max": max(map(len, ids)) + cfg.max_new_tokens},
        "engine": {**ENGINE_KW, "verify_width": max(cfg.draft_lens) + 1, "batch": cfg.batch},
        "results": [],
    }


def make_log(t_start: float):
    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.0f}s] {msg}", flush=True)

    return log


def provenance(model_path: str) -> dict:
    import torch

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {
        "commit": git("rev-parse", "HEAD"),
        "tree_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__},
        "model": model_path, "dtype": "float32", "sampling": "greedy (temperature 0)",
    }


# ---------------------------------------------------------------- output


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    draft_lens = result["config"]["draft_lens"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for comp in dict.fromkeys(r["compressor"] for r in rows):  # those measured so far
        mine = sorted((r for r in rows if r["compressor"] == comp), key=lambda r: r["draft_len"])
        xs = [r["draft_len"] for r in mine]
        ax1.plot(xs, [r["mean_acc_len"] for r in mine], marker="o", label=comp)
        ax2.plot(xs, [r["tok_s_ratio"] for r in mine], marker="o", label=comp)
    ax1.plot(draft_lens, [d + 1 for d in draft_lens], "k--", lw=0.8, label="ideal (draft_len + 1)")
    ax1.set(xlabel="draft length", ylabel="acceptance length (tokens / verify round)",
            title=f"Acceptance length, compressors at {result['config']['ratio']:g}x")
    ax2.axhline(1.0, color="k", lw=0.8, ls="--")
    ax2.set(xlabel="draft length", ylabel="tok/s VERICACHE / tok/s speculation off",
            title=f"Speed vs speculation off ({result['machine']['cores']} CPU cores, batch {result['config']['batch']})")
    for ax in (ax1, ax2):
        ax.set_xticks(draft_lens)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{Path(result['model']).name}, {result['dtype']}, {len(result['prompts'])} prompts x "
                 f"{result['config']['max_new_tokens']} tokens ({result['mode']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(result: dict) -> str:
    rows = result["results"]
    n = len(result["prompts"])
    same = sum(r["identical"] for r in rows)
    best = max(rows, key=lambda r: r["mean_acc_len"])
    fastest = max(rows, key=lambda r: r["tok_s_ratio"])
    partial = "" if result.get("complete") else " (INCOMPLETE)"
    return (f"bench_spec {result['mode']}{partial}: {len(rows)} configs x {n} prompts x "
            f"{result['config']['max_new_tokens']} tok; identical {same}/{len(rows) * n}; best acc_len "
            f"{best['mean_acc_len']:.2f} ({best['compressor']}, d={best['draft_len']}); best speed x"
            f"{fastest['tok_s_ratio']:.2f} vs off ({fastest['compressor']}, d={fastest['draft_len']}); "
            f"generation {result['wall_s']['generation']:.0f} s, total {result['wall_s']['total']:.0f} s")


def parse_args() -> tuple[BenchConfig, str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", const="quick", dest="mode")
    mode.add_argument("--medium", action="store_const", const="medium", dest="mode")
    p.add_argument("--out", default=None, help="JSON path, PNG beside it (default benchmark/results/spec.json; "
                   "--quick: spec_quick.json)")
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--compressors", default=None, help="comma list, overrides the preset")
    p.add_argument("--draft-lens", default=None, help="comma list, overrides the preset")
    p.add_argument("--prompts-per-category", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="concurrent requests per generate call (default 1)")
    p.add_argument("--full-device-budget", type=int, default=None,
                   help="the VERICACHE arm's --vericache-full-device-budget in tokens (staggered verifies; "
                        "default -1: off)")
    p.add_argument("--replot", action="store_true", help="only redraw the PNG and summary from an existing --out JSON")
    a = p.parse_args()
    if a.full_device_budget is not None and a.full_device_budget < -1:
        p.error(f"--full-device-budget {a.full_device_budget}: must be -1 (off) or a token count >= 0")
    cfg = PRESETS[a.mode or "full"]
    overrides = {"out": a.out, "prompts_per_category": a.prompts_per_category,
                 "max_new_tokens": a.max_new_tokens, "batch": a.batch,
                 "full_device_budget": a.full_device_budget,
                 "compressors": tuple(a.compressors.split(",")) if a.compressors else None,
                 "draft_lens": tuple(int(d) for d in a.draft_lens.split(",")) if a.draft_lens else None}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides.keys() - {"out"}:
        overrides["mode"] = cfg.mode + "+custom"
    return dataclasses.replace(cfg, **overrides), a.model_path, a.replot


def preset_args(doc: str, config_cls, presets: dict, quick_help: str, default_out: str, check=None):
    """The CLI of a benchmark whose settings are one dataclass: ``--quick`` picks
    ``presets["quick"]`` (else ``presets["default"]``), every field but ``mode`` / ``out`` is a
    flag overriding the preset, numbers must be positive (or at least a field's ``min``
    metadata), ``check(parser, cfg)`` refuses the
    rest. Returns (cfg, model_path, replot) for ``bench_main``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", default=None, help=f"JSON path, PNG beside it (default {default_out})")
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    names = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("mode", "out")]
    for field in dataclasses.fields(config_cls):
        if field.name in names and isinstance(field.default, bool):  # --flag / --no-flag
            p.add_argument("--" + field.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=None)
        elif field.name in names:
            p.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=None)
    p.add_argument("--replot", action="store_true", help="only redraw the PNG and table from an existing --out JSON")
    args = p.parse_args()
    cfg = presets["quick" if args.quick else "default"]
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    lows = {f.name: f.metadata.get("min") for f in dataclasses.fields(config_cls)}
    for name, value in overrides.items():
        lo = lows.get(name)
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and lo is not None and value < lo:
            p.error(f"--{name.replace('_', '-')} {value} must be at least {lo}")
        if isinstance(value, (int, float)) and lo is None and value <= 0:
            p.error(f"--{name.replace('_', '-')} {value} must be positive")
    cfg = dataclasses.replace(cfg, **overrides, **({"out": args.out} if args.out else {}))
    if check is not None:
        check(p, cfg)
    return cfg, args.model_path, args.replot


def check_compressor(parser, cfg) -> None:
    """``preset_args``' check for a config with one ``compressor``."""
    if cfg.compressor not in COMPRESSORS:
        parser.error(f"--compressor {cfg.compressor!r} is not one of {', '.join(COMPRESSORS)}")


def bench_main(parse, run_fn, plot_fn, summarize) -> None:
    """The shared driver of the engine benchmarks: ``parse()`` -> (cfg with ``out``,
    model_path, replot); re-plot a saved JSON, or run and save after every point."""
    cfg, model_path, replot = parse()
    out = ROOT / cfg.out if not Path(cfg.out).is_absolute() else Path(cfg.out)
    if replot:
        result = json.loads(out.read_text())
        plot_fn(result, out.with_suffix(".png"))
        print(summarize(result))
        return
    if model_path is None:
        from sgl_vericache.default_model import ensure_default_model

        model_path = str(ensure_default_model())
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        result["machine"]["load_avg"] = list(os.getloadavg())
        out.write_text(json.dumps(result, indent=1))

    result = run_fn(cfg, model_path, save)
    plot_fn(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    print(summarize(result))


def main() -> None:
    bench_main(parse_args, run, plot, summary)


if __name__ == "__main__":
    main()
