"""bench_preempt.py without an engine: its prompts, its summary, and the shared CLI it
and bench_tiers use (presets, overrides, refusals); bench_tiers' summary of parked full KV."""

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


def test_bench_tiers_full_device_budget_takes_minus_one_to_turn_off_and_no_less():
    out = subprocess.run([sys.executable, str(BENCH / "bench_tiers.py"), "--full-device-budget", "-2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--full-device-budget -2 must be at least -1" in out.stderr, out.stderr[-500:]


def test_bench_tiers_reports_the_verify_stall_of_parked_full_kv():
    import bench_tiers as bt

    def arm(seconds, **extra):
        return {"seconds": seconds, "completion_tokens": 8, "cached_tokens": 4, "device_hit_tokens": 4,
                "host_hit_tokens": 0, "storage_hit_tokens": 0, "output_ids": [1], **extra}

    counters = {name: 1.0 for name in bt.PARKING_COUNTERS}
    turns = [{"prompt_tokens": 10, "identical": True, "off": arm(2.0),
              "vericache": arm(1.0, compressed_prefix_hit_tokens=0, compressed_prefix_bytes=0,
                               full_kv_load_seconds=0.0, verify_seconds=0.5,
                               **{**counters, "full_kv_wait_seconds": 0.05})} for _ in range(2)]
    parked = {"kv_bytes_per_token": 100, "config": {"full_device_budget": 0}, "turns": turns}
    s = bt.summarize_arms(parked)
    assert parked["verify_stall_fraction"] == pytest.approx(0.1)
    assert s["vericache"]["full_kv_loaded_tokens"] == 2 and s["speedup"] == pytest.approx(2.0)
    assert "verify waited 0.100 s of 1.00 s (10.0%)" in bt.summary({**parked, "summary": s})
    off = {"kv_bytes_per_token": 100, "config": {"full_device_budget": -1}, "turns": turns,
           "verify_stall_fraction": None}
    bt.summarize_arms(off)
    assert off["verify_stall_fraction"] is None


_CONTEXTS = """
import os, sys
sys.path.insert(0, {bench!r})
import bench_spec
print(bench_spec.engine_context({{"SGLANG_USE_CPU_ENGINE": "1"}}).get_start_method(),
      bench_spec.engine_context({{}}).get_start_method(),
      bench_spec.engine_context({{"SGLANG_TEST_RETRACT": "1"}}).get_start_method())
"""


_FIRST_UNFORKABLE = """
import sys
sys.path.insert(0, {bench!r})
import bench_spec
method = bench_spec.engine_context({{"SGLANG_TEST_RETRACT": "1"}}).get_start_method()
print(method, "sglang.srt.entrypoints.engine" in sys.modules)
"""


def test_an_engine_that_cannot_be_forked_does_not_import_sglang_in_the_parent():
    """bench_preempt's engines carry SGLANG_TEST_RETRACT, which SGLang reads at import: they
    are spawned, and the parent does not pay an import it cannot use."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("VERICACHE_BENCH_SPAWN", "SGLANG_TEST_RETRACT")}
    out = subprocess.run([sys.executable, "-c", _FIRST_UNFORKABLE.format(bench=str(BENCH))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "spawn False"


@pytest.mark.parametrize("spawn_env, expected", [(None, "fork fork spawn"), ("1", "spawn spawn spawn")])
def test_engines_are_forked_only_where_the_import_saw_their_environment(spawn_env, expected):
    """The benchmarks fork engines from a parent that imported SGLang once; an engine whose
    environment SGLang would have read differently at that import is spawned."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("VERICACHE_BENCH_SPAWN", "SGLANG_TEST_RETRACT")}
    if spawn_env:
        env["VERICACHE_BENCH_SPAWN"] = spawn_env
    out = subprocess.run([sys.executable, "-c", _CONTEXTS.format(bench=str(BENCH))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected
