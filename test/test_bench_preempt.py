"""bench_preempt.py without an engine: its prompts, its summary, and the shared CLI it
and bench_tiers use (presets, overrides, refusals)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmark"
sys.path.insert(0, str(BENCH))
import bench_preempt as bp  # noqa: E402


def test_prompts_have_the_asked_length_and_share_no_prefix(default_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    cfg = bp.PRESETS["quick"]
    ids = bp.prompts(tok, cfg)
    assert len(ids) == cfg.requests
    assert all(len(x) == cfg.prompt_tokens for x in ids), [len(x) for x in ids]
    # distinct from the first token after the chat template's common head
    heads = {tuple(x[:40]) for x in ids}
    assert len(heads) == cfg.requests


def _arm(spec, keep, tok_s, outs):
    return {"speculation": spec, "keep_preempted_kv": keep, "tok_per_s": tok_s, "output_ids": outs,
            "identical_to_first_arm": sum(o == r for o, r in zip(outs, [[1, 2], [3]]))}


def test_summary_ratios_are_keep_on_over_keep_off_per_mode():
    arms = [_arm("off", False, 4.0, [[1, 2], [3]]), _arm("off", True, 5.0, [[1, 2], [3]]),
            _arm("vericache", False, 8.0, [[1, 2], [3]]), _arm("vericache", True, 6.0, [[1, 2], [4]])]
    s = bp.summarize_arms({"arms": arms})
    assert s["off_keep_speedup"] == pytest.approx(1.25)
    assert s["vericache_keep_speedup"] == pytest.approx(0.75)
    assert s["all_identical"] is False  # the last arm's second output differs
    assert "vericache_keep_speedup" not in bp.summarize_arms({"arms": arms[:3]})


@pytest.mark.parametrize("args, message", [
    (["--compressor", "zip"], "--compressor 'zip' is not one of"),
    (["--requests", "0"], "--requests 0 must be positive"),
    (["--preempt-interval", "x"], "invalid int value"),
])
def test_bad_flags_are_refused_before_any_engine(args, message):
    for bench in ("bench_preempt.py", "bench_tiers.py"):
        if bench == "bench_tiers.py" and args[0] != "--compressor":
            continue  # bench_tiers has no such flags
        out = subprocess.run([sys.executable, str(BENCH / bench), *args], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and message in out.stderr, (bench, out.stderr[-500:])
