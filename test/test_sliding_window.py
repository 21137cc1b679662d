"""Exactness on a model with sliding-window layers (Gemma 3's layout; gpt-oss, OLMo 3 and
Gemma 2 alike): greedy token ids with VERICACHE equal speculation off past the window.

The model is a tiny random-weight Gemma 3 text model (2 layers: one sliding-window layer of
16 positions, one full; the default model's tokenizer), built with transformers in the
test's temporary directory. Its prompts are 70 and 79 tokens, so every verify round sees
positions its window has left. Before verify attention followed windows, the first rounds
already diverged (token 1 of both requests: checked by hand with the window ignored).

The second request drafts with the ``full`` compressor, so its drafts differ from the
target's tokens only where draft attention differs from the target's: window layers draft
over the pool's last window tokens (spec/window_draft.py), and it needs the 5 rounds of a
perfect draft (30 when the window layer drafted over the whole context).
"""

from __future__ import annotations

import json

from engines import greedy_pair, save_tiny_model, tiny_prompts

WINDOW, PROMPTS, NEW = 16, (70, 79), 40


def _tiny_gemma3(dest, tokenizer_dir, window=WINDOW):
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048,
                              query_pre_attn_scalar=16, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # wide enough that outputs vary (the default init repeats one token)
        for p in model.parameters():
            p.normal_(std=0.05)
    save_tiny_model(model, dest, tokenizer_dir)
    return model


def test_greedy_ids_equal_speculation_off_past_the_window(default_model_path, tmp_path):
    import torch

    model_dir = tmp_path / "gemma3-tiny"
    model = _tiny_gemma3(model_dir, default_model_path)
    # the window matters for these prompts: transformers' own greedy decode changes without it
    ids = torch.tensor([tiny_prompts(PROMPTS)[0]])
    windowed = model.generate(ids, max_new_tokens=12, do_sample=False)[0, PROMPTS[0]:].tolist()
    wide = _tiny_gemma3(tmp_path / "wide", default_model_path, window=4096)
    assert wide.generate(ids, max_new_tokens=12, do_sample=False)[0, PROMPTS[0]:].tolist() != windowed
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["sliding_window"] == WINDOW

    ref, _, _ = greedy_pair(model_dir, False, tiny_prompts(PROMPTS), NEW)
    ours, rounds, state = greedy_pair(model_dir, True, tiny_prompts(PROMPTS), NEW)
    assert len(set(ref[0])) > 3, ref  # not one repeated token
    assert ours == ref, [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(ours, ref)]
    assert all(0 < r < NEW for r in rounds), rounds  # it speculated
    # drafts over the full KV with the target's window are the target's tokens: 40 tokens in 5
    # rounds of 8 drafts + 1 (rounding aside). Drafting the window layer over the whole context
    # (before spec/window_draft.py) took 30 rounds
    assert rounds[1] <= 7, rounds
    assert state["vericache_kernels"]["head_layout"].startswith("HeadLayout(num_q_heads=4, num_kv_heads=2, head_dim=16")
    windows = state["vericache_windows"]
    assert windows["layers"] == 1 and windows["drafts"] == "over the full KV pool", windows
    assert len(windows["windows"]) == 1 and WINDOW - 1 <= windows["windows"][0] <= WINDOW, windows
