"""API fuzzing against a running server with VeriCache on (issue 26): generated bodies for
native ``/generate`` (single and batch), ``/v1/completions`` and ``/v1/chat/completions``,
the corpus of bodies that once crashed the server, and the frontend DSL. After each body:
a 2xx or 4xx answer (never a 5xx, streamed error events included), the server's processes
alive, ``/health_generate`` good.

CI runs ``FUZZ_EXAMPLES`` bodies per API (about 3 minutes on 2 loaded cores, on top of the
server's start); ``VERICACHE_FUZZ_EXAMPLES=N`` runs N per API (the long run). A body that
fails goes into fuzz_corpus.json once fixed.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ServerProcess

CORPUS = json.loads((Path(__file__).parent / "fuzz_corpus.json").read_text())
FUZZ_EXAMPLES = {"generate": 24, "completions": 10, "chat": 10}
LONG_RUN = int(os.environ.get("VERICACHE_FUZZ_EXAMPLES", "0"))
VOCAB = 49152
STATUSES = collections.Counter()  # (api, status) over this module's fuzzed bodies

pytestmark = pytest.mark.timeout(1800)


def fuzz_settings(api: str):
    return settings(max_examples=LONG_RUN or FUZZ_EXAMPLES[api], deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


# -- sending and checking ------------------------------------------------------------------


def send(srv, path: str, body) -> tuple[int, str]:
    """POST ``body`` (any JSON value); a stream is read to its end. Returns (status, text)."""
    data = json.dumps(body, allow_nan=True)  # NaN / Infinity too: the server's parser must refuse them
    stream = isinstance(body, dict) and body.get("stream") is True
    r = requests.post(srv.url + path, data=data, headers={"Content-Type": "application/json"},
                      timeout=300, stream=stream)
    return r.status_code, r.text


def stream_errors(text: str) -> list[dict]:
    """The error events of an SSE stream (SGLang reports a request's failure inside a 200 stream)."""
    errors = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            try:
                event = json.loads(line[6:])
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and "error" in event:
                errors.append(event["error"])
    return errors


def error_code(error) -> int:
    code = error.get("code", 400) if isinstance(error, dict) else 400
    return int(code) if str(code).isdigit() else 400


def check_contained(srv, path: str, body, status: int, text: str) -> None:
    shown = json.dumps(body, allow_nan=True)[:600]
    assert status < 500, f"{path} answered {status} to {shown}:\n{text[:600]}\n{srv.log_tail(30)}"
    five_hundreds = [e for e in stream_errors(text) if error_code(e) >= 500]
    assert not five_hundreds, f"{path} streamed {five_hundreds} for {shown}"
    check_healthy(srv, f"{path} {shown}")


def check_healthy(srv, after: str) -> None:
    assert srv.proc.poll() is None, f"server exited after {after}:\n{srv.log_tail(60)}"
    health = requests.get(srv.url + "/health_generate", timeout=300)
    assert health.status_code == 200, f"/health_generate {health.status_code} after {after}:\n{srv.log_tail(60)}"


def fuzz_one(srv, api: str, path: str, body) -> None:
    status, text = send(srv, path, body)
    STATUSES[(api, status // 100)] += 1
    check_contained(srv, path, body, status, text)


# -- strategies ----------------------------------------------------------------------------
# Each field has a strategy for values the server should serve and one for values it should
# refuse. A body is drawn in one of three modes: all fields good (reaches the scheduler with
# combinations of features), one field bad (the refusal of that field), or chaos (any).

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
any_int = st.integers(-3, 8) | st.integers(-(2 ** 70), 2 ** 70) | st.sampled_from([VOCAB - 1, VOCAB, VOCAB + 1])
any_float = st.floats() | st.integers(-5, 5) | st.sampled_from([0.0, 1e-30, 1e30, -1.0])
good_text = st.text(min_size=1, max_size=24).filter(str.strip) | st.sampled_from(
    [" ", "\x00", "<|im_start|>", "<|im_end|>", "🙂" * 4, "a\nb", "def f():", "ب" * 5])
bad_text = st.sampled_from(["", "word " * 9000, "🙂" * 9000])  # empty; past the 8192-token context
good_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
bad_ids = st.lists(any_int, max_size=4) | st.just([]) | st.just([1] * 9000)
small_max_new = st.integers(0, 3)  # a served request stays cheap: at most 3 new tokens

good_regexes = st.sampled_from(["[0-9]+", "(yes|no)", "[a-z ]{1,8}", ".*"])
bad_regexes = st.sampled_from(["(", "[a-", "a{2,1}", "\\"]) | st.text(max_size=6)
good_schemas = st.sampled_from(['{"type": "object"}', '{"type": "integer"}', "{}",
                                '{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}'])
bad_schemas = st.sampled_from(['{"type": "bogus"}', "not json", "[1, 2]", '{"$ref": "#/nope"}']) | junk
good_ebnfs = st.sampled_from(['root ::= "a" | "b"', "root ::= [0-9]+"])
bad_ebnfs = st.sampled_from(["root ::= ", "nonsense", 'root ::= "a" root2'])

COMPRESSOR_OPTIONS = {  # method -> good option values
    "kivi4": {"group_size": st.sampled_from([16, 32, 64]), "residual_length": st.sampled_from([16, 32, 128])},
    "kivi2": {"group_size": st.sampled_from([16, 32, 64]), "residual_length": st.sampled_from([16, 32])},
    "quest": {"page_size": st.sampled_from([8, 16]), "min_budget": st.sampled_from([16, 32])},
    "snapkv": {"window_size": st.sampled_from([8, 32]), "kernel_size": st.sampled_from([3, 7])},
    "streamingllm": {"num_sinks": st.sampled_from([1, 4]), "min_budget": st.sampled_from([16, 32])},
    "h2o": {"heavy_fraction": st.sampled_from([0.25, 0.5])},
    "fp8": {"scale": st.sampled_from(["head", "tensor"])},
    "int8": {}, "full": {},
}


@st.composite
def good_custom_params(draw):
    params = {}
    if draw(st.booleans()):
        method = params["vericache_compressor"] = draw(st.sampled_from(sorted(COMPRESSOR_OPTIONS)))
        options = draw(st.fixed_dictionaries({}, optional=COMPRESSOR_OPTIONS[method]))
        if options and draw(st.booleans()):
            params["vericache_compressor_options"] = options if draw(st.booleans()) else ",".join(
                f"{k}={v}" for k, v in options.items())
    if draw(st.booleans()):
        params["vericache_ratio"] = draw(st.floats(1.0, 64.0) | st.integers(1, 64))
    if draw(st.booleans()):
        params["vericache_draft_len"] = draw(st.integers(1, 16))
    if draw(st.booleans()):
        params["another_plugins_key"] = draw(junk)  # not ours: passed through
    return params


bad_custom_params = st.fixed_dictionaries({}, optional={
    "vericache_compressor": st.sampled_from(["zip", "", "KIVI4"]) | junk,
    "vericache_ratio": st.sampled_from([0.5, 65, float("nan"), float("inf"), "4", True]) | junk,
    "vericache_draft_len": st.sampled_from([0, 17, 4.5, -1, True, "4"]) | junk,
    "vericache_compressor_options": st.dictionaries(st.sampled_from(["group_size", "residual_length", "a", ""]),
                                                    st.integers(-2, 0) | st.floats() | junk, min_size=1, max_size=2)
    | st.sampled_from(["group_size=0", "a=1", "=", ",,", "group_size"]) | junk,
    "vericache_bogus": junk,
}).filter(bool) | st.text(max_size=4) | st.lists(st.integers(), max_size=2) | st.sampled_from([
    # KIVI group sizes that do not divide the served model's head_dim (64)
    {"vericache_compressor": method, "vericache_compressor_options": f"group_size={group}"}
    for method, group in (("kivi4", 48), ("kivi4", 3), ("kivi2", 6))])

MODES = ("good", "good", "one_bad", "chaos")  # half the bodies reach the scheduler

# name -> (good, bad); good values are served, bad ones refused (or served, where SGLang
# defines a meaning: the point is never a 5xx and never a dead server)
SAMPLING = {
    "temperature": (st.floats(0, 2), any_float | junk),
    "top_p": (st.floats(0.05, 1), any_float),
    "top_k": (st.just(-1) | st.integers(1, 100) | st.just(VOCAB * 4), any_int),
    "min_p": (st.floats(0, 1), any_float),
    "frequency_penalty": (st.floats(-2, 2), any_float),
    "presence_penalty": (st.floats(-2, 2), any_float),
    "repetition_penalty": (st.floats(0.05, 2), any_float),
    "min_new_tokens": (st.integers(0, 0), st.integers(-1, 5) | junk),
    "stop": (good_text | st.lists(good_text, max_size=3), junk),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB + 10), max_size=3), st.lists(any_int, max_size=3) | junk),
    "stop_regex": (good_regexes, bad_regexes | st.lists(bad_regexes, max_size=2)),
    "ignore_eos": (st.booleans(), junk),
    "skip_special_tokens": (st.booleans(), junk),
    "spaces_between_special_tokens": (st.booleans(), junk),
    "no_stop_trim": (st.booleans(), junk),
    "n": (st.integers(1, 2), st.sampled_from([0, -1, 129, 10 ** 6]) | junk),
    "regex": (good_regexes, bad_regexes),
    "json_schema": (good_schemas, bad_schemas),
    "ebnf": (good_ebnfs, bad_ebnfs),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
                   st.dictionaries(st.integers(-5, VOCAB + 5).map(str) | st.text(max_size=4), any_float, min_size=1,
                                   max_size=2) | junk),
    "sampling_seed": (st.integers(-(2 ** 63), 2 ** 63 - 1), st.integers(2 ** 63, 2 ** 70) | junk),
    "custom_params": (good_custom_params(), bad_custom_params),
    "max_new_tokens": (small_max_new, st.sampled_from([-1, 8192, 10 ** 9, 2.5]) | junk),
    "stream_interval": (st.integers(1, 3), st.integers(-2, 0) | junk),
    "beam_width": (st.nothing(), st.integers(-1, 3) | junk),
    "structural_tag": (st.nothing(), st.text(max_size=10) | junk),
    "watermark": (st.nothing(), junk),
    "is_normalized": (st.nothing(), st.booleans()),  # SamplingParams' internals: not a client's
    "stop_strs": (st.nothing(), junk),
}
GRAMMARS = ("regex", "json_schema", "ebnf")
TOP_LEVEL = {
    "return_logprob": (st.booleans(), junk),
    "logprob_start_len": (st.integers(-1, 1), any_int),
    "top_logprobs_num": (st.integers(0, 5), any_int | junk),  # VOCAB is served, but slowly (49152 per token)
    "token_ids_logprob": (st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(any_int, min_size=1, max_size=3)),
    "return_text_in_logprobs": (st.booleans(), junk),
    "stream": (st.booleans(), junk),
    "priority": (st.integers(-10, 10), any_int | junk),
    "extra_key": (st.text(max_size=8), junk),
    "cache_salt": (st.text(max_size=8), junk),
    "log_metrics": (st.booleans(), junk),
    "rid": (st.nothing(), junk | st.just("") | st.uuids().map(str)),  # one rid for a batch is a 400
    "lora_path": (st.nothing(), st.text(max_size=6) | junk),
    "session_params": (st.nothing(), junk | st.sampled_from([{"id": "nope"}, {"x": 1}, {"id": "s", "offset": "x"}])),
    "return_prompt_token_ids": (st.booleans(), junk),
    "max_thinking_tokens": (st.nothing(), any_int),
    "return_routed_experts": (st.nothing(), st.just(True)),
    "data_parallel_rank": (st.nothing(), any_int),
    "return_hidden_states": (st.nothing(), st.just(True)),
    "custom_logit_processor": (st.nothing(), st.text(max_size=8)),
    "input_embeds": (st.nothing(), st.lists(st.lists(st.floats(-1, 1), min_size=1, max_size=3), max_size=2)),
    "image_data": (st.nothing(), st.sampled_from(["data:image/png;base64,AAAA", "not an image"]) | junk),
    "bootstrap_room": (st.nothing(), any_int),
    "routed_dp_rank": (st.nothing(), any_int),
}


def draw_fields(draw, fields: dict, bad: str | None, chaos: bool, share: int = 4) -> dict:
    """Each field in about one draw in ``share``, with a good value; the ``bad`` one always,
    with a bad value; in chaos, good or bad at random. Fields with no good value (features
    this server does not have) appear only when bad or in chaos."""
    out = {}
    for name, (good, bad_values) in fields.items():
        if name == bad:
            out[name] = draw(bad_values)
        elif draw(st.integers(0, share - 1)) == 0:
            if chaos and draw(st.booleans()):
                out[name] = draw(bad_values)
            elif not good.is_empty:
                out[name] = draw(good)
    return out


@st.composite
def sampling_params(draw, bad=None, chaos=False):
    params = draw_fields(draw, SAMPLING, bad, chaos)
    params.setdefault("max_new_tokens", draw(small_max_new))
    grammars = [g for g in GRAMMARS if g in params]
    if not chaos and len(grammars) > 1:  # one grammar at a time, unless that is the fault
        for g in grammars[1:]:
            if g != bad:
                del params[g]
    return params


@st.composite
def generate_bodies(draw):
    mode = draw(st.sampled_from(MODES))
    chaos = mode == "chaos"
    fields = ["prompt", "sampling"] + sorted(SAMPLING) + sorted(TOP_LEVEL)
    bad = draw(st.sampled_from(fields)) if mode == "one_bad" else None
    batch = draw(st.integers(0, 3))  # 0: a single prompt
    texts = draw(st.booleans())
    one_good = good_text if texts else good_ids
    one_bad = (bad_text if texts else bad_ids) | junk
    if batch == 0:
        prompt = draw(one_bad if bad == "prompt" or (chaos and draw(st.booleans())) else one_good)
    else:
        prompt = draw(st.lists(one_good, min_size=batch, max_size=batch))
        if bad == "prompt" or (chaos and draw(st.booleans())):
            prompt[draw(st.integers(0, batch - 1))] = draw(one_bad)
    body = {"text" if texts else "input_ids": prompt}
    in_sampling = bad if bad in SAMPLING else None
    if bad == "sampling":
        body["sampling_params"] = draw(junk)
    elif batch and draw(st.booleans()):
        body["sampling_params"] = [draw(sampling_params(in_sampling, chaos)) for _ in range(batch)]
        n = body["sampling_params"][0].get("n", 1)
        for params in body["sampling_params"]:  # SGLang wants one n across a batch
            params["n"] = n
    else:
        body["sampling_params"] = draw(sampling_params(in_sampling, chaos))
    body.update(draw_fields(draw, TOP_LEVEL, bad if bad in TOP_LEVEL else None, chaos, share=8))
    if chaos and draw(st.integers(0, 3)) == 0:
        body[draw(st.text(max_size=8))] = draw(junk)  # an unknown field
    if chaos and draw(st.integers(0, 9)) == 0:
        return draw(junk)  # not even an object
    return body


OPENAI = {
    "temperature": (st.floats(0, 2), any_float | junk),
    "top_p": (st.floats(0.05, 1), any_float),
    "n": (st.integers(1, 2), st.sampled_from([0, 129, 10 ** 6]) | junk),
    "stream": (st.booleans(), junk),
    "stop": (good_text | st.lists(good_text, max_size=3), junk),
    "seed": (st.integers(0, 2 ** 31), any_int | junk),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=2),
                   st.dictionaries(st.integers(-5, VOCAB + 5).map(str), any_float, min_size=1, max_size=2) | junk),
    "frequency_penalty": (st.floats(-2, 2), any_float),
    "presence_penalty": (st.floats(-2, 2), any_float),
    "response_format": (st.sampled_from([
        {"type": "json_object"}, {"type": "text"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}]),
        st.sampled_from([{"type": "json_schema", "json_schema": {"name": "x"}},
                         {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
                         {"type": "nope"}]) | junk),
    "custom_params": (good_custom_params(), bad_custom_params),
    "regex": (good_regexes, bad_regexes),
    "stream_options": (st.just({"include_usage": True}), junk),
    "user": (st.text(max_size=6), junk),
}


@st.composite
def completion_bodies(draw):
    fields = dict(OPENAI, logprobs=(st.integers(0, 5), any_int | junk), echo=(st.booleans(), junk),
                  max_tokens=(small_max_new.filter(bool), st.sampled_from([0, -1, 8192, 10 ** 9]) | junk))
    mode = draw(st.sampled_from(MODES))
    bad = draw(st.sampled_from(["prompt"] + sorted(fields))) if mode == "one_bad" else None
    chaos = mode == "chaos"
    form = draw(st.sampled_from([good_text, st.lists(good_text, min_size=1, max_size=3), good_ids,
                                 st.lists(good_ids, min_size=1, max_size=3)]))
    prompt = draw(form)
    if bad == "prompt" or (chaos and draw(st.booleans())):
        bad_one = draw(bad_text | bad_ids | junk)
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt[draw(st.integers(0, len(prompt) - 1))] = bad_one
        else:
            prompt = bad_one
    body = {"model": "default", "prompt": prompt, "max_tokens": draw(small_max_new.filter(bool))}
    body.update(draw_fields(draw, fields, bad, chaos))
    if chaos and draw(st.integers(0, 9)) == 0:
        return draw(junk | st.just([body]))  # not even an object
    return body


content_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": good_text}), min_size=1, max_size=2)
good_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                      "content": good_text | content_parts})
bad_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | st.text(max_size=5),
     "content": bad_text | st.none() | junk | st.just([{"type": "image_url", "image_url": {
         "url": "data:image/png;base64,AAAA"}}])},
    optional={"tool_calls": st.just([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}])
              | junk, "tool_call_id": st.text(max_size=4), "name": junk},
)
good_tools = st.lists(st.fixed_dictionaries({
    "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "search"])},
                                      optional={"parameters": st.just({"type": "object", "properties": {
                                          "city": {"type": "string"}}, "required": ["city"]}),
                                          "description": good_text})}), min_size=1, max_size=2)
bad_tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "nope"]), "function": junk})
                     | junk, min_size=1, max_size=2) | junk


@st.composite
def chat_bodies(draw):
    fields = dict(OPENAI, tools=(good_tools, bad_tools), logprobs=(st.booleans(), junk),
                  top_logprobs=(st.integers(0, 5), any_int | junk),
                  tool_choice=(st.sampled_from(["auto", "none", "required"]),
                               st.sampled_from([{"type": "function", "function": {"name": "nope"}}, "sometimes"])
                               | junk),
                  max_completion_tokens=(small_max_new.filter(bool), st.sampled_from([-1, 10 ** 9]) | junk),
                  chat_template_kwargs=(st.just({"enable_thinking": False}), junk),
                  continue_final_message=(st.booleans(), junk), separate_reasoning=(st.booleans(), junk))
    mode = draw(st.sampled_from(MODES))
    bad = draw(st.sampled_from(["messages"] + sorted(fields))) if mode == "one_bad" else None
    chaos = mode == "chaos"
    messages = draw(st.lists(good_message, min_size=1, max_size=3))
    if bad == "messages" or (chaos and draw(st.booleans())):
        if draw(st.booleans()):
            messages.insert(draw(st.integers(0, len(messages))), draw(bad_message))
        else:
            messages = draw(junk | st.just([]))
    body = {"model": "default", "messages": messages, "max_tokens": draw(small_max_new.filter(bool))}
    body.update(draw_fields(draw, fields, bad, chaos))
    if "tool_choice" in body and body.get("tool_choice") == "required" and "tools" not in body:
        body["tools"] = draw(good_tools)
    if chaos and draw(st.integers(0, 9)) == 0:
        return draw(junk | st.just([body]))  # not even an object (SGLang's pre-validator read it with .get)
    return body


# -- tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(server):
    """The server as a user starts it (conftest's: VeriCache on, metrics on), shared with
    test_server.py, which runs after this module and stops it."""
    return server


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_corpus(srv, case):
    """Every body that once crashed the server: now the status it names (a 400), the error
    naming the field and value, and the server healthy after."""
    status, text = send(srv, case["path"], case["body"])
    assert status == case["status"], (status, text[:400])
    for part in case["named"]:
        assert part in text, (part, text[:400])
    check_contained(srv, case["path"], case["body"], status, text)


def test_fuzz_generate(srv):
    @fuzz_settings("generate")
    @given(body=generate_bodies())
    def run(body):
        fuzz_one(srv, "generate", "/generate", body)

    run()
    assert STATUSES[("generate", 2)] and STATUSES[("generate", 4)], STATUSES  # both kinds were generated


def test_fuzz_completions(srv):
    @fuzz_settings("completions")
    @given(body=completion_bodies())
    def run(body):
        fuzz_one(srv, "completions", "/v1/completions", body)

    run()
    assert STATUSES[("completions", 2)] and STATUSES[("completions", 4)], STATUSES


def test_fuzz_chat(srv):
    @fuzz_settings("chat")
    @given(body=chat_bodies())
    def run(body):
        fuzz_one(srv, "chat", "/v1/chat/completions", body)

    run()
    assert STATUSES[("chat", 2)] and STATUSES[("chat", 4)], STATUSES
    print("fuzzed statuses (api, class):", dict(STATUSES))


def test_frontend_dsl(srv):
    """The SGLang frontend language: a program whose generation has an empty prompt is
    refused (it crashed the server before), and gen + select run on after it."""
    import sglang as sgl

    backend = sgl.RuntimeEndpoint(srv.url, chat_template_name="chatml")

    @sgl.function
    def empty_prompt(s):
        s += sgl.gen("out", max_tokens=2, temperature=0)

    @sgl.function
    def huge_top_logprobs(s):
        s += "Say yes:" + sgl.gen("out", max_tokens=2, return_logprob=True, top_logprobs_num=10 ** 6)

    @sgl.function
    def pick(s):
        s += "Q: Is the sky blue? Answer yes or no.\nA:" + sgl.select("answer", choices=[" yes", " no"])
        s += " Because" + sgl.gen("why", max_tokens=3, temperature=0)

    for program, named in ((empty_prompt, "empty"), (huge_top_logprobs, "top_logprobs_num")):
        state = program.run(backend=backend)
        error = state.error()
        assert error is not None and named in str(error), error
        check_healthy(srv, f"the DSL program refused for {named}")
    state = pick.run(backend=backend)
    assert state.error() is None, state.error()
    assert state["answer"] in (" yes", " no") and state["why"]


@pytest.mark.slow
def test_negative_control_without_checks(tmp_path, monkeypatch):
    """With the request checks off (VERICACHE_REQUEST_CHECKS=0) the first corpus body still
    takes the whole server down: the corpus tests what it claims to."""
    monkeypatch.setenv("VERICACHE_REQUEST_CHECKS", "0")
    server = ServerProcess([], tmp_path / "server.log")
    try:
        server.wait_ready()
        case = next(c for c in CORPUS if c["name"] == "token_id_past_vocab")
        try:
            send(server, case["path"], case["body"])
        except requests.RequestException:
            pass
        try:
            server.proc.wait(timeout=120)
        except Exception:
            pass
        assert server.proc.poll() is not None, "the server survived a corpus body with the checks off"
        log = server.log_path.read_text(errors="replace")
        assert "Scheduler hit an exception" in log and "index out of range" in log, server.log_tail(60)
    finally:
        server.stop()
