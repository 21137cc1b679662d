"""request_checks (the rules) and containment.attributable, without a server."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest

from sgl_vericache import request_checks as checks
from sgl_vericache.config import VeriCacheConfig

VOCAB = 49152
PLAIN = checks.Limits(VOCAB)  # VeriCache off: custom_params are not ours to check
SMOLLM2 = ((3, 64),)  # (KV heads, head_dim) of SmolLM2-135M's attention, the served model of the API tests
WITH_VC = checks.Limits(VOCAB, VeriCacheConfig(), kv_layouts=SMOLLM2)
CORPUS = json.loads((Path(__file__).parent / "fuzz_corpus.json").read_text())


def refused(body, limits=WITH_VC, names=checks.NATIVE) -> str:
    with pytest.raises(checks.RequestError) as info:
        checks.check_generate_body(body, limits, names)
    return str(info.value)


@pytest.mark.parametrize("body, named", [
    ({"input_ids": [999999999]}, ["input_ids[0]", "999999999", "0 to 49151"]),
    ({"input_ids": [-3, 5]}, ["input_ids[0]", "-3", "0 to 49151"]),
    ({"input_ids": [5, VOCAB]}, ["input_ids[1]", str(VOCAB)]),
    ({"input_ids": [[1, 2], [3, 70000]]}, ["input_ids[1][1]", "70000"]),
    ({"input_ids": [[1], []]}, ["input_ids[1] is empty", "at least one token"]),
    ({"input_ids": []}, ["input_ids is empty"]),
    ({"text": ""}, ["text is an empty string", "at least one token"]),
    ({"text": ["a", ""]}, ["text[1] is an empty string"]),
    ({"text": "hi", "return_logprob": True, "top_logprobs_num": 100000}, ["top_logprobs_num 100000", "0 to 49152"]),
    ({"text": ["a", "b"], "top_logprobs_num": [1, -1]}, ["top_logprobs_num[1] -1"]),
    ({"text": "hi", "sampling_params": {"n": 100000}}, ["sampling_params.n 100000", "1 to 128"]),
    ({"text": "hi", "sampling_params": {"n": 0}}, ["sampling_params.n 0"]),
    ({"text": ["a", "b"], "sampling_params": [{}, {"custom_params": {"vericache_draft_len": 4.5}}]},
     ["sampling_params[1]: custom_params vericache_draft_len 4.5"]),
    # a bias past float32 (or NaN, +inf) made every probability NaN: the sampled verify's draw
    # raised (token 0 for ever, spec off); a null or a string raised in the scheduler
    ({"text": "hi", "sampling_params": {"logit_bias": {"5": 1e308}}},
     ["sampling_params.logit_bias['5'] 1e+308", "a number up to 1e+30", "-inf bans it"]),
    ({"text": "hi", "sampling_params": {"logit_bias": {"5": float("nan")}}}, ["logit_bias['5'] nan"]),
    ({"text": "hi", "sampling_params": {"logit_bias": {"5": 1.0, "7": float("inf")}}},
     ["sampling_params.logit_bias['7'] inf"]),
    ({"text": "hi", "sampling_params": {"logit_bias": {"5": 2e30}}}, ["logit_bias['5'] 2e+30"]),
    ({"text": "hi", "sampling_params": {"logit_bias": {"5": -(10 ** 400)}}}, ["logit_bias['5'] -1000"]),
    ({"text": "hi", "sampling_params": {"logit_bias": {"5": None}}}, ["logit_bias['5'] None"]),
    ({"text": "hi", "sampling_params": {"logit_bias": {"5": "1.5"}}}, ["logit_bias['5'] '1.5'"]),
    ({"text": "hi", "sampling_params": {"logit_bias": {"5": True}}}, ["logit_bias['5'] True"]),
    ({"text": "hi", "sampling_params": {"logit_bias": {"five": 1}}}, ["logit_bias key 'five' is not a token id"]),
    ({"text": "hi", "sampling_params": {"logit_bias": [1, 2]}}, ["sampling_params.logit_bias [1, 2] is not an object"]),
    # 0 in float32: a repeated token's score divided by 0
    ({"text": "hi", "sampling_params": {"repetition_penalty": 5e-324}},
     ["sampling_params.repetition_penalty 5e-324", "from 1e-20 to 2"]),
    ({"text": "hi", "sampling_params": {"repetition_penalty": 1e-30}}, ["repetition_penalty 1e-30"]),
    # SGLang indexes a list by prompt: an IndexError or a TypeError, a 500
    ({"text": "0", "sampling_params": []}, ["sampling_params is a list of 0 for a single prompt", "one object"]),
    ({"text": "0", "sampling_params": [{"max_new_tokens": 2}]}, ["sampling_params is a list of 1 for a single"]),
    ({"input_ids": [5, 6], "sampling_params": [{}, {}]}, ["a list of 2 for a single prompt"]),
    ({"text": ["0", "1"], "sampling_params": []}, ["sampling_params is a list of 0 for 2 prompts"]),
    ({"text": ["0", "1"], "sampling_params": [{"max_new_tokens": 2}]}, ["a list of 1 for 2 prompts"]),
    ({"input_ids": [[5], [6], [7]], "sampling_params": [{}, {}]}, ["a list of 2 for 3 prompts"]),
])
def test_refused_and_named(body, named):
    message = refused(body)
    for part in named:
        assert part in message, (part, message)


@pytest.mark.parametrize("custom_params, named", [
    ({"vericache_draft_len": 4.5}, "vericache_draft_len"),
    ({"vericache_draft_len": True}, "vericache_draft_len"),
    ({"vericache_draft_len": 1000}, "vericache_draft_len"),
    ({"vericache_compressor_options": {"a": 1}}, "a"),
    ({"vericache_compressor_options": {"group_size": [1]}}, "group_size"),
    ({"vericache_compressor_options": 7}, "vericache_compressor_options"),
    ({"vericache_compressor": "zip"}, "zip"),
    ({"vericache_ratio": float("nan")}, "vericache_ratio"),
    ({"vericache_ratio": "4"}, "vericache_ratio"),
    ({"vericache_nope": 1}, "vericache_nope"),
    ("not an object", "custom_params"),
    ([1, 2], "custom_params"),
])
def test_custom_params_refused_when_vericache_is_on(custom_params, named):
    body = {"text": "hi", "sampling_params": {"custom_params": custom_params}}
    message = refused(body)
    assert named in message and "custom_params" in message, message
    checks.check_generate_body(body, PLAIN)  # VeriCache off: SGLang passes custom_params through


@pytest.mark.parametrize("body", [
    {"text": "hi"},
    {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 1}]},
    {"input_ids": [0, VOCAB - 1]},
    {"input_ids": [[1], [2, 3]]},
    {"text": "hi", "return_logprob": True, "top_logprobs_num": VOCAB},
    {"text": "hi", "sampling_params": {"n": 128, "custom_params": {"vericache_draft_len": 4, "other_key": [1]}}},
    {"text": "hi", "sampling_params": {"custom_params": {"vericache_compressor": "quest",
                                                         "vericache_compressor_options": {"page_size": 16}}}},
    {"text": " "},
    {"text": "hi", "sampling_params": {"logit_bias": {"5": float("-inf"), "6": -1e308, "7": 1e30, "8": 100, "9": 0}}},
    {"text": "hi", "sampling_params": {"logit_bias": {}}},
    {"text": "hi", "sampling_params": {"repetition_penalty": 1e-20}},
    {"text": "hi", "sampling_params": {"repetition_penalty": 0}},  # SGLang's own check refuses it
    # shapes SGLang's own contract check answers are left to it
    {"input_ids": "abc"}, {"text": 5}, {"sampling_params": [1]}, [1, 2], None,
    # lists SGLang serves: one per prompt (extra ones it ignores), or one for a single prompt
    # asking for several samples (a batch of one)
    {"text": ["a", "b"], "sampling_params": [{}, {}, {}]},
    {"text": "a", "sampling_params": [{"n": 2}]},
    {"text": "a", "sampling_params": {"n": 2}},
])
def test_accepted(body):
    checks.check_generate_body(body, WITH_VC)


def test_openai_names():
    message = refused({"input_ids": [[1], [-1]]}, names=checks.OPENAI_COMPLETIONS)
    assert message.startswith("prompt[1][0] -1"), message
    message = refused({"text": "hi", "top_logprobs_num": 10 ** 6}, names=checks.OPENAI_CHAT)
    assert message.startswith("top_logprobs 1000000"), message
    message = refused({"text": "hi", "sampling_params": {"n": 500}}, names=checks.OPENAI_COMPLETIONS)
    assert message.startswith("n 500"), message
    message = refused({"text": "hi", "sampling_params": {"logit_bias": {"3": 1e300}}}, names=checks.OPENAI_CHAT)
    assert message.startswith("logit_bias['3'] 1e+300"), message
    message = refused({"text": "hi", "sampling_params": {"custom_params": {"vericache_draft_len": 0}}},
                      names=checks.OPENAI_CHAT)
    assert message.startswith("custom_params vericache_draft_len 0"), message


def test_after_tokenization():
    with pytest.raises(checks.RequestError, match="empty after tokenization"):
        checks.check_tokenized([], 0, PLAIN)
    with pytest.raises(checks.RequestError, match=r"input_ids\[2\] 49152"):
        checks.check_tokenized([1, 2, VOCAB], 0, PLAIN)
    with pytest.raises(checks.RequestError, match="top_logprobs_num 49153"):
        checks.check_tokenized([1], VOCAB + 1, PLAIN)
    checks.check_tokenized([1, 2], 5, PLAIN)
    checks.check_tokenized(None, 0, PLAIN)  # input_embeds: no ids to check


def test_sampling_fields_stop_regex_and_sessions():
    fields = frozenset({"max_new_tokens", "stop_regex", "n", "custom_params"})
    limits = checks.Limits(VOCAB, sampling_fields=fields)
    for body, named in (
        ({"text": "hi", "sampling_params": {"": 1}}, "sampling_params has no field ''"),
        ({"text": "hi", "sampling_params": {"is_normalized": True}}, "sampling_params has no field 'is_normalized'"),
        ({"text": "hi", "sampling_params": {"stop_regex": "a{2,1}"}}, "sampling_params.stop_regex 'a{2,1}'"),
        ({"text": "hi", "sampling_params": {"stop_regex": ["ok", "("]}}, "sampling_params.stop_regex[1] '('"),
        ({"text": "hi", "session_params": {"x": 1}}, "session_params has no field 'x'"),
        ({"text": "hi", "session_params": {"id": "s", "offset": "3"}}, "session_params.offset '3' is not an integer"),
        ({"text": "hi", "session_params": {"id": "s", "replace": 1}}, "session_params.replace 1 is not true or false"),
        ({"text": "hi", "session_params": [1]}, "session_params [1] is not an object"),
    ):
        message = refused(body, limits)
        assert message.startswith(named), (named, message)
    checks.check_generate_body({"text": "hi", "sampling_params": {"stop_regex": ["a+", "b"], "n": 2},
                                "session_params": {"id": "s", "rid": None, "offset": -1}}, limits)


def test_the_field_sglangs_openai_layer_adds_is_accepted_and_checked():
    """SGLang's chat route sets ``ebnf_full_assistant`` for GLM-4.7's tool-call grammar; the
    request then reached these checks and was refused as an unknown field (a 400 on a valid
    tool call). It is accepted, as a boolean."""
    from sgl_vericache.sglang.validation import sampling_fields

    limits = checks.Limits(VOCAB, sampling_fields=sampling_fields())
    checks.check_generate_body({"text": "hi", "sampling_params": {"ebnf_full_assistant": True}}, limits)
    message = refused({"text": "hi", "sampling_params": {"ebnf_full_assistant": "yes"}}, limits)
    assert message.startswith("sampling_params.ebnf_full_assistant 'yes' is not a boolean"), message


def test_session_fields_are_sglangs():
    from sglang.srt.managers.io_struct import SessionParams

    assert set(checks.SESSION_FIELDS) == set(SessionParams.__struct_fields__)


def test_long_values_are_shortened():
    message = refused({"text": "hi", "top_logprobs_num": 10 ** 200})
    assert len(message) < 200, message


def test_custom_params_errors_of_any_type_are_refused(monkeypatch):
    """A parser that raises something other than ValueError (issue 29's AttributeError) is
    still this request's bad value, never the server's."""
    import sgl_vericache.config as config

    def broken(custom_params, server, layouts=()):
        raise AttributeError("'int' object has no attribute 'split'")

    monkeypatch.setattr(config, "request_config", broken)
    message = refused({"text": "hi", "sampling_params": {"custom_params": {"vericache_ratio": 2}}})
    assert "AttributeError" in message and "custom_params" in message


@pytest.mark.parametrize("options", ["group_size=48", "group_size=3", {"group_size": 48}])
def test_a_compressor_override_the_model_cannot_use_is_refused(options):
    """kivi4 with a group size that does not divide head_dim passed these checks and raised
    at the request's first round, which stopped the scheduler: a 400 now, naming the value
    and what is accepted."""
    body = {"text": "hi", "sampling_params": {"custom_params": {"vericache_compressor": "kivi4",
                                                                "vericache_compressor_options": options}}}
    message = refused(body)
    group = options if isinstance(options, str) else "group_size=48"
    assert message.startswith("sampling_params: bad VeriCache custom_params"), message
    assert f"kivi4: {group} does not divide head_dim=64" in message, message
    assert "accepted: a divisor of 64 (1, 2, 4, 8, 16, 32, 64), or 64 and above" in message, message
    message = refused({"text": ["a", "b"], "sampling_params": [{}, body["sampling_params"]]})
    assert message.startswith("sampling_params[1]: ") and "does not divide head_dim=64" in message, message
    checks.check_generate_body(body, checks.Limits(VOCAB, VeriCacheConfig()))  # layout unknown: left to the worker


@pytest.mark.parametrize("group", [16, 32, 64, 4096])
def test_a_compressor_override_the_model_can_use_is_accepted(group):
    for method in ("kivi4", "kivi2"):
        checks.check_generate_body({"text": "hi", "sampling_params": {"custom_params": {
            "vericache_compressor": method, "vericache_compressor_options": f"group_size={group}"}}}, WITH_VC)


def test_head_dim_80_refuses_kivi_at_its_default_group_and_takes_auto():
    limits = checks.Limits(VOCAB, VeriCacheConfig(), kv_layouts=((32, 80),))
    message = refused({"text": "hi", "sampling_params": {"custom_params": {"vericache_compressor": "kivi4"}}}, limits)
    assert "kivi4: group_size=32 does not divide head_dim=80" in message, message
    for custom in ({"vericache_compressor": "auto"}, {"vericache_draft_len": 4},
                   {"vericache_compressor": "kivi4", "vericache_compressor_options": "group_size=16"}):
        checks.check_generate_body({"text": "hi", "sampling_params": {"custom_params": custom}}, limits)


def _tokenizer_manager(head_dim=64, swa_head_dim=None):
    """The parts of SGLang's TokenizerManager (and its ModelConfig) the checks read."""
    config = types.SimpleNamespace(vocab_size=VOCAB, head_dim=head_dim, swa_head_dim=swa_head_dim,
                                   get_num_kv_heads=lambda tp: 6 // tp, get_swa_num_kv_heads=lambda tp: 4 // tp)
    return types.SimpleNamespace(model_config=config, server_args=types.SimpleNamespace(tp_size=2))


def test_the_tokenizer_side_knows_the_models_heads(monkeypatch):
    """limits_of (the HTTP, OpenAI and tokenizer-manager checks) carries the model's head
    layout, per tensor-parallel rank, a sliding-window layer's too where its size differs;
    the catch-all hook after tokenization refuses an override it cannot serve (a 400 before
    the scheduler), for multimodal and input_embeds requests as well."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sgl_vericache.sglang import validation
    from sgl_vericache.sglang.runtime import Runtime

    assert validation.limits_of(_tokenizer_manager()).kv_layouts == ((3, 64),)
    assert validation.kv_layouts_of(_tokenizer_manager(swa_head_dim=128)) == ((2, 128), (3, 64))
    broken = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=VOCAB, head_dim=64))
    assert validation.kv_layouts_of(broken) == ()  # no head count to read: left to the worker
    monkeypatch.setenv("VERICACHE_CONFIG", json.dumps(dataclasses.asdict(VeriCacheConfig())))
    validation.install_tokenizer_checks(Runtime())
    custom = {"vericache_compressor": "kivi4", "vericache_compressor_options": "group_size=48"}
    for extra in ({"input_ids": [1, 2]}, {"input_embeds": [[0.0] * 4] * 2}):
        obj = GenerateReqInput(sampling_params={"custom_params": custom}, **extra)
        with pytest.raises(checks.RequestError, match="kivi4: group_size=48 does not divide head_dim=64"):
            TokenizerManager._validate_one_request(_tokenizer_manager(), obj, [1, 2])


def test_corpus_native_bodies_are_refused_by_the_rules():
    """Every corpus body for native /generate whose fault is a value these rules own is
    refused here too (the others are SGLang's own checks, exercised over HTTP)."""
    for case in CORPUS:
        if case["path"] == "/generate" and case.get("rule") == "request_checks":
            refused(case["body"])


@pytest.mark.parametrize("value, named", [
    (1, "response_format 1 is not an object"),
    ([{"type": "json_object"}], "response_format [{'type': 'json_object'}] is not an object"),
    ("json_object", "response_format 'json_object' is not an object"),
    ({"type": "json_schema", "schema": 5}, "response_format.schema 5 is not an object"),
    ({"type": "json_schema", "schema": {"properties": [1]}}, "response_format.schema.properties [1]"),
    ({"type": "json_schema", "schema": {"properties": {"strict": 1}}}, "response_format.schema.properties.strict 1"),
])
def test_response_format_refused(value, named):
    with pytest.raises(checks.RequestError, match="accepted") as info:
        checks.check_response_format(value)
    assert named in str(info.value)


def test_chat_body_refused_unless_an_object():
    for body in ([{"model": "x"}], 1, "x", None, True):
        with pytest.raises(checks.RequestError, match="is not a JSON object"):
            checks.check_chat_body(body)
    with pytest.raises(checks.RequestError, match="response_format 1"):
        checks.check_chat_body({"model": "x", "response_format": 1})
    checks.check_chat_body({"model": "x", "messages": []})


@pytest.mark.parametrize("value", [None, {}, {"type": "text"}, {"type": "json_object"},
                                   {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
                                   {"type": "json_schema", "schema": {"title": "T", "properties": {
                                       "strict": {"default": True}, "a": {"type": "string"}}}},
                                   {"type": "nope", "schema": 5}])  # a bad type is pydantic's to refuse
def test_response_format_accepted(value):
    checks.check_response_format(value)


def test_chat_body_checks_on_sglangs_routes():
    """The hook on SGLang's real chat request model, installed after ``http_server`` built
    its routes (the late path; the plugin's usual early one is test_api_fuzz's corpus over
    HTTP): a response_format that is not an object is SGLang's 400 naming it, where it was
    an AttributeError and a 500; a good one still reaches the model."""
    from fastapi.testclient import TestClient
    from sglang.srt.entrypoints import http_server
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    from sgl_vericache.sglang.runtime import Runtime
    from sgl_vericache.sglang.validation import install_chat_body_checks

    install_chat_body_checks(Runtime())
    install_chat_body_checks(Runtime())  # again: idempotent
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    client = TestClient(http_server.app)
    reply = client.post("/v1/chat/completions", json=dict(body, response_format=[1]))
    assert reply.status_code == 400, reply.text[:300]
    assert "response_format [1] is not an object" in reply.text
    for junk in ([body], 5, "hi", None):  # a body that is not an object reached the same .get
        reply = client.post("/v1/chat/completions", content=json.dumps(junk), headers={"Content-Type": "application/json"})
        assert reply.status_code == 400 and "is not a JSON object" in reply.text, (junk, reply.text[:300])
    shorthand = {"type": "json_schema", "schema": {"title": "T", "properties": {"strict": {"default": True}}}}
    request = ChatCompletionRequest.model_validate(dict(body, response_format=shorthand))
    assert request.response_format.json_schema.name == "T" and request.response_format.json_schema.strict is True


# -- containment --------------------------------------------------------------------------


def _raise_in(name: str, filename: str) -> Exception:
    code = compile(f"def {name}():\n    raise RuntimeError('x')\n", filename, "exec")
    scope = {}
    exec(code, scope)
    try:
        scope[name]()
    except RuntimeError as exc:
        return exc


def test_a_grammar_that_admits_nothing_is_told_from_one_that_admits_something():
    """containment.admits_nothing reads the grammar's own next-token bitmask (xgrammar's
    layout: int32 words); anything it cannot read leaves SGLang's 500 alone."""
    import torch

    from sgl_vericache.sglang.containment import admits_nothing

    class Grammar:
        vocab_size = 100

        def __init__(self, allowed):
            self.allowed = allowed

        def allocate_vocab_mask(self, vocab_size, batch_size, device):
            return torch.zeros(batch_size, (vocab_size + 31) // 32, dtype=torch.int32)

        def fill_vocab_mask(self, mask, idx):
            for t in self.allowed:
                mask[idx, t // 32] |= 1 << (t % 32)

    assert admits_nothing(Grammar([]))
    assert not admits_nothing(Grammar([0])) and not admits_nothing(Grammar([99]))
    assert not admits_nothing(object())  # another backend: cannot tell


def test_attributable():
    from sgl_vericache.sglang.containment import attributable

    assert attributable(_raise_in("_create_generation_req", "/x/sglang/srt/managers/scheduler.py"))
    assert not attributable(_raise_in("_add_request_to_queue", "/x/sglang/srt/managers/scheduler.py"))
    assert not attributable(_raise_in("_prefetch_kvcache", "/x/sglang/srt/managers/scheduler.py"))
    assert not attributable(_raise_in("match_prefix", "/x/sglang/srt/mem_cache/radix_cache.py"))
    assert not attributable(KeyboardInterrupt())


class _FakeScheduler:
    """What containment.end_request touches on SGLang's Scheduler."""

    def __init__(self, raise_in):
        self.waiting_queue = [types.SimpleNamespace(rid="other"), types.SimpleNamespace(rid="r1")]
        self.grammar_manager = types.SimpleNamespace(grammar_queue=[types.SimpleNamespace(rid="r1")])
        self.sent = []
        self._handle_generate_request = raise_in

    def send_abort_output(self, abort, recv_req):
        self.sent.append((abort, recv_req))


def test_admission_containment_ends_the_request_alone():
    """The hook on SGLang's real Scheduler.handle_generate_request: an error while admitting
    one request answers that request with a 500 and takes it out of the queues; one raised
    where shared state is touched (queueing, the prefix cache) still propagates."""
    from sglang.srt.managers.scheduler import Scheduler

    from sgl_vericache.sglang.containment import install_admission_containment
    from sgl_vericache.sglang.runtime import Runtime

    install_admission_containment(Runtime())
    recv = types.SimpleNamespace(rid="r1", mm_inputs=None, http_worker_ipc=None)

    def bad_request(*args, **kwargs):
        raise TypeError("'str' object cannot be interpreted as an integer")

    fake = _FakeScheduler(bad_request)
    assert Scheduler.handle_generate_request(fake, recv) is None
    (abort, to), = fake.sent
    assert abort.rid == "r1" and to is recv
    assert abort.finished_reason["status_code"] == 500 and "TypeError" in abort.finished_reason["message"]
    assert [r.rid for r in fake.waiting_queue] == ["other"] and fake.grammar_manager.grammar_queue == []

    def _add_request_to_queue(*args, **kwargs):  # named as SGLang's: shared state
        raise RuntimeError("queue broke")

    fake = _FakeScheduler(_add_request_to_queue)
    with pytest.raises(RuntimeError, match="queue broke"):
        Scheduler.handle_generate_request(fake, recv)
    assert fake.sent == []
