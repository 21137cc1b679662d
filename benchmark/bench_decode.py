"""Decode speed at long context: VERICACHE against speculation off, on SGLang (issue 6).

SmolLM2-135M-Instruct on CPU, fp32, greedy. Two offline engines, each in a child process
of its own (``bench_spec.EngineProc``), alive for the whole run and started with the same
flags (CPU, torch_native attention, radix cache on, ``enable_metrics``) except that arm B
adds ``speculative_algorithm=VERICACHE`` (its draft length cap = the largest benchmarked). Each
request picks its compressor (ratio 4) and draft length through ``custom_params``.

Per (context, batch): a warm-up puts the batch's prompts into both engines' radix caches
(so the timed runs prefill one token, the same in both arms), then ``repeats`` rounds of
A, B(compressor 1), B(compressor 2), ... run back to back, so both arms see the same
machine conditions. Per run:
  tok/s        decode tok/s: output tokens after the first / the decode window, from
               SGLang's per-request timestamps (last request's first token -> last finish).
               ``e2e`` tok/s (generate call wall time) is kept beside it.
  acc_len      tokens emitted per verify round (accepted drafts + bonus), from the
               worker's counters; ``tokens_per_verify`` is SGLang's ``spec_accept_length``
               (completion tokens / ``spec_verify_ct``, prefill token included).
  time split   draft / verify / tier load / other seconds of the decode window. draft and
               verify are differences of the worker's ``vericache:*_seconds_total``
               Prometheus counters (scheduler process), read in the engine's child process
               with prometheus_client's multiprocess collector over the PROMETHEUS_MULTIPROC_DIR
               that SGLang's Engine sets; tier load is 0 (no tiered cache yet); other = window
               - draft - verify (scheduling, sampling, detokenization, IPC).
  identical    every request's output ids against the off arm's in the same round.

    python benchmark/bench_decode.py --quick        # ~1k context, batch 1, kivi4: < 60 s after engines are up
    python benchmark/bench_decode.py                # 2k/4k/8k x batch 1/4 x every compressor
    python benchmark/bench_decode.py --contexts 2048,8000 --batches 4 --compressors kivi4,streamingllm \\
        --draft-lens 8,16 --max-new-tokens 32 --repeats 2 --out benchmark/results/decode_medium.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import (COMPRESSORS, ENGINE_KW, ROOT, EngineProc, _start_child, bench_main,  # noqa: E402
                        first_divergence, make_log, provenance)
from prompts import CODE, TOOL, messages  # noqa: E402  (bench_spec put test/ on sys.path)

MODEL_MAX_LEN = 8192  # SmolLM2's max_position_embeddings
COUNTERS = ("draft_seconds", "verify_seconds", "rounds", "drafted_tokens", "accepted_tokens", "emitted_tokens")
TIER_LOAD_NOTE = "0: no tiered cache yet (full KV resident in host memory for both arms)"


@dataclass(frozen=True)
class DecodeConfig:
    mode: str
    contexts: tuple[int, ...]  # prompt tokens; MODEL_MAX_LEN means "as long as fits"
    batches: tuple[int, ...]
    compressors: tuple[str, ...]
    draft_lens: tuple[int, ...] = ()  # one per compressor; () -> best in benchmark/results/spec*.json, else 16
    max_new_tokens: int = 64
    repeats: int = 3
    ratio: float = 4.0
    draft_weights: str = "auto"  # --vericache-draft-weights of the VERICACHE arm (auto: fp16 copy at batch <= 2 of an fp32 model)
    repetition_penalty: float = 1.0  # both arms' requests (Qwen2.5's generation config: 1.05)
    min_new_tokens: int = 0  # both arms' requests (a penalizer too: stop tokens held back until it is reached)
    out: str = "benchmark/results/decode.json"


PRESETS = {
    "quick": DecodeConfig("quick", (1024,), (1,), ("kivi4",), (8,), max_new_tokens=12, repeats=2,
                          out="benchmark/results/decode_quick.json"),
    "full": DecodeConfig("full", (2048, 4096, MODEL_MAX_LEN), (1, 4), COMPRESSORS),
}


# ---------------------------------------------------------------- engines


class DecodeEngine(EngineProc):
    """``bench_spec.EngineProc`` whose child also returns the VeriCache counter deltas."""

    def __init__(self, model_path: str, env: dict, **engine_kw):  # noqa: super().__init__ would start bench_spec's child
        self._start(_decode_engine_main, model_path, env, engine_kw)

    def server_state(self) -> dict:
        """``/server_info``'s ``internal_states[0]`` (any engine)."""
        self.conn.send(("info",))
        return self._reply()


def _decode_engine_main(conn, model_path: str, env: dict, engine_kw: dict, forked: bool = False) -> None:
    import traceback

    _start_child(env, forked)
    try:
        from sglang.srt.entrypoints.engine import Engine

        engine = Engine(model_path=model_path, **{**ENGINE_KW, **engine_kw})
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", {"prometheus_dir": os.environ.get("PROMETHEUS_MULTIPROC_DIR")}))
    try:
        while (msg := conn.recv())[0] in ("generate", "state", "info"):
            if msg[0] in ("state", "info"):
                try:
                    state = engine.get_server_info()["internal_states"][0]
                    conn.send(("ok", state.get("vericache") if msg[0] == "state" else state))
                except Exception:
                    conn.send(("error", traceback.format_exc()))
                continue
            try:
                before = read_counters()
                t0 = time.perf_counter()
                outs = engine.generate(input_ids=msg[1], sampling_params=msg[2])
                seconds = time.perf_counter() - t0
                after = read_counters()
                delta = None if after is None else {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
                conn.send(("ok", ([{"output_ids": o["output_ids"], "meta_info": o["meta_info"]} for o in outs],
                                  seconds, delta)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        engine.shutdown()


def read_counters() -> dict | None:
    """The worker's ``vericache:*`` counter totals, summed over the scheduler processes'
    Prometheus files; None when metrics are off (no PROMETHEUS_MULTIPROC_DIR)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path or not os.path.isdir(path):
        return None
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    totals = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.startswith("vericache:") and sample.name.endswith("_total"):
                name = sample.name[len("vericache:"):-len("_total")]
                totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def start_engines(model_path: str, cfg: DecodeConfig, max_draft_len: int, max_context: int):
    from sgl_vericache.config import VeriCacheConfig

    per_request = max_context + cfg.max_new_tokens + max_draft_len + 64
    common = dict(enable_metrics=True, max_total_tokens=max(8192, max(cfg.batches) * per_request + 256))
    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    # with penalties, the off arm runs without the overlap scheduler, as VeriCache does: SGLang's
    # overlap scheduler adds each output token to the penalty state one step late (ids differ)
    off = DecodeEngine(model_path, env, **common, **({"disable_overlap_schedule": True} if _penalized(cfg) else {}))
    VeriCacheConfig(compressor=cfg.compressors[0], ratio=cfg.ratio, draft_len=max_draft_len,
                    draft_weights=cfg.draft_weights).to_env()
    spec = DecodeEngine(model_path, env, speculative_algorithm="VERICACHE", speculative_num_draft_tokens=max_draft_len + 1,
                        speculative_ngram_max_bfs_breadth=1, disable_overlap_schedule=True, **common)
    return off, spec, common


# ---------------------------------------------------------------- prompts


def filler_text(n_blocks: int) -> str:
    """A code file interleaved with a tool-call transcript: blocks of varied, deterministic
    snippets, the kind of context the issue cares about (code and tool-call prompts)."""
    cities = ("Paris", "Oslo", "Denver", "Boston", "Lima", "Osaka", "Cairo", "Perth", "Quito", "Turin", "Hanoi")
    fields = ("price", "quantity", "weight", "score", "latency_ms", "retries", "offset", "budget")
    parts = []
    for i in range(n_blocks):
        city, other, field = cities[i % len(cities)], cities[(3 * i + 1) % len(cities)], fields[i % len(fields)]
        parts.append(
            f"def update_{field}_{i}(records, limit={10 + i % 7}):\n"
            f'    """Clamp `{field}` of every record to [0, limit] and return how many changed."""\n'
            f"    changed = 0\n"
            f"    for rec in records:\n"
            f"        value = min(max(rec.get('{field}', 0), 0), limit)\n"
            f"        if value != rec.get('{field}'):\n"
            f"            rec['{field}'] = value\n"
            f"            changed += 1\n"
            f"    return changed\n\n"
            f'# tool call {i}: {{"tool": "get_weather", "arguments": {{"city": "{city}", "unit": "{"CF"[i % 2]}"}}}}\n'
            f'# result {i}: {{"city": "{city}", "temperature": {(7 * i) % 35 - 5}, "conditions": '
            f'"{("rain", "sun", "snow", "fog")[i % 4]}"}}\n'
            f'# tool call {i}b: {{"tool": "search_flights", "arguments": {{"origin": "{city}", '
            f'"destination": "{other}", "date": "2026-{1 + i % 12:02d}-{1 + i % 28:02d}"}}}}\n\n')
    return "".join(parts)


def build_prompts(tok, context: int, n: int) -> list[list[int]]:
    """``n`` prompts of exactly ``context`` tokens (chat template included): the filler,
    cut to length, then a question from test/prompts.py (code and tool calls alternate)."""
    questions = [("code", q) for q in CODE] + [("tool", q) for q in TOOL]
    questions = [questions[(i // 2) + (i % 2) * len(CODE)] for i in range(len(questions))]  # code, tool, code, ...
    marker = "\x00FILLER\x00"
    prompts = []
    for i in range(n):
        category, question = questions[i % len(questions)]
        text = tok.apply_chat_template(messages(category, f"{marker}\n\n{question}"), add_generation_prompt=True,
                                       tokenize=False)
        head, tail = (tok.encode(part, add_special_tokens=False) for part in text.split(marker))
        need = context - len(head) - len(tail)
        filler = tok.encode(filler_text(need // 40 + 8)[i * 997:], add_special_tokens=False)  # varied per prompt
        assert len(filler) >= need > 0, (len(filler), need)
        prompts.append(head + filler[:need] + tail)
    return prompts


def default_draft_lens(compressors) -> tuple[int, ...]:
    """Each compressor's fastest draft length in benchmark/results/spec.json (then
    spec_quick.json), else 16."""
    best = {}
    for name in ("spec_quick.json", "spec.json"):  # spec.json (more prompts) wins
        path = ROOT / "benchmark" / "results" / name
        if path.exists():
            rows = json.loads(path.read_text())["results"]
            for comp in {r["compressor"] for r in rows}:
                best[comp] = max((r for r in rows if r["compressor"] == comp), key=lambda r: r["tok_s_ratio"])["draft_len"]
    return tuple(best.get(c, 16) for c in compressors)


# ---------------------------------------------------------------- runs


def _penalized(cfg: DecodeConfig) -> bool:
    """The requests carry one of SGLang's penalizers: the off arm then runs without the overlap
    scheduler, as the VERICACHE arm does (with it SGLang adds each output token to the
    penalty state one step late, and ids differ)."""
    return cfg.repetition_penalty != 1.0 or cfg.min_new_tokens > 0


def timed_run(engine, ids, max_new_tokens: int, compressor=None, draft_len=None, ratio=4.0,
              repetition_penalty=1.0, min_new_tokens=0) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
              "repetition_penalty": repetition_penalty, "min_new_tokens": min_new_tokens}
    if compressor is not None:
        params["custom_params"] = {"vericache_compressor": compressor, "vericache_ratio": ratio,
                                   "vericache_draft_len": draft_len}
    outs, seconds, counters = engine.generate(ids, [params] * len(ids))
    metas = [o["meta_info"] for o in outs]
    for m in metas:
        if (m.get("finish_reason") or {}).get("type") == "abort":
            raise RuntimeError(f"request aborted: {m['finish_reason'].get('message')}")
    tokens = sum(m["completion_tokens"] for m in metas)
    window = decode_window(metas)
    run = {"output_ids": [list(o["output_ids"]) for o in outs], "e2e_s": seconds, "e2e_tok_s": tokens / seconds,
           "decode_s": window, "decode_tokens": tokens - len(ids), "cached_tokens": [m.get("cached_tokens") for m in metas],
           "verify_ct": sum(m.get("spec_verify_ct", 0) for m in metas), "completion_tokens": tokens}
    run["tok_s"] = run["decode_tokens"] / window if window else run["e2e_tok_s"]
    if compressor is not None and counters is not None:
        run["counters"] = counters
    return run


def decode_window(metas) -> float | None:
    """Seconds from the batch's last first token to its last finish (SGLang's timestamps,
    present with enable_metrics), i.e. the decode phase without prefill or queueing."""
    try:
        first = max(m["request_received_ts"] + m["first_token_latency"] for m in metas)
        return max(m["request_finished_ts"] for m in metas) - first
    except KeyError:
        return None


def make_row(context, batch, compressor, draft_len, offs, vcs, ratio) -> dict:
    """One (context, batch, compressor) row over paired repeats (off run i, VeriCache run i)."""
    pairs = [vc["tok_s"] / off["tok_s"] for off, vc in zip(offs, vcs)]
    div = [first_divergence(v, o) for off, vc in zip(offs, vcs) for v, o in zip(vc["output_ids"], off["output_ids"])]
    c = {k: sum(vc.get("counters", {}).get(k, 0.0) for vc in vcs) for k in COUNTERS}
    window = sum(vc["decode_s"] or vc["e2e_s"] for vc in vcs)
    n = len(vcs)
    split = {"draft": c["draft_seconds"] / n, "verify": c["verify_seconds"] / n, "tier_load": 0.0}
    split["other"] = window / n - split["draft"] - split["verify"]
    tok_s_off, tok_s_vc = [r["tok_s"] for r in offs], [r["tok_s"] for r in vcs]
    return {
        "context": context, "batch": batch, "compressor": compressor, "ratio": ratio, "draft_len": draft_len,
        "tok_s_off": statistics.median(tok_s_off), "tok_s_off_runs": tok_s_off,
        "tok_s_vc": statistics.median(tok_s_vc), "tok_s_vc_runs": tok_s_vc,
        "speedup": statistics.median(pairs), "speedup_runs": pairs, "speedup_min": min(pairs), "speedup_max": max(pairs),
        "e2e_tok_s_off": statistics.median(r["e2e_tok_s"] for r in offs),
        "e2e_tok_s_vc": statistics.median(r["e2e_tok_s"] for r in vcs),
        "mean_acc_len": c["emitted_tokens"] / c["rounds"] if c["rounds"] else None,
        "acc_rate": c["accepted_tokens"] / c["drafted_tokens"] if c["drafted_tokens"] else None,
        "tokens_per_verify": sum(r["completion_tokens"] for r in vcs) / max(1, sum(r["verify_ct"] for r in vcs)),
        "verify_rounds": c["rounds"] / n,
        "identical": sum(d is None for d in div), "compared": len(div),
        "first_divergent": [d for d in div if d is not None],
        "time_split": split,  # seconds per timed run (cost_model.py --measured reads these four)
        "time_split_fraction": {k: v / (window / n) for k, v in split.items()},
        "cached_tokens_vc": vcs[0]["cached_tokens"],
    }


def run_point(engines, ids, cfg: DecodeConfig, draft_lens, log, label) -> list[dict]:
    """Warm both radix caches with the prompts, then repeats x (A, B per compressor)."""
    off, spec = engines
    t0 = time.time()
    off.generate(ids, [{"max_new_tokens": 1, "temperature": 0}] * len(ids))
    spec.generate(ids, [{"max_new_tokens": 1, "temperature": 0, "custom_params": {
        "vericache_compressor": cfg.compressors[0], "vericache_ratio": cfg.ratio, "vericache_draft_len": 1}}] * len(ids))
    log(f"{label}: prefill warm-up of both arms {time.time() - t0:.1f} s")
    offs, vcs = [], {c: [] for c in cfg.compressors}
    for rep in range(cfg.repeats):
        offs.append(timed_run(off, ids, cfg.max_new_tokens, repetition_penalty=cfg.repetition_penalty,
                              min_new_tokens=cfg.min_new_tokens))
        log(f"{label} rep {rep} off: {offs[-1]['tok_s']:6.2f} tok/s (decode {offs[-1]['decode_s']:.2f} s)")
        for comp, d in zip(cfg.compressors, draft_lens):
            vcs[comp].append(timed_run(spec, ids, cfg.max_new_tokens, comp, d, cfg.ratio, cfg.repetition_penalty,
                                       cfg.min_new_tokens))
            r = vcs[comp][-1]
            same = sum(a == b for a, b in zip(r["output_ids"], offs[-1]["output_ids"]))
            log(f"{label} rep {rep} {comp} d={d}: {r['tok_s']:6.2f} tok/s (x{r['tok_s'] / offs[-1]['tok_s']:.2f}), "
                f"identical {same}/{len(ids)}")
    return [make_row(len(ids[0]), len(ids), comp, d, offs, vcs[comp], cfg.ratio)
            for comp, d in zip(cfg.compressors, draft_lens)]


def run(cfg: DecodeConfig, model_path: str, save) -> dict:
    from transformers import AutoTokenizer

    t_start = time.time()
    log = make_log(t_start)
    tok = AutoTokenizer.from_pretrained(model_path)
    draft_lens = cfg.draft_lens or default_draft_lens(cfg.compressors)
    limit = MODEL_MAX_LEN - cfg.max_new_tokens - max(draft_lens) - 32  # room for output + one verify window
    contexts = sorted({min(c, limit) for c in cfg.contexts})
    prompts = {c: build_prompts(tok, c, max(cfg.batches)) for c in contexts}
    log(f"{cfg.mode}: contexts {contexts}, batches {list(cfg.batches)}, compressors "
        f"{dict(zip(cfg.compressors, draft_lens))} (draft len), {cfg.max_new_tokens} new tokens, "
        f"{cfg.repeats} repeats; starting two engines")
    off, spec, common = start_engines(model_path, cfg, max(draft_lens), max(contexts))
    try:
        ready = [e._reply() for e in (off, spec)]
        t_up = time.time()
        log(f"engines up in {t_up - t_start:.0f} s (not counted below)")
        result = describe(cfg, model_path, draft_lens, contexts, prompts, common, ready)
        result["wall_s"] = {"engine_start": t_up - t_start}
        for context in contexts:
            for batch in cfg.batches:
                result["results"] += run_point((off, spec), prompts[context][:batch], cfg, draft_lens, log,
                                               f"ctx {context} batch {batch}")
                result["wall_s"].update(benchmark=time.time() - t_up, total=time.time() - t_start)
                save(result)
        result["complete"] = True
        save(result)
    finally:
        for engine in (off, spec):
            engine.shutdown()
    return result


def describe(cfg, model_path, draft_lens, contexts, prompts, common, ready) -> dict:
    import torch

    info = provenance(model_path)
    info["machine"]["torch_threads"] = torch.get_num_threads()
    return {
        "mode": cfg.mode, "complete": False, "config": {**dataclasses.asdict(cfg), "draft_lens": list(draft_lens)},
        **info, "prompt_tokens": {str(c): [len(p) for p in prompts[c]] for c in contexts},
        "prompts": "filler_text() (code file + tool-call transcript) cut to length, then a test/prompts.py "
                   "code or tool question; chat template included",
        "engine": {**ENGINE_KW, **common, "verify_width": max(draft_lens) + 1, "radix_cache": True,
                   "vericache_arm": "speculative_algorithm=VERICACHE, otherwise identical flags",
                   "off_arm": ("disable_overlap_schedule=True, as the VERICACHE arm (with penalties, SGLang's "
                               "overlap scheduler penalizes each token one step late)")
                   if _penalized(cfg) else "SGLang's defaults (overlap scheduler)"},
        "counters": "prometheus multiprocess files" if ready[1] and ready[1].get("prometheus_dir") else "unavailable",
        "tok_s": "decode tok/s: (completion tokens - 1 per request) / (last finish - last first token)",
        "time_split_note": "seconds per timed run of the VeriCache arm's decode window; draft and verify from the "
                           "worker's vericache:* counters (verify includes acceptance, KV commit and the "
                           "compressed-store sync); other = window - draft - verify; tier_load " + TIER_LOAD_NOTE,
        "results": [],
    }


# ---------------------------------------------------------------- output


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {c: f"C{i}" for i, c in enumerate(dict.fromkeys(r["compressor"] for r in rows))}
    for comp, batch in dict.fromkeys((r["compressor"], r["batch"]) for r in rows):
        mine = sorted((r for r in rows if r["compressor"] == comp and r["batch"] == batch), key=lambda r: r["context"])
        xs, ys = [r["context"] for r in mine], [r["speedup"] for r in mine]
        err = [[y - r["speedup_min"] for y, r in zip(ys, mine)], [r["speedup_max"] - y for y, r in zip(ys, mine)]]
        ax1.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=colors[comp], ls="-" if batch == 1 else "--",
                     label=f"{comp} d={mine[0]['draft_len']} batch {batch}")
    ax1.axhline(1.0, color="k", lw=0.8, ls=":")
    ax1.set(xlabel="context (prompt tokens)", ylabel="decode tok/s VeriCache / speculation off",
            title=f"Speedup, compressors at {result['config']['ratio']:g}x (median, min-max)")
    ax1.legend(fontsize=7)
    labels = [f"{r['compressor']}\nctx {r['context']} b{r['batch']}" for r in rows]
    bottom = [0.0] * len(rows)
    for part, color in (("draft", "C0"), ("verify", "C1"), ("tier_load", "C2"), ("other", "C7")):
        vals = [r["time_split_fraction"][part] for r in rows]
        ax2.bar(range(len(rows)), vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xticks(range(len(rows)), labels, fontsize=6)
    ax2.set(ylabel="fraction of VeriCache decode time", title="VeriCache time split")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    m = result["machine"]
    fig.suptitle(f"{Path(result['model']).name}, {result['dtype']}, {m['cores']} CPU cores, "
                 f"{result['config']['max_new_tokens']} new tokens, {result['config']['repeats']} repeats ({result['mode']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict) -> str:
    lines = ["| context | batch | compressor | d | tok/s off | tok/s VeriCache | ratio (min-max) | acc len | "
             "identical | draft / verify / tier / other |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        f = r["time_split_fraction"]
        acc = f"{r['mean_acc_len']:.2f}" if r["mean_acc_len"] is not None else f"{r['tokens_per_verify']:.2f}*"
        lines.append(f"| {r['context']} | {r['batch']} | {r['compressor']} | {r['draft_len']} | {r['tok_s_off']:.2f} | "
                     f"{r['tok_s_vc']:.2f} | {r['speedup']:.2f} ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | {acc} | "
                     f"{r['identical']}/{r['compared']} | {f['draft']:.0%} / {f['verify']:.0%} / {f['tier_load']:.0%} / "
                     f"{f['other']:.0%} |")
    w = result["wall_s"]
    lines.append(f"\nengine start {w['engine_start']:.0f} s; benchmark {w.get('benchmark', 0):.0f} s after the engines "
                 f"were up; total {w.get('total', 0):.0f} s" + ("" if result.get("complete") else " (INCOMPLETE)"))
    return "\n".join(lines)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1k context, batch 1, kivi4 d=8, 12 tokens, 2 repeats")
    p.add_argument("--out", default=None, help="JSON path, PNG beside it (default benchmark/results/decode.json; "
                   "--quick: decode_quick.json)")
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    for flag, help_ in (("--contexts", "prompt tokens, comma list (8192: as long as fits)"),
                        ("--batches", "comma list"), ("--compressors", "comma list"),
                        ("--draft-lens", "comma list, one per compressor (or one for all)")):
        p.add_argument(flag, default=None, help=help_)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--draft-weights", default=None, choices=("auto", "model", "fp16", "int8"),
                   help="the VERICACHE arm's --vericache-draft-weights (default auto: the fp16 copy up to 2 rows per product for an fp32 model on a CPU)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="every request's repetition_penalty, both arms (default 1: none; Qwen2.5 sets 1.05)")
    p.add_argument("--min-new-tokens", type=int, default=None,
                   help="every request's min_new_tokens, both arms (default 0: none; with ignore_eos it changes no "
                        "output, but its penalizer runs)")
    p.add_argument("--replot", action="store_true", help="only redraw the PNG and table from an existing --out JSON")
    a = p.parse_args()
    cfg = PRESETS["quick" if a.quick else "full"]
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    overrides = {"contexts": a.contexts and ints(a.contexts), "batches": a.batches and ints(a.batches),
                 "compressors": a.compressors and tuple(a.compressors.split(",")),
                 "draft_lens": a.draft_lens and ints(a.draft_lens), "max_new_tokens": a.max_new_tokens,
                 "repeats": a.repeats, "draft_weights": a.draft_weights, "repetition_penalty": a.repetition_penalty,
                 "min_new_tokens": a.min_new_tokens}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        overrides["mode"] = cfg.mode + "+custom"
    cfg = dataclasses.replace(cfg, **overrides, **({"out": a.out} if a.out else {}))
    if cfg.draft_lens and len(cfg.draft_lens) == 1:
        cfg = dataclasses.replace(cfg, draft_lens=cfg.draft_lens * len(cfg.compressors))
    if cfg.draft_lens and len(cfg.draft_lens) != len(cfg.compressors):
        p.error("--draft-lens: one per compressor, or one for all")
    return cfg, a.model_path, a.replot


def main() -> None:
    bench_main(parse_args, run, plot, table)


if __name__ == "__main__":
    main()
