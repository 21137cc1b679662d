"""The adaptive controller against speculation off, today's fixed defaults and the best fixed
setting, on four workloads (issue 7).

Three offline engines side by side (SmolLM2-135M-Instruct, CPU, fp32): speculation off;
VERICACHE with the controller off (``--no-vericache-adaptive``, kivi4, draft length 16:
the fixed defaults before the controller; the same engine runs each swept fixed setting
through ``custom_params``); VERICACHE with the controller on (``--vericache-compressor
auto``, the new defaults). Per workload every arm runs in turn, the order rotating each
repeat, so each ratio compares runs made minutes apart on this shared machine:

- W1 serving: many requests at once (continuous batching), prompts of varied length, half
  greedy and half seeded sampling; every arm starts with an empty prefix cache;
- W2 agents: multi-turn agent conversations (a shared system prompt, a growing history,
  tool results between turns), the agents' turns sent together; an empty prefix cache at
  the first turn;
- W3 long context: a few requests with long prompts at once (prefix cached by a warm-up);
- W4 one user: one code-generation request with a long prompt (prefix cached).

Before a workload's first repeat each engine runs it once untimed at its own defaults and
flushes its caches (``--no-warm-shapes`` skips that): an engine's first requests at a new
shape pay one-time costs (fresh memory for KV reads, entries and draft buffers) that would
otherwise land on whichever arm meets the shape first on its engine.

"best fixed" is the fastest of the swept (compressor, draft length) settings on that
workload in that repeat. Reported: tokens per second per arm, ratios, outputs compared
token by token with the off arm (greedy and seeded), the controller's counters.

    python benchmark/bench_adaptive.py --quick        # ~20-30 min on 2 cores
    python benchmark/bench_adaptive.py                # the issue's sizes (hours on 2 cores)
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark"))
from bench_decode import build_prompts, filler_text  # noqa: E402
from bench_spec import CPU_ENV, EngineProc, bench_main, first_divergence, make_log, preset_args, provenance  # noqa: E402

WORKLOADS = ("W1", "W2", "W3", "W4")
COUNTERS = ("plain_iterations", "spec_iterations", "rounds", "emitted_tokens", "compressor_switches",
            "predicted_step_seconds", "measured_step_seconds")


@dataclass(frozen=True)
class AdaptiveConfig:
    mode: str = "default"
    workloads: str = "W1,W2,W3,W4"
    repeats: int = 2
    w1_requests: int = 16
    w1_min_prompt: int = 200
    w1_max_prompt: int = 2000
    w1_new_tokens: int = 128
    w2_agents: int = 4
    w2_turns: int = 4
    w2_new_tokens: int = 32
    w3_requests: int = 4
    w3_context: int = 8000
    w3_new_tokens: int = 128
    w4_context: int = 2000
    w4_new_tokens: int = 128
    sweep: str = "kivi4:4,kivi4:8,kivi4:16,streamingllm:8,streamingllm:16"
    max_draft_len: int = 16
    warm_shapes: bool = True
    out: str = "benchmark/results/adaptive.json"


PRESETS = {
    "default": AdaptiveConfig(),
    "quick": AdaptiveConfig(mode="quick", repeats=2, w1_requests=8, w1_min_prompt=150, w1_max_prompt=600,
                            w1_new_tokens=32, w2_agents=2, w2_turns=3, w2_new_tokens=24, w3_context=4000,
                            w3_new_tokens=48, w4_context=1000, w4_new_tokens=64,
                            sweep="kivi4:8,streamingllm:8,streamingllm:16",
                            out="benchmark/results/adaptive_quick.json"),
}


def sweep_settings(cfg: AdaptiveConfig) -> list[tuple[str, int]]:
    out = []
    for item in cfg.sweep.split(","):
        name, _, d = item.partition(":")
        out.append((name.strip(), int(d)))
    return out


def check(parser, cfg: AdaptiveConfig) -> None:
    from sgl_vericache.mem_cache.compress.registry import available_compressors

    bad = [w for w in cfg.workloads.split(",") if w not in WORKLOADS]
    if bad:
        parser.error(f"--workloads {cfg.workloads!r}: {bad[0]} is not one of {', '.join(WORKLOADS)}")
    try:
        settings = sweep_settings(cfg)
    except ValueError:
        parser.error(f"--sweep {cfg.sweep!r}: expected compressor:draft_len,...")
    for name, d in settings:
        if name not in available_compressors() or not 1 <= d <= cfg.max_draft_len:
            parser.error(f"--sweep {name}:{d}: a compressor of {', '.join(available_compressors())} and a draft "
                         f"length from 1 to --max-draft-len {cfg.max_draft_len}")


# ---------------------------------------------------------------- engines and arms


def kv_tokens(cfg: AdaptiveConfig) -> int:
    """A KV pool that holds the largest workload's requests (and W2's histories) at once."""
    w2 = cfg.w2_agents * (1200 + cfg.w2_turns * (cfg.w2_new_tokens + 40))
    need = max(cfg.w1_requests * (cfg.w1_max_prompt + cfg.w1_new_tokens), w2,
               cfg.w3_requests * (cfg.w3_context + cfg.w3_new_tokens), cfg.w4_context + cfg.w4_new_tokens)
    return int(need * 1.3) + 2048


def start_engines(model_path: str, cfg: AdaptiveConfig) -> dict:
    from sgl_vericache.config import VeriCacheConfig

    pool = kv_tokens(cfg)
    spec = dict(speculative_algorithm="VERICACHE", speculative_num_draft_tokens=cfg.max_draft_len + 1,
                speculative_ngram_max_bfs_breadth=1, disable_overlap_schedule=True, max_total_tokens=pool)
    engines = {"off": EngineProc(model_path, dict(CPU_ENV), max_total_tokens=pool)}
    VeriCacheConfig(compressor="kivi4", draft_len=cfg.max_draft_len, adaptive=False).to_env()  # read by the child
    engines["fixed"] = EngineProc(model_path, dict(CPU_ENV), **spec)
    VeriCacheConfig(compressor="auto", draft_len=cfg.max_draft_len, adaptive=True).to_env()
    engines["adaptive"] = EngineProc(model_path, dict(CPU_ENV), **spec)
    for engine in engines.values():
        engine.wait_ready()
    return engines


def warm_up(engines: dict, tok) -> None:
    """One short batch per engine before any arm is timed: an engine's first requests pay
    one-time costs (allocations, first calls of each shape; 1.4-1.5x the time of the same
    run later at 7e7b127 and since, for off and VERICACHE alike), which would land on
    whichever arm runs first on it. Prefix caches are flushed after."""
    ids = build_prompts(tok, 200, 2)
    for engine in engines.values():
        engine.generate(ids, [{"max_new_tokens": 16, "temperature": 0}] * len(ids))
        # seeded sampling too: SGLang's multinomial_with_seed is torch.compile'd, and its first
        # call compiled for seconds inside W1's first arm on each engine (rep 0: defaults 21.5 s,
        # 13.7 s in rep 1, at 2f39552)
        engine.generate(ids, [{"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "sampling_seed": 7 + i}
                              for i in range(len(ids))])
        engine.flush_cache()


def arms(cfg: AdaptiveConfig) -> list[tuple[str, str, dict | None]]:
    """(arm name, engine, custom_params): off, the fixed defaults, each swept setting, adaptive."""
    out = [("off", "off", None), ("defaults", "fixed", None)]
    out += [(f"{c}:d{d}", "fixed", {"vericache_compressor": c, "vericache_draft_len": d}) for c, d in sweep_settings(cfg)]
    return out + [("adaptive", "adaptive", None)]


def with_custom(params: list[dict], custom) -> list[dict]:
    return [dict(p, custom_params=custom) if custom else p for p in params]


# ---------------------------------------------------------------- workloads


def _chat(tok, system: str, user: str) -> list[int]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


def w1_inputs(tok, cfg):
    n = cfg.w1_requests
    lengths = [cfg.w1_min_prompt + (cfg.w1_max_prompt - cfg.w1_min_prompt) * i // max(1, n - 1) for i in range(n)]
    ids = [build_prompts(tok, length, i + 1)[i] for i, length in enumerate(lengths)]
    params = [{"max_new_tokens": cfg.w1_new_tokens, "temperature": 0} if i % 2 == 0 else
              {"max_new_tokens": cfg.w1_new_tokens, "temperature": 0.7, "top_p": 0.9, "sampling_seed": 100 + i}
              for i in range(n)]
    return ids, params


def run_w1(engine, tok, cfg, custom, _):
    ids, params = w1_inputs(tok, cfg)
    outs, seconds = engine.generate(ids, with_custom(params, custom))
    return [o["output_ids"] for o in outs], seconds


def run_w2(engine, tok, cfg, custom, reference):
    """Agent turns: each agent's history grows by its answer and a tool result; the inputs
    of a later turn are the reference arm's (so every arm answers the same prompts)."""
    system = "You are a coding agent. Tools return JSON. " + filler_text(6)
    histories = [_chat(tok, system, f"Task {a}: write a function that parses tool result {a} and retries on error.")
                 for a in range(cfg.w2_agents)]
    outputs, seconds = [], 0.0
    for turn in range(cfg.w2_turns):
        params = [{"max_new_tokens": cfg.w2_new_tokens, "temperature": 0, "ignore_eos": True}] * cfg.w2_agents
        outs, s = engine.generate(histories, with_custom(params, custom))
        seconds += s
        got = [o["output_ids"] for o in outs]
        outputs += got
        basis = got if reference is None else reference[turn * cfg.w2_agents:(turn + 1) * cfg.w2_agents]
        tool = [tok(f"<|im_end|>\n<|im_start|>user\nTool result {turn}.{a}: {{\"status\": \"ok\", \"rows\": "
                    f"{7 * turn + a}}}. Continue.<|im_end|>\n<|im_start|>assistant\n",
                    add_special_tokens=False)["input_ids"] for a in range(cfg.w2_agents)]
        histories = [h + list(b) + t for h, b, t in zip(histories, basis, tool)]
    return outputs, seconds


def _cached_run(engine, ids, params):
    engine.generate(ids, [dict(params[0], max_new_tokens=1)] * len(ids))  # prefill: the prefix is cached after
    outs, seconds = engine.generate(ids, params)
    return [o["output_ids"] for o in outs], seconds


def run_w3(engine, tok, cfg, custom, _):
    ids = build_prompts(tok, cfg.w3_context, cfg.w3_requests)
    params = [{"max_new_tokens": cfg.w3_new_tokens, "temperature": 0, "ignore_eos": True}] * len(ids)
    return _cached_run(engine, ids, with_custom(params, custom))


def run_w4(engine, tok, cfg, custom, _):
    ids = build_prompts(tok, cfg.w4_context, 1)  # a code question over a code file
    params = [{"max_new_tokens": cfg.w4_new_tokens, "temperature": 0, "ignore_eos": True}]
    return _cached_run(engine, ids, with_custom(params, custom))


RUNNERS = {"W1": run_w1, "W2": run_w2, "W3": run_w3, "W4": run_w4}
# Workloads whose prompts arrive new: every arm starts from an empty prefix cache (the swept
# settings share one engine, which would otherwise find the earlier arms' prefixes cached).
COLD = ("W1", "W2")


# ---------------------------------------------------------------- run


def warm_shape(name, engines, tok, cfg, log) -> dict:
    """One untimed run of the workload per engine (each at its own defaults), then its caches
    flushed (the prefix cache and the compressed entries: nothing of it is reused). An
    engine's first requests at a new shape pay one-time costs: fresh memory for its KV reads,
    compressed entries and draft buffers (page faults; in the three-engine run at 4 x 4k the
    fixed engine's first round there took 8.0 s to set up, 1.4 s on the next arm and 0.05 s
    once warm, and the adaptive engine's 0.8 s where one engine alone takes 0.26 s). Without
    this they land on whichever arm meets the shape first on its engine: the defaults arm on
    the fixed engine, which warms it for every swept setting after it, and the adaptive arm,
    which has no such predecessor. The controller keeps what it learned here, as a running
    server keeps what earlier requests taught it. Returns each engine's seconds."""
    out = {}
    for engine_name, engine in engines.items():
        _, seconds = RUNNERS[name](engine, tok, cfg, None, None)
        if not engine.flush_cache():
            raise RuntimeError(f"{name} warm pass: the {engine_name} engine did not flush its caches")
        out[engine_name] = seconds
        log(f"{name} warm pass {engine_name}: {seconds:.2f} s (untimed)")
    return out


def run_workload(name, engines, tok, cfg, log) -> dict:
    arm_list = arms(cfg)
    rows = {arm: {"tok_s": [], "seconds": [], "identical": [], "counters": []} for arm, _, _ in arm_list}
    warm = warm_shape(name, engines, tok, cfg, log) if cfg.warm_shapes else {}
    reference = None
    for rep in range(cfg.repeats):
        order = arm_list[rep % len(arm_list):] + arm_list[:rep % len(arm_list)]
        order.sort(key=lambda a: a[0] != "off")  # the reference first: W2's inputs follow it
        for arm, engine_name, custom in order:
            engine = engines[engine_name]
            if name in COLD and not engine.flush_cache():
                raise RuntimeError(f"{name} {arm}: the engine did not flush its prefix cache")
            before = engine.vericache_state()
            outputs, seconds = RUNNERS[name](engine, tok, cfg, custom, reference)
            after = engine.vericache_state()
            if arm == "off":
                reference = outputs
            tokens = sum(len(o) for o in outputs)
            same = sum(first_divergence(o, r) is None for o, r in zip(outputs, reference))
            rows[arm]["tok_s"].append(tokens / seconds)
            rows[arm]["seconds"].append(seconds)
            rows[arm]["identical"].append([same, len(outputs)])
            rows[arm]["counters"].append(counter_diff(before, after))
            log(f"{name} rep {rep} {arm}: {tokens / seconds:.2f} tok/s, identical {same}/{len(outputs)}")
    return dict(summarize_workload(rows, cfg), warm_pass_seconds=warm)


def counter_diff(before: dict, after: dict) -> dict:
    """The controller's counters over one arm's run, with the requests planned per compressor
    (``compressor_requests``: auto's choices) and the rounds per draft length (``draft_steps``)."""
    out = {k: after[k] - before.get(k, 0) for k in COUNTERS if k in after}
    for key in ("compressor_requests", "draft_steps"):
        now, then = after.get(key) or {}, before.get(key) or {}
        diff = {k: v - then.get(k, 0) for k, v in now.items() if v - then.get(k, 0)}
        if diff:
            out[key] = diff
    return out


def summarize_workload(rows: dict, cfg) -> dict:
    reps = range(cfg.repeats)
    off = [rows["off"]["tok_s"][r] for r in reps]
    swept = [a for a in rows if a not in ("off", "adaptive")]
    best = [max(swept, key=lambda a: rows[a]["tok_s"][r]) for r in reps]
    ratio = lambda arm, base: [rows[arm]["tok_s"][r] / base[r] for r in reps]  # noqa: E731
    best_tok_s = [rows[best[r]]["tok_s"][r] for r in reps]
    return {"arms": rows, "best_fixed": best,
            "adaptive_vs_off": ratio("adaptive", off), "defaults_vs_off": ratio("defaults", off),
            "best_fixed_vs_off": [b / o for b, o in zip(best_tok_s, off)],
            "adaptive_vs_best_fixed": ratio("adaptive", best_tok_s),
            "all_identical": all(s == n for arm in rows.values() for s, n in arm["identical"])}


def run(cfg: AdaptiveConfig, model_path: str, save) -> dict:
    from transformers import AutoTokenizer

    t0 = time.time()
    log = make_log(t0)
    tok = AutoTokenizer.from_pretrained(model_path)
    result = {"mode": cfg.mode, "complete": False, "config": dataclasses.asdict(cfg), **provenance(model_path),
              "workloads": {}}
    log("starting engines (off, fixed, adaptive)")
    engines = start_engines(model_path, cfg)
    try:
        warm_up(engines, tok)
        for name in cfg.workloads.split(","):
            result["workloads"][name] = run_workload(name, engines, tok, cfg, log)
            result["wall_s"] = time.time() - t0
            save(result)
    finally:
        for engine in engines.values():
            engine.request_shutdown()
        for engine in engines.values():
            engine.shutdown()
    result["complete"] = True
    result["wall_s"] = time.time() - t0
    save(result)
    return result


# ---------------------------------------------------------------- output


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def table(result: dict) -> str:
    lines = ["| workload | off tok/s | defaults vs off | best fixed (setting) vs off | adaptive vs off | "
             "adaptive vs best fixed | identical |", "|---|---|---|---|---|---|---|"]
    for name, w in result["workloads"].items():
        spread = lambda xs: f"{_mean(xs):.2f}" + (f" ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else "")  # noqa: E731
        same = sum(s for a in w["arms"].values() for s, _ in a["identical"])
        total = sum(n for a in w["arms"].values() for _, n in a["identical"])
        lines.append(f"| {name} | {_mean(w['arms']['off']['tok_s']):.2f} | {spread(w['defaults_vs_off'])} | "
                     f"{spread(w['best_fixed_vs_off'])} ({', '.join(dict.fromkeys(w['best_fixed']))}) | "
                     f"{spread(w['adaptive_vs_off'])} | {spread(w['adaptive_vs_best_fixed'])} | {same}/{total} |")
    return "\n".join(lines)


def summary(result: dict) -> str:
    partial = "" if result.get("complete") else " (INCOMPLETE)"
    return f"bench_adaptive {result['mode']}{partial}, {result.get('wall_s', 0):.0f} s\n" + table(result)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    series = [("defaults", "defaults_vs_off"), ("best fixed", "best_fixed_vs_off"), ("adaptive", "adaptive_vs_off")]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(series)
    for k, (label, key) in enumerate(series):
        values = [_mean(result["workloads"][n][key]) for n in names]
        ax.bar([i + k * width for i in range(len(names))], values, width, label=label)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks([i + width for i in range(len(names))], names)
    ax.set(ylabel="tok/s / tok/s speculation off", title=f"Adaptive speculation ({result['mode']}, "
           f"{result['machine']['cores']} CPU cores, {Path(result['model']).name})")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse():
    return preset_args(__doc__, AdaptiveConfig, PRESETS, "the short preset (~20-30 min on 2 cores)",
                       PRESETS["default"].out, check)


if __name__ == "__main__":
    bench_main(parse, run, plot, summary)
