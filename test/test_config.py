"""The --vericache-* flags (``config.py``, generated from ``VeriCacheConfig``), per-request
``custom_params`` overrides, and the server's flag checks (a full-KV device budget and the
radix backend it needs). No engine is started here."""

from __future__ import annotations

import pytest

from sgl_vericache.config import VeriCacheConfig, parse_known, request_config


def test_flags_are_split_from_sglang_flags():
    vc, rest = parse_known(["--vericache-draft-len", "8", "--port", "1234", "--vericache-compressor=snapkv",
                            "--no-vericache-deterministic", "--log-level", "info"])
    assert (vc.draft_len, vc.compressor, vc.deterministic) == (8, "snapkv", False)
    assert rest == ["--port", "1234", "--log-level", "info"]
    assert vc.tier_checksums  # on unless turned off
    assert not parse_known(["--no-vericache-tier-checksums"])[0].tier_checksums


@pytest.mark.parametrize("argv, message", [
    (["--vericache-draft-lenn", "3"], "unknown flag --vericache-draft-lenn"),
    (["--vericache-draft-len", "65"], "out of range; accepted: 1 to 64"),
    (["--vericache-compressor", "lz4"], "is not one of"),
    (["--vericache-compressor-options", "group_size"], "not of the form name=value"),
    (["--vericache-compressed-cache-mb", "-1"], "compressed-cache-mb -1 is out of range; accepted: 0 to"),
])
def test_bad_flags_name_the_problem(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_known(argv)


def test_config_round_trips_through_the_environment(monkeypatch):
    vc = VeriCacheConfig(compressor="h2o", ratio=8.0, draft_len=5)
    monkeypatch.delenv("VERICACHE_CONFIG", raising=False)
    vc.to_env()
    assert VeriCacheConfig.from_env() == vc


def test_request_overrides():
    server = VeriCacheConfig(compressor="kivi4", draft_len=16)
    assert request_config(None, server) is server
    assert request_config({"other_key": 1}, server) is server
    cfg = request_config({"vericache_compressor": "quest", "vericache_draft_len": 4}, server)
    assert (cfg.compressor, cfg.draft_len, cfg.ratio) == ("quest", 4, server.ratio)
    with pytest.raises(ValueError, match="exceeds the server's --vericache-draft-len 16"):
        request_config({"vericache_draft_len": 17}, server)
    with pytest.raises(ValueError, match="unknown custom_params key 'vericache_speed'"):
        request_config({"vericache_speed": 2}, server)
    with pytest.raises(ValueError, match="custom_params vericache_ratio 0.1 is out of range"):
        request_config({"vericache_ratio": 0.1}, server)
    cfg = request_config({"vericache_compressor_options": {"group_size": 16, "residual_length": 8}}, server)
    assert cfg.options() == {"group_size": "16", "residual_length": "8"}


@pytest.mark.parametrize("params, message", [
    # the two bodies that once took the server down (issue 29): now each names its key
    ({"vericache_compressor_options": {"a": 1}}, "unknown option"),
    ({"vericache_draft_len": 4.5}, "vericache_draft_len 4.5 is not an integer"),
    ({"vericache_draft_len": True}, "vericache_draft_len True is not an integer"),
    ({"vericache_draft_len": "4"}, "vericache_draft_len '4' is not an integer"),
    ({"vericache_draft_len": 0}, "vericache_draft_len 0 is out of range"),
    ({"vericache_ratio": "x"}, "vericache_ratio 'x' is not a number"),
    ({"vericache_ratio": float("inf")}, "vericache_ratio inf is not a number"),
    ({"vericache_compressor": 3}, "vericache_compressor 3 is not a string"),
    ({"vericache_compressor": "nope"}, "vericache_compressor 'nope' is not one of"),
    ({"vericache_compressor_options": [1]}, "vericache_compressor_options \\[1\\] is not a string"),
    ({"vericache_compressor_options": {"group_size": [1]}}, "option 'group_size'"),
    ({"vericache_compressor_options": "group_size=x"}, "group_size='x' is invalid"),
    ("not an object", "custom_params 'not an object' is not an object"),
])
def test_bad_request_overrides_name_their_key(params, message):
    """Every malformed override is a ValueError (the request's 400), never another error
    type that would escape the round's plan and stop the scheduler."""
    with pytest.raises(ValueError, match=message):
        request_config(params, VeriCacheConfig(compressor="kivi4", draft_len=16))


def test_compressor_options_need_a_named_compressor():
    with pytest.raises(ValueError, match="need a named compressor, not auto"):
        request_config({"vericache_compressor_options": "group_size=16"}, VeriCacheConfig())
    cfg = request_config({"vericache_compressor": "kivi4", "vericache_compressor_options": "group_size=16"},
                         VeriCacheConfig())
    assert cfg.build_compressor().name == "kivi4"
    assert VeriCacheConfig().build_compressor().name == "streamingllm"  # auto's first candidate


def test_flag_values_are_type_checked():
    with pytest.raises(ValueError, match="--vericache-draft-len 4.5 is not an integer"):
        VeriCacheConfig(draft_len=4.5)
    with pytest.raises(ValueError, match="--vericache-enable 1 is not true or false"):
        VeriCacheConfig(enable=1)
    assert VeriCacheConfig(ratio=8).ratio == 8  # an integer is a number


def test_a_full_kv_device_budget_brings_the_vericache_radix_backend_and_refuses_others():
    from sgl_vericache.sglang.server import apply_vericache_flags

    vc, rest = parse_known(["--vericache-full-device-budget", "0"])
    assert vc.full_device_budget == 0
    argv = apply_vericache_flags(vc, rest)
    assert argv[argv.index("--radix-cache-backend") + 1] == "vericache"
    assert apply_vericache_flags(vc, ["--radix-cache-backend=vericache"]).count("--radix-cache-backend") == 0
    with pytest.raises(ValueError, match="needs --radix-cache-backend vericache, not 'flexkv'"):
        apply_vericache_flags(vc, ["--radix-cache-backend", "flexkv"])
    with pytest.raises(ValueError, match="needs --page-size 1, not '16'"):
        apply_vericache_flags(vc, ["--page-size", "16"])
    off = parse_known([])[0]
    assert off.full_device_budget == -1 and "--radix-cache-backend" not in apply_vericache_flags(off, [])
    with pytest.raises(ValueError, match="full-device-budget -2 is out of range"):
        parse_known(["--vericache-full-device-budget", "-2"])
