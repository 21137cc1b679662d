"""Preempted requests: SGLang's recompute against keeping their KV (issue 5).

When the KV pool runs short mid-decode, SGLang retracts running requests and requeues them.
As shipped it frees a retracted request's KV and prefills the request again from scratch
on resume (prompt and every token it had generated); with ``--vericache-keep-preempted-kv``
(our default) the KV goes into the radix tree first and the request resumes from it.

Preemptions here are forced with SGLang's own test hook (``SGLANG_TEST_RETRACT``: the
decode batch retracts one request every ``preempt_interval`` forward passes when two or
more decode together), which runs the same retraction path memory pressure does: on this
CPU, SGLang's admission control (every new request reserves its full ``max_new_tokens``)
kept small pools from running out in the runs tried, so real pressure is not what is
measured. Four arms, one engine each, started one after another with the same flags (CPU,
torch_native, fp32, radix cache): speculation off and VERICACHE, each with
keep-preempted-kv off (SGLang's behaviour) and on; each gets the same batch of prompts at
once. Per arm: wall seconds, output tok/s, retractions (SGLang's per-request
``num_retractions``), requests whose KV was kept and the tokens newly kept (``/server_info``
``vericache_preempted``), and how many outputs equal the first arm's (speculation off,
SGLang's behaviour). Ratios: keep on / keep off per speculation mode.

    python benchmark/bench_preempt.py --quick     # 3 requests x 48 tokens
    python benchmark/bench_preempt.py --out benchmark/results/preempt.json

``--host-ratio R`` adds HiCache with a host tier R times the device pool (kept KV that the
device evicts is then loaded back from host on resume).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import DecodeEngine  # noqa: E402
from bench_spec import bench_main, check_compressor, first_divergence, make_log, preset_args, provenance  # noqa: E402
from prompts import CODE, TOOL, messages  # noqa: E402  (bench_spec put test/ on sys.path)


@dataclass(frozen=True)
class PreemptConfig:
    mode: str
    requests: int = 4
    prompt_tokens: int = 512
    max_new_tokens: int = 128
    preempt_interval: int = 6  # forward passes between forced preemptions
    device_tokens: int = 8192
    compressor: str = "streamingllm"
    draft_len: int = 8
    host_ratio: float = 0.0  # > 0: HiCache on, a host tier of this many times the device pool
    out: str = "benchmark/results/preempt.json"


PRESETS = {
    "quick": PreemptConfig("quick", requests=3, prompt_tokens=256, max_new_tokens=48, preempt_interval=4,
                           out="benchmark/results/preempt_quick.json"),
    "default": PreemptConfig("default"),
}
ARMS = (("off", False), ("off", True), ("vericache", False), ("vericache", True))


def prompts(tok, cfg: PreemptConfig) -> list[list[int]]:
    """``requests`` prompts of ``prompt_tokens`` each: code and tool-call requests whose
    text is repeated to length (distinct prompts: no prefix shared between them)."""
    texts = [t for pair in zip(CODE, TOOL) for t in pair]
    out = []
    for i in range(cfg.requests):
        cat = "code" if i % 2 == 0 else "tool"
        head = tok.apply_chat_template(messages(cat, f"Request {i}. " + texts[i % len(texts)]),
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
        body = tok.encode(f" Context block {i}: " + " ".join(texts) * 20, add_special_tokens=False)
        need = max(0, cfg.prompt_tokens - len(head))
        out.append(head[:-5] + body[:need] + head[-5:])
    return out


def run(cfg: PreemptConfig, model_path: str, save) -> dict:
    from transformers import AutoTokenizer

    from sgl_vericache.config import VeriCacheConfig

    log = make_log(time.time())
    tok = AutoTokenizer.from_pretrained(model_path)
    ids = prompts(tok, cfg)
    flags = dict(max_total_tokens=cfg.device_tokens, max_running_requests=cfg.requests)
    env = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_TEST_RETRACT": "1",
           "SGLANG_TEST_RETRACT_INTERVAL": str(cfg.preempt_interval)}
    if cfg.host_ratio:
        flags.update(enable_hierarchical_cache=True, hicache_ratio=cfg.host_ratio, hicache_io_backend="kernel",
                     hicache_mem_layout="page_first")
    result = {**provenance(model_path), "config": dataclasses.asdict(cfg), "engine_flags": flags, "engine_env": env,
              "prompt_tokens": [len(x) for x in ids], "arms": []}
    params = {"max_new_tokens": cfg.max_new_tokens, "temperature": 0, "ignore_eos": True}
    reference = None
    for spec, keep in ARMS:
        kw = dict(flags)
        if spec == "vericache":
            VeriCacheConfig(compressor=cfg.compressor, ratio=4.0, draft_len=cfg.draft_len,
                            keep_preempted_kv=keep).to_env()
            kw.update(speculative_algorithm="VERICACHE", speculative_num_draft_tokens=cfg.draft_len + 1,
                      speculative_ngram_max_bfs_breadth=1, disable_overlap_schedule=True)
        else:
            VeriCacheConfig(keep_preempted_kv=keep).to_env()
        log(f"arm {spec} keep_preempted_kv={keep}: starting the engine")
        engine = DecodeEngine(model_path, env, **kw)
        try:
            engine.wait_ready()
            outs, seconds, _ = engine.generate(ids, params)
            state = engine.server_state()
        finally:
            engine.shutdown()
        out_ids = [o["output_ids"] for o in outs]
        if reference is None:
            reference = out_ids
        tokens = sum(len(o) for o in out_ids)
        arm = {"speculation": spec, "keep_preempted_kv": keep, "seconds": seconds, "output_tokens": tokens,
               "tok_per_s": tokens / seconds,
               "retractions": sum(o["meta_info"].get("num_retractions", 0) or 0 for o in outs),
               "preempted_kept": state.get("vericache_preempted"),
               "spec_accept_length": [o["meta_info"].get("spec_accept_length") for o in outs],
               "identical_to_first_arm": sum(first_divergence(a, b) is None for a, b in zip(out_ids, reference)),
               "output_ids": out_ids}
        result["arms"].append(arm)
        log(f"arm {spec} keep={keep}: {seconds:.1f} s, {arm['tok_per_s']:.2f} tok/s, {arm['retractions']} "
            f"retractions, kept {arm['preempted_kept']}, identical {arm['identical_to_first_arm']}/{len(ids)}")
        result["summary"] = summarize_arms(result)
        save(result)
    return result


def summarize_arms(result: dict) -> dict:
    by = {(a["speculation"], a["keep_preempted_kv"]): a for a in result["arms"]}
    out = {}
    for spec in ("off", "vericache"):
        if (spec, False) in by and (spec, True) in by:
            out[f"{spec}_keep_speedup"] = by[(spec, True)]["tok_per_s"] / by[(spec, False)]["tok_per_s"]
    out["all_identical"] = all(a["identical_to_first_arm"] == len(a["output_ids"]) for a in result["arms"])
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = result["arms"]
    labels = [f"{a['speculation']}\nkeep {'on' if a['keep_preempted_kv'] else 'off'}" for a in arms]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(labels, [a["tok_per_s"] for a in arms], color=["#999", "#4a7", "#99c", "#36a"][:len(arms)])
    for bar, a in zip(bars, arms):
        ax.annotate(f"{a['retractions']} retr.", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tok/s")
    cfg = result["config"]
    ax.set_title(f"{cfg['requests']} requests x {cfg['max_new_tokens']} tokens, a preemption every "
                 f"{cfg['preempt_interval']} passes", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(result: dict) -> str:
    lines = ["| speculation | keep preempted KV | seconds | tok/s | retractions | kept (requests / tokens) | identical |",
             "|---|---|---|---|---|---|---|"]
    for a in result["arms"]:
        kept = a["preempted_kept"] or {}
        lines.append(f"| {a['speculation']} | {'on' if a['keep_preempted_kv'] else 'off'} | {a['seconds']:.1f} | "
                     f"{a['tok_per_s']:.2f} | {a['retractions']} | {kept.get('requests', 0)} / "
                     f"{kept.get('kept_tokens', 0)} | {a['identical_to_first_arm']}/{len(a['output_ids'])} |")
    lines.append(f"summary: {result.get('summary')}")
    return "\n".join(lines)


def parse_args():
    return preset_args(__doc__, PreemptConfig, PRESETS, "3 requests x 48 tokens, a preemption every 4 passes", "benchmark/results/preempt.json", check_compressor)


def main() -> None:
    bench_main(parse_args, run, plot, summary)


if __name__ == "__main__":
    main()
