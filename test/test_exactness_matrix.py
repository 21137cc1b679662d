"""The full exactness matrix (``slow``): every compressor at 4x x draft lengths 1/4/16/30 x
batch 1 and 4 concurrent, 24 prompts (chat, code, JSON tool calls) x 256 new tokens, greedy,
fp32, SmolLM2-135M on CPU; token ids against the same engine with speculation off. One
VERICACHE engine per draft length d (verify width d + 1, as ``--vericache-draft-len d``
serves), every compressor through per-request overrides.

    VERICACHE_SLOW=1 ./scripts/test.sh test/test_exactness_matrix.py -s

On this 2-core CPU the matrix takes many hours (each config is 6,144 generated tokens, and
a draft step costs about as much as a decode step at these short contexts), so it is
resumable: every finished configuration is written at once to the results file
(``VERICACHE_MATRIX_RESULTS``, default ``benchmark/results/exactness_matrix.json``) with a
fingerprint of the code and package versions, and a rerun skips the configurations already
done under the same fingerprint. The speculation-off reference is computed once per
fingerprint and stored there too. Any change to ``python/sgl_vericache`` or the prompts
starts the matrix afresh. Progress goes to the terminal (``-s``). The test fails if any
output differs from the reference; the report names the prompt, the configuration, the
first divergent index and the reference's top-2 logprob margin there.

Shards: ``VERICACHE_MATRIX_SHARD=k/n`` runs only the configurations whose index (in the
fixed order draft length, batch, compressor) is k mod n, each shard with its own results
file and its own reference. On this 2-core machine two shards with ``OMP_NUM_THREADS=1``
each finish ~1.25x sooner than one run on both cores. ``python test/test_exactness_matrix.py
FILE...`` prints the table of one or more results files (and says which configurations
are missing).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prompts import prompt_set
from test_exactness import (COMPRESSORS, DRAFT_LENS, _engine, _input_ids, first_divergence,
                            reference_outputs, run_configs)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 256
BATCHES = [4, 1]  # batch 4 first: it is faster
RESULTS = Path(os.environ.get("VERICACHE_MATRIX_RESULTS", ROOT / "benchmark" / "results" / "exactness_matrix.json"))


def all_configs() -> list[tuple[str, int, int]]:
    """Every (compressor, draft_len, batch) of the matrix, in the order it runs."""
    return [(c, d, b) for d in DRAFT_LENS for b in BATCHES for c in COMPRESSORS]


def parse_shard(text: str) -> tuple[int, int]:
    """``"k/n"`` -> (k, n) with 0 <= k < n; anything else is refused with the accepted form."""
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"VERICACHE_MATRIX_SHARD={text!r}: expected k/n with integers 0 <= k < n, e.g. 0/2") from None
    if not (n >= 1 and 0 <= k < n):
        raise ValueError(f"VERICACHE_MATRIX_SHARD={text!r}: expected k/n with 0 <= k < n and n >= 1, e.g. 0/2")
    return k, n


def shard_configs(shard: str | None) -> list[tuple[str, int, int]]:
    configs = all_configs()
    if not shard:
        return configs
    k, n = parse_shard(shard)
    return [c for i, c in enumerate(configs) if i % n == k]


def fingerprint() -> str:
    """Hash of everything that decides the matrix's outputs: our package, the prompts, this
    file, and the versions of SGLang and torch."""
    from importlib.metadata import version

    h = hashlib.sha256()
    files = sorted((ROOT / "python" / "sgl_vericache").rglob("*.py"))
    files += [ROOT / "test" / "prompts.py", ROOT / "test" / "test_exactness.py", Path(__file__)]
    for path in files:
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    h.update(f"sglang={version('sglang')} torch={version('torch')}".encode())
    return h.hexdigest()[:16]


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "python", "test"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip()[:12] + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_results(fp: str) -> dict:
    """The results file's content for fingerprint ``fp``; a file written under another
    fingerprint (or none) gives a fresh record."""
    if RESULTS.exists():
        data = json.loads(RESULTS.read_text())
        if data.get("fingerprint") == fp:
            return data
    return {"fingerprint": fp, "max_new_tokens": MAX_NEW_TOKENS, "reference": None, "rows": []}


def save_results(data: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, RESULTS)  # an interrupted run never leaves a torn file


def compare(names, outs, ref_ids, ref_top2):
    """Per prompt: identical or the first divergent index (with the reference's top-2
    logprob margin there)."""
    divergent, accept = [], []
    for name, out, expected, top2 in zip(names, outs, ref_ids, ref_top2):
        accept.append(out["meta_info"].get("spec_accept_length"))
        idx = first_divergence(out["output_ids"], expected)
        if idx is not None:
            margin = top2[idx][0] - top2[idx][1] if idx < len(top2) and len(top2[idx]) == 2 else None
            divergent.append({"prompt": name, "index": idx, "ours": out["output_ids"][idx:idx + 3],
                              "reference": expected[idx:idx + 3], "top2_margin": margin})
    return divergent, accept


def table(rows) -> str:
    lines = ["| compressor | draft len | batch | identical | mean acceptance length | seconds |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["batch"], COMPRESSORS.index(r["compressor"]), r["draft_len"])):
        lines.append(f"| {r['compressor']} | {r['draft_len']} | {r['batch']} | {r['identical']}/{r['prompts']} | "
                     f"{r['mean_acc_len']:.2f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


@pytest.mark.timeout(48 * 3600)  # hours by design (the suite's default is 40 min per test)
def test_full_matrix(default_model_path, capsys):
    prompts = prompt_set(8)
    assert len(prompts) >= 20, "the matrix needs at least 20 prompts"
    names = [name for name, _ in prompts]
    mine = shard_configs(os.environ.get("VERICACHE_MATRIX_SHARD"))  # a bad value fails here, before any work
    ids = _input_ids(default_model_path, prompts)
    fp = fingerprint()
    data = load_results(fp)

    def say(msg):
        with capsys.disabled():
            print(f"[matrix {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    if data["reference"] is None or data["reference"]["input_ids"] != ids:
        say(f"speculation-off reference: {len(ids)} prompts x {MAX_NEW_TOKENS} tokens")
        t0 = time.perf_counter()
        ref = reference_outputs(default_model_path, ids, MAX_NEW_TOKENS)
        data.update(reference={"input_ids": ids, "output_ids": list(ref), "top2": ref.top2,
                               "seconds": time.perf_counter() - t0}, rows=[])
        save_results(data)
    ref_ids, ref_top2 = data["reference"]["output_ids"], data["reference"]["top2"]

    done = {(r["compressor"], r["draft_len"], r["batch"]) for r in data["rows"]}
    total = len(mine)
    say(f"fingerprint {fp}: {len(done & set(mine))}/{total} configurations done -> {RESULTS}"
        + (f" (shard {os.environ['VERICACHE_MATRIX_SHARD']} of the matrix's {len(all_configs())})"
           if total < len(all_configs()) else ""))
    from sgl_vericache.config import VeriCacheConfig

    # One engine per draft length, its verify width = draft length + 1: what a server started
    # with --vericache-draft-len d runs; per-request overrides below the server's width are
    # the CI subset's job.
    for draft_len in DRAFT_LENS:
        todo = [(c, b) for c, d, b in mine if d == draft_len and (c, d, b) not in done]
        if not todo:
            continue
        VeriCacheConfig(compressor="kivi4", ratio=4.0, draft_len=draft_len).to_env()
        engine = _engine(default_model_path, speculative_algorithm="VERICACHE",
                         speculative_num_draft_tokens=draft_len + 1,
                         speculative_ngram_max_bfs_breadth=1, disable_overlap_schedule=True)
        try:
            for comp, batch in todo:
                t0 = time.perf_counter()
                outs = run_configs(engine, ids, [(comp, draft_len)] * len(ids), MAX_NEW_TOKENS, batch=batch)
                seconds = time.perf_counter() - t0
                divergent, accept = compare(names, outs, ref_ids, ref_top2)
                row = {"compressor": comp, "ratio": 4.0, "draft_len": draft_len, "batch": batch,
                       "prompts": len(ids), "identical": len(ids) - len(divergent), "divergent": divergent,
                       "mean_acc_len": sum(a or 0 for a in accept) / len(accept), "acc_len_per_prompt": accept,
                       "tokens": sum(len(o["output_ids"]) for o in outs), "seconds": seconds, "commit": _commit()}
                data["rows"].append(row)
                save_results(data)
                say(f"{comp} draft_len={draft_len} batch={batch}: identical {row['identical']}/{len(ids)}, "
                    f"mean acceptance {row['mean_acc_len']:.2f}, {seconds:.0f} s "
                    f"({len(data['rows'])}/{total} done)")
        finally:
            engine.shutdown()

    say("\n" + table(data["rows"]))
    failures = [f"prompt {d['prompt']} [{r['compressor']}, draft_len={r['draft_len']}, batch={r['batch']}]: "
                f"first divergent index {d['index']}: ours {d['ours']} vs ref {d['reference']}, "
                f"reference top-2 logprob margin there {d['top2_margin']}"
                for r in data["rows"] for d in r["divergent"]]
    assert not failures, "\n".join(failures)
    assert set(mine) <= {(r["compressor"], r["draft_len"], r["batch"]) for r in data["rows"]}


def merged_report(paths) -> str:
    """The table over several results files (shards), with the configurations none has."""
    rows, prints = [], set()
    for path in paths:
        data = json.loads(Path(path).read_text())
        prints.add(data["fingerprint"])
        rows += data["rows"]
    got = {(r["compressor"], r["draft_len"], r["batch"]) for r in rows}
    missing = [c for c in all_configs() if c not in got]
    n_prompts = sum(r["prompts"] for r in rows)
    n_same = sum(r["identical"] for r in rows)
    lines = [table(rows), "",
             f"{len(got)}/{len(all_configs())} configurations, {n_same}/{n_prompts} outputs identical; "
             f"fingerprints {sorted(prints)}, commits {sorted({r.get('commit') for r in rows})}"]
    if missing:
        lines.append("missing: " + ", ".join(f"{c} d={d} b={b}" for c, d, b in missing))
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python test/test_exactness_matrix.py RESULTS.json [RESULTS.json ...]")
    print(merged_report(sys.argv[1:]))
