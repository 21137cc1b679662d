"""Exactness on a model with attention sinks (gpt-oss's layout: a learned per-head logit in
every softmax's denominator; Granite-SWA and MiMo-V2 alike): greedy token ids with
VERICACHE equal speculation off.

The model is a tiny random-weight Granite-SWA (2 layers: one sliding-window layer of 16
positions, one full; sinks on both; the default model's tokenizer), built with transformers
in the test's temporary directory. SGLang's CPU attention (torch_native) takes no sinks:
sglang/attention.py gives it ``cpu.attention.explicit_attention``, and the speculation-off
engine's greedy ids are checked against transformers' own first. Before VeriCache's verify
took the sinks (its backend dropped them), its logits were not decode's on any GPU backend.

The second request drafts with the ``full`` compressor, so its drafts differ from the
target's tokens only where draft attention differs from the target's: with sinks applied
in the drafts too, it needs the 5 rounds of a perfect draft.
"""

from __future__ import annotations

from engines import greedy_pair, save_tiny_model, tiny_prompts

WINDOW, PROMPTS, NEW = 16, (70, 79), 40


def _tiny_granite_swa(dest, tokenizer_dir, sinks=True):
    import torch
    from transformers import GraniteSWAConfig, GraniteSWAForCausalLM

    config = GraniteSWAConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048,
                              bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = GraniteSWAForCausalLM(config)
    with torch.no_grad():  # wide enough that outputs vary and the sinks take a real share
        for name, p in model.named_parameters():
            p.normal_(std=0.12)
            if name.endswith("sinks"):
                p.normal_(mean=3.0, std=1.0) if sinks else p.fill_(-60.0)  # exp(-60): no share at all
    save_tiny_model(model, dest, tokenizer_dir)
    return model


def test_greedy_ids_equal_speculation_off_with_attention_sinks(default_model_path, tmp_path):
    import torch

    model_dir = tmp_path / "granite-swa-tiny"
    model = _tiny_granite_swa(model_dir, default_model_path)
    ids = torch.tensor([tiny_prompts(PROMPTS)[0]])
    hf = model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, PROMPTS[0]:].tolist()
    # the sinks matter for these prompts: transformers' own greedy decode changes without them
    plain = _tiny_granite_swa(tmp_path / "no-sinks", default_model_path, sinks=False)
    assert plain.generate(ids, max_new_tokens=NEW, do_sample=False)[0, PROMPTS[0]:].tolist() != hf

    # Granite-SWA gets SGLang's hybrid sliding-window pool by default, which VERICACHE refuses (the
    # launcher passes this flag; an Engine built directly must)
    ref, _, _ = greedy_pair(model_dir, False, tiny_prompts(PROMPTS), NEW, disable_hybrid_swa_memory=True)
    assert len(set(ref[0])) > 3, ref  # not one repeated token
    # SGLang's CPU engine with sink attention decodes as transformers does (fp32 both; the
    # first tokens, before summation order may tip a near-tie)
    assert ref[0][:12] == hf[:12], (ref[0][:12], hf[:12])
    ours, rounds, state = greedy_pair(model_dir, True, tiny_prompts(PROMPTS), NEW, disable_hybrid_swa_memory=True)
    assert ours == ref, [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(ours, ref)]
    assert all(0 < r < NEW for r in rounds), rounds  # it speculated
    # drafts over every token with the target's sinks and window are the target's tokens:
    # 40 tokens in 5 rounds of 8 drafts + 1 (rounding aside)
    assert rounds[1] <= 7, rounds
    assert "sinks=True" in state["vericache_kernels"]["head_layout"], state["vericache_kernels"]
