"""The analytic cost model (benchmark/cost_model.py): properties any honest roofline must
have, the paper's Llama-70B example within a stated tolerance, the bench_decode report.
Pure arithmetic, no torch: well under a second."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
import cost_model as cm  # noqa: E402
import gpu_projection as gp  # noqa: E402

SMOL, LLAMA = cm.smollm2_135m(), cm.llama_70b()
# an H100-like device with no capacity limit, so batch effects do not mix into the checks
GPU = replace(cm.h100_nvl_x2(), mem_capacity=None)
CPU = cm.cpu_this_machine(mem_bw=7e9, flops=40e9)


def speedup(hw=GPU, shape=LLAMA, context=32768, batch=4, ratio=4.0, draft_len=30, **acc):
    acc = acc or {"acc_len": 23.0}
    return cm.predict(shape, hw, context, batch, 2, ratio, draft_len, **acc)


def test_presets_count_the_published_parameters():
    assert SMOL.params == 134_515_008
    assert LLAMA.params == 70_553_706_496
    assert LLAMA.kv_bytes_per_token(2) == 327_680  # 80 layers x 8 heads x 128 x K,V x bf16


def test_expected_acceptance_length():
    assert cm.expected_acceptance_length(0.0, 30) == 1.0  # only the bonus token
    assert cm.expected_acceptance_length(1.0, 30) == 31.0  # every draft + the bonus
    assert cm.expected_acceptance_length(0.5, 1) == pytest.approx(1.5)
    lens = [cm.expected_acceptance_length(a, 30) for a in (0.5, 0.8, 0.9, 0.97, 0.999)]
    assert lens == sorted(lens) and lens[-1] < 31
    with pytest.raises(ValueError):
        cm.expected_acceptance_length(1.2, 30)


@pytest.mark.parametrize("hw", [GPU, cm.h100_nvl_x2(), CPU], ids=["h100-unlimited", "h100-nvl-x2", "cpu"])
def test_full_kv_throughput_falls_with_context(hw):
    shape = SMOL if hw is CPU else LLAMA
    rates = [cm.predict(shape, hw, c, 8, 2, 4, 30, acc_len=20)["tok_s"]["full_resident"]
             for c in (1024, 4096, 16384, 32768)]
    assert all(a > b for a, b in zip(rates, rates[1:])), rates


def test_offloaded_full_kv_is_slower_than_resident():
    for context in (1024, 8192, 65536):
        resident = cm.full_kv_step_time(LLAMA, GPU, context, 8, 2)
        offloaded = cm.full_kv_step_time(LLAMA, GPU, context, 8, 2, offloaded=True)
        serial = cm.full_kv_step_time(LLAMA, GPU, context, 8, 2, offloaded=True, overlap=False)
        assert resident < offloaded < serial
    assert speedup()["tok_s"]["full_offloaded"] < speedup()["tok_s"]["full_resident"]
    with pytest.raises(ValueError, match="no host link"):
        cm.full_kv_step_time(SMOL, CPU, 1024, 1, 4, offloaded=True)


def test_speedup_grows_with_ratio_and_acceptance():
    by_ratio = [speedup(ratio=r)["best_speedup"] for r in (1, 2, 4, 8, 16)]
    assert all(a < b for a, b in zip(by_ratio, by_ratio[1:])), by_ratio
    by_alpha = [speedup(alpha=a)["best_speedup"] for a in (0.5, 0.8, 0.9, 0.97, 1.0)]
    assert all(a < b for a, b in zip(by_alpha, by_alpha[1:])), by_alpha
    # on a capacity-limited device a 4x ratio also buys batch: more requests held
    held = speedup(hw=cm.h100_nvl_x2(), batch=32)["batch"]
    assert held["vericache_offloaded"] > held["full_resident"] >= 1


def test_speedup_bounds():
    for hw, shape in ((GPU, LLAMA), (CPU, SMOL)):
        for acc_len in (1.0, 8.0, 23.0, 31.0):
            p = speedup(hw=hw, shape=shape, acc_len=acc_len)
            # a round costs at least one full-KV pass (the verify), so it cannot beat acc_len
            assert p["speedup"]["vericache_resident"] <= acc_len
            assert p["best_speedup"] <= p["ideal_speedup"] + 1e-12
    # resident, unlimited memory, free flops, everything accepted, long drafts: the speedup
    # tends to the bandwidth bound (W + KV) / (W + KV / ratio), never above the ratio
    free_flops = replace(GPU, flops=1e30)
    context, batch, ratio = 32768, 8, 4.0
    weights = LLAMA.read_params() * 2
    kv = batch * context * LLAMA.kv_bytes_per_token(2)
    bound = (weights + kv) / (weights + kv / ratio)
    long_draft = cm.predict(LLAMA, free_flops, context, batch, 2, ratio, 20000, alpha=1.0)
    assert long_draft["speedup"]["vericache_resident"] == pytest.approx(bound, rel=0.01)
    assert bound < ratio


def test_round_overlap_hides_the_transfer():
    args = (LLAMA, GPU, 32768, 8, 2, 4.0, 30)
    resident = cm.vericache_round_time(*args, offloaded=False)
    overlapped = cm.vericache_round_time(*args, offloaded=True)
    serial = cm.vericache_round_time(*args, offloaded=True, overlap=False)
    transfer = 8 * 32768 * LLAMA.kv_bytes_per_token(2) / GPU.host_link_bw
    assert overlapped == pytest.approx(max(resident, transfer))
    assert serial == pytest.approx(resident + transfer)


def test_paper_example_within_tolerance():
    """Llama-70B on 2x H100 NVL, 4x, draft 30, acc_len 23 (paper: 102 -> 256 tok/s) under
    the assumptions in cm.PAPER_ASSUMPTIONS (32k context, 32 requests offered)."""
    rep = cm.paper_report()
    tok_s = rep["prediction"]["tok_s"]
    # the paper's baseline matches full KV RESIDENT with the batch capped by HBM ...
    assert tok_s["full_resident"] == pytest.approx(102, rel=0.35)
    assert tok_s["vericache_offloaded"] == pytest.approx(256, rel=0.35)
    assert rep["prediction"]["best_speedup"] == pytest.approx(256 / 102, rel=0.35)
    # ... and NOT full KV streamed over PCIe at every step: at 32k that gives ~12 tok/s,
    # and 102 tok/s would need a ~4k context, not the long-context setting. So we assert
    # only the looser relation the model can justify.
    assert tok_s["full_offloaded"] < 0.5 * 102
    assert 3000 < rep["context_where_streamed_baseline_is_102"] < 5000


def test_fraction_of_bound():
    assert cm.fraction_of_bound(2.0, 2.5) == pytest.approx(0.8)
    assert cm.gain_fraction(1.0, 1.25) == 0.0  # the lenient case fraction_of_bound warns of
    assert cm.gain_fraction(1.2, 0.9) is None
    with pytest.raises(ValueError):
        cm.fraction_of_bound(1.0, 0.0)


def test_predict_rejects_bad_acceptance():
    with pytest.raises(ValueError):
        speedup(acc_len=20.0, alpha=0.9)
    with pytest.raises(ValueError):
        cm.predict(LLAMA, GPU, 1024, 1, 2, 4.0, 30)
    with pytest.raises(ValueError):
        speedup(acc_len=32.0)  # more than draft_len + 1


def test_measured_report(tmp_path):
    rows = [{"context": 8192, "batch": 4, "compressor": c, "draft_len": 30, "mean_acc_len": 17.0,
             "tok_s_vc": 12.0, "tok_s_off": 15.0, "time_split": {"draft": 6.0, "verify": 3.0, "other": 1.0}}
            for c in ("kivi4", "streamingllm")]
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({"results": rows}))
    kivi, stream = cm.measured_report(path, CPU, nominal_ratio=4.0)["rows"]
    p = cm.predict(SMOL, CPU, 8192, 4, 4, 4.0, 30, acc_len=17.0)["best_speedup"]
    assert kivi["predicted_speedup"] == pytest.approx(p)
    assert kivi["fraction_of_bound"] == pytest.approx(0.8 / p)
    # our drafter reads a dequantized dense copy: kivi4 as built saves no draft bandwidth
    assert kivi["predicted_speedup_as_built"] < kivi["predicted_speedup"]
    assert stream["predicted_speedup_as_built"] == pytest.approx(stream["predicted_speedup"])
    assert kivi["draft_share"]["measured"] == pytest.approx(0.6)
    assert 0 < kivi["draft_share"]["predicted"] < 1


def test_cli_paper_writes_json(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cm.json"
    monkeypatch.setattr(sys, "argv", ["cost_model.py", "--paper", "--cpu-mem-bw", "7e9",
                                      "--cpu-flops", "4e10", "--out", str(out)])
    cm.main()
    result = json.loads(out.read_text())
    assert {"paper", "cpu", "commit"} <= set(result)
    assert [r["context"] for r in result["cpu"]["grid"]] == [2048, 2048, 4096, 4096, 8192, 8192]
    assert "VeriCache, full KV offloaded" in capsys.readouterr().out


def test_cheaper_draft_weights_shorten_only_the_draft_passes():
    """fp16 draft weights (2 bytes a parameter for an fp32 model) make a weight-bound round
    cheaper, never the full-KV arm; the gain vanishes where the KV dominates the bytes."""
    args = (SMOL, CPU, 2048, 4, 4, 4.0, 16)
    fp32 = cm.vericache_round_time(*args, offloaded=False)
    fp16 = cm.vericache_round_time(*args, offloaded=False, draft_weight_bytes=2)
    assert fp16 < fp32
    p32 = cm.predict(*args, acc_len=12.0)
    p16 = cm.predict(*args, acc_len=12.0, draft_weight_bytes=2)
    assert p16["tok_s"]["full_resident"] == p32["tok_s"]["full_resident"]
    assert p16["best_speedup"] > p32["best_speedup"]
    weights_only = cm.vericache_round_time(SMOL, CPU, 1, 1, 4, 4.0, 16, offloaded=False)
    long_kv = cm.vericache_round_time(LLAMA, GPU, 131072, 32, 2, 4.0, 16, offloaded=False)
    gain_short = weights_only / cm.vericache_round_time(SMOL, CPU, 1, 1, 4, 4.0, 16, offloaded=False,
                                                        draft_weight_bytes=2)
    gain_long = long_kv / cm.vericache_round_time(LLAMA, GPU, 131072, 32, 2, 4.0, 16, offloaded=False,
                                                  draft_weight_bytes=1)
    assert gain_short > gain_long > 1


def test_cpu_attention_paths_price_each_pass():
    """A slow full-KV path (the CPU engine's gather + strided SDPA) slows the off arm and
    VeriCache's verify, never the draft passes; the per-call overhead counts per request
    and layer on the full-KV path only."""
    slow = replace(CPU, full_kv_bw=CPU.mem_bw / 10)
    base_step = cm.full_kv_step_time(SMOL, CPU, 8192, 4, 4)
    assert cm.full_kv_step_time(SMOL, slow, 8192, 4, 4) > 3 * base_step
    draft = cm._pass_time(SMOL, CPU, 8192, 4, 4, 1, 4.0, draft=True)
    assert cm._pass_time(SMOL, slow, 8192, 4, 4, 1, 4.0, draft=True) == draft
    calls = replace(CPU, attn_call_overhead_s=1e-4)
    assert cm.full_kv_step_time(SMOL, calls, 8192, 4, 4) == pytest.approx(base_step + 4 * SMOL.layers * 1e-4)
    assert cm._pass_time(SMOL, calls, 8192, 4, 4, 1, 4.0, draft=True) == draft
    # the verify pass (several tokens) may run at its own rate; one-token steps keep theirs
    slow_verify = replace(CPU, verify_kv_bw=CPU.mem_bw / 10)
    assert cm._pass_time(SMOL, slow_verify, 8192, 4, 4, 17) > cm._pass_time(SMOL, CPU, 8192, 4, 4, 17)
    assert cm.full_kv_step_time(SMOL, slow_verify, 8192, 4, 4) == base_step
    # a slower full-KV path leaves more for VeriCache to win: its drafts skip it
    assert cm.predict(SMOL, slow, 8192, 4, 4, 4.0, 16, acc_len=13)["best_speedup"] > \
        cm.predict(SMOL, CPU, 8192, 4, 4, 4.0, 16, acc_len=13)["best_speedup"]


def test_fitted_overhead_recovers_a_known_one(tmp_path):
    """Rows whose off arm runs at the model's step time plus 40 ms give back 40 ms, and
    the fitted model then predicts that off arm exactly."""
    rows = []
    for context in (2048, 8192):
        for batch in (1, 4):
            step = cm.full_kv_step_time(SMOL, CPU, context, batch, 4) + 0.040
            rows.append({"context": context, "batch": batch, "compressor": "streamingllm", "draft_len": 16,
                         "mean_acc_len": 12.0, "tok_s_vc": 2 * batch / step, "tok_s_off": batch / step})
    assert cm.fit_step_overhead(rows, CPU) == pytest.approx(0.040)
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({"results": rows}))
    rep = cm.measured_report(path, CPU, 4.0, fit_overhead=True)
    assert rep["fitted_step_overhead_s"] == pytest.approx(0.040)
    for r in rep["rows"]:
        assert r["tok_s_off"]["predicted"] == pytest.approx(r["tok_s_off"]["measured"])
    assert cm.measured_report(path, CPU, 4.0)["fitted_step_overhead_s"] is None


def _bench_kernels_json(draft_fraction=0.7, full_fraction=0.8, loader_gbps=50.0, verify_fractions=None):
    """A small bench_kernels.py result: Llama-70B/TP8 heads at 32k x 8 (and one far-off combo)."""
    peak, full_bytes = 4.8e12, 2 * 8 * 32768 * 1 * 128 * 2

    def row(kind, method, fraction, read_ratio=1.0, context=32768, batch=8):
        nbytes = full_bytes / read_ratio
        ms = nbytes / (fraction * peak) * 1e3
        return {"shape": "llama70b-tp8", "context": context, "batch": batch, "full_kv_bytes": full_bytes,
                "kind": kind, "method": method, "ms": ms, "bytes_read": nbytes, "read_ratio": read_ratio,
                "hbm_fraction": fraction}

    rows = [row("full", "triton_paged", full_fraction), row("full", "torch_sdpa", full_fraction / 2),
            row("draft", "kivi4", draft_fraction, 3.2), row("draft", "droppers", draft_fraction, 4.0),
            row("draft", "int8", draft_fraction, 1.97),
            row("full", "triton_paged", 0.1, context=8192, batch=1),
            {"shape": "llama70b-tp8", "context": 32768, "batch": 8, "kind": "draft", "method": "kivi2",
             "error": "OutOfMemoryError"}]
    for method, fraction in (verify_fractions or {}).items():
        rows.append(row("verify", method, fraction))
    return {"hbm_bytes_per_s": peak, "gpu": "synthetic", "rows": rows, "loader": {"GBps": loader_gbps}}


def test_gpu_kernel_terms_pick_the_nearest_combo_and_the_faster_baseline():
    terms = gp.gpu_kernel_terms(_bench_kernels_json(), context=32768, batch=8)
    assert (terms["context"], terms["batch"]) == (32768, 8)
    assert terms["full"]["method"] == "triton_paged" and terms["full"]["hbm_fraction"] == pytest.approx(0.8)
    assert terms["draft"]["kivi4"]["read_ratio"] == pytest.approx(3.2)
    assert terms["draft"]["droppers"]["speedup_vs_full"] == pytest.approx(4.0 * 0.7 / 0.8)
    assert "kivi2" not in terms["draft"]  # a row that failed to run carries no terms
    assert terms["host_link_GBps"] == 50.0
    far = gp.gpu_kernel_terms(_bench_kernels_json(), context=4096, batch=1)
    assert (far["context"], far["batch"]) == (8192, 1)
    with pytest.raises(ValueError, match="no timed full-KV rows for shape 'llama3-8b'"):
        gp.gpu_kernel_terms(_bench_kernels_json(), shape="llama3-8b")


def test_gpu_projection_uses_the_measured_attention_terms():
    """Measured efficiencies below the peak can only slow both arms relative to the roofline;
    a slower draft kernel lowers VeriCache's projection and leaves the full-KV arm alone; at
    the peak with the roofline's link the projection is the roofline's (paper_report)."""
    proj = gp.gpu_projection(gp.gpu_kernel_terms(_bench_kernels_json()))
    roof = proj["roofline"]["tok_s"]
    for name in ("kivi4", "droppers", "int8"):
        m = proj["methods"][name]
        assert m["tok_s"]["full_resident"] < roof["full_resident"]
        assert 0 < m["tok_s"]["vericache_offloaded"] and m["vericache_over_paper"] == pytest.approx(
            m["tok_s"]["vericache_offloaded"] / 256)
    assert proj["methods"]["droppers"]["tok_s"]["vericache_offloaded"] > proj["methods"]["int8"]["tok_s"][
        "vericache_offloaded"]  # reads 1/4 against 1/2, at the same efficiency
    slow = gp.gpu_projection(gp.gpu_kernel_terms(_bench_kernels_json(draft_fraction=0.2)))["methods"]["kivi4"]
    assert slow["tok_s"]["vericache_offloaded"] < proj["methods"]["kivi4"]["tok_s"]["vericache_offloaded"]
    assert slow["tok_s"]["full_resident"] == proj["methods"]["kivi4"]["tok_s"]["full_resident"]
    ideal = _bench_kernels_json(draft_fraction=1.0, full_fraction=1.0, loader_gbps=64.0)
    at_peak = gp.gpu_projection(gp.gpu_kernel_terms(ideal))["methods"]["droppers"]
    assert at_peak["tok_s"]["full_resident"] == pytest.approx(roof["full_resident"])
    assert at_peak["tok_s"]["vericache_offloaded"] == pytest.approx(roof["vericache_offloaded"])
    assert "upper bound" in proj["why"]


def test_gpu_projection_prices_verify_by_the_verify_kernel_where_timed():
    """The verify pass's attention: the timed verify kernel whose block is nearest the paper's
    draft_len + 1 (31 tokens: the 17-token row, not the 5-token one, nor the torch path's);
    absent, the full-KV decode's share. A slower verify lowers only VeriCache's arms: the
    resident one at once, the offloaded one (bound by the host link at the paper's setting)
    once the verify's attention outlasts what the link hides (here at 2% of HBM)."""
    plain = gp.gpu_projection(gp.gpu_kernel_terms(_bench_kernels_json()))
    assert plain["terms"]["verify"] is None
    data = _bench_kernels_json(verify_fractions={"triton_verify_t5": 0.8, "triton_verify_t17": 0.4,
                                                 "torch_verify_t17": 0.01})
    terms = gp.gpu_kernel_terms(data)
    assert terms["verify"]["method"] == "triton_verify_t17" and terms["verify"]["verify_tokens"] == 17
    assert terms["verify"]["decode_steps"] == pytest.approx(2.0)  # 0.8 of HBM against 0.4: twice a decode step
    slow = gp.gpu_projection(terms)
    crawl = gp.gpu_projection(gp.gpu_kernel_terms(_bench_kernels_json(verify_fractions={"triton_verify_t17": 0.02})))
    for name in ("kivi4", "droppers"):
        a, b, c = (p["methods"][name]["tok_s"] for p in (plain, slow, crawl))
        assert b["vericache_resident"] < a["vericache_resident"] and b["full_resident"] == a["full_resident"]
        assert b["vericache_offloaded"] <= a["vericache_offloaded"] and c["vericache_offloaded"] < a[
            "vericache_offloaded"]
        assert c["full_resident"] == a["full_resident"] and c["full_offloaded"] == a["full_offloaded"]
    same = gp.gpu_projection(gp.gpu_kernel_terms(_bench_kernels_json(verify_fractions={"triton_verify_t17": 0.8})))
    assert same["methods"]["kivi4"]["tok_s"] == pytest.approx(plain["methods"]["kivi4"]["tok_s"])


def test_cli_gpu_kernels_writes_the_projection(tmp_path, monkeypatch, capsys):
    src, out = tmp_path / "bench_kernels.json", tmp_path / "cm.json"
    src.write_text(json.dumps(_bench_kernels_json()))
    monkeypatch.setattr(sys, "argv", ["cost_model.py", "--gpu-kernels", str(src), "--out", str(out)])
    cm.main()
    result = json.loads(out.read_text())
    assert set(result["gpu_projection"]["methods"]) == {"kivi4", "droppers", "int8"}
    assert "of the paper's 256" in capsys.readouterr().out


def test_hbm_peak_follows_the_device(monkeypatch):
    """bench_kernels' shares of the HBM peak use the lent device's own peak: an H100 SXM's
    3.35 TB/s is not divided by the H200's 4.8 (which would understate every share by 30%)."""
    import torch

    import gpu_timer as gt

    cuda = torch.device("cuda", 0)
    names = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H100 NVL": 3.9e12,
             "NVIDIA H100 PCIe": 2.0e12, "NVIDIA GH200 480GB": 4.0e12}
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        got, source = gt.hbm_peak(cuda)
        assert got == pytest.approx(peak) and "datasheet" in source, name
    # an unknown device: memory clock (kHz) x bus width (bits) x 2 transfers a clock
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    props = type("Props", (), {"memory_clock_rate": 9001000, "memory_bus_width": 384})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    got, source = gt.hbm_peak(cuda)
    assert got == pytest.approx(2 * 9.001e9 * 48) and "clock" in source
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: object())
    with pytest.raises(RuntimeError, match="--hbm-tbps"):
        gt.hbm_peak(cuda)
    assert gt.hbm_peak(cuda, 3.0) == (3.0e12, "--hbm-tbps")
    with pytest.raises(ValueError, match="positive"):
        gt.hbm_peak(cuda, 0.0)
