"""What the target model's attention layers do, read off SGLang's modules (``RadixAttention``
and the attributes its models set): the checks the worker runs at start (a model whose
decode attention VeriCache's verify would not reproduce, or whose layers share another
layer's KV, is refused), and each layer's sliding window, soft cap and attention sinks as
the draft and verify attention apply them."""

from __future__ import annotations

import torch


def unreproduced_attention(model, model_config, device) -> list:
    """What the target's attention layers do that VeriCache's verify does not compute, on a
    device whose SGLang backends do it (CUDA; the CPU engine's torch_native does none of it,
    so speculation off ignores it there too): Grok's attention temperature
    (``xai_temperature_len``), a soft cap other than tanh, a positional mode applied in the
    kernel (ALiBi), Llama 4's chunked local attention, cross-attention. One line each; empty
    when verify's logits are decode's. Checked when the worker starts (``check_attention``)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    if torch.device(device).type != "cuda":
        return []
    layers = [m for m in model.modules() if isinstance(m, RadixAttention)]
    found = []
    if any(getattr(m, "xai_temperature_len", -1) > 0 for m in layers):
        found.append("attention temperature by position (xai_temperature_len, Grok)")
    methods = {getattr(m, "logit_capping_method", "tanh") for m in layers if getattr(m, "logit_cap", 0)}
    if methods - {"tanh"}:
        found.append(f"logit capping method {sorted(methods - {'tanh'})} (verify caps by tanh only)")
    modes = {str(getattr(m, "pos_encoding_mode", "NONE")) for m in layers} - {"NONE", "None"}
    if modes:
        found.append(f"positional encoding in the attention kernel {sorted(modes)}")
    if getattr(model_config, "attention_chunk_size", None) and any(getattr(m, "use_irope", False) for m in layers):
        found.append(f"chunked local attention (attention_chunk_size {model_config.attention_chunk_size}, Llama 4)")
    if any(getattr(m, "is_cross_attention", False) for m in layers):
        found.append("cross-attention layers")
    return found


def shared_kv_layers(model) -> list:
    """Layer ids of ``model``'s attention layers that read an earlier layer's KV instead of
    their own: Gemma 3n and Gemma 4 end with layers (``is_kv_shared_layer``) that compute
    no keys or values (``k``, ``v`` None, ``save_kv_cache=False``) and attend over the KV of
    ``kv_shared_layer_index``. Empty for every other model (an MLA layer's two attention
    modules, one per prefill and decode form, share one id and their own KV: not these)."""
    return sorted({getattr(m, "layer_id", -1) for m in model.modules()
                   if getattr(m, "is_kv_shared_layer", False) and getattr(m, "kv_shared_layer_index", None) is not None})


def check_attention(model, model_config, device) -> None:
    """Refuse at start a model whose decode attention verify would not reproduce (its outputs
    would differ from speculation off), naming what; and, on every device, one whose layers
    share another layer's KV: a draft step gives each layer's attention its own new keys and
    values (those layers pass none, and the first draft round would fail)."""
    shared = shared_kv_layers(model)
    if shared:
        raise ValueError("--speculative-algorithm VERICACHE does not draft for attention layers that read another "
                         f"layer's KV (KV sharing, Gemma 3n / Gemma 4: layers {shared}); serve it with "
                         "--no-vericache-enable")
    found = unreproduced_attention(model, model_config, device)
    if found:
        raise ValueError("--speculative-algorithm VERICACHE cannot verify this model exactly: its attention "
                         f"layers use {'; '.join(found)}, which VeriCache's verify attention does not compute; "
                         "serve it with --no-vericache-enable")


# where SGLang's models keep the attention sinks they pass to their attention as ``sinks``
SINK_ATTRIBUTES = ("sinks", "attention_sink_bias")


def has_attention_sinks(model) -> bool:
    """Whether ``model``'s attention modules hold attention sinks (gpt-oss, Granite-SWA,
    MiMo-V2), which they pass to every attention call: the warm-up then compiles the split
    merge's variant that adds them. Only a warm-up hint: what a call passes is what applies."""
    return any(isinstance(getattr(m, name, None), torch.Tensor) for m in model.modules() for name in SINK_ATTRIBUTES)


def sliding_windows(model) -> dict:
    """Layer id -> window of each sliding-window attention layer of ``model`` (none: {})."""
    from sglang.srt.layers.radix_attention import RadixAttention

    found = ((m.layer_id, sliding_window(m)) for m in model.modules() if isinstance(m, RadixAttention))
    return {layer_id: window for layer_id, window in found if window is not None}


def sliding_window(layer):
    """The layer's sliding window as SGLang's decode applies it (a query at position p sees
    positions p - window .. p), or None for full attention."""
    window = getattr(layer, "sliding_window_size", None)
    return window if window is not None and window > -1 and not getattr(layer, "is_cross_attention", False) else None


def logit_cap(layer):
    """The layer's attention logit soft cap (scores -> cap * tanh(score / cap)), or None."""
    cap = getattr(layer, "logit_cap", None)
    return float(cap) if cap else None
