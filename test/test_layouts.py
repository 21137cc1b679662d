"""Compressors against the model's attention layout (``KVCompressor.check_layout``): a
request's override is refused before admission (a 400 naming the value), a configured
compressor the model cannot use is refused at start, and ``auto`` leaves such candidates
out. A KIVI group size that does not divide head_dim used to raise at a request's first
round and stop the scheduler. CPU, no engine."""

from __future__ import annotations

import types

import pytest
import torch

from sgl_vericache.config import VeriCacheConfig, request_config

SMOLLM2 = ((3, 64),)  # (num_kv_heads, head_dim) of SmolLM2-135M's attention
PHI2 = ((32, 80),)  # head_dim 80 (Phi-2, Pythia-2.8B, StableLM-3B): not a multiple of KIVI's default group 32


def test_request_overrides_are_checked_against_the_models_heads():
    """A KIVI group size that does not divide head_dim passed every check and raised at the
    request's first round, which stopped the scheduler: refused here, naming the value."""
    server = VeriCacheConfig()
    for options in ("group_size=48", "group_size=3"):
        with pytest.raises(ValueError, match=f"kivi4: {options} does not divide head_dim=64 .*a divisor of 64"):
            request_config({"vericache_compressor": "kivi4", "vericache_compressor_options": options}, server, SMOLLM2)
    with pytest.raises(ValueError, match="kivi2: group_size=6 does not divide head_dim=64"):
        request_config({"vericache_compressor": "kivi2", "vericache_compressor_options": {"group_size": 6}}, server,
                       SMOLLM2)
    for group in (16, 32, 64):
        cfg = request_config({"vericache_compressor": "kivi4", "vericache_compressor_options": f"group_size={group}"},
                             server, SMOLLM2)
        assert cfg.build_compressor().options["group_size"] == group
    with pytest.raises(ValueError, match="group_size=32 does not divide head_dim=80"):
        request_config({"vericache_compressor": "kivi4"}, server, PHI2)
    assert request_config({"vericache_compressor": "auto"}, server, PHI2).compressor == "auto"  # it picks one that fits
    assert request_config({"vericache_compressor": "kivi4", "vericache_compressor_options": "group_size=48"},
                          server).compressor == "kivi4"  # no layout known: not checked


class _Req:
    """The parts of SGLang's Req the Planner reads."""

    def __init__(self, rid, custom_params=None, prompt_len=100):
        self.rid, self.origin_input_ids, self.output_ids = rid, [1] * prompt_len, []
        self.sampling_params = types.SimpleNamespace(custom_params=custom_params, max_new_tokens=16)


def _planner(vc, aborted=None):
    from sgl_vericache.spec.plan import Planner
    from sgl_vericache.spec.stats import Stats

    def abort(req, message, status=400):
        assert aborted is not None, message  # no request is to be aborted
        aborted.append((req.rid, status, message))

    return Planner(vc, Stats(False), abort, vc.build_compressor())


@pytest.mark.parametrize("adaptive", [True, False])
def test_auto_leaves_out_the_candidates_a_model_cannot_use(adaptive, caplog):
    """On a head_dim-80 model kivi4 (group 32) would raise at the first round of any request
    auto chose it for: the planner drops it (logged), and the warm-up and memory plan see
    only the rest."""
    planner = _planner(VeriCacheConfig(adaptive=adaptive))
    planner.serve_layouts(PHI2)
    assert planner.candidates == ("streamingllm",)
    assert "chooses without kivi4 on this model (32 KV heads of head_dim 80)" in caplog.text, caplog.text
    assert [c.name for c in planner.configured_compressors()] == ["streamingllm"]
    plans = planner.plan_arriving([_Req(f"r{i}", prompt_len=n) for i, n in enumerate((10, 4000))])
    assert [p.compressor.name for p in plans] == ["streamingllm", "streamingllm"]
    planner = _planner(VeriCacheConfig(adaptive=adaptive))
    planner.serve_layouts(SMOLLM2)  # head_dim 64: both candidates stay
    assert planner.candidates == ("streamingllm", "kivi4")


@pytest.mark.parametrize("compressor, options", [("kivi4", ""), ("kivi2", ""), ("kivi4", "group_size=48")])
def test_a_configured_compressor_the_model_cannot_use_is_refused_at_start(compressor, options):
    from sgl_vericache.spec.plan import served_compressors

    vc = VeriCacheConfig(compressor=compressor, compressor_options=options)
    with pytest.raises(ValueError) as info:
        _planner(vc).serve_layouts(PHI2)
    message = str(info.value)
    assert message.startswith(f"--vericache-compressor {compressor} cannot serve this model's attention "
                              "(32 KV heads of head_dim 80)"), message
    assert "does not divide head_dim=80" in message and "--vericache-compressor-options" in message, message
    assert served_compressors(VeriCacheConfig(compressor=compressor, compressor_options="group_size=16"),
                              PHI2) == (compressor,)


def test_the_worker_gives_the_planner_every_attention_layers_shape():
    """What the worker checks at start (``Planner.serve_layouts``): each distinct (KV heads,
    head_dim) of its attention layers, as compress() will see them."""
    from sglang.srt.layers.radix_attention import RadixAttention

    from sgl_vericache.sglang.worker import WorkerSeam

    model = torch.nn.ModuleList([RadixAttention(32, 80, 0.1, 32, layer_id=i) for i in range(2)]
                                + [RadixAttention(8, 128, 0.1, 2, layer_id=2)])
    seam = WorkerSeam.__new__(WorkerSeam)
    seam.model_runner = types.SimpleNamespace(model=model)
    assert seam.kv_layouts() == ((2, 128), (32, 80))
    with pytest.raises(ValueError, match="group_size=32 does not divide head_dim=80"):
        _planner(VeriCacheConfig(compressor="kivi4")).serve_layouts(seam.kv_layouts())


def test_the_planner_refuses_an_override_the_model_cannot_use():
    """The scheduler's side, for a request the tokenizer's checks did not see (they are off,
    or another entry point): a 400 for that request at its plan, not the first round's raise.
    A request asking for auto on a server of a named compressor gets a candidate that fits."""
    aborted = []
    planner = _planner(VeriCacheConfig(compressor="int8"), aborted)
    planner.serve_layouts(PHI2)
    bad = _Req("bad", {"vericache_compressor": "kivi4"})
    good = _Req("good", {"vericache_compressor": "kivi4", "vericache_compressor_options": "group_size=16"})
    auto = _Req("auto", {"vericache_compressor": "auto"})
    plans = planner.plan_arriving([bad, good, auto])
    ((rid, status, message),) = aborted
    assert (rid, status) == ("bad", 400) and "group_size=32 does not divide head_dim=80" in message, message
    assert plans[0].error and plans[1].compressor.name == "kivi4" and plans[2].compressor.name == "streamingllm"
