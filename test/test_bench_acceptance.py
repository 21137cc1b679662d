"""bench_acceptance.py's arithmetic: rounds from SGLang's correct-drafts histogram, pooled
per compressor and per category (no engine)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
import bench_acceptance as ba  # noqa: E402


def test_round_lengths_count_the_bonus_token():
    # index = correct drafts, value = rounds: 2 rounds with 1 correct, 1 with 3
    assert ba.round_lengths([0, 2, 0, 1]) == [2, 2, 4]
    assert ba.round_lengths([]) == []


def test_summary_pools_rounds_not_requests():
    rows = [{"compressor": "streamingllm", "category": "code", "hist": [0, 0, 0, 3]},  # 3 rounds of 4
            {"compressor": "streamingllm", "category": "tool", "hist": [1]},  # 1 round of 1
            {"compressor": "snapkv", "category": "tool", "hist": []}]  # no round at all
    s = ba.summarize(rows)
    assert s["streamingllm"] == {"rounds": 4, "mean_acc_len": pytest.approx(13 / 4)}  # not (4 + 1) / 2
    assert s["streamingllm/code"]["mean_acc_len"] == 4 and s["streamingllm/tool"]["mean_acc_len"] == 1
    assert "snapkv" not in s
