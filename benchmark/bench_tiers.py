"""Multi-turn agent trace through tiered KV (issue 5): SGLang's HiCache with speculation off
against VERICACHE with the same HiCache, side by side in one run.

SmolLM2-135M-Instruct on CPU, fp32, greedy. Two offline engines, each in a child process of
its own (``bench_decode.DecodeEngine``), alive for the whole run and started with the same
flags: CPU, torch_native attention, ``--enable-hierarchical-cache`` with a device pool too
small for the trace (so earlier turns' prefixes are evicted to the host tier and loaded
back), a host tier ``--host-ratio`` times the device pool, and the ``file`` storage backend
(one folder per arm). Arm B adds ``speculative_algorithm=VERICACHE``.

The trace: ``conversations`` agents share one system prompt (tool descriptions); each turn
appends a user request and a tool result (code and tool-call transcript, ~``tool_tokens``)
to that agent's history, and the agents take turns, so every turn's prompt is its own
conversation so far; with ``--agents-at-once K`` a turn's requests of K agents go to the
engine together (one generate call; wall time and counters shared out evenly over them).
Both arms get the same prompts (history grows with arm A's answers); each group runs on A
then on B back to back.

Per arm: decode throughput (output tokens / generate wall time, prefill included: the
loads are part of the cost), prefix hit ratio (cached / prompt tokens) and hits per tier
(device / host / storage) from ``meta_info.cached_tokens_details``, the bytes those hits
moved (tokens x full-KV bytes per token), and whether B's outputs equal A's; for B also the
tokens whose compressed KV came from VeriCache's compressed prefix cache (the previous
turn's entry) rather than being compressed again. SGLang loads a hit prefix back before the
forward that uses it, and the time that takes on this CPU (``vericache:full_kv_load_seconds``)
is reported as ``full_kv_load_fraction`` of the VERICACHE arm's time. By default a running
request's full KV stays on the device, so verify never waits for a load; with
``--full-device-budget N`` the VERICACHE arm staggers verifies (``--vericache-full-device-budget``):
each iteration verifies the requests whose own full KV fits in N tokens, the others draft
with theirs parked in host memory, loaded back while the drafts of the round they verify in
run; ``verify_stall_fraction`` is the share of verify time spent waiting for it, with the
bytes moved each way and the request-iterations deferred. A request alone always verifies,
so the budget needs ``--agents-at-once`` > 1 to park anything.

    python benchmark/bench_tiers.py --quick     # 2 agents x 2 turns, 8 tokens
    python benchmark/bench_tiers.py --quick --full-device-budget 0 --agents-at-once 2
    python benchmark/bench_tiers.py --out benchmark/results/tiers.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import DecodeEngine, filler_text  # noqa: E402
from bench_spec import bench_main, check_compressor, first_divergence, make_log, preset_args, provenance  # noqa: E402

TIERS = ("device", "host", "storage")
PARKING_COUNTERS = ("full_kv_parked_tokens", "full_kv_loaded_tokens", "full_kv_bytes_to_host",
                    "full_kv_bytes_to_device", "full_kv_wait_seconds", "full_kv_copy_seconds", "full_kv_parks",
                    "full_kv_parks_in_host_pool", "deferred_rows", "rounds")
STALL_NOTE = ("verify never waits for loads: without --full-device-budget a running request's full KV stays on "
              "the device; the wait is before prefill, reported as full_kv_load_fraction")
PARKED_NOTE = ("--full-device-budget: verifies staggered so that requests' own full KV on the device per verify "
               "stays within the budget; the rest draft with theirs parked in host memory, copied back layer by "
               "layer while the drafts of the round they verify in run; verify_stall_fraction = seconds verify "
               "waited for a layer / verify seconds (prompts are parked too, less a prefix the radix tree held when the request arrived)")


@dataclass(frozen=True)
class TiersConfig:
    mode: str
    conversations: int = 4
    turns: int = 4  # per conversation
    max_new_tokens: int = 32
    tool_tokens: int = 160  # tool result appended per turn (about)
    device_tokens: int = 2048  # device KV pool of each arm
    host_ratio: float = 2.0
    compressor: str = "streamingllm"
    draft_len: int = 8
    full_device_budget: int = dataclasses.field(default=-1, metadata={"min": -1})  # VERICACHE arm's
    # --vericache-full-device-budget (tokens; -1 = off)
    agents_at_once: int = 1  # a turn's requests of this many agents go to the engine together
    out: str = "benchmark/results/tiers.json"


PRESETS = {
    "quick": TiersConfig("quick", conversations=2, turns=2, max_new_tokens=8, tool_tokens=80, device_tokens=768,
                         out="benchmark/results/tiers_quick.json"),
    "default": TiersConfig("default"),
}


def kv_bytes_per_token(model_path: str) -> int:
    config = json.loads((Path(model_path) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return 2 * config["num_hidden_layers"] * heads * head_dim * 4  # K and V, fp32


def system_prompt() -> str:
    tools = "\n".join(
        f'- {name}({args}): {doc}' for name, args, doc in [
            ("get_weather", "city, unit", "current weather for a city"),
            ("search_flights", "origin, destination, date", "flights on a date"),
            ("run_python", "code", "runs code in a sandbox and returns stdout"),
            ("read_file", "path", "returns a file's contents"),
        ])
    return ("You are a coding agent. Call tools by answering with one JSON object "
            '{"tool": NAME, "arguments": {...}}, or answer the user directly.\nTools:\n' + tools + "\n")


def start_engines(model_path: str, cfg: TiersConfig, storage_root: Path):
    from sgl_vericache.config import VeriCacheConfig

    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    common = dict(max_total_tokens=cfg.device_tokens, enable_hierarchical_cache=True, hicache_ratio=cfg.host_ratio,
                  hicache_io_backend="kernel", hicache_mem_layout="page_first", hicache_storage_backend="file",
                  hicache_storage_prefetch_policy="wait_complete")
    off = DecodeEngine(model_path, env, file_storage_path=str(storage_root / "off"), **common)
    VeriCacheConfig(compressor=cfg.compressor, ratio=4.0, draft_len=cfg.draft_len,
                    full_device_budget=cfg.full_device_budget).to_env()
    parking = {"radix_cache_backend": "vericache"} if cfg.full_device_budget >= 0 else {}
    spec = DecodeEngine(model_path, env, **parking,
                      file_storage_path=str(storage_root / "vericache"), speculative_algorithm="VERICACHE",
                      speculative_num_draft_tokens=cfg.draft_len + 1, speculative_ngram_max_bfs_breadth=1,
                      disable_overlap_schedule=True, **common)
    return off, spec, common


def run(cfg: TiersConfig, model_path: str, save) -> dict:
    from transformers import AutoTokenizer

    log = make_log(time.time())
    tok = AutoTokenizer.from_pretrained(model_path)
    per_token = kv_bytes_per_token(model_path)
    with tempfile.TemporaryDirectory(prefix="vericache-tiers-") as storage:
        log("starting both engines (speculation off + HiCache, VERICACHE + HiCache)")
        off, spec, common = start_engines(model_path, cfg, Path(storage))
        try:
            off.wait_ready()
            spec.wait_ready()
            # Each engine's first generate pays one-time costs (lazy kernels, allocator warm-up):
            # without this the off arm, which goes first, ran its first turn 3x slower. The
            # warm-up prompt is raw text with no chat template, so it shares no prefix with the trace.
            warm = tok.encode("Warm-up before the trace: count from one to twenty.")
            for engine in (off, spec):
                engine.generate([warm], {"max_new_tokens": 8, "temperature": 0})
            log("engines ready and warmed up")
            result = {**provenance(model_path), "config": dataclasses.asdict(cfg), "engine_flags": common,
                      "kv_bytes_per_token": per_token, "verify_stall_fraction": None,
                      "verify_stall_note": STALL_NOTE if cfg.full_device_budget < 0 else PARKED_NOTE,
                      "turns": []}
            chats = [[{"role": "system", "content": system_prompt()}] for _ in range(cfg.conversations)]
            tool_blocks = max(1, cfg.tool_tokens // 120)
            params = {"max_new_tokens": cfg.max_new_tokens, "temperature": 0}
            for turn in range(cfg.turns):
                for first in range(0, cfg.conversations, cfg.agents_at_once):
                    group = list(range(first, min(first + cfg.agents_at_once, cfg.conversations)))
                    prompts = []
                    for agent in group:
                        start = (agent * cfg.turns + turn) * tool_blocks
                        chats[agent].append({
                            "role": "user", "content": f"Task {turn}: fix the clamp helpers below, then check "
                            f"the weather where the next flight lands.\nTool result:\n"
                            + filler_text(start + tool_blocks)[len(filler_text(start)):]})
                        prompts.append(tok.apply_chat_template(chats[agent], add_generation_prompt=True,
                                                               tokenize=True, return_dict=False))
                    rows = [{"agent": agent, "turn": turn, "prompt_tokens": len(ids), "batch": len(group)}
                            for agent, ids in zip(group, prompts)]
                    for arm, engine in (("off", off), ("vericache", spec)):
                        state = engine.vericache_state() if arm == "vericache" else None
                        outs, seconds, _ = engine.generate(prompts, [params] * len(prompts))
                        after = engine.vericache_state() if state is not None else None
                        for row, out in zip(rows, outs):
                            meta = out["meta_info"]
                            details = meta.get("cached_tokens_details") or {}
                            # a group's wall time and counters, shared out evenly over its requests
                            row[arm] = {"seconds": seconds / len(rows), "completion_tokens": meta["completion_tokens"],
                                        "cached_tokens": meta.get("cached_tokens", 0),
                                        **{f"{t}_hit_tokens": details.get(t, 0) for t in TIERS},
                                        "output_ids": out["output_ids"],
                                        "spec_accept_length": meta.get("spec_accept_length")}
                            if after is not None:
                                row[arm]["compressed_prefix_hit_tokens"] = (
                                    after["compressed_prefix_hit_tokens"] - state["compressed_prefix_hit_tokens"]) / len(rows)
                                row[arm]["compressed_prefix_bytes"] = int(after["compressed_prefix_bytes"])
                                for name in PARKING_COUNTERS + ("full_kv_load_seconds", "verify_seconds"):
                                    row[arm][name] = (after.get(name, 0) - state.get(name, 0)) / len(rows)
                    for agent, row in zip(group, rows):
                        row["identical"] = first_divergence(row["vericache"]["output_ids"],
                                                            row["off"]["output_ids"]) is None
                        chats[agent].append({"role": "assistant",
                                             "content": tok.decode(row["off"]["output_ids"], skip_special_tokens=True)})
                        result["turns"].append(row)
                        log(f"agent {agent} turn {turn}: {row['prompt_tokens']} prompt tokens"
                            + (f" ({len(group)} agents at once)" if len(group) > 1 else "") + "; "
                            + "; ".join(f"{arm} {row[arm]['seconds']:.2f} s, hits "
                                        + "/".join(str(row[arm][f'{t}_hit_tokens']) for t in TIERS)
                                        for arm in ("off", "vericache"))
                            + f"; identical {row['identical']}")
                    result["summary"] = summarize_arms(result)
                    save(result)
        finally:
            for engine in (off, spec):  # both shut down at once, then wait for each
                engine.request_shutdown()
            off.shutdown()
            spec.shutdown()
            log("engines shut down")
    return result


def summarize_arms(result: dict) -> dict:
    per_token = result["kv_bytes_per_token"]
    turns = result["turns"]
    prompt = sum(r["prompt_tokens"] for r in turns)
    summary = {}
    for arm in ("off", "vericache"):
        rows = [r[arm] for r in turns]
        seconds = sum(r["seconds"] for r in rows)
        summary[arm] = {
            "tok_per_s": sum(r["completion_tokens"] for r in rows) / max(seconds, 1e-9),
            "seconds": seconds,
            "prefix_hit_ratio": sum(r["cached_tokens"] for r in rows) / max(prompt, 1),
            **{f"{t}_hit_tokens": sum(r[f"{t}_hit_tokens"] for r in rows) for t in TIERS},
            **{f"{t}_loaded_bytes": sum(r[f"{t}_hit_tokens"] for r in rows) * per_token for t in ("host", "storage")},
        }
    reused = [r["vericache"].get("compressed_prefix_hit_tokens") for r in turns]
    if all(x is not None for x in reused):
        summary["vericache"]["compressed_prefix_hit_tokens"] = round(sum(reused))
        summary["vericache"]["compressed_prefix_hit_ratio"] = sum(reused) / max(prompt, 1)
        load = sum(r["vericache"]["full_kv_load_seconds"] for r in turns)
        summary["vericache"]["full_kv_load_seconds"] = load
        summary["vericache"]["full_kv_load_fraction"] = load / max(summary["vericache"]["seconds"], 1e-9)
        for name in PARKING_COUNTERS + ("verify_seconds",):
            summary["vericache"][name] = sum(r["vericache"].get(name, 0) for r in turns)
        if result["config"].get("full_device_budget", -1) >= 0:
            result["verify_stall_fraction"] = (summary["vericache"]["full_kv_wait_seconds"]
                                               / max(summary["vericache"]["verify_seconds"], 1e-9))
    summary["speedup"] = summary["vericache"]["tok_per_s"] / max(summary["off"]["tok_per_s"], 1e-9)
    summary["identical"] = f"{sum(r['identical'] for r in turns)}/{len(turns)}"
    return summary


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = result["turns"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(turns))
    for arm, color in (("off", "tab:gray"), ("vericache", "tab:blue")):
        ax1.plot(x, [r[arm]["completion_tokens"] / r[arm]["seconds"] for r in turns], "o-", color=color, label=arm)
    ax1.set_xlabel("turn (agents interleaved)")
    ax1.set_ylabel("output tok/s (prefill included)")
    ax1.legend()
    bottom = [0] * len(turns)
    for tier, color in zip(TIERS, ("tab:green", "tab:orange", "tab:red")):
        values = [r["vericache"][f"{tier}_hit_tokens"] for r in turns]
        ax2.bar(x, values, bottom=bottom, color=color, label=tier)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax2.plot(x, [r["prompt_tokens"] for r in turns], "k.", label="prompt tokens")
    ax2.set_xlabel("turn")
    ax2.set_ylabel("prefix tokens found (VERICACHE arm)")
    ax2.legend()
    fig.suptitle(f"agent trace through tiered KV: {result['config']['compressor']} d={result['config']['draft_len']}, "
                 f"device pool {result['config']['device_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(result: dict) -> str:
    s = result["summary"]
    lines = ["| arm | tok/s | prefix hit ratio | device / host / storage hit tokens | host / storage MB loaded |",
             "|---|---|---|---|---|"]
    for arm in ("off", "vericache"):
        a = s[arm]
        lines.append(f"| {arm} | {a['tok_per_s']:.2f} | {a['prefix_hit_ratio']:.2f} | "
                     f"{a['device_hit_tokens']} / {a['host_hit_tokens']} / {a['storage_hit_tokens']} | "
                     f"{a['host_loaded_bytes'] / 1e6:.1f} / {a['storage_loaded_bytes'] / 1e6:.1f} |")
    if "compressed_prefix_hit_tokens" in s["vericache"]:
        lines.append(f"vericache: {s['vericache']['compressed_prefix_hit_tokens']} prompt tokens "
                     f"({s['vericache']['compressed_prefix_hit_ratio']:.2f} of all) drafted from cached compressed "
                     "prefix entries instead of compressing them again; "
                     f"{s['vericache']['full_kv_load_seconds']:.2f} s ({100 * s['vericache']['full_kv_load_fraction']:.1f}% "
                     "of its time) loading full KV from the host tier before prefill")
    if result.get("verify_stall_fraction") is not None:
        v = s["vericache"]
        lines.append(f"parked full KV (device budget {result['config']['full_device_budget']} tokens): "
                     f"{int(v['full_kv_parked_tokens'])} tokens parked, {int(v['full_kv_loaded_tokens'])} loaded back "
                     f"({v['full_kv_bytes_to_device'] / 1e6:.1f} MB); verify waited {v['full_kv_wait_seconds']:.3f} s "
                     f"of {v['verify_seconds']:.2f} s ({100 * result['verify_stall_fraction']:.1f}%), the copies took "
                     f"{v['full_kv_copy_seconds']:.3f} s beside the drafts; {int(v['deferred_rows'])} of "
                     f"{int(v['deferred_rows'] + v['rounds'])} request-iterations drafted without verifying")
        lines.append(f"speedup {s['speedup']:.2f}x, identical {s['identical']}")
    else:
        lines.append(f"speedup {s['speedup']:.2f}x, identical {s['identical']}; verify stall: {STALL_NOTE}")
    return "\n".join(lines)


def parse_args():
    return preset_args(__doc__, TiersConfig, PRESETS, "2 agents x 2 turns, 8 tokens, 768-token device pool", "benchmark/results/tiers.json", check_compressor)


def main() -> None:
    bench_main(parse_args, run, plot, summary)


if __name__ == "__main__":
    main()
