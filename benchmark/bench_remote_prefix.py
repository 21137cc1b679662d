"""Remote prefix reuse (the paper's second scenario, issue 5): agents come back after their
prefix has left the device and host tiers and lives only in a remote store; VERICACHE
drafts from the prefix's compressed entry while the full entry streams in.

SmolLM2-135M-Instruct on CPU, fp32, greedy. Three offline engines side by side, each in a
child process of its own, started with the same flags: CPU, torch_native attention,
``--enable-hierarchical-cache`` with a device pool and a host tier too small for the
agents, and a remote tier: SGLang's ``file`` backend read at ``store_mb_per_s``
(``throttled_store.ThrottledFile``; writes are not slowed), prefetch policy
``wait_complete``. Arms:

- ``off``: speculation off (SGLang + HiCache);
- ``vericache``: VERICACHE with ``--vericache-fetch-draft-tokens 0`` (a request waits for
  its prefix idle, as SGLang makes every request wait);
- ``fetch_draft``: VERICACHE drafting while the prefix streams in (the default, 64). With
  ``--compressed-cache-mb 1`` its compressed prefix cache holds no conversation's entry: each
  goes to the same store, and is read back (through the same throttle) before drafting starts
  when it is expected to land within ``--tier-fraction`` of the full prefix's fetch
  (``--vericache-fetch-draft-tier-fraction``; 1: always).

The trace: ``agents`` agents share a system prompt; each first turn carries a tool result of
about ``tool_tokens`` (different per agent); after all first turns, each agent's second turn
(its first turn, the answer, a new request) finds its prefix in the remote store only (the
tiers hold about two agents' contexts). Each request runs on the three engines back to back,
the arms taking turns going first (an engine's write-through to its store runs on after its
request, on the same two cores).
Per request: wall seconds (prefetch, prefill and decode), hit tokens per tier, whether the
output equals ``off``'s, and for the VERICACHE arms the fetch-drafting counters. The
summary compares second turns: mean seconds per arm, speedups, the seconds the fetch took
(storage hit tokens x bytes per token / bandwidth), drafts made while waiting and how many
verify accepted.

On this CPU a 135M model decodes a token in ~30-60 ms and its full KV is 46 KB per token,
so at 20 MB/s a 1000-token prefix takes ~2.3 s to fetch, several decode rounds' time: the
regime of a large model's long prefix on a datacenter link (Llama-70B fp16: 320 KB per
token, 32k tokens at 3 GB/s = 3.5 s). The bandwidth is a flag.

    python benchmark/bench_remote_prefix.py --quick
    python benchmark/bench_remote_prefix.py --out benchmark/results/remote_prefix.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also where the engines import throttled_store from
from bench_decode import DecodeEngine, filler_text  # noqa: E402
from bench_spec import bench_main, check_compressor, first_divergence, make_log, preset_args, provenance  # noqa: E402
from bench_tiers import TIERS, kv_bytes_per_token, system_prompt  # noqa: E402

ARMS = ("off", "vericache", "fetch_draft")
FETCH_COUNTERS = ("fetch_draft_requests", "fetch_draft_steps", "fetch_draft_seconds", "fetch_draft_tokens",
                  "fetch_draft_rounds", "fetch_draft_accepted", "rounds", "emitted_tokens",
                  "fetch_draft_tier_entries", "fetch_draft_tier_skipped", "compressed_tier_spilled_entries",
                  "compressed_tier_fetches",
                  "compressed_tier_fetched_bytes", "compressed_tier_fetch_seconds")


@dataclass(frozen=True)
class RemoteConfig:
    mode: str
    agents: int = 6
    tool_tokens: int = 600  # tool result in each agent's first turn (about)
    max_new_tokens: int = 32
    device_tokens: int = 1024
    host_ratio: float = 2.0
    store_mb_per_s: float = 20.0
    compressor: str = "kivi4"
    compressor_options: str = ""  # e.g. residual_length=32 (--vericache-compressor-options)
    draft_len: int = 8
    fetch_draft_tokens: int = 64
    # the fetch_draft arm's compressed prefix cache (MiB; VeriCache's default is 512); 1: every entry
    # goes to the store and is read back
    compressed_cache_mb: int = 512
    # the fetch_draft arm's --vericache-fetch-draft-tier-fraction (-1: VeriCache's default)
    tier_fraction: float = dataclasses.field(default=-1.0, metadata={"min": -1.0})
    out: str = "benchmark/results/remote_prefix.json"


PRESETS = {
    "quick": RemoteConfig("quick", agents=4, tool_tokens=400, max_new_tokens=16, device_tokens=768,
                          out="benchmark/results/remote_prefix_quick.json"),
    "default": RemoteConfig("default"),
}


def vericache_options(cfg: RemoteConfig) -> dict:
    """The VeriCacheConfig fields both VERICACHE arms share."""
    return dict(compressor=cfg.compressor, ratio=4.0, draft_len=cfg.draft_len,
                compressor_options=cfg.compressor_options)


def check_config(parser, cfg: RemoteConfig) -> None:
    """``preset_args``' check: what VeriCacheConfig itself would refuse, refused at the
    command line (a bad compressor, its options, the tier fraction)."""
    from sgl_vericache.config import VeriCacheConfig

    check_compressor(parser, cfg)
    if cfg.tier_fraction > 1:
        parser.error(f"--tier-fraction {cfg.tier_fraction} is out of range; accepted: 0 to 1, or -1 for "
                     "VeriCache's default")
    try:
        VeriCacheConfig(**vericache_options(cfg)).build_compressor()
    except ValueError as e:
        parser.error(str(e))


def start_engines(model_path: str, cfg: RemoteConfig, storage_root: Path):
    from sgl_vericache.config import VeriCacheConfig

    env = {"SGLANG_USE_CPU_ENGINE": "1"}

    def flags(arm):
        store = {"backend_name": "throttled_file", "module_path": "throttled_store", "class_name": "ThrottledFile",
                 "file_storage_path": str(storage_root / arm), "throttle_mb_per_s": cfg.store_mb_per_s}
        return dict(max_total_tokens=cfg.device_tokens, enable_hierarchical_cache=True, hicache_ratio=cfg.host_ratio,
                    hicache_io_backend="kernel", hicache_mem_layout="page_first", hicache_storage_backend="dynamic",
                    hicache_storage_backend_extra_config=json.dumps(store),
                    hicache_storage_prefetch_policy="wait_complete")

    spec = dict(speculative_algorithm="VERICACHE", speculative_num_draft_tokens=cfg.draft_len + 1,
                speculative_ngram_max_bfs_breadth=1, disable_overlap_schedule=True)
    engines = {"off": DecodeEngine(model_path, env, **flags("off"))}
    default_mb = VeriCacheConfig().compressed_cache_mb  # the vericache arm keeps the product's default
    for arm, fetch, mb in (("vericache", 0, default_mb), ("fetch_draft", cfg.fetch_draft_tokens,
                                                           cfg.compressed_cache_mb)):
        VeriCacheConfig(**vericache_options(cfg), fetch_draft_tokens=fetch, compressed_cache_mb=mb,
                        **({"fetch_draft_tier_fraction": cfg.tier_fraction} if fetch and cfg.tier_fraction >= 0
                           else {})).to_env()
        engines[arm] = DecodeEngine(model_path, env, **flags(arm), **spec)
    common = {k: v for k, v in flags("off").items() if k != "hicache_storage_backend_extra_config"}
    return engines, common


def run(cfg: RemoteConfig, model_path: str, save) -> dict:
    from transformers import AutoTokenizer

    log = make_log(time.time())
    tok = AutoTokenizer.from_pretrained(model_path)
    per_token = kv_bytes_per_token(model_path)
    with tempfile.TemporaryDirectory(prefix="vericache-remote-") as storage:
        log(f"starting three engines ({', '.join(ARMS)}), remote store read at {cfg.store_mb_per_s} MB/s")
        engines, common = start_engines(model_path, cfg, Path(storage))
        try:
            for engine in engines.values():
                engine.wait_ready()
            warm = tok.encode("Warm-up before the trace: count from one to twenty.")
            for engine in engines.values():
                engine.generate([warm], {"max_new_tokens": 8, "temperature": 0})
            log("engines ready and warmed up")
            result = {**provenance(model_path), "config": dataclasses.asdict(cfg), "engine_flags": common,
                      "kv_bytes_per_token": per_token, "requests": []}
            chats = [[{"role": "system", "content": system_prompt()}] for _ in range(cfg.agents)]
            blocks = max(1, round(cfg.tool_tokens / 200))  # filler_text: ~200 tokens a block
            params = {"max_new_tokens": cfg.max_new_tokens, "temperature": 0}
            for turn in (0, 1):
                for agent in range(cfg.agents):
                    if turn == 0:
                        text = (f"Task: fix the clamp helpers below.\nTool result:\n"
                                + filler_text((agent + 1) * blocks)[len(filler_text(agent * blocks)):])
                    else:
                        text = "Now check the weather where the next flight lands, with one tool call."
                    chats[agent].append({"role": "user", "content": text})
                    ids = tok.apply_chat_template(chats[agent], add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
                    # the arms take turns going first: an engine's write-through to its store
                    # runs on after its request and slows whichever engine runs next
                    k = len(result["requests"]) % len(ARMS)
                    order = ARMS[k:] + ARMS[:k]
                    row = {"agent": agent, "turn": turn, "prompt_tokens": len(ids), "order": list(order)}
                    for arm in order:
                        engine = engines[arm]
                        state = engine.vericache_state() if arm != "off" else None
                        outs, seconds, _ = engine.generate([ids], [params])
                        meta = outs[0]["meta_info"]
                        details = meta.get("cached_tokens_details") or {}
                        row[arm] = {"seconds": seconds, "completion_tokens": meta["completion_tokens"],
                                    **{f"{t}_hit_tokens": details.get(t, 0) for t in TIERS},
                                    "output_ids": outs[0]["output_ids"]}
                        if state is not None:
                            after = engine.vericache_state()
                            row[arm].update({k: after.get(k, 0) - state.get(k, 0) for k in FETCH_COUNTERS})
                    for arm in ARMS[1:]:
                        row[arm]["identical"] = first_divergence(row[arm]["output_ids"], row["off"]["output_ids"]) is None
                    chats[agent].append({"role": "assistant",
                                         "content": tok.decode(row["off"]["output_ids"], skip_special_tokens=True)})
                    result["requests"].append(row)
                    log(f"agent {agent} turn {turn}: {len(ids)} prompt tokens; "
                        + "; ".join(f"{arm} {row[arm]['seconds']:.2f} s (storage {row[arm]['storage_hit_tokens']})"
                                    for arm in ARMS)
                        + f"; drafted while fetching {row['fetch_draft']['fetch_draft_tokens']:.0f}, accepted "
                          f"{row['fetch_draft']['fetch_draft_accepted']:.0f}; identical "
                        + "/".join(str(row[a]["identical"]) for a in ARMS[1:]))
                    result["summary"] = summarize(result)
                    save(result)
        finally:
            for engine in engines.values():
                engine.shutdown()
    return result


def summarize(result: dict) -> dict:
    cfg, per_token = result["config"], result["kv_bytes_per_token"]
    rows = result["requests"]
    second = [r for r in rows if r["turn"] == 1]
    out = {"requests": len(rows), "second_turns": len(second)}
    for arm in ARMS:
        out[arm] = {
            "mean_seconds_second_turn": sum(r[arm]["seconds"] for r in second) / max(1, len(second)),
            "mean_seconds_first_turn": sum(r[arm]["seconds"] for r in rows if r["turn"] == 0)
                                       / max(1, len(rows) - len(second)),
            "storage_hit_tokens_second_turn": sum(r[arm]["storage_hit_tokens"] for r in second),
        }
        if arm != "off":
            out[arm].update({k: sum(r[arm].get(k, 0) for r in second) for k in FETCH_COUNTERS})
            out[arm]["identical"] = f"{sum(r[arm]['identical'] for r in rows)}/{len(rows)}"
    storage = out["fetch_draft"]["storage_hit_tokens_second_turn"]
    out["fetch_seconds_per_second_turn"] = storage * per_token / (cfg["store_mb_per_s"] * 1e6) / max(1, len(second))
    base = out["off"]["mean_seconds_second_turn"]
    for arm in ARMS[1:]:
        out[f"speedup_{arm}_vs_off"] = base / max(out[arm]["mean_seconds_second_turn"], 1e-9)
    out["speedup_fetch_draft_vs_vericache"] = (out["vericache"]["mean_seconds_second_turn"]
                                              / max(out["fetch_draft"]["mean_seconds_second_turn"], 1e-9))
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    second = [r for r in result["requests"] if r["turn"] == 1]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for k, (arm, color) in enumerate(zip(ARMS, ("tab:gray", "tab:orange", "tab:blue"))):
        ax.bar([i + (k - 1) * width for i in range(len(second))], [r[arm]["seconds"] for r in second], width,
               color=color, label=arm)
    ax.axhline(result["summary"]["fetch_seconds_per_second_turn"], color="k", ls=":", label="prefix fetch (mean)")
    ax.set_xticks(range(len(second)), [f"agent {r['agent']}" for r in second])
    ax.set_ylabel("seconds (fetch + prefill + decode)")
    cfg = result["config"]
    ax.set_title(f"second turns, prefix in a {cfg['store_mb_per_s']:g} MB/s store; {cfg['compressor']} "
                 f"d={cfg['draft_len']}, {cfg['max_new_tokens']} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(result: dict) -> str:
    s, cfg = result["summary"], result["config"]
    lines = [f"second turns ({s['second_turns']} agents, prefix in the remote store only, "
             f"{cfg['store_mb_per_s']:g} MB/s; fetch ~{s['fetch_seconds_per_second_turn']:.2f} s each):",
             "| arm | mean s (2nd turn) | mean s (1st turn) | storage hit tokens | drafted while fetching | "
             "accepted of those | identical |", "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        a = s[arm]
        lines.append(f"| {arm} | {a['mean_seconds_second_turn']:.2f} | {a['mean_seconds_first_turn']:.2f} | "
                     f"{a['storage_hit_tokens_second_turn']} | {a.get('fetch_draft_tokens', 0):.0f} | "
                     f"{a.get('fetch_draft_accepted', 0):.0f} | {a.get('identical', '-')} |")
    lines.append(f"speedup on second turns: vericache {s['speedup_vericache_vs_off']:.2f}x, fetch_draft "
                 f"{s['speedup_fetch_draft_vs_off']:.2f}x of off; fetch_draft {s['speedup_fetch_draft_vs_vericache']:.2f}x "
                 "of vericache without it")
    return "\n".join(lines)


def parse_args():
    return preset_args(__doc__, RemoteConfig, PRESETS, "4 agents, ~530-token prefixes, 16 tokens, 768-token device pool",
                       "benchmark/results/remote_prefix.json", check_config)


def main() -> None:
    bench_main(parse_args, run, plot, summary)


if __name__ == "__main__":
    main()
