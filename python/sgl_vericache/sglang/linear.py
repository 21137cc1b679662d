"""Weight products: the CPU engine's packed fp32 weights, the draft passes' cheaper weight
copies, deterministic mode's row-invariant products, and rebuilding copies after SGLang
updates weights in place.

Touches ``UnquantizedLinearMethod.apply`` and ``LogitsProcessor._compute_lm_head`` (every
dense weight product and the plain lm_head product), ``ModelRunner.forward`` (deterministic
mode wraps every non-draft forward) and ``WeightUpdater``'s update methods.
"""

from __future__ import annotations

import logging

import torch

from sgl_vericache.cpu.row_invariant import ROW_BLOCK, row_invariant_mode
from sgl_vericache.sglang.runtime import Runtime, patch

logger = logging.getLogger(__name__)


def install_cpu_linear(runtime: Runtime, mode: str) -> None:
    """``--vericache-cpu-linear``: route the engine's dense fp32 CPU weight products (SGLang's
    unquantized linear layers and its plain lm_head product) through prepacked oneDNN
    weights. Applies to every forward, speculation on or off (``install_weight_products``)."""
    from sgl_vericache.cpu.linear import PackedLinear, packed_linear_available

    if mode == "torch" or (mode == "auto" and not packed_linear_available()):
        runtime.packed_linear = None
        return
    if runtime.packed_linear is None:
        runtime.packed_linear = PackedLinear()  # mode packed without oneDNN raises, naming the way out


def install_weight_products(runtime: Runtime) -> None:
    """While a VERICACHE worker drafts with ``--vericache-draft-weights fp16|int8``, SGLang's
    unquantized linear layers and its lm_head product use ``DraftWeights.linear`` (a cheaper
    copy of the same weights); otherwise the packed fp32 weights serve them when
    ``runtime.packed_linear`` is set, else SGLang's own code."""
    from sglang.srt.layers.logits_processor import LogitsProcessor, should_apply_lm_head_quant_method
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    def make_apply(apply):
        def draft_apply(self, layer, x, bias=None):
            rt = draft_apply.runtime
            if rt.draft_weights is not None:
                return rt.draft_weights.linear(x, layer.weight, bias)
            packed = rt.packed_linear
            if (packed is not None and not getattr(layer, "use_intel_amx_backend", False)
                    and type(layer.weight.data) is torch.Tensor and packed.serves(x, layer.weight, bias)):
                return packed.linear(x, layer.weight, bias)
            return apply(self, layer, x, bias)

        return draft_apply

    def make_lm_head(lm_head):
        def draft_lm_head(self, hidden_states, head, embedding_bias=None, **kwargs):
            rt = draft_lm_head.runtime
            plain = (not hasattr(head, "set_lora") and hasattr(head, "weight")
                     and not should_apply_lm_head_quant_method(head, getattr(head, "quant_method", None)))
            if rt.draft_weights is not None and plain:
                logits = rt.draft_weights.linear(hidden_states, head.weight)
                return logits if embedding_bias is None else logits + embedding_bias
            packed = rt.packed_linear
            if (packed is not None and plain and not self.use_fp32_lm_head
                    and not getattr(head, "use_intel_amx_backend", False) and self.rl_on_policy_target is None
                    and packed.serves(hidden_states, head.weight)):
                return packed.linear(hidden_states, head.weight)  # SGLang's plain branch: matmul, no bias
            return lm_head(self, hidden_states, head, embedding_bias, **kwargs)

        return draft_lm_head

    patch(UnquantizedLinearMethod, "apply", runtime, make_apply)
    patch(LogitsProcessor, "_compute_lm_head", runtime, make_lm_head)


def build_draft_weights(mode: str, model_runner, runtime: Runtime):
    """The draft passes' weight copies (None: the model's own), checked against the device."""
    from sgl_vericache.spec.draft_weights import DraftWeights, resolve_mode

    mode, max_rows = resolve_mode(mode, model_runner.model_config.dtype, model_runner.device)
    logger.info("VeriCache draft weights: %s%s", mode, "" if max_rows is None else f" up to {max_rows} rows per product")
    if mode == "model":
        return None
    model_linear = runtime.packed_linear.linear if runtime.packed_linear is not None else None
    weights = DraftWeights(mode, max_rows, model_linear) if model_linear else DraftWeights(mode, max_rows)
    weights.check_device(model_runner.device, model_runner.model_config.dtype)
    return weights


def install_row_invariant_forward(runtime: Runtime) -> None:
    """``--vericache-deterministic``: every forward of the model runner that produces output
    logits or committed KV (prefill, decode, verify) uses row-invariant weight products.
    Attention is made row-invariant separately (``attention.verify_attention`` computes each
    verify row as a decode step would). Draft passes run as usual: their tokens are
    proposals that verify recomputes, so only acceptance, never output, can depend on their
    rounding."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    def make(original):
        def forward(self, *args, **kwargs):
            if forward.runtime.drafting:
                return original(self, *args, **kwargs)
            with row_invariant_mode():
                return original(self, *args, **kwargs)

        return forward

    patch(ModelRunner, "forward", runtime, make)
    logger.info("VeriCache deterministic mode: row-invariant weight products (blocks of %d rows)", ROW_BLOCK)


def install_weight_update_hook(runtime: Runtime) -> None:
    """Weight copies we make (draft fp16/int8 copies, packed weights) are rebuilt after
    SGLang updates the model's weights in place (update_weights_from_disk / _tensor / ...)."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from sgl_vericache.cpu.linear import weights_updated

    def make(method):
        def hooked(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            finally:
                weights_updated()

        hooked.__name__ = method.__name__
        return hooked

    for name in dir(WeightUpdater):
        if name.startswith(("update_weights", "load_weights", "receive_weights")) or name == "end_weight_update":
            if callable(getattr(WeightUpdater, name)):
                patch(WeightUpdater, name, runtime, make)
