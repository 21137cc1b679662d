"""Acceptance length at long context, per prompt category (issue 6's second target).

One VERICACHE engine (SmolLM2-135M-Instruct, CPU, fp32, greedy) prefills ``--prompts``
prompts of ``--context`` tokens (code and tool-call questions alternating, the same
prompts as bench_decode.py) once, then generates up to ``--max-new-tokens`` for them with
each compressor (ratio 4, ``--draft-len``) through ``custom_params``: later compressors hit
the radix cache, so each prompt is prefilled once. No speculation-off arm: acceptance
does not need one, and outputs are checked against speculation off by bench_decode.py and
the exactness tests.

Acceptance length = tokens a verify round yields (accepted drafts + the bonus token), from
SGLang's per-request ``spec_correct_drafts_histogram`` (correct drafts -> rounds): it counts
what the verify accepted, before max_new_tokens or a stop cut the last round, so it is not
lowered by where the generation ends. Reported per request, per category (code, tool) and
pooled over rounds. ``spec_accept_length`` (emitted tokens / rounds, prefill token included)
is kept beside it.

    python benchmark/bench_acceptance.py --quick      # 1k context, 2 prompts, 32 tokens, d=8
    python benchmark/bench_acceptance.py --context 7900 --prompts 4 --max-new-tokens 256 \\
        --draft-len 30 --compressors streamingllm,snapkv --out benchmark/results/acceptance_d30_8k.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import MODEL_MAX_LEN, DecodeEngine, build_prompts  # noqa: E402
from bench_spec import COMPRESSORS, ROOT, make_log, provenance  # noqa: E402


def round_lengths(hist: list[int]) -> list[int]:
    """Tokens per round (correct drafts + 1) for each round of a histogram."""
    return [k + 1 for k, rounds in enumerate(hist) for _ in range(rounds)]


def summarize(rows: list[dict]) -> dict:
    """Pooled mean acceptance length over rounds, per compressor and per category."""
    out = {}
    for row in rows:
        for key in (row["compressor"], f"{row['compressor']}/{row['category']}"):
            out.setdefault(key, []).extend(round_lengths(row["hist"]))
    return {key: {"rounds": len(lens), "mean_acc_len": sum(lens) / len(lens)} for key, lens in out.items() if lens}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1k context, 2 prompts, 32 tokens, streamingllm d=8")
    p.add_argument("--context", type=int, default=7900, help="prompt tokens (default 7900: + 256 new fits 8192)")
    p.add_argument("--prompts", type=int, default=4, help="prompts, code and tool-call alternating (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--draft-len", type=int, default=30)
    p.add_argument("--compressors", default="streamingllm,snapkv", help="comma-separated, each at ratio 4")
    p.add_argument("--out", default=None, help="JSON path (default benchmark/results/acceptance.json; "
                                               "--quick: acceptance_quick.json)")
    args = p.parse_args()
    if args.quick:
        args.context, args.prompts, args.max_new_tokens, args.draft_len = 1024, 2, 32, 8
        args.compressors = "streamingllm"
    comps = [c.strip() for c in args.compressors.split(",") if c.strip()]
    bad = [c for c in comps if c not in COMPRESSORS]
    if bad or not comps:
        p.error(f"--compressors {args.compressors!r}: each must be one of {', '.join(COMPRESSORS)}")
    if not 1 <= args.draft_len <= 64:
        p.error(f"--draft-len {args.draft_len} is out of range: 1..64")
    if args.prompts < 1 or args.max_new_tokens < 1:
        p.error("--prompts and --max-new-tokens must be at least 1")
    if args.context + args.max_new_tokens + args.draft_len + 1 > MODEL_MAX_LEN:
        p.error(f"--context {args.context} + --max-new-tokens {args.max_new_tokens} + --draft-len "
                f"{args.draft_len} + 1 exceeds the model's {MODEL_MAX_LEN} tokens")
    args.compressors = comps
    args.out = Path(args.out or ROOT / "benchmark" / "results" /
                    ("acceptance_quick.json" if args.quick else "acceptance.json"))
    return args


def main() -> None:
    from transformers import AutoTokenizer

    from sgl_vericache.config import VeriCacheConfig
    from sgl_vericache.default_model import ensure_default_model

    args = parse_args()
    log = make_log(time.time())
    model_path = str(ensure_default_model())
    ids = build_prompts(AutoTokenizer.from_pretrained(model_path), args.context, args.prompts)
    VeriCacheConfig(compressor=args.compressors[0], ratio=4.0, draft_len=args.draft_len).to_env()
    log(f"{args.prompts} prompts x {args.context} tokens, d={args.draft_len}, {args.compressors}; starting the engine")
    engine = DecodeEngine(model_path, {"SGLANG_USE_CPU_ENGINE": "1"}, speculative_algorithm="VERICACHE",
                          speculative_num_draft_tokens=args.draft_len + 1, speculative_ngram_max_bfs_breadth=1,
                          disable_overlap_schedule=True,
                          max_total_tokens=args.prompts * (args.context + args.max_new_tokens + args.draft_len + 64))
    rows = []
    try:
        engine.wait_ready()
        _, seconds, _ = engine.generate(ids, {"max_new_tokens": 1, "temperature": 0})
        log(f"prefill {seconds:.0f} s")
        for comp in args.compressors:
            params = {"max_new_tokens": args.max_new_tokens, "temperature": 0,
                      "custom_params": {"vericache_compressor": comp, "vericache_ratio": 4.0,
                                        "vericache_draft_len": args.draft_len}}
            outs, seconds, _ = engine.generate(ids, params)
            for i, out in enumerate(outs):
                meta = out["meta_info"]
                hist = list(meta.get("spec_correct_drafts_histogram") or [])
                lens = round_lengths(hist)
                rows.append({"compressor": comp, "prompt": i, "category": "code" if i % 2 == 0 else "tool",
                             "tokens": len(out["output_ids"]), "rounds": len(lens), "hist": hist,
                             "mean_acc_len": sum(lens) / len(lens) if lens else None,
                             "spec_accept_length": meta.get("spec_accept_length"),
                             "finish": meta.get("finish_reason")})
            log(f"{comp}: {seconds:.0f} s; acceptance length per prompt "
                f"{[round(r['mean_acc_len'] or 0, 1) for r in rows if r['compressor'] == comp]}")
    finally:
        engine.shutdown()
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              **provenance(model_path), "rows": rows, "summary": summarize(rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for key, s in result["summary"].items():
        log(f"{key:<22} mean acceptance length {s['mean_acc_len']:5.2f} over {s['rounds']} rounds")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
