"""Request checks where SGLang takes a request in: a bad field is a 400 before the
scheduler sees it (the rules: ``request_checks``; the table: docs/reliability.md).

Touches, all in the HTTP / tokenizer-manager process (and the offline ``Engine``'s):

- ``TokenizerManager._validate_one_request``: every generate (sub-)request after
  tokenization, whatever API sent it (native, OpenAI, the frontend DSL, Anthropic, Ollama,
  the offline Engine): the catch-all, named in native field names; VeriCache's
  ``custom_params`` against the model's head layout here too (multimodal and input_embeds
  requests included: the hook below has no tokenizer manager, so no model, to ask);
- ``GenerateReqInput.normalize_batch_and_arguments``: ``sampling_params`` (field names,
  ``stop_regex``, ``n``, VeriCache's ``custom_params``, a list's length against the prompts)
  before SGLang expands ``n`` into ``n`` requests;
- ``http_server.generate_contract_error`` (the native ``/generate`` body, beside SGLang's own
  JSON contract): before a stream starts, so a bad streamed request is a 400 too rather
  than an error event in a 200 stream; batch items named by index;
- ``OpenAIServingCompletion`` / ``OpenAIServingChat._convert_to_internal_request``: the
  OpenAI requests in OpenAI's field names (``prompt``, ``logprobs``, ``top_logprobs``), also
  before a stream starts.

``VERICACHE_REQUEST_CHECKS=0`` leaves SGLang's own checks alone (the negative control of
test_api_fuzz.py; never needed in serving).
"""

from __future__ import annotations

import functools
import os

from sgl_vericache import request_checks as checks
from sgl_vericache.sglang.runtime import Runtime, patch

ENV_SWITCH = "VERICACHE_REQUEST_CHECKS"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def vericache_config():
    """The server's VeriCacheConfig when VeriCache is on, else None (no keys of ours to check)."""
    from sgl_vericache.config import ENV_VAR

    return _vericache_from(os.environ.get(ENV_VAR, ""))


@functools.lru_cache(maxsize=4)
def _vericache_from(raw: str):
    from sgl_vericache.config import VeriCacheConfig

    vc = VeriCacheConfig.from_json(raw)
    return vc if vc is not None and vc.enable else None


def limits_of(tokenizer_manager) -> checks.Limits:
    """The served model's limits, VeriCache's config and the sampling fields SGLang knows."""
    return checks.Limits(tokenizer_manager.model_config.vocab_size, vericache_config(), sampling_fields(),
                         kv_layouts_of(tokenizer_manager))


def kv_layouts_of(tokenizer_manager) -> tuple:
    """(KV heads per tensor-parallel rank, head_dim) of the served model's attention layers
    (a sliding-window layer's too, where its head size differs), as the workers' compressed
    entries hold them: what a request's compressor override must serve. () where the model
    config does not say: the worker's planner then refuses such an override itself (a 400
    at the request's prefill), so a config this cannot read must not fail every request."""
    config = tokenizer_manager.model_config
    tp_size = getattr(getattr(tokenizer_manager, "server_args", None), "tp_size", 1) or 1
    try:
        layouts = {(config.get_num_kv_heads(tp_size), config.head_dim)}
        swa_head_dim = getattr(config, "swa_head_dim", None)
        if swa_head_dim and swa_head_dim != config.head_dim:
            layouts.add((config.get_swa_num_kv_heads(tp_size), swa_head_dim))
    except Exception:  # a config of a shape SGLang reads elsewhere (no head count, VGQA)
        return ()
    return tuple(sorted(layout for layout in layouts if layout[1]))


# SamplingParams' internal fields (set by its normalize(); "not API-facing"): a client that
# sets is_normalized skips every default and check __post_init__ applies
# (``ebnf_full_assistant`` is not among them: SGLang's OpenAI layer sets it for tool-call
# grammars that cover the whole assistant turn, GLM-4.7's, and the request then reaches these checks)
INTERNAL_SAMPLING_FIELDS = frozenset({"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
                                      "is_normalized"})


@functools.lru_cache(maxsize=1)
def sampling_fields() -> frozenset:
    """The names a client may give ``sampling_params``: ``SamplingParams``' API fields (an
    unknown one is a TypeError in SGLang, a 500)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    return frozenset(SamplingParams.__struct_fields__) - INTERNAL_SAMPLING_FIELDS


def install_tokenizer_checks(runtime: Runtime) -> None:
    """Every generate request, after tokenization and before SGLang's own length checks."""
    if not enabled():
        return
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    def make(original):
        def _validate_one_request(self, obj, input_ids):
            if isinstance(obj, GenerateReqInput):
                limits = limits_of(self)
                if obj.input_embeds is None and not obj.contains_mm_input():
                    checks.check_tokenized(input_ids, obj.top_logprobs_num, limits)
                    checks.check_session_params(obj.session_params)
                params = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
                checks.check_custom_params(params.get("custom_params"), "sampling_params", limits.vericache,
                                           limits.kv_layouts)
            return original(self, obj, input_ids)

        return _validate_one_request

    def make_normalize(original):
        def normalize_batch_and_arguments(self):
            params = self.sampling_params
            for item in params if isinstance(params, list) else [params]:
                checks.check_sampling_params(item, checks.NATIVE, vericache_config(), sampling_fields())
            checks.check_sampling_params_count(params, checks.prompt_count(self.text, self.input_ids,
                                                                            self.input_embeds), checks.NATIVE)
            return original(self)

        return normalize_batch_and_arguments

    patch(TokenizerManager, "_validate_one_request", runtime, make)
    patch(GenerateReqInput, "normalize_batch_and_arguments", runtime, make_normalize)


def install_http_checks(runtime: Runtime) -> None:
    """The native ``/generate`` body, answered like SGLang's other 400s
    (``{"error": {"message": ...}}``) and before any stream starts."""
    if not enabled():
        return
    from sglang.srt.entrypoints import http_server

    def make(original):
        def generate_contract_error(body):
            error = original(body)
            state = http_server._global_state
            if error is not None or state is None:
                return error
            try:
                checks.check_generate_body(body, limits_of(state.tokenizer_manager))
            except checks.RequestError as exc:
                return {"message": str(exc), "type": "invalid_request_error", "code": 400}
            return None

        return generate_contract_error

    patch(http_server, "generate_contract_error", runtime, make)


def install_openai_checks(runtime: Runtime) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``: the converted request, checked in
    the executor thread SGLang converts it on (a ValueError there is SGLang's 400)."""
    if not enabled():
        return
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion

    def maker(names):
        def make(original):
            def _convert_to_internal_request(self, request, raw_request=None):
                adapted, processed = original(self, request, raw_request)
                body = {"text": adapted.text, "input_ids": adapted.input_ids,
                        "top_logprobs_num": adapted.top_logprobs_num, "sampling_params": adapted.sampling_params}
                checks.check_generate_body(body, limits_of(self.tokenizer_manager), names)
                return adapted, processed

            return _convert_to_internal_request

        return make

    patch(OpenAIServingCompletion, "_convert_to_internal_request", runtime, maker(checks.OPENAI_COMPLETIONS))
    patch(OpenAIServingChat, "_convert_to_internal_request", runtime, maker(checks.OPENAI_CHAT))


def install_chat_body_checks(runtime: Runtime) -> None:
    """``/v1/chat/completions``' body model: SGLang's "before" validator ``set_json_schema``
    reads the body and its ``response_format`` with ``.get`` before pydantic checks their
    types, so a body or a ``response_format`` that is a number or a list raised
    AttributeError through pydantic, a 500. The hook checks the shape first
    (a ValueError, which pydantic reports as a validation error: SGLang's 400), and the model
    is rebuilt so its validator calls the hook. Must run before ``http_server`` builds its
    routes (they keep the validator of the model they were built with): the plugin runs
    first in every entry point, and a late install rebuilds the routes' body fields too."""
    if not enabled():
        return
    import dataclasses
    import sys

    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    def make(original):
        def set_json_schema(cls, values):
            checks.check_chat_body(values)
            return original(cls, values)

        return set_json_schema

    hook = patch(ChatCompletionRequest, "set_json_schema", runtime, make)
    validators = ChatCompletionRequest.__pydantic_decorators__.model_validators
    if getattr(validators["set_json_schema"].func, "__func__", None) is hook:
        return  # this process's model already calls the hook
    validators["set_json_schema"] = dataclasses.replace(validators["set_json_schema"],
                                                        func=ChatCompletionRequest.set_json_schema)
    ChatCompletionRequest.model_rebuild(force=True)
    http_server = sys.modules.get("sglang.srt.entrypoints.http_server")
    if http_server is not None:
        _rebuild_body_fields(http_server.app, ChatCompletionRequest)


def _rebuild_body_fields(app, model) -> None:
    """Routes built before the model was rebuilt: their body fields' validators, anew (a
    route's ``body_field`` is the same object as its dependant's one body parameter)."""
    for route in app.routes:
        dependant = getattr(route, "dependant", None)  # API routes only; mounts have none
        for field in getattr(dependant, "body_params", ()):
            if field.field_info.annotation is model:
                field.__post_init__()
