"""Checks on one generate request before it reaches SGLang's scheduler (no SGLang imports).

SGLang 0.5.23 checks a request's types (its JSON contract, pydantic) and most sampling
fields, but a few values pass every check and then fail inside a forward pass, where the
error is no longer one request's: the scheduler raises and the launcher stops the whole
server. These are the fields and the rules (docs/reliability.md has the full table):

- token ids (``input_ids``, an OpenAI ``prompt`` of ids): integers in ``[0, vocab)``;
- the prompt: at least one token after tokenization (``text: ""`` and an empty string in
  a batch, a template that renders to nothing);
- ``top_logprobs_num`` (OpenAI ``logprobs`` / ``top_logprobs``): 0 to the vocabulary size;
- ``sampling_params``: only the fields SGLang's ``SamplingParams`` has (an unknown one was a
  500); ``stop_regex`` patterns that compile (a bad one raised ``re.error``, a 500);
  ``n`` from 1 to ``MAX_N`` (each sample is a request of its own); ``logit_bias`` an object
  of token ids to numbers up to ``MAX_LOGIT_BIAS`` (a bias past float32's range, 1e308 say,
  made every token's probability NaN: the sampled verify's draw raised and the server
  stopped; speculation off emits token 0 for ever; in the offline Engine, a null or a
  string raised in the scheduler); ``repetition_penalty`` not below
  ``MIN_REPETITION_PENALTY`` (SGLang takes any value in (0, 2]: one that is 0 in float32,
  5e-324 say, divides a repeated token's score by 0, NaN again);
- ``sampling_params`` as a list: one object per prompt of a batch (SGLang indexes it by
  prompt: a shorter list, an empty one, or a list for one prompt was an ``IndexError`` or a
  ``TypeError``, a 500);
- ``session_params``: SGLang's ``SessionParams`` fields with their types (an unknown one was
  a 500, a wrong type reaches the scheduler);
- ``sampling_params.custom_params``: VeriCache's ``vericache_*`` keys, when VeriCache is
  on, through ``config.request_config`` (so a bad override is refused before it is queued),
  a compressor among them against the model's head layout (``Limits.kv_layouts``: a KIVI
  ``group_size`` that does not divide head_dim raised at the request's first round);
- an OpenAI chat body and its ``response_format``: objects (SGLang's pre-validation read them
  with ``.get`` before pydantic checked their types; a number or a list there was a 500).

Every error is a ``RequestError`` (a ``ValueError``: SGLang answers it with a 400) whose
message names the field, the value and what is accepted. ``Names`` maps the native field
names to what a client of another API sent (OpenAI ``prompt``, ``logprobs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

SESSION_FIELDS = {"id": str, "rid": str, "offset": int, "replace": bool, "drop_previous_output": bool}
MAX_N = 128  # samples per prompt (OpenAI's own limit); each is a scheduled request
# the largest logit bias: its token already certain at any temperature, and the scores still
# finite in float32 after SGLang divides them by a temperature down to 1e-6
MAX_LOGIT_BIAS = 1e30
# the smallest repetition penalty: a repeated token's score (up to 3e12) divided by it and by
# a temperature down to 1e-6 stays finite in float32 (SGLang accepts any positive value)
MIN_REPETITION_PENALTY = 1e-20
_SHOW = 60  # characters of a value shown in an error


class RequestError(ValueError):
    """A request field the server cannot serve; the message names it (HTTP 400)."""


@dataclass(frozen=True)
class Limits:
    """What the served model accepts."""

    vocab_size: int
    vericache: Any = None  # the server's VeriCacheConfig when VeriCache is on, else None
    sampling_fields: Optional[frozenset] = None  # the names sampling_params may have (None: any)
    # (num_kv_heads, head_dim) of the model's attention layers, as its compressed entries hold
    # them: a compressor override must serve each (empty: not known, not checked)
    kv_layouts: tuple = ()


@dataclass(frozen=True)
class Names:
    """The field names a client sent (errors name these)."""

    text: str = "text"
    input_ids: str = "input_ids"
    top_logprobs_num: str = "top_logprobs_num"
    sampling_params: str = "sampling_params"
    extra: Mapping[str, str] = field(default_factory=dict)  # sampling field -> client name

    def sampling(self, key: str) -> str:
        return self.extra.get(key) or f"{self.sampling_params}.{key}"


NATIVE = Names()
_OPENAI_TOP_LEVEL = {"n": "n", "stop_regex": "stop_regex", "logit_bias": "logit_bias",
                     "repetition_penalty": "repetition_penalty"}
OPENAI_COMPLETIONS = Names(text="prompt", input_ids="prompt", top_logprobs_num="logprobs", sampling_params="",
                           extra=_OPENAI_TOP_LEVEL)
OPENAI_CHAT = Names(text="messages", input_ids="messages", top_logprobs_num="top_logprobs", sampling_params="",
                    extra=_OPENAI_TOP_LEVEL)


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOW else text[: _SHOW - 5] + " ...]"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _batch(value: Any, is_item) -> list:
    """``value`` as a list of items: one item, a batch of them, or [] when neither."""
    if is_item(value):
        return [(None, value)]
    if isinstance(value, list) and value and all(is_item(v) for v in value):
        return list(enumerate(value))
    return []


# -- single fields -------------------------------------------------------------------------


def check_token_ids(ids: Any, name: str, limits: Limits) -> None:
    """``ids``: a non-empty list of token ids in ``[0, vocab)``."""
    if ids is None:
        return
    if len(ids) == 0:
        raise RequestError(f"{name} is empty; accepted: a prompt of at least one token")
    vocab = limits.vocab_size
    for i, tok in enumerate(ids):
        if not _is_int(tok) or not 0 <= tok < vocab:
            raise RequestError(f"{name}[{i}] {show(tok)} is not a token id of this model; "
                               f"accepted: integers from 0 to {vocab - 1}")


def check_text(text: Any, name: str) -> None:
    if isinstance(text, str) and not text:
        raise RequestError(f"{name} is an empty string; accepted: a prompt of at least one token")


def check_top_logprobs(num: Any, name: str, limits: Limits) -> None:
    """More top logprobs than the vocabulary fails in the forward's top-k."""
    if num is None:
        return
    if not _is_int(num) or not 0 <= num <= limits.vocab_size:
        raise RequestError(f"{name} {show(num)} is out of range; accepted: an integer from 0 to "
                           f"{limits.vocab_size} (the vocabulary size)")


def check_sampling_params(params: Any, names: Names, vericache: Any, fields: Optional[frozenset] = None,
                          kv_layouts: tuple = ()) -> None:
    """What SGLang does not check in ``sampling_params``: its field names (``fields``), the
    ``stop_regex`` patterns, ``n``, ``logit_bias``, a vanishing ``repetition_penalty`` and,
    when ``vericache`` (the server's VeriCacheConfig) is given, VeriCache's
    ``custom_params`` (a compressor among them against ``kv_layouts``, see ``Limits``)."""
    if not isinstance(params, dict):
        return
    unknown = sorted(map(str, set(params) - fields)) if fields is not None else []
    if unknown:
        raise RequestError(f"{names.sampling_params} has no field {', '.join(map(repr, unknown))}; accepted: "
                           f"{', '.join(sorted(fields))}")
    check_stop_regex(params.get("stop_regex"), names.sampling("stop_regex"))
    n = params.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= MAX_N):
        raise RequestError(f"{names.sampling('n')} {show(n)} is out of range; accepted: an integer from 1 to {MAX_N}")
    check_logit_bias(params.get("logit_bias"), names.sampling("logit_bias"))
    full_turn = params.get("ebnf_full_assistant")
    if full_turn is not None and not isinstance(full_turn, bool):
        raise RequestError(f"{names.sampling('ebnf_full_assistant')} {show(full_turn)} is not a boolean; "
                           "accepted: true or false")
    penalty = params.get("repetition_penalty")
    if isinstance(penalty, (int, float)) and not isinstance(penalty, bool) and 0 < penalty < MIN_REPETITION_PENALTY:
        raise RequestError(f"{names.sampling('repetition_penalty')} {show(penalty)} is too small to compute with; "
                           f"accepted: a number from {MIN_REPETITION_PENALTY:g} to 2 (1 = no penalty)")
    check_custom_params(params.get("custom_params"), names.sampling_params, vericache, kv_layouts)


ONE_PROMPT = -1  # prompt_count of a request that is not a batch


def prompt_count(text: Any, input_ids: Any, input_embeds: Any = None) -> Optional[int]:
    """How many prompts a generate request holds, as SGLang counts them: ``ONE_PROMPT`` for
    one (a string, a list of token ids), else the batch's length; None where the request
    has no prompt of a shape SGLang reads (its own checks answer that)."""
    if text is not None:
        return len(text) if isinstance(text, list) else ONE_PROMPT
    if isinstance(input_ids, list):
        return len(input_ids) if input_ids and isinstance(input_ids[0], list) else ONE_PROMPT
    if isinstance(input_embeds, list) and input_embeds and isinstance(input_embeds[0], list):
        return len(input_embeds) if input_embeds[0] and isinstance(input_embeds[0][0], list) else ONE_PROMPT
    return None


def check_sampling_params_count(params: Any, prompts: Optional[int], names: Names) -> None:
    """``sampling_params`` given as a list: one object per prompt of a batch of ``prompts``
    (``prompt_count``'s). A single prompt takes one object, or a list of one when it asks
    for several samples (SGLang then makes it a batch of one)."""
    if not isinstance(params, list) or prompts is None:
        return
    name = names.sampling_params or "sampling_params"
    if prompts == ONE_PROMPT:
        first = params[0] if params else None
        n = first.get("n", 1) if isinstance(first, dict) else 1
        if not params or n == 1:
            raise RequestError(f"{name} is a list of {len(params)} for a single prompt; accepted: one object, "
                               "or a list of one object per prompt with a batch of prompts")
    elif len(params) < prompts:
        raise RequestError(f"{name} is a list of {len(params)} for {prompts} prompts; accepted: one object for "
                           "all of them, or a list of one object per prompt")


def check_logit_bias(bias: Any, name: str) -> None:
    """An object of token ids (integers, or strings of them: SGLang reads ``int(key)``; its
    own check bounds them by the vocabulary) to biases: numbers up to MAX_LOGIT_BIAS (any
    negative one; -inf bans the token)."""
    if bias is None:
        return
    accepted = (f"a number up to {MAX_LOGIT_BIAS:g} (any negative one lowers the token's chance; "
                "-inf bans it)")
    if not isinstance(bias, dict):
        raise RequestError(f"{name} {show(bias)} is not an object; accepted: an object of token ids to biases, "
                           f"each {accepted}")
    for key, value in bias.items():
        try:
            int(key)
        except (TypeError, ValueError):
            raise RequestError(f"{name} key {show(key)} is not a token id; accepted: integers, as strings "
                               'such as "42"') from None
        try:  # an integer past float's range overflows in SGLang's bias tensor
            usable = isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) <= MAX_LOGIT_BIAS
        except OverflowError:
            usable = False
        if not usable:  # NaN compares false: refused too
            raise RequestError(f"{name}[{key!r}] {show(value)} is not a usable bias; accepted: {accepted}")


def check_session_params(params: Any, name: str = "session_params") -> None:
    if params is None:
        return
    if not isinstance(params, dict):
        raise RequestError(f"{name} {show(params)} is not an object; accepted: an object with "
                           f"{', '.join(SESSION_FIELDS)}")
    for key, value in params.items():
        kind = SESSION_FIELDS.get(key)
        if kind is None:
            raise RequestError(f"{name} has no field {key!r}; accepted: {', '.join(SESSION_FIELDS)}")
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise RequestError(f"{name}.{key} {show(value)} is not {_KIND_NAMES[kind]}")


_KIND_NAMES = {str: "a string", int: "an integer", bool: "true or false"}


def check_stop_regex(patterns: Any, name: str) -> None:
    """Each pattern compiles (SGLang parses it with ``re`` when it builds the request)."""
    for i, pattern in _batch(patterns, lambda v: isinstance(v, str)):
        try:
            re.compile(pattern)
        except Exception as exc:  # re.error, RecursionError, OverflowError on pathological patterns
            raise RequestError(f"{_at(name, i)} {show(pattern)} is not a regular expression ({exc}); "
                               "accepted: a Python regular expression") from None


def check_custom_params(custom_params: Any, where: str, vericache: Any, kv_layouts: tuple = ()) -> None:
    """VeriCache's per-request keys against ``vericache`` (None: VeriCache is off, nothing
    to check): ``request_config`` type- and range-checks each, builds the compressor and
    checks it serves ``kv_layouts``; its messages name ``custom_params`` and the key,
    ``where`` says whose (``sampling_params``)."""
    if vericache is None or custom_params is None:
        return
    from sgl_vericache.config import request_config

    prefix = f"{where}: " if where else ""
    try:
        request_config(custom_params, vericache, kv_layouts)
    except ValueError as exc:
        raise RequestError(f"{prefix}{exc}") from None
    except Exception as exc:  # a parser that raised something else: still this request's value
        raise RequestError(f"{prefix}custom_params {show(custom_params)}: {type(exc).__name__}: {exc}") from None


def check_chat_body(body: Any) -> None:
    """An OpenAI chat body as SGLang's pre-validation reads it: a JSON object (a list or a
    number reached ``.get``), with a ``response_format`` of the shape below."""
    if body is None or isinstance(body, (list, str, int, float, bool)):
        raise RequestError(f"the request body {show(body)} is not a JSON object; accepted: an object such as "
                           '{"model": ..., "messages": [{"role": "user", "content": ...}]}')
    if isinstance(body, dict):
        check_response_format(body.get("response_format"))


def check_response_format(value: Any, name: str = "response_format") -> None:
    """An OpenAI ``response_format`` in the shape SGLang's chat request reads before pydantic
    checks its type: an object, and for ``json_schema`` a ``schema`` given at the top level
    (SGLang's shorthand) an object whose ``properties`` is an object."""
    if not value:
        return
    accepted = ('an object: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                '"json_schema": {"name": ..., "schema": {...}}}')
    if not isinstance(value, dict):
        raise RequestError(f"{name} {show(value)} is not an object; accepted: {accepted}")
    if value.get("type") != "json_schema" or value.get("json_schema"):
        return
    schema = value.get("schema")
    if not schema:
        return
    if not isinstance(schema, dict):
        raise RequestError(f"{name}.schema {show(schema)} is not an object; accepted: a JSON schema object")
    properties = schema.get("properties")
    if "properties" in schema and not isinstance(properties, dict):
        raise RequestError(f"{name}.schema.properties {show(properties)} is not an object; "
                           "accepted: an object of property schemas")
    if isinstance(properties, dict) and properties.get("strict") and not isinstance(properties["strict"], dict):
        raise RequestError(f"{name}.schema.properties.strict {show(properties['strict'])} is not an object; "
                           "accepted: a property schema such as {\"default\": true}")


# -- whole requests ------------------------------------------------------------------------


def check_generate_body(body: Any, limits: Limits, names: Names = NATIVE) -> None:
    """A native ``/generate`` JSON body, single or batch, before tokenization (text that
    tokenizes to nothing is caught after, by ``check_tokenized``). Types are SGLang's own
    contract check's job; values of an unexpected shape are left to it."""
    if not isinstance(body, dict):
        return
    for i, text in _batch(body.get("text"), lambda v: isinstance(v, str)):
        check_text(text, _at(names.text, i))
    ids = body.get("input_ids")
    for i, row in _batch(ids, lambda v: isinstance(v, list) and all(_is_int(t) for t in v)):
        check_token_ids(row, _at(names.input_ids, i), limits)
    check_session_params(body.get("session_params"))
    for i, num in _batch(body.get("top_logprobs_num"), _is_int):
        check_top_logprobs(num, _at(names.top_logprobs_num, i), limits)
    for i, params in _batch(body.get("sampling_params"), lambda v: isinstance(v, dict)):
        check_sampling_params(params, _at_names(names, i), limits.vericache, limits.sampling_fields, limits.kv_layouts)
    check_sampling_params_count(body.get("sampling_params"),
                                prompt_count(body.get("text"), ids, body.get("input_embeds")), names)


def check_tokenized(input_ids: Optional[list], top_logprobs_num: Any, limits: Limits, names: Names = NATIVE) -> None:
    """One (sub-)request after tokenization: the prompt SGLang will schedule (its sampling
    parameters were checked before SGLang split the batch)."""
    if input_ids is not None and len(input_ids) == 0:
        raise RequestError(f"the prompt ({names.text} / {names.input_ids}) is empty after tokenization; "
                           "accepted: a prompt of at least one token")
    check_token_ids(input_ids, names.input_ids, limits)
    check_top_logprobs(top_logprobs_num, names.top_logprobs_num, limits)


def _at(name: str, index: Optional[int]) -> str:
    return name if index is None else f"{name}[{index}]"


def _at_names(names: Names, index: Optional[int]) -> Names:
    if index is None:
        return names
    return Names(names.text, names.input_ids, names.top_logprobs_num, _at(names.sampling_params, index), names.extra)
