"""The product's promise: with VeriCache on, output token ids equal those of the same
engine with speculation off (greedy, fp32, SmolLM2-135M, CPU).

CI subset (this file without ``slow``): one VERICACHE engine (draft length up to 30)
serves every compressor at 4x and draft lengths 1, 4, 16 and 30 through per-request
overrides (``custom_params``), at batch 4 over 8 prompts x 128 tokens and at batch 1 over
two of them x 64 tokens; the speculation-off reference is computed once and reused. The
engine parks requests' own full KV beyond a 64-token device budget in host memory between
verify rounds (``--vericache-full-device-budget``), so both paths run. The
full matrix (every compressor x draft lengths 1/4/16/30 x batch 1/4, 24 prompts x 256
tokens) is the ``slow`` test in ``test_exactness_matrix.py``.
"""

from __future__ import annotations

import os

import pytest

from prompts import prompt_set

COMPRESSORS = ["kivi4", "kivi2", "int8", "fp8", "streamingllm", "snapkv", "h2o", "quest"]
DRAFT_LENS = [1, 4, 16, 30]
MAX_DRAFT_LEN = 30
FULL_BUDGET = 64  # --vericache-full-device-budget of the VERICACHE engine (tokens)
# sleep_on_idle: an idle SGLang scheduler otherwise polls at 100% of a core, and this module
# keeps up to three engines alive at once on two cores
ENGINE_KW = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                 dtype="float32", max_total_tokens=16384, log_level="warning", sleep_on_idle=True)


def _engine(model_path, **kw):
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sglang.srt.entrypoints.engine import Engine

    return Engine(model_path=str(model_path), **ENGINE_KW, **kw)


def _input_ids(model_path, prompts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
            for _, m in prompts]


def first_divergence(ours, ref):
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def reference_outputs(model_path, ids, max_new_tokens, extra=None):
    """Speculation-off greedy outputs (token ids, and the top-2 logprobs at every step, for
    near-tie diagnosis), from an engine that is shut down before returning. ``extra(engine,
    greedy_ids)`` computes further references in the same engine. Without overlap scheduling,
    as VERICACHE runs: under it SGLang penalizes a request's last prompt token and then each
    output token one step late (it reads the output before the last step's token is in it),
    so a penalized request's ids depend on the flag, speculation off or on."""
    engine = _engine(model_path, disable_overlap_schedule=True)
    try:
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0},
                              return_logprob=True, top_logprobs_num=2)
        greedy = [o["output_ids"] for o in out]
        top2 = [[[lp for lp, *_ in step] for step in o["meta_info"]["output_top_logprobs"]] for o in out]
        more = extra(engine, greedy) if extra is not None else None
    finally:
        engine.shutdown()
    return Reference(greedy, top2, more)


class Reference(list):
    """Greedy token ids per prompt (a list), plus ``top2`` and any ``extra`` results."""

    def __init__(self, greedy, top2, extra):
        super().__init__(greedy)
        self.top2, self.extra = top2, extra


CI_PROMPTS = prompt_set(3)[:8]

# Seeded sampling: 4 prompts x 64 tokens; the draw at each position depends only on
# (seed, position), so VeriCache must reproduce these token ids exactly.
SEEDED = [{"max_new_tokens": 64, "temperature": 0.7, "top_p": 0.9, "sampling_seed": 1000 + i} for i in range(3)] + [
    {"max_new_tokens": 64, "temperature": 1.0, "top_k": 20, "sampling_seed": 77}]


def stop_params(tok, greedy):
    """Requests that stop inside a draft: on a token id, on a string, at max_new_tokens,
    each picked from the greedy reference so that it fires mid-generation."""
    stop_id = greedy[0][min(21, len(greedy[0]) - 2)]
    at = min(30, len(greedy[1]) - 4)
    text = tok.decode(greedy[1][at : at + 3])
    return [
        {"max_new_tokens": 128, "temperature": 0, "stop_token_ids": [stop_id]},
        {"max_new_tokens": 128, "temperature": 0, "stop": [text.strip() or text]},
        {"max_new_tokens": 7, "temperature": 0},
        {"max_new_tokens": 128, "temperature": 0, "stop": ["\n"], "no_stop_trim": True},
        # the answer's EOS, which the model follows with a new turn: a verify that accepted
        # past the EOS ended at this string instead (SGLang checks strings first in a run)
        {"max_new_tokens": 128, "temperature": 0, "stop": ["<|im_start|>"]},
    ]


def penalized_params(greedy):
    """Requests whose sampling SGLang penalizes once an iteration: frequency, repetition and
    presence penalties, greedy and seeded, and a stop token held back by min_new_tokens (the
    greedy reference's token at position 10, barred until 24 tokens are out). None combines
    an additive penalty (frequency, presence) with the multiplicative one (repetition):
    SGLang applies the two kinds in an order that depends on its scheduling path and, on one
    of them, on a set's iteration order in the process, so such a request is not
    reproducible across SGLang engines, speculation off or on (docs/exactness.md)."""
    return [
        {"max_new_tokens": 40, "temperature": 0, "frequency_penalty": 0.8},
        {"max_new_tokens": 40, "temperature": 0, "repetition_penalty": 1.3},
        {"max_new_tokens": 40, "temperature": 0, "stop_token_ids": [greedy[2][10]], "min_new_tokens": 24},
        {"max_new_tokens": 40, "temperature": 0.8, "sampling_seed": 5, "presence_penalty": 0.5},
        # both additive penalties: decoding applies them one after the other, SGLang's verify
        # and a speculating engine's plain steps summed them first (an ulp apart)
        {"max_new_tokens": 40, "temperature": 0, "frequency_penalty": 0.6, "presence_penalty": 0.7},
    ]


# Raw text whose greedy continuation repeats one token: a penalized request's rounds verify
# copies of its last token, which the target predicts again (before 2026-12-06 such a row
# accepted several under one penalty state and diverged at tokens 5 and 13).
REPEATING_TEXTS = ["ha ha ha ha ha ha ha ha ha ha", "0000000000000000000000"]
REPEATING_PARAMS = {"max_new_tokens": 40, "temperature": 0, "frequency_penalty": 0.1}


# A grammar-constrained request beside them: its verify masks every position by the grammar,
# and its rows share rounds with penalized rows
GRAMMAR_PARAMS = {"max_new_tokens": 48, "temperature": 0, "regex": r"Answer: (yes|no)\. [A-Za-z ,]{20,80}\."}


def penalized_inputs(tok, ids):
    """(input ids, params) of the requests beside the penalized CI prompts: the repeating
    texts' and a grammar-constrained one."""
    repeating = [tok(t)["input_ids"] for t in REPEATING_TEXTS]
    return ids[:5] + repeating + [ids[5]], [REPEATING_PARAMS] * len(repeating) + [GRAMMAR_PARAMS]


CONVERSATION_TURNS = 10
CONVERSATION_TOKENS = 24


def tool_turns(tok):
    """Token ids appended after each answer of the 10-turn conversation: a tool result and
    the next assistant turn, in SmolLM2's chat format."""
    return [tok(f"<|im_end|>\n<|im_start|>user\nTool result {i}: status=ok, rows={7 * i + 3}. Continue."
                f"<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
            for i in range(CONVERSATION_TURNS)]


SHARED_PARAMS = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}

# Two prompts no other test sends (raw text, no chat template), each longer than the
# VERICACHE engine's 64-token budget, for the test that their requests park their prompts.
FRESH_PARAMS = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
FRESH_TEXTS = [
    "Release notes, version 4.2 of the tile cache daemon. The eviction thread now wakes on memory pressure "
    "instead of polling every second, which cut idle CPU use by a third on the test fleet. Writes to the "
    "journal are batched per shard, and a torn journal entry is detected by its checksum and skipped. "
    "Known issue: a shard that is resized while a compaction runs may report stale sizes until the next scan.",
    "Field log, day nine. We left the upper camp before dawn and followed the moraine to the second lake, "
    "where the ice had retreated almost two hundred metres since last season. The water samples from the "
    "outflow were cloudy, so we filtered twice and labelled them by depth. In the afternoon the wind turned "
    "and we measured the snow line on the north face with the laser before the cloud came down.",
]


def shared_prefix_prompts(tok, ids):
    """Three prompts that share one long prefix (a CI prompt and the start of a tool
    result) and differ after it, like agents sharing a system prompt."""
    return [ids[6] + suffix for suffix in tool_turns(tok)[:3]]


def conversation(engine, first_ids, turns, max_new_tokens, custom_params=None):
    """[(input_ids, output_ids)] per turn: each turn's input is the previous input, its
    answer and the next tool result (the speculation-off engine defines the inputs)."""
    ids, out = list(first_ids), []
    for suffix in turns:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        if custom_params:
            params["custom_params"] = custom_params
        got = engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
        out.append((ids, got))
        ids = ids + got + suffix
    return out


def _extra_references(model_path, ids):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)

    def extra(engine, greedy):
        seeded = engine.generate(input_ids=ids[:4], sampling_params=SEEDED)
        stops = stop_params(tok, greedy)
        stopped = engine.generate(input_ids=ids[:len(stops)], sampling_params=stops)
        penalized_ids, repeating = penalized_inputs(tok, ids)
        penalized = engine.generate(input_ids=penalized_ids, sampling_params=penalized_params(greedy) + repeating)
        return {"seeded": [o["output_ids"] for o in seeded], "stops": stops,
                "penalized": [o["output_ids"] for o in penalized],
                "stopped": [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in stopped],
                "conversation": conversation(engine, ids[2], tool_turns(tok), CONVERSATION_TOKENS),
                "shared": [(p, engine.generate(input_ids=p, sampling_params=SHARED_PARAMS)["output_ids"])
                           for p in shared_prefix_prompts(tok, ids)],
                "fresh": [(p, engine.generate(input_ids=p, sampling_params=FRESH_PARAMS)["output_ids"])
                          for p in (tok(t)["input_ids"] for t in FRESH_TEXTS)]}

    return extra


@pytest.fixture(scope="module")
def reference(default_model_path):
    """The CI prompt set's references (greedy, seeded sampling, stop conditions), computed
    once, before the VERICACHE engine exists."""
    ids = _input_ids(default_model_path, CI_PROMPTS)
    return reference_outputs(default_model_path, ids, 128, _extra_references(default_model_path, ids))


PREEMPT_INTERVAL = 7  # forward passes between the preemptions SGLang's test hook forces


def _vericache_engine(model_path, preempt):
    from sgl_vericache.config import VeriCacheConfig

    # A device budget of 64 tokens for requests' own full KV: at batch 4, once requests have
    # generated more than that, verifies are staggered (each iteration verifies the requests
    # that fit, longest-waiting first; the rest draft with their full KV parked in host
    # memory, copied back while the drafts of the round they verify in run); at batch 1 the
    # one request always verifies. Both paths run in the tests below.
    VeriCacheConfig(compressor="kivi4", ratio=4.0, draft_len=MAX_DRAFT_LEN, full_device_budget=FULL_BUDGET).to_env()
    with pytest.MonkeyPatch.context() as env:  # read once, when the scheduler starts
        if preempt:
            env.setenv("SGLANG_TEST_RETRACT", "1")
            env.setenv("SGLANG_TEST_RETRACT_INTERVAL", str(PREEMPT_INTERVAL))
        else:
            env.delenv("SGLANG_TEST_RETRACT", raising=False)
        return _engine(model_path, speculative_algorithm="VERICACHE",
                       speculative_num_draft_tokens=MAX_DRAFT_LEN + 1,
                       speculative_ngram_max_bfs_breadth=1, disable_overlap_schedule=True,
                       radix_cache_backend="vericache",
                       decode_log_interval=1)  # SGLang's accept-length totals, current at every step


@pytest.fixture(scope="module")
def vc_engine(default_model_path):
    """The VERICACHE engine most tests here run on, under preemption: SGLang's own test
    hook (``SGLANG_TEST_RETRACT``) retracts a decoding request every ``PREEMPT_INTERVAL``
    forward passes whenever two or more decode together, so requests leave the batch
    mid-answer and resume (their KV kept in the radix tree, their compressed entry in the
    prefix cache). The reference engine never preempts: outputs must not depend on it."""
    engine = _vericache_engine(default_model_path, preempt=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def steady_engine(default_model_path):
    """The same VERICACHE engine without forced preemption, for the tests that need
    requests to decode side by side from their first round to their last. The hook's
    counter is global: where a retraction falls in a short request depends on every
    forward pass before it, so under it whether two requests ever verify in one round (and
    whose prompt is still their own, not the tree's, when they do) is left to chance."""
    engine = _vericache_engine(default_model_path, preempt=False)
    yield engine
    engine.shutdown()


def run_configs(engine, ids, configs, max_new_tokens, batch):
    """Generate each prompt with its (compressor, draft_len), ``batch`` requests at once."""
    outs = []
    for start in range(0, len(ids), batch):
        chunk = list(range(start, min(start + batch, len(ids))))
        params = [{"max_new_tokens": max_new_tokens, "temperature": 0,
                   "custom_params": {"vericache_compressor": configs[i][0], "vericache_ratio": 4.0,
                                     "vericache_draft_len": configs[i][1]}} for i in chunk]
        out = engine.generate(input_ids=[ids[i] for i in chunk], sampling_params=params)
        outs.extend(out)
    return outs


def check_identical(prompts, configs, outs, ref, batch, top2=None):
    """Every output equals its reference; a failure names the prompt, the configuration,
    the first divergent index and the reference's top-2 logprob margin there (a margin
    under 1e-4 means a near-tie that fp32 rounding between verify and decode can flip)."""
    failures, accept = [], []
    for i, ((name, _), (comp, draft_len), out, expected) in enumerate(zip(prompts, configs, outs, ref)):
        ours = out["output_ids"]
        accept.append(out["meta_info"].get("spec_accept_length"))
        idx = first_divergence(ours, expected)
        if idx is not None:
            margin = ""
            if top2 is not None and idx < len(top2[i]) and len(top2[i][idx]) == 2:
                margin = f", reference top-2 logprob margin there {top2[i][idx][0] - top2[i][idx][1]:.3g}"
            failures.append(f"prompt {name} [{comp}, draft_len={draft_len}, batch={batch}]: "
                            f"first divergent index {idx}: ours {ours[idx:idx + 3]} vs ref {expected[idx:idx + 3]}"
                            f"{margin}")
    print(f"identical: {len(outs) - len(failures)}/{len(outs)}")
    assert not failures, "\n".join(failures)
    return accept


def test_every_compressor_and_draft_len_batch4(reference, vc_engine, default_model_path):
    prompts = CI_PROMPTS
    ids = _input_ids(default_model_path, prompts)
    # Every compressor once, each draft length twice; each batch of 4 mixes compressors and
    # two draft lengths (1 with 4, 16 with 30). A round drafts as many steps as its longest
    # request asks for, so a batch pairing draft length 1 (many short rounds) with 30 would
    # draft 30 steps in each of those rounds: same coverage, several times the time. The
    # long drafts go to the quantizers, which accept most of them here (few rounds of 30
    # steps); the droppers' long drafts are test_batch1_and_full_compressor's (snapkv, 16).
    configs = [("h2o", 1), ("quest", 1), ("streamingllm", 4), ("snapkv", 4),
               ("kivi2", 16), ("kivi4", 16), ("int8", 30), ("fp8", 30)]
    assert sorted(c for c, _ in configs) == sorted(COMPRESSORS)
    ref = reference
    before = _vericache_state(vc_engine)["compressor_requests"]
    outs = run_configs(vc_engine, ids, configs, 128, batch=4)
    accept = check_identical(prompts, configs, outs, ref, batch=4, top2=ref.top2)
    print("mean acceptance length per request:", accept)
    check_spec_counts(outs)
    # each request drafted from the compressor it asked for (a request is planned again when
    # it resumes after a preemption, so at least once each)...
    after = _vericache_state(vc_engine)["compressor_requests"]
    planned = {c: after.get(c, 0) - before.get(c, 0) for c in COMPRESSORS}
    assert all(n >= 1 for n in planned.values()), f"an override was not applied: {planned}"
    # ...and its drafts were worth verifying: tokens per round above a floor per compressor and
    # draft length (about half of what the exactness matrix measured for the same prompt at
    # 256 tokens; drafts that never agree give ~1.0)
    low = [f"{c} d={d}: {a}" for (c, d), a in zip(configs, accept) if a is None or a < ACCEPT_FLOORS[c]]
    assert not low, f"acceptance below the floor: {low} (floors {ACCEPT_FLOORS})"


# Tokens per verify round each batch-4 configuration must reach (its compressor at its
# draft length there): h2o d1, quest d1, streamingllm d4, snapkv d4, kivi2 d16, kivi4 d16,
# int8 d30, fp8 d30.
ACCEPT_FLOORS = {"h2o": 1.35, "quest": 1.2, "streamingllm": 2.0, "snapkv": 1.4, "kivi2": 6.0, "kivi4": 7.0,
                 "int8": 9.0, "fp8": 9.0}


def check_spec_counts(outs):
    """Per-request spec counters stay consistent when verifies are staggered (rows that
    drafted without verifying accept 0 tokens and must not count as verifies)."""
    for out in outs:
        meta = out["meta_info"]
        hist = meta["spec_correct_drafts_histogram"]
        assert sum(hist) == meta["spec_verify_ct"], meta
        assert sum(k * c for k, c in enumerate(hist)) == meta["spec_num_correct_drafts"], meta


def test_preempted_requests_resume_from_their_kept_kv(vc_engine):
    """The batch-4 run above was preempted again and again (and stayed identical): each
    preempted request left its KV in the tree (``--vericache-keep-preempted-kv``, on by
    default) and, resumed, started from its compressed entry instead of compressing again."""
    state = vc_engine.get_server_info()["internal_states"][0]
    kept, vc = state["vericache_preempted"], state["vericache"]
    print("preempted:", kept, "compressed prefix hits:", vc["compressed_prefix_hits"])
    assert kept["requests"] >= 4 and kept["kept_tokens"] > 0, kept
    assert vc["compressed_prefix_hits"] >= 4 and vc["compressed_prefix_hit_tokens"] > 0, vc


def test_batch1_and_full_compressor(reference, vc_engine, default_model_path):
    """Batch 1 (two prompts x 64 tokens), and the uncompressed draft ('full'), whose drafts
    verify almost always."""
    prompts = CI_PROMPTS
    ids = _input_ids(default_model_path, prompts)
    ref = reference
    picks, tokens = [0, 5], 64  # greedy: the reference's first 64 tokens are its 64-token answer
    configs = [("snapkv", 16), ("full", 30)]
    outs = run_configs(vc_engine, [ids[i] for i in picks], configs, tokens, batch=1)
    accept = check_identical([prompts[i] for i in picks], configs, outs, [ref[i][:tokens] for i in picks], batch=1,
                             top2=[ref.top2[i][:tokens] for i in picks])
    assert accept[1] is not None and accept[1] > 8, f"uncompressed drafts should mostly verify: {accept}"


def _with_vc(params, comp, draft_len):
    return {**params, "custom_params": {"vericache_compressor": comp, "vericache_draft_len": draft_len}}


def test_seeded_sampling_is_token_identical(reference, vc_engine, default_model_path):
    """Seeded mode: sampled output equals speculation-off sampling with the same seeds."""
    ids = _input_ids(default_model_path, CI_PROMPTS[:4])
    # One draft length for the batch: a round drafts as many steps as its longest request
    # asks for (draft lengths are the greedy test's job).
    configs = [("kivi4", 4), ("h2o", 4), ("quest", 4), ("kivi2", 4)]
    params = [_with_vc(p, c, d) for p, (c, d) in zip(SEEDED, configs)]
    before = _vericache_state(vc_engine)
    outs = vc_engine.generate(input_ids=ids, sampling_params=params)
    accept = check_identical(CI_PROMPTS[:4], configs, outs, reference.extra["seeded"], batch=4)
    print("seeded mean acceptance length per request:", accept)
    after = _vericache_state(vc_engine)
    # past the 64-token budget the sampled rounds were staggered too: deferred rows drafted
    # nothing and were left out of the verify forward
    assert after["deferred_rows"] > before["deferred_rows"], (before, after)
    assert after["verify_rows_skipped"] - before["verify_rows_skipped"] == after["deferred_rows"] - before["deferred_rows"]


def test_penalized_sampling_is_token_identical(reference, steady_engine, default_model_path):
    """Penalties and min_new_tokens, which SGLang accumulates once an iteration. Penalized
    requests draft, each verified position penalized as a decode step there
    (``sglang.penalties``; min_new_tokens' count too, so the request it holds drafts from
    its first round), and their ids equal speculation off's; the batch's other rows keep
    drafting (a regex-constrained one among them). On the engine without forced preemption: a
    retracted request's penalties start again from zero when it resumes, in SGLang itself,
    with or without speculation (the reference never preempts)."""
    from transformers import AutoTokenizer

    ids, repeating = penalized_inputs(AutoTokenizer.from_pretrained(default_model_path),
                                      _input_ids(default_model_path, CI_PROMPTS[:6]))
    params = [_with_vc(p, "kivi4", 8) for p in penalized_params(reference[:5]) + repeating]
    outs = steady_engine.generate(input_ids=ids + ids[:1], sampling_params=params + [
        _with_vc({"max_new_tokens": 40, "temperature": 0}, "kivi4", 8)])
    for i, (out, want) in enumerate(zip(outs, reference.extra["penalized"])):
        assert out["output_ids"] == want, (i, params[i], first_divergence(out["output_ids"], want))
    assert outs[2]["output_ids"][10] != reference[2][10] and len(outs[2]["output_ids"]) >= 24  # min_new_tokens held
    assert outs[-2]["text"].startswith("Answer: ")  # the grammar held
    assert outs[-1]["output_ids"] == reference[0][:40]
    assert outs[-1]["meta_info"]["spec_verify_ct"] < 40  # the unpenalized row still drafted
    rounds = [(len(o["output_ids"]), o["meta_info"]["spec_verify_ct"]) for o in outs]
    assert all(rounds[i][1] < rounds[i][0] for i in range(7)), rounds  # penalized rows drafted, min_new_tokens' too


def test_stop_conditions_inside_drafts(reference, vc_engine, default_model_path):
    """Stop token id, stop string, max_new_tokens and a kept stop string, each reached in
    the middle of a draft of 16 or 30 tokens, and an EOS followed by a stop string in the
    same draft: exactly what speculation off emits."""
    stops, expected = reference.extra["stops"], reference.extra["stopped"]
    ids = _input_ids(default_model_path, CI_PROMPTS[:len(stops)])
    params = [_with_vc(p, "kivi4", 30 if i % 2 else 16) for i, p in enumerate(stops)]
    outs = vc_engine.generate(input_ids=ids, sampling_params=params)
    for i, (out, (ref_ids, ref_text, ref_finish)) in enumerate(zip(outs, expected)):
        assert out["output_ids"] == ref_ids, (stops[i], first_divergence(out["output_ids"], ref_ids))
        assert out["text"] == ref_text, stops[i]
        assert out["meta_info"]["finish_reason"] == ref_finish, stops[i]
    assert len(expected[2][0]) == 7
    assert len(expected[0][0]) < 128 and expected[0][2]["type"] == "stop"  # the stop fired mid-way
    assert expected[4][2] == {"type": "stop", "matched": expected[4][0][-1]}  # decoding ends at the EOS


def _vericache_state(engine):
    return engine.get_server_info()["internal_states"][0]["vericache"]


def test_ten_turn_conversation_reuses_compressed_prefixes(reference, vc_engine):
    """A 10-turn agent conversation (answer, tool result, answer, ...): every turn equals
    speculation off, and every turn after the first starts from the compressed entry the
    previous turn left in the prefix cache (it compresses only the new tokens)."""
    turns = reference.extra["conversation"]
    assert len(turns) == CONVERSATION_TURNS
    before = _vericache_state(vc_engine)
    failures = []
    for i, (ids, expected) in enumerate(turns):
        out = vc_engine.generate(input_ids=ids, sampling_params={
            "max_new_tokens": CONVERSATION_TOKENS, "temperature": 0, "ignore_eos": True,
            "custom_params": {"vericache_compressor": "streamingllm", "vericache_draft_len": 8}})
        idx = first_divergence(out["output_ids"], expected)
        if idx is not None:
            failures.append(f"turn {i} ({len(ids)} prompt tokens): first divergent index {idx}")
    after = _vericache_state(vc_engine)
    assert not failures, "\n".join(failures)
    hits = after["compressed_prefix_hits"] - before["compressed_prefix_hits"]
    hit_tokens = after["compressed_prefix_hit_tokens"] - before["compressed_prefix_hit_tokens"]
    # turn i+1 finds turn i's entry (its prompt and answer up to the last round): at least
    # turn i's prompt
    assert hits >= CONVERSATION_TURNS - 1, (before, after)
    assert hit_tokens >= sum(len(ids) for ids, _ in turns[:-1]), (hit_tokens, before, after)
    assert after["compressed_prefix_bytes"] > 0 and after["compressed_prefix_entries"] >= 1


def test_requests_sharing_a_prefix_reuse_its_compressed_entry(reference, vc_engine):
    """Requests that share a prefix SGLang's radix tree already holds (one after another,
    as agents sharing a system prompt arrive): the compressed entry is filed at the shared
    prefix, the later request starts from it, and every output equals speculation off."""
    before = _vericache_state(vc_engine)
    for i, (ids, expected) in enumerate(reference.extra["shared"]):
        out = vc_engine.generate(input_ids=ids, sampling_params={
            **SHARED_PARAMS, "custom_params": {"vericache_compressor": "kivi2", "vericache_draft_len": 8}})
        idx = first_divergence(out["output_ids"], expected)
        assert idx is None, f"shared-prefix request {i}: first divergent index {idx}"
    after = _vericache_state(vc_engine)
    hits = after["compressed_prefix_hits"] - before["compressed_prefix_hits"]
    hit_tokens = after["compressed_prefix_hit_tokens"] - before["compressed_prefix_hit_tokens"]
    # the third request at least starts from the entry the second filed at the shared prefix
    assert hits >= 1 and hit_tokens >= _common_prefix_len([p for p, _ in reference.extra["shared"]]), (before, after)


def _common_prefix_len(prompts):
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def test_bad_per_request_override_is_refused(vc_engine, default_model_path):
    """A bad override ends that request with an error naming it (as an abort finish
    reason, or raised by the offline engine); the engine keeps serving."""
    ids = _input_ids(default_model_path, prompt_set(1)[:1])
    try:
        out = vc_engine.generate(input_ids=ids[0], sampling_params={
            "max_new_tokens": 8, "temperature": 0, "custom_params": {"vericache_draft_len": 40}})
        finish = out["meta_info"]["finish_reason"]
        assert finish["type"] == "abort", finish
        message = finish["message"]
    except Exception as exc:  # the offline engine may raise the abort instead
        message = str(exc)
    assert "exceeds the server's --vericache-draft-len" in message
    good = vc_engine.generate(input_ids=ids[0], sampling_params={"max_new_tokens": 8, "temperature": 0})
    assert len(good["output_ids"]) == 8


def test_prompt_queries_of_requests_finished_at_prefill_are_let_go(vc_engine, default_model_path):
    """SnapKV / H2O requests keep their last prompt queries from prefill to their first
    round, which uses them. A request that ends at its prefill (one token asked) never has
    a round: its queries go at the next forward, not never (they were kept for ever)."""
    ids = _input_ids(default_model_path, prompt_set(1)[:2])
    params = [{"max_new_tokens": 1, "temperature": 0, "custom_params": {"vericache_compressor": c}}
              for c in ("snapkv", "h2o")]
    outs = vc_engine.generate(input_ids=ids, sampling_params=params)
    assert [len(o["output_ids"]) for o in outs] == [1, 1]
    vc_engine.generate(input_ids=ids[0], sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert _vericache_state(vc_engine)["captured_query_requests"] == 0


def test_streaming_while_verifies_are_staggered(reference, vc_engine, default_model_path):
    """Three requests stream at once past the 64-token budget: every chunk brings new tokens
    (an iteration a request only drafted in sends nothing) and the streamed tokens are
    speculation off's. The longest returns logprobs (top 2 too) and outlives the others:
    it verifies in every round while the other two take turns (a batch with a logprob row
    used to verify every row, loading all parked KV at once), and its logprobs are
    speculation off's, laid out by row among rows that emitted nothing."""
    import asyncio

    longest = sorted(range(len(reference)), key=lambda i: -len(reference[i]))[:3]
    assert min(len(reference[i]) for i in longest) > 96, [len(r) for r in reference]
    ids = [_input_ids(default_model_path, CI_PROMPTS)[i] for i in longest]
    lengths = [128, 64, 64]  # the logprob stream is alone for its last rounds
    deferred = lambda: vc_engine.get_server_info()["internal_states"][0]["vericache"]["deferred_rows"]  # noqa: E731
    before = deferred()

    async def stream(prompt, n, logprobs):
        counts, last, top = [], None, []
        extra = dict(return_logprob=True, top_logprobs_num=2) if logprobs else {}
        async for chunk in await vc_engine.async_generate(input_ids=prompt, stream=True, **extra,
                                                          sampling_params={"max_new_tokens": n, "temperature": 0}):
            counts.append(chunk["meta_info"]["completion_tokens"])
            if logprobs:
                steps = chunk["meta_info"]["output_top_logprobs"]
                top = top + steps if vc_engine.server_args.incremental_streaming_output else steps
            last = chunk
        return counts, last, top

    async def all_streams():
        return await asyncio.gather(*(stream(p, n, k == 0) for k, (p, n) in enumerate(zip(ids, lengths))))

    results = vc_engine.loop.run_until_complete(all_streams())
    assert deferred() > before, "the streams without logprobs should have taken turns verifying"
    for i, n, (counts, last, _) in zip(longest, lengths, results):
        want = reference[i][:n]
        assert all(b > a for a, b in zip(counts, counts[1:])), f"a chunk without new tokens: {counts}"
        assert counts[-1] == len(want), (counts[-1], len(want))
        if vc_engine.server_args.incremental_streaming_output:
            continue  # chunks carry only their own tokens; the count check above covers them
        assert list(last["output_ids"]) == want, f"prompt {i}: streamed tokens differ from speculation off"
    top = [[lp for lp, *_ in step] for step in results[0][2]]
    ref = reference.top2[longest[0]][:lengths[0]]
    assert len(top) == len(ref) and all(len(step) == 2 for step in top), (len(top), len(ref))
    worst = max(abs(a - b) for ours, theirs in zip(top, ref) for a, b in zip(ours, theirs))
    assert worst < 1e-3, f"top-2 logprobs differ from speculation off's by up to {worst:.3g}"


def test_full_kv_beyond_the_budget_was_parked_and_loaded_back(vc_engine):
    """Runs after the tests above: their requests' own full KV beyond the engine's 64-token
    device budget went to host memory and came back for the next verify (their outputs,
    checked above, are those of speculation off); nothing stays parked once they finished."""
    stats = vc_engine.get_server_info()["internal_states"][0]["vericache"]
    assert stats["deferred_rows"] > 0, stats  # verifies were staggered: some rows drafted only
    # greedy rounds left their deferred rows out of the verify forward (sampled ones keep them)
    assert 0 < stats["verify_rows_skipped"] <= stats["deferred_rows"], stats
    # SGLang's own server-level accept length counts a deferred row as no verify (tokens per
    # verify, as ours); counting it as one would give emitted / (rounds + deferred rows)
    sglang_accept = vc_engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"]
    ours = stats["emitted_tokens"] / stats["rounds"]
    assert sglang_accept == pytest.approx(ours, rel=0.02), (sglang_accept, ours, stats)
    assert sglang_accept > stats["emitted_tokens"] / (stats["rounds"] + stats["deferred_rows"]) * 1.02
    assert stats["full_kv_parked_tokens"] > 0, stats
    assert stats["full_kv_loaded_tokens"] == stats["full_kv_parked_tokens"], stats
    assert stats["full_kv_bytes_to_device"] == stats["full_kv_bytes_to_host"] > 0, stats


def test_unseeded_sampling_runs_and_differs_across_requests(steady_engine, default_model_path):
    """Rejection-sampling rows (no seed): valid output of the requested length, random
    (two identical requests differ), with drafts still accepted. Distributional exactness
    of the rule itself is test_accept.py's statistical test."""
    ids = _input_ids(default_model_path, CI_PROMPTS[:1]) * 2
    params = [_with_vc({"max_new_tokens": 48, "temperature": 0.8, "ignore_eos": True}, "kivi4", 16)] * 2
    before = _vericache_state(steady_engine)["deferred_rows"]
    outs = steady_engine.generate(input_ids=ids, sampling_params=params)
    # both decode side by side past the 64-token budget: rejection rows are staggered too
    assert _vericache_state(steady_engine)["deferred_rows"] > before
    assert all(len(o["output_ids"]) == 48 for o in outs)
    assert outs[0]["output_ids"] != outs[1]["output_ids"]
    assert all(o["meta_info"]["spec_accept_length"] > 1.5 for o in outs), [o["meta_info"] for o in outs]


def test_running_requests_park_their_prompts(reference, steady_engine):
    """Under the budget a running request's prompt is its own (SGLang's radix tree gets it
    when the request leaves), so it is parked with the rest of its KV between verifies: two
    requests with prompts the tree has never seen, each over the budget, arrive together,
    take turns verifying, and each park moves at least the parked request's prompt."""
    fresh = reference.extra["fresh"]
    prompts = [p for p, _ in fresh]
    assert min(len(p) for p in prompts) > FULL_BUDGET, [len(p) for p in prompts]
    before = _vericache_state(steady_engine)
    outs = steady_engine.generate(input_ids=prompts, sampling_params=[FRESH_PARAMS] * len(prompts))
    for i, (out, (_, expected)) in enumerate(zip(outs, fresh)):
        idx = first_divergence(out["output_ids"], expected)
        assert idx is None, f"fresh prompt {i}: first divergent index {idx}"
    after = _vericache_state(steady_engine)
    parks = after["full_kv_parks"] - before["full_kv_parks"]
    parked = after["full_kv_parked_tokens"] - before["full_kv_parked_tokens"]
    # each park holds the request's prompt (less a first token or two another request may
    # have left in the tree) and what it has generated (at most 24 tokens: not enough alone)
    assert parks > 0 and parked >= parks * (min(len(p) for p in prompts) - 4), (parks, parked, before, after)
    assert after["full_kv_loaded_tokens"] - before["full_kv_loaded_tokens"] == parked


# --- the adaptive controller --------------------------------------------------------------

ADAPTIVE_SCHEDULE = "0,4,0,0,16,2,0,8"  # the controller's decisions, in turn: plain and several draft lengths
SWITCH_EVERY = 5  # rounds between forced moves of auto requests to the other candidate compressor


@pytest.fixture(scope="module")
def adaptive_engine(default_model_path):
    """VERICACHE with the adaptive controller on and ``--vericache-compressor auto``, no
    device budget (so iterations may be plain), its decisions cycled through a schedule
    (``VERICACHE_ADAPTIVE_SCHEDULE``) so that every request switches between plain decoding
    and rounds of several draft lengths mid-generation, and its auto requests moved to the
    other candidate compressor every ``SWITCH_EVERY`` rounds (their compressed entry rebuilt)."""
    from sgl_vericache.config import VeriCacheConfig
    from sgl_vericache.spec.plan import SCHEDULE_ENV, SWITCH_ENV

    VeriCacheConfig(compressor="auto", draft_len=16).to_env()
    with pytest.MonkeyPatch.context() as env:  # read when the scheduler starts
        env.setenv(SCHEDULE_ENV, ADAPTIVE_SCHEDULE)
        env.setenv(SWITCH_ENV, str(SWITCH_EVERY))
        env.delenv("SGLANG_TEST_RETRACT", raising=False)
        engine = _engine(default_model_path, speculative_algorithm="VERICACHE", speculative_num_draft_tokens=17,
                         speculative_ngram_max_bfs_breadth=1, disable_overlap_schedule=True)
    yield engine
    engine.shutdown()


def test_adaptive_switching_is_token_identical(reference, adaptive_engine, default_model_path):
    """Requests that switch between plain decoding and rounds of 2/4/8/16 drafts, and between
    compressors, mid-generation: greedy and seeded token ids equal speculation off; unseeded
    sampling stays random and of the requested length."""
    ids = _input_ids(default_model_path, CI_PROMPTS[:4])
    before = _vericache_state(adaptive_engine)
    greedy = adaptive_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 128, "temperature": 0})
    check_identical(CI_PROMPTS[:4], [("auto", 16)] * 4, greedy, reference[:4], batch=4, top2=reference.top2[:4])
    seeded = adaptive_engine.generate(input_ids=ids, sampling_params=SEEDED)
    check_identical(CI_PROMPTS[:4], [("auto", 16)] * 4, seeded, reference.extra["seeded"], batch=4)
    unseeded = adaptive_engine.generate(input_ids=ids[:1] * 2, sampling_params={
        "max_new_tokens": 48, "temperature": 0.8, "ignore_eos": True})
    assert all(len(o["output_ids"]) == 48 for o in unseeded) and unseeded[0]["output_ids"] != unseeded[1]["output_ids"]
    after = _vericache_state(adaptive_engine)
    grew = {k: after[k] - before[k] for k in ("plain_iterations", "spec_iterations", "compressor_switches")}
    assert grew["plain_iterations"] > 0 and grew["spec_iterations"] > 0, grew
    assert grew["compressor_switches"] > 0, grew
    lengths = {int(d) for d, n in after["draft_steps"].items() if n > before["draft_steps"].get(d, 0)}
    assert {2, 4, 8, 16} <= lengths, lengths
    check_spec_counts(greedy + seeded)
