"""How often a draft over compressed KV agrees with full-KV greedy decoding.

For each compressor (droppers and Quest at 2x/4x/8x, quantizers at their bit widths) on
SmolLM2-135M-Instruct, fp32, over fixed chat / code / JSON-tool-call prompts:

  agreement   teacher-forced along the full-KV greedy continuation: at every position the
              draft model (attention over the compressed entry of the TRUE KV so far, its
              own token's KV uncompressed) predicts the next token; the share of positions
              where its argmax equals the full-KV token.
  acc_len@30  exact per-round VeriCache simulation: the compressed entry holds the
              verified tokens (appended with their true KV and queries after every round);
              the draft runs up to 30 steps over it plus its own provisional KV; a round
              yields the agreeing prefix + 1 (the verify pass's bonus token). Mean tokens
              per round; rounds cut short by the end of the continuation are left out.

The model forward is plain torch from the HF weights (Llama: RMSNorm, RoPE, GQA, SiLU MLP,
tied embeddings); `--check-hf` confirms its greedy tokens equal transformers'.

    python benchmark/bench_compressors.py --quick
    python benchmark/bench_compressors.py --out benchmark/results/compressors.json
    python benchmark/bench_compressors.py --compressors quest@4 quest@4:heads=query quest@1.3333 \
        --out benchmark/results/quest_heads.json          # chosen ones: name[@ratio][:option=value,...]
    python benchmark/bench_compressors.py --compressors int8 --int8-query \
        --out benchmark/results/int8_query.json           # + int8 as an int8_query GPU launch drafts
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from draft_sim import ChatTokenizer, Llama, Reference, agreement_pass, append_true, prompt_entry, round_pass  # noqa: E402
from sgl_vericache.mem_cache.compress import get_compressor  # noqa: E402
from sgl_vericache.mem_cache.compress.quant import Int8Compressor  # noqa: E402
from sgl_vericache.mem_cache.compress.registry import parse_options  # noqa: E402

TOOLS = (
    '[{"name": "get_weather", "description": "Weather forecast for a city", "parameters": '
    '{"city": "string", "date": "YYYY-MM-DD"}}, {"name": "send_email", "description": "Send an email", '
    '"parameters": {"to": "string", "subject": "string", "body": "string"}}, {"name": "search_restaurants", '
    '"parameters": {"cuisine": "string", "near": "string", "party_size": "integer", "time": "HH:MM"}}]'
)
TOOL_SYSTEM = (
    "You are an assistant that calls tools. Available tools: " + TOOLS + ". Answer ONLY with a JSON "
    'list of calls, each {"name": ..., "arguments": {...}}.'
)
PROMPTS = [  # (category, system or None, user); the first of each category runs in --quick
    ("chat", None, "Explain how a hash map works, step by step, and give an everyday analogy."),
    ("code", None, "Write a Python function that reads a CSV file and returns the average of every "
     "numeric column. Include a docstring, type hints and a short usage example."),
    ("json_tool_call", TOOL_SYSTEM, "Check the weather in Paris and in Tokyo for 2025-06-01, find an "
     "Italian restaurant near Union Square for 4 people at 19:30, and email the plan to alice@example.com."),
    ("chat", None, "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    ("code", None, "Implement a binary search tree class in Python with insert, search, delete and "
     "in-order traversal, then show a few example calls."),
    ("json_tool_call", TOOL_SYSTEM, "Email bob@example.com a summary of tomorrow's weather (2025-07-14) "
     "in Berlin, Madrid and Rome, with the subject 'Weekend trip'."),
]
QUANTIZERS = ["kivi4", "kivi2", "int8", "fp8"]
RATIO_METHODS = ["streamingllm", "snapkv", "h2o", "quest"]


@dataclass(frozen=True)
class BenchConfig:
    model_path: str
    gen_len: int = 256
    draft_len: int = 30
    ratios: tuple[float, ...] = (2.0, 4.0, 8.0)
    num_prompts: int = len(PROMPTS)
    out: str = "benchmark/results/compressors.json"
    check_hf: bool = False
    threads: int = 1
    compressors: tuple[str, ...] = ()  # specs "name[@ratio][:k=v,...]"; empty: every method (build_compressors)
    int8_query: bool = False  # each int8 also as Int8QueryTerms (a GPU int8_query launch's drafts)


# ---------------------------------------------------------------- orchestration


def build_compressors(ratios, variants: bool) -> list:
    """Paper defaults for every method; with `variants`, also KIVI with the 32-token
    full-precision window of DESIGN.md's calibration (the default 128 keeps most of a
    short chat in full precision)."""
    comps = [get_compressor("full")] + [get_compressor(n) for n in QUANTIZERS]
    if variants:
        comps += [get_compressor(n, residual_length=32) for n in ("kivi4", "kivi2")]
    return comps + [get_compressor(n, r) for n in RATIO_METHODS for r in ratios]


class Int8QueryTerms(Int8Compressor):
    """int8 as a GPU launch with LaunchConfig.int8_query drafts: the entry's keys met by the
    query's int8 terms, the provisional keys by the query itself
    (kernels.ops.int8_query_attention, the kernels' own twin)."""

    name = "int8(int8_query)"

    def attend(self, layer, q, scale, k_extra=None, v_extra=None):
        from sgl_vericache.kernels.ops import int8_query_attention  # imports Triton: only when asked

        return int8_query_attention(self, layer, q, scale, k_extra, v_extra)


def with_int8_query(comps: list) -> list:
    """Each int8 compressor followed by its Int8QueryTerms twin (same options)."""
    out = []
    for comp in comps:
        out.append(comp)
        if type(comp) is Int8Compressor:
            out.append(Int8QueryTerms(comp.config))
    return out


def parse_spec(spec: str):
    """"quest@4:heads=query,page_size=32" -> that compressor (options checked by the registry)."""
    head, _, opts = spec.partition(":")
    name, _, ratio = head.partition("@")
    try:
        value = float(ratio) if ratio else None
    except ValueError:
        raise ValueError(f"ratio {ratio!r} is not a number (e.g. quest@4)") from None
    return get_compressor(name.strip(), value, **parse_options(opts))


def label(comp) -> str:
    """e.g. "snapkv@4x", "kivi2(residual_length=32)": name, ratio, non-default options."""
    changed = series(comp).removeprefix(comp.name)
    return comp.name + ("" if comp.ratio is None else f"@{comp.ratio:g}x") + changed


def series(comp) -> str:
    """The name and non-default options, e.g. "quest(heads=query)": one line of the plot."""
    defaults = {s.name: s.default for s in comp.option_specs}
    changed = ",".join(f"{k}={v}" for k, v in comp.options.items() if v != defaults[k])
    return comp.name + (f"({changed})" if changed else "")


def reference_for(model, tokenizer, prompt, gen_len, eos) -> Reference:
    category, system, user = prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    ids = tokenizer.encode_chat(messages)
    continuation = model.greedy(ids, gen_len, eos)
    _, ks, vs, qs = model.forward_full(torch.tensor(ids + continuation))
    return Reference(ids + continuation, len(ids), ks, vs, qs)


def ratios_of(comp, ref: Reference) -> dict:
    """Achieved ratios of layer 0's entry holding the whole sequence (all layers match)."""
    entry = append_true(comp, prompt_entry(comp, ref, 0), ref, 0, ref.prompt_len, len(ref.ids))
    n, h, d = entry.num_tokens, entry.num_kv_heads, entry.head_dim
    gpu_read_ratio = comp.achieved_read_ratio(entry)
    if comp.name == "quest" and comp.options["heads"] == "query":  # GPU: the pages once per query head
        tokens_read = min(n, comp.pages_read(n) * comp.options["page_size"])
        gpu_read_ratio = n / (ref.q[0].shape[1] // h * tokens_read + comp.num_pages(n))
    return {
        "achieved_ratio": comp.achieved_ratio(entry),
        "achieved_read_ratio": comp.achieved_read_ratio(entry),
        "gpu_read_ratio": gpu_read_ratio,
        "achieved_ratio_fp16": comp.full_nbytes(n, h, d, torch.float16) / comp.nbytes_for(n, h, d, torch.float16),
    }


def make_progress(tag: str, every: int = 10):
    start, calls = time.time(), [0]

    def progress(done, total):
        calls[0] += 1
        if done >= total or calls[0] % every == 0:
            end = "\n" if done >= total else ""
            print(f"\r  {tag}: {done}/{total} ({time.time() - start:.0f}s)", end=end, flush=True)

    return progress


def run_prompt(model, tokenizer, prompt, cfg: BenchConfig, comps, eos) -> dict:
    t0 = time.time()
    ref = reference_for(model, tokenizer, prompt, cfg.gen_len, eos)
    gen = len(ref.ids) - ref.prompt_len
    print(f"[{prompt[0]}] prompt {ref.prompt_len} tok, full-KV greedy {gen} tok ({time.time() - t0:.0f}s)")
    hf_match = check_against_hf(cfg.model_path, prompt, ref, gen, eos) if cfg.check_hf else None
    agree = agreement_pass(model, ref, comps, make_progress("agreement, layers", every=5))
    rows = round_pass(model, ref, comps, cfg.draft_len, make_progress(f"rounds@{cfg.draft_len}"))
    results = {}
    for comp, hits, drafter in zip(comps, agree, rows):
        results[label(comp)] = {
            "agreement": sum(hits) / max(1, len(hits)),
            "acc_len": _mean(drafter.rounds),
            "rounds": drafter.rounds,
            "cut_rounds": drafter.cut_rounds,
            **ratios_of(comp, ref),
        }
    return {"category": prompt[0], "prompt_tokens": ref.prompt_len, "gen_tokens": gen,
            "hf_greedy_match": hf_match, "results": results}


def check_against_hf(model_path, prompt, ref: Reference, gen: int, eos) -> bool:
    """Same prompt ids from transformers' chat template, same greedy tokens from its generate."""
    _, system, user = prompt
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    hf_ids = AutoTokenizer.from_pretrained(model_path).apply_chat_template(messages, add_generation_prompt=True)
    hf_ids = list(hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids)
    if hf_ids != ref.ids[: ref.prompt_len]:
        print("  transformers' chat template gives different prompt ids")
        return False
    prompt = torch.tensor([hf_ids])
    out = hf.generate(prompt, max_new_tokens=gen, do_sample=False, eos_token_id=list(eos), pad_token_id=0)
    theirs, ours = out[0, ref.prompt_len :].tolist(), ref.ids[ref.prompt_len :]
    first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
    match = theirs == ours
    print(f"  transformers greedy {'matches' if match else f'differs (first at {first})'} ({len(theirs)} tok)")
    return match


def summarize(prompt_results: list[dict], comps) -> dict:
    table = {}
    for comp in comps:
        per = [p["results"][label(comp)] for p in prompt_results]
        rounds = [r for p in per for r in p["rounds"]]
        lower_bound = not rounds  # only rounds cut short (continuation shorter than a draft)
        rounds = rounds or [r for p in per for r in p["cut_rounds"]]
        table[label(comp)] = {
            "compressor": comp.name,
            "series": series(comp),
            "requested_ratio": comp.ratio,
            "options": dict(comp.options),
            "agreement": sum(p["agreement"] for p in per) / len(per),
            "acc_len": _mean(rounds),
            "acc_len_is_lower_bound": lower_bound,
            "achieved_ratio": sum(p["achieved_ratio"] for p in per) / len(per),
            "achieved_read_ratio": sum(p["achieved_read_ratio"] for p in per) / len(per),
            "gpu_read_ratio": sum(p.get("gpu_read_ratio", p["achieved_read_ratio"]) for p in per) / len(per),
            "achieved_ratio_fp16": sum(p["achieved_ratio_fp16"] for p in per) / len(per),
            "acc_len_histogram": {str(n): rounds.count(n) for n in sorted(set(rounds))},
            "by_category": {
                cat: {
                    "agreement": sum(p["agreement"] for p, r in zip(per, prompt_results) if r["category"] == cat)
                    / sum(1 for r in prompt_results if r["category"] == cat),
                    "acc_len": _mean([x for p, r in zip(per, prompt_results) if r["category"] == cat
                                      for x in p["rounds"]]),
                }
                for cat in sorted({r["category"] for r in prompt_results})
            },
        }
    return table


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def print_table(table: dict) -> None:
    print(f"\n{'compressor':<28}{'ratio':>7}{'read':>7}{'gpu':>7}{'fp16':>7}{'agree':>8}{'acc@30':>8}")
    for name, r in table.items():
        print(f"{name:<28}{r['achieved_ratio']:>7.2f}{r['achieved_read_ratio']:>7.2f}{r['gpu_read_ratio']:>7.2f}"
              f"{r['achieved_ratio_fp16']:>7.2f}{r['agreement']:>8.3f}{r['acc_len']:>8.2f}"
              + (" (>=, only cut rounds)" if r["acc_len_is_lower_bound"] else ""))


def plot(table: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in sorted({r.get("series", r["compressor"]) for r in table.values()} - {"full"}):
        pts = sorted((r.get("gpu_read_ratio", r["achieved_read_ratio"]), r["agreement"], r["acc_len"])
                     for r in table.values() if r.get("series", r["compressor"]) == name)
        for ax, i in zip(axes, (1, 2)):
            ax.plot([p[0] for p in pts], [p[i] for p in pts], marker="o", label=name)
    for ax, ylabel in zip(axes, ("per-token agreement", "acceptance length @30")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("achieved ratio (full KV / bytes a GPU draft step reads, model dtype)")
        ax.set_ylabel(ylabel), ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Draft over compressed KV vs full-KV greedy (SmolLM2-135M, fp32)")
    fig.tight_layout(), fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def machine_info() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()}


def git_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "benchmark", "python"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return (sha or "none") + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def default_model_path() -> str | None:
    try:
        from sgl_vericache.default_model import ensure_default_model
    except ImportError:
        return None
    return str(ensure_default_model())


def parse_args(argv=None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF Llama checkpoint dir (default: the embedded SmolLM2)")
    p.add_argument("--quick", action="store_true", help="3 prompts, 24 tokens, 4x only (< 60 s on 2 idle cores)")
    p.add_argument("--gen-len", type=int, default=None, help="continuation length (default 256, quick 24)")
    p.add_argument("--draft-len", type=int, default=30)
    p.add_argument("--out", default=None, help="JSON path (default benchmark/results/compressors[_quick].json)")
    p.add_argument("--check-hf", action="store_true", help="check our greedy tokens equal transformers'")
    p.add_argument("--compressors", nargs="+", default=(), metavar="SPEC",
                   help="only these, each name[@ratio][:option=value,...] (e.g. quest@4:heads=query); "
                        "the full-KV reference is always computed")
    p.add_argument("--int8-query", action="store_true",
                   help="each int8 compressor also drafted as a GPU launch with LaunchConfig.int8_query does "
                        "(the entry's keys against the query's int8 terms): row int8(int8_query)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 is fastest on a shared 2-core box (many tiny ops, no spin-wait)")
    a = p.parse_args(argv)
    model_path = a.model_path or default_model_path()
    if model_path is None:
        p.error("no --model-path and sgl_vericache.default_model is not available")
    for spec in a.compressors:
        try:
            parse_spec(spec)
        except ValueError as exc:
            p.error(f"--compressors {spec!r}: {exc}")
    quick_name = "benchmark/results/compressors_quick.json"
    return BenchConfig(
        model_path=model_path,
        gen_len=a.gen_len or (24 if a.quick else 256),
        draft_len=a.draft_len,
        ratios=(4.0,) if a.quick else (2.0, 4.0, 8.0),
        num_prompts=3 if a.quick else len(PROMPTS),
        out=a.out or (quick_name if a.quick else BenchConfig.out),
        check_hf=a.check_hf,
        threads=a.threads,
        compressors=tuple(a.compressors),
        int8_query=a.int8_query,
    )


def write_result(cfg: BenchConfig, prompt_results: list, comps: list, seconds: float, final: bool) -> dict:
    """Write the JSON (after every prompt, so a long run leaves partial results)."""
    table = summarize(prompt_results, comps)
    result = {"commit": git_commit(), "machine": machine_info(), "model": cfg.model_path, "dtype": "float32",
              "config": asdict(cfg), "complete": final, "seconds": seconds, "prompts": prompt_results,
              "table": table}
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return table


def summary_line(cfg: BenchConfig, table: dict, num_prompts: int, seconds: float) -> str:
    cells = " | ".join(f"{name} {r['agreement']:.2f}/{r['acc_len']:.1f}" for name, r in table.items())
    return (f"SUMMARY compressors ({num_prompts} prompts x {cfg.gen_len} tok, agreement/acc_len@{cfg.draft_len}, "
            f"{seconds:.0f}s): {cells}")


def main(argv=None) -> None:
    cfg = parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(cfg.threads)
    start = time.time()
    model, tokenizer = Llama(Path(cfg.model_path)), ChatTokenizer(Path(cfg.model_path))
    eos = model.cfg.get("eos_token_id", [])
    eos = ({eos} if isinstance(eos, int) else set(eos)) | {tokenizer.eos_token_id} - {None}
    comps = ([parse_spec(s) for s in cfg.compressors] if cfg.compressors
             else build_compressors(cfg.ratios, variants=cfg.num_prompts > 3))
    if cfg.int8_query:
        comps = with_int8_query(comps)
    prompts = PROMPTS[: cfg.num_prompts]
    print(f"{len(comps)} compressors x {len(prompts)} prompts, {cfg.gen_len} tokens, draft {cfg.draft_len}")
    prompt_results = []
    for i, prompt in enumerate(prompts):
        prompt_results.append(run_prompt(model, tokenizer, prompt, cfg, comps, eos))
        table = write_result(cfg, prompt_results, comps, time.time() - start, final=i == len(prompts) - 1)
    print_table(table)
    plot(table, Path(cfg.out).with_suffix(".png"))
    print(f"json: {cfg.out}")
    print(summary_line(cfg, table, len(prompts), time.time() - start))


if __name__ == "__main__":
    main()
