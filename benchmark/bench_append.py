"""What a round's end costs each request per layer: ``compressor.append`` of the round's
verified tokens, for every compressor, at long context (no engine, one thread).

Two ways per compressor and context, interleaved rep by rep so both see the same machine:
  in_place  append to the entry the last append returned, as ``CompressedKVStore.sync``
            does: entries that only gain rows write them into spare rows
            (``mem_cache/compress/rows.py``)
  copy      the same chain of appends, each to a copy of the entry whose tensors have no
            spare rows (the copy made outside the timer): every row is copied into a new
            buffer, which is what every append did before entries grew in place (and what
            an entry that another request has already grown past costs)
SnapKV and H2O re-choose their kept tokens at every append, a copy of the kept rows either
way (the copy arm adds the join of the new tokens that in place writes into spare rows);
StreamingLLM's one copy is the same either way. Times are means over ``--reps`` (the amortized cost, KIVI's group flushes and the
spare rows' reallocations included), with the median and the range beside them; one layer,
SmolLM2-135M's shape by default (3 KV heads of 64, fp32). The copy arm's entry was just
copied, so it starts warmer in the caches: at short contexts that favours it.

    python benchmark/bench_append.py                     # 8k and 32k, every compressor, ~1 min
    python benchmark/bench_append.py --contexts 131072 --compressors int8,kivi4 --out /tmp/a.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from sgl_vericache.mem_cache.compress import available_compressors, get_compressor
from sgl_vericache.mem_cache.compress.rows import plain_copy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def bench(name: str, context: int, heads: int, head_dim: int, q_heads: int, dtype: torch.dtype, tokens: int,
          reps: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    comp = get_compressor(name)
    queries = rand(64, q_heads, head_dim) if comp.needs_queries else None
    first = comp.compress(rand(context, heads, head_dim), rand(context, heads, head_dim), queries)
    new_k, new_v = rand(tokens, heads, head_dim), rand(tokens, heads, head_dim)  # no queries: the store's sync
    grown = copied = comp.append(first, new_k, new_v)
    times = {"in_place": [], "copy": []}
    for _ in range(reps):
        def grow():
            nonlocal grown
            grown = comp.append(grown, new_k, new_v)

        def copy(plain=plain_copy(copied)):  # the same entry, its tensors plain copies (untimed)
            nonlocal copied
            copied = comp.append(plain, new_k, new_v)

        times["in_place"].append(_time(grow))
        times["copy"].append(_time(copy))
    row = {"compressor": name, "context": context, "tokens": tokens, "grows_in_place": comp.grows_in_place,
           "entry_bytes": first.nbytes()}
    for way, ts in times.items():  # the mean is the amortized cost: group flushes, reallocations
        row[f"{way}_ms"] = round(statistics.fmean(ts), 4)
        row[f"{way}_ms_median"] = round(statistics.median(ts), 4)
        row[f"{way}_ms_range"] = [round(min(ts), 4), round(max(ts), 4)]
    row["speedup"] = round(row["copy_ms"] / row["in_place_ms"], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="8192,32768", help="tokens already in the entry, comma-separated")
    ap.add_argument("--compressors", default=",".join(available_compressors()))
    ap.add_argument("--tokens", type=int, default=8, help="verified tokens a round appends")
    ap.add_argument("--heads", type=int, default=3, help="KV heads")
    ap.add_argument("--q-heads", type=int, default=9, help="query heads (SnapKV / H2O score the prompt with them)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmark/results/append.json")
    args = ap.parse_args()
    names = [n for n in args.compressors.split(",") if n]
    unknown = sorted(set(names) - set(available_compressors()))
    if unknown:
        ap.error(f"--compressors: unknown {', '.join(unknown)}; accepted: {', '.join(available_compressors())}")
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        ap.error(f"--contexts {args.contexts!r}: accepted: comma-separated token counts")
    if not contexts or min(contexts) < 1 or args.tokens < 1 or args.reps < 1 or args.heads < 1 \
            or args.q_heads % args.heads or args.head_dim < 1 or args.threads < 1:
        ap.error("accepted: contexts, --tokens, --reps, --heads, --head-dim, --threads >= 1 and --q-heads a "
                 "multiple of --heads")
    torch.set_num_threads(args.threads)
    rows = []
    for context in contexts:
        for name in names:
            row = bench(name, context, args.heads, args.head_dim, args.q_heads, DTYPES[args.dtype], args.tokens,
                        args.reps)
            rows.append(row)
            print(f"{name:12s} {context:7d} tokens: append {row['in_place_ms']:8.3f} ms in place, "
                  f"{row['copy_ms']:8.3f} ms copying ({row['speedup']:.1f}x)", flush=True)
    result = {"what": "compressor.append of a round's verified tokens, one layer: in place vs every row copied",
              "command": "python benchmark/bench_append.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
              "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                          "torch": torch.__version__},
              "shape": {"kv_heads": args.heads, "q_heads": args.q_heads, "head_dim": args.head_dim,
                        "dtype": args.dtype},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
