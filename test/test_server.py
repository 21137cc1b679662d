"""The server as a user runs it: `python -m sgl_vericache.launch_server` with defaults.

One server (conftest's ``server``, with ``--enable-metrics``), shared with test_api_fuzz.py,
which runs just before this module; the shutdown test runs last and stops it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import requests

from conftest import ROOT
from prompts import prompt_set

JSON_HEADERS = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv(server):
    return server


def post(srv, path, payload, **kw):
    return requests.post(srv.url + path, json=payload, timeout=300, **kw)


def assert_healthy(srv):
    r = post(srv, "/generate", {"text": "1, 2, 3,", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 4


def test_native_generate(srv):
    r = post(srv, "/generate", {"text": "The capital of France is",
                                "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["text"]
    assert body["meta_info"]["completion_tokens"] == len(body["output_ids"]) == 8


def test_model_info_is_default_model(srv, default_model_path):
    info = requests.get(srv.url + "/get_model_info", timeout=30).json()
    assert info["model_path"] == str(default_model_path)


def test_openai_completions(srv):
    r = post(srv, "/v1/completions", {"model": "default", "prompt": "def add(a, b):",
                                      "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 12
    assert body["choices"][0]["text"]


def test_openai_chat_and_streaming(srv):
    msgs = [{"role": "user", "content": "Name three colors."}]
    r = post(srv, "/v1/chat/completions", {"model": "default", "messages": msgs,
                                           "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    full = r.json()["choices"][0]["message"]["content"]
    assert full
    r = post(srv, "/v1/chat/completions", {"model": "default", "messages": msgs, "max_tokens": 16,
                                           "temperature": 0, "stream": True}, stream=True)
    assert r.status_code == 200
    pieces, chunks = [], 0
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunks += 1
        delta = json.loads(line[6:])["choices"][0]["delta"]
        pieces.append(delta.get("content") or "")
    assert chunks > 2, "streaming should deliver several chunks"
    assert "".join(pieces) == full, "streamed text must equal the non-streamed greedy text"


def test_greedy_matches_transformers(srv, default_model_path):
    """SGLang fp32 greedy == HF transformers fp32 greedy, token ids, 6 prompts x 40 tokens
    (sent to the server in one batch; HF generates them one by one, ~0.1 s a token here)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    prompts = prompt_set(2)
    all_ids = [tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
               for _, msgs in prompts]
    r = post(srv, "/generate", {"input_ids": all_ids, "sampling_params": {"max_new_tokens": 40, "temperature": 0}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == len(prompts)
    for (name, _), ids, body in zip(prompts, all_ids, outs):
        ours = [t for t in body["output_ids"] if t != eos]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=eos)
        ref = [t for t in out[0, len(ids):].tolist() if t != eos]
        first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        assert ours == ref, f"prompt {name}: first divergent index {first if first is not None else min(len(ours), len(ref))}"


def test_frontend_dsl(srv):
    import sglang as sgl

    backend = sgl.RuntimeEndpoint(srv.url, chat_template_name="chatml")

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0))
        s += sgl.user("Is that answer short or long?")
        s += sgl.assistant(sgl.select("verdict", choices=["short", "long"]))

    @sgl.function
    def branches(s, topic):
        s += "Two facts about " + topic + ":\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"{i + 1}." + sgl.gen("fact", max_tokens=12, temperature=0, stop="\n")
        s += "".join("- " + f["fact"].strip() + "\n" for f in forks)

    state = qa.run(question="What is 2 + 2?", backend=backend)
    assert state["answer"]
    assert state["verdict"] in ("short", "long")
    states = branches.run_batch([{"topic": "cats"}, {"topic": "the moon"}], backend=backend)
    assert len(states) == 2
    for st in states:
        assert st.text().count("- ") >= 2


def test_sampling_mixed_batch_and_seeds(srv):
    """Greedy, seeded, unseeded, top-p and min-p requests decoded together under VeriCache:
    all answered; a seeded request gives the same tokens alone and next to batch-mates that
    filter (SGLang alone would key its noise differently then); the server stays healthy."""
    import concurrent.futures as cf

    base = {"text": "Write a haiku about the sea.", "sampling_params": {"max_new_tokens": 24}}
    seeded = {"temperature": 0.8, "sampling_seed": 5}
    variants = [{"temperature": 0}, seeded, {"temperature": 0.8}, {"temperature": 0.9, "min_p": 0.1},
                {"temperature": 0.7, "top_p": 0.9}, seeded]
    bodies = [{**base, "sampling_params": {**base["sampling_params"], **v}} for v in variants]
    alone = post(srv, "/generate", bodies[1])
    assert alone.status_code == 200, alone.text
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: post(srv, "/generate", b), bodies))
    for v, r in zip(variants, replies):
        assert r.status_code == 200, (v, r.text)
    for r in (replies[1], replies[-1]):
        assert r.json()["output_ids"] == alone.json()["output_ids"]
    assert_healthy(srv)


def test_acceptance_in_meta_info_and_metrics(srv):
    r = post(srv, "/generate", {"text": "List the numbers from 1 to 30 separated by commas:",
                                "sampling_params": {"max_new_tokens": 48, "temperature": 0}})
    meta = r.json()["meta_info"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] > 1.0, meta
    hist = meta["spec_correct_drafts_histogram"]  # rounds per number of accepted drafts
    assert sum(hist) == meta["spec_verify_ct"]
    metrics = requests.get(srv.url + "/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("vericache:") and not line.startswith("#")}
    assert values.get("vericache:rounds_total", 0) >= meta["spec_verify_ct"], sorted(values)
    assert values["vericache:emitted_tokens_total"] >= values["vericache:accepted_tokens_total"] > 0
    assert values["vericache:draft_seconds_total"] > 0 and values["vericache:verify_seconds_total"] > 0
    assert "sglang:spec_accept_length" in metrics


@pytest.mark.parametrize("body, expect", [
    (b'{"text": "hello", "sampling_params": ', "validation error"),
    (b'{"text": "hello", "sampling_params": {"temperature": -1}}', "temperature"),
    (b'{"text": "hello", "sampling_params": {"max_new_tokens": -5}}', "max_new_tokens"),
])
def test_bad_request_is_4xx_and_server_survives(srv, body, expect):
    r = requests.post(srv.url + "/generate", data=body, headers=JSON_HEADERS, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert expect in r.text
    assert_healthy(srv)


def test_prompt_longer_than_context(srv):
    r = post(srv, "/generate", {"input_ids": [42] * 9000, "sampling_params": {"max_new_tokens": 4}})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert "context length" in r.text
    assert_healthy(srv)


@pytest.mark.parametrize("args, expect", [
    (["--vericache-bogus", "1"], "unknown flag --vericache-bogus"),
    (["--vericache-ratio", "0.5"], "--vericache-ratio 0.5 is out of range"),
    (["--vericache-draft-len", "0"], "--vericache-draft-len 0 is out of range"),
    (["--vericache-compressor", "zip"], "--vericache-compressor 'zip' is not one of"),
    (["--model-path", "/no/such/model"], "no such model directory"),
    (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3 stores the full KV quantized"),
    (["--vericache-full-device-budget", "64", "--page-size", "16"], "needs --page-size 1, not '16'"),
])
def test_launcher_rejects_bad_flags(args, expect):
    r = subprocess.run([sys.executable, "-m", "sgl_vericache.launch_server", *args],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2
    assert expect in r.stderr, r.stderr


def test_help_lists_both_flag_sets():
    r = subprocess.run([sys.executable, "-m", "sgl_vericache.launch_server", "--help"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "--vericache-draft-len" in r.stdout and "--speculative-algorithm" in r.stdout
    assert "--mem-fraction-static" in r.stdout


def test_idle_server_leaves_the_cores_alone(srv):
    """The server on a CPU, idle: its scheduler sleeps until a request comes (the
    launcher's --sleep-on-idle) instead of polling at 100% of a core for as long as it is
    up, a core the engine's own threads need (it slowed everything else on a 2-core
    machine). It still answers."""
    server = srv
    assert_healthy(server)
    time.sleep(2)  # the health check's own work is done
    before, start = server.cpu_seconds(), time.monotonic()
    time.sleep(6)
    used, elapsed = server.cpu_seconds() - before, time.monotonic() - start
    # a polling scheduler uses about `elapsed` seconds here (half of it on a loaded machine)
    assert used < 0.15 * elapsed, f"idle server used {used:.2f} s of CPU in {elapsed:.1f} s"
    r = requests.post(server.url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
                      timeout=60)
    assert r.status_code == 200, r.text


def test_zz_clean_shutdown(srv):
    """Runs last in this module: SIGTERM stops the server and all its processes."""
    assert_healthy(srv)
    assert srv.stop(signal.SIGTERM, timeout=60), "processes left behind after SIGTERM:\n" + srv.log_tail()
