"""Which model architectures VERICACHE serves exactly on SGLang's CPU engine.

For each architecture: a tiny random-weight model (transformers' own class, 2 layers, hidden
64, the default model's tokenizer), served by SGLang's CPU engine speculation off and with
VERICACHE (streamingllm, draft length 8; the second request drafts with the ``full``
compressor), two greedy requests of 40 and 70 prompt tokens x 24 new tokens
(``test/engines.py: greedy_pair``). Each architecture runs in a process of its own (a
scheduler that fails takes its process group with it). Outcomes:

- ``equal``: VERICACHE's ids equal speculation off's (and the verify rounds per request);
- ``DIFFERS``: they do not, an exactness bug;
- ``refused``: the VERICACHE engine refused the model at start (the message is kept),
  while speculation off served it;
- ``not on CPU``: SGLang's CPU engine does not serve it with speculation off either (or the
  run died before speculation off had served it);
- ``FAILED``: anything else (the last error line is kept).

    python scripts/check_models.py                       # every architecture, ~50 s each
    python scripts/check_models.py --models qwen3,gemma2 --out /tmp/models.json
    python scripts/check_models.py --from-json   # docs/models.md's table from the JSON

Writes JSON (``--out``, default benchmark/results/model_check.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
WINDOW = dict(sliding_window=16)
# name -> (transformers config class, model class, config keywords, config.json keys SGLang reads)
ARCHITECTURES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}), {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16), {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None), {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0), {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(pad_token_id=0), {}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(pad_token_id=0, **WINDOW), {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(attention_multiplier=0.2, residual_multiplier=0.5,
                                                           embedding_multiplier=2.0, logits_scaling=4.0), {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=16, pad_token_id=0), {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}, {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, attn_logit_softcapping=20.0,
                                                        final_logit_softcapping=None, pad_token_id=0, **WINDOW),
               {"hidden_act": "gelu_pytorch_tanh"}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=16, decoder_sparse_step=1, num_experts=4,
                                                               num_experts_per_tok=2, moe_intermediate_size=32), {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, query_pre_attn_scalar=16, pad_token_id=0,
                                                            layer_types=["sliding_attention", "full_attention"],
                                                            **WINDOW), {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(pad_token_id=0), {}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(pad_token_id=0, layer_types=["sliding_attention",
                                                                                         "full_attention"], **WINDOW),
                {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=None), {}),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.5, num_key_value_heads=4), {}),  # SGLang: MHA
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_inner=128, multi_query=True), {}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=16, pad_token_id=0), {}),
    "hunyuan_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(head_dim=16, pad_token_id=0), {}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}, {}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(pad_token_id=0), {}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0,
                                                     num_key_value_heads=4), {}),  # SGLang's q/k norms: MHA
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), {}),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                        sliding_window=None), {}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                                            moe_intermediate_size=32, first_k_dense_replace=1,
                                                            n_shared_experts=1, pad_token_id=0), {}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1, pad_token_id=0),
        {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(shared_expert_intermediate_size=32,
                                                               decoder_sparse_step=1, num_experts=4,
                                                               num_experts_per_tok=2, moe_intermediate_size=32), {}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=2, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "rope_theta": 10000.0}),
        {"moe_layer_freq": 1, "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
                                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                               "rope_theta": 10000.0}}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(head_dim=16, pad_token_id=0, **WINDOW), {}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                         pad_token_id=0, **WINDOW), {}),
}

# name -> (std of the random weights, whether the embeddings get them too), where the default's
# greedy output is a few tokens repeated: Gemma 2 scales its tied embeddings by sqrt(hidden),
# Gemma 3 saturates; norms (LayerNorm's "ln_" too) keep their initial weights
INIT = {"gemma2": (0.3, False), "gemma3": (0.05, True), "starcoder2": (0.3, True)}


def build(name: str, dest: Path) -> None:
    """The tiny model, saved with the default model's tokenizer."""
    import torch
    import transformers

    from engines import save_tiny_model
    from sgl_vericache.default_model import default_model_dir

    config_cls, model_cls, keywords, config_json = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, **keywords}))
    std, embeddings = INIT.get(name, (0.12, True))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" not in param_name and "ln_" not in param_name and (embeddings or "embed" not in param_name):
                param.normal_(0, std)
    save_tiny_model(model, dest, default_model_dir())
    if config_json:
        path = dest / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config_json}, indent=1))


def run_one(name: str, workdir: Path) -> dict:
    """Both arms on one architecture (in this process); the outcome as a dict."""
    from engines import greedy_pair, tiny_prompts

    dest = workdir / name
    if not dest.exists():
        build(name, dest)
    prompts = tiny_prompts([40, 70])
    try:
        off, _, _ = greedy_pair(dest, False, prompts, 24)
    except Exception as e:  # noqa: BLE001 - SGLang's CPU engine does not serve it
        return {"outcome": "not on CPU", "why": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    print(f"{name}: speculation off served", flush=True)
    on, rounds, _ = greedy_pair(dest, True, prompts, 24)
    return {"outcome": "equal" if on == off else "DIFFERS", "verify_rounds": rounds,
            "distinct_tokens_off": [len(set(o)) for o in off]}


def last_error(text: str) -> str:
    lines = [line for line in text.splitlines() if "Error" in line and not line.startswith(" ")]
    return lines[-1][:400] if lines else text.strip().splitlines()[-1][:400] if text.strip() else ""


DOC = ROOT / "docs" / "models.md"
MARKERS = ("<!-- model-check:start -->", "<!-- model-check:end -->")


def table(results: dict) -> str:
    """The results as docs/models.md's table."""
    rows = ["| architecture | transformers class | outcome | verify rounds | note |", "|---|---|---|---|---|"]
    for name, r in results.items():
        rounds = " / ".join(map(str, r.get("verify_rounds", []))) or "-"
        note = r.get("why", "")
        if "distinct_tokens_off" in r:
            note = f"distinct tokens off: {' / '.join(map(str, r['distinct_tokens_off']))}"
        rows.append(f"| {name} | `{ARCHITECTURES[name][1]}` | {r['outcome']} | {rounds} | {note.replace('|', '/')} |")
    return "\n".join(rows)


def update_doc(results: dict) -> None:
    text = DOC.read_text()
    start, end = text.index(MARKERS[0]) + len(MARKERS[0]), text.index(MARKERS[1])
    DOC.write_text(text[:start] + "\n" + table(results) + "\n" + text[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(ARCHITECTURES),
                        help=f"comma-separated, of: {', '.join(ARCHITECTURES)}")
    parser.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "model_check.json"),
                        help="the JSON written (default: %(default)s)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per architecture")
    parser.add_argument("--update-doc", action="store_true", help=f"rewrite the table in {DOC.relative_to(ROOT)}")
    parser.add_argument("--from-json", action="store_true", help="rewrite the doc's table from --out's JSON, running nothing")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "test"))
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, Path(args.workdir))), flush=True)
        return 0
    if args.from_json:
        update_doc(json.loads(Path(args.out).read_text())["results"])
        return 0
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(ARCHITECTURES)}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="vc-models-") as workdir:
        for i, name in enumerate(names, 1):
            print(f"[{i}/{len(names)}] {name} ...", flush=True)
            t0 = time.time()
            try:
                proc = subprocess.run([sys.executable, __file__, "--one", name, "--workdir", workdir],
                                      capture_output=True, text=True, timeout=args.timeout, start_new_session=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
                out = proc.stdout + proc.stderr
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is not None:
                    result = json.loads(line[len("RESULT "):])
                elif f"{name}: speculation off served" not in proc.stdout:  # its scheduler took the process
                    result = {"outcome": "not on CPU", "why": last_error(out)}
                elif "--speculative-algorithm VERICACHE" in out:
                    result = {"outcome": "refused", "why": last_error(out)}
                else:
                    result = {"outcome": "FAILED", "why": last_error(out), "returncode": proc.returncode}
            except subprocess.TimeoutExpired:
                result = {"outcome": "FAILED", "why": f"timed out after {args.timeout} s"}
            result["seconds"] = round(time.time() - t0, 1)
            results[name] = result
            print(f"    {result['outcome']}  {json.dumps({k: v for k, v in result.items() if k != 'outcome'})}",
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"what": __doc__.split("\n\n")[0], "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    if args.update_doc:
        update_doc(results)
        print(f"updated {DOC}")
    return 1 if any(r["outcome"] in ("DIFFERS", "FAILED") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
