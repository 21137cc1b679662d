"""The full matrix's bookkeeping (shards, merged table), without running the matrix."""

import json

import pytest

import test_exactness_matrix as m


def test_shards_partition_the_matrix():
    everything = m.all_configs()
    assert len(everything) == 64 and len(set(everything)) == 64
    for n in (1, 2, 3):
        parts = [m.shard_configs(f"{k}/{n}") for k in range(n)]
        assert sorted(c for p in parts for c in p) == sorted(everything)
        assert all(abs(len(p) - 64 / n) < 1 for p in parts)
    assert m.shard_configs(None) == everything == m.shard_configs("")
    # two shards split droppers and quantizers evenly (their costs differ several-fold)
    halves = [{c for c, _, _ in m.shard_configs(f"{k}/2")} for k in range(2)]
    assert all(len(h & {"kivi4", "kivi2", "int8", "fp8"}) == 2 for h in halves)


@pytest.mark.parametrize("bad", ["2/2", "-1/2", "1", "a/b", "0/0", "1/2/3"])
def test_bad_shard_is_refused_with_the_accepted_form(bad):
    with pytest.raises(ValueError, match=r"VERICACHE_MATRIX_SHARD=.*expected k/n"):
        m.shard_configs(bad)


def test_merged_report_counts_rows_across_files_and_names_what_is_missing(tmp_path):
    def row(c, d, b, same=24):
        return {"compressor": c, "draft_len": d, "batch": b, "prompts": 24, "identical": same,
                "mean_acc_len": 2.0, "seconds": 10.0, "commit": "abc"}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"fingerprint": "f", "rows": [row("kivi4", 1, 4), row("kivi2", 1, 4, 23)]}))
    b.write_text(json.dumps({"fingerprint": "f", "rows": [row("int8", 1, 4)]}))
    text = m.merged_report([a, b])
    assert "3/64 configurations, 71/72 outputs identical" in text
    assert "| kivi2 | 1 | 4 | 23/24 |" in text
    assert "missing: fp8 d=1 b=4" in text and "kivi4 d=1 b=4," not in text
