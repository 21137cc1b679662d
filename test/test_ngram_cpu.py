"""End to end: SGLang's own NGRAM speculative decoding on the CPU engine (the sgl_kernel
ops it calls come from sgl_vericache.cpu.ops) gives token ids identical to the same
engine with speculation off. SmolLM2-135M, fp32, greedy, 4 prompts x 64 tokens, one of
them repetitive so that n-gram drafts get accepted.

Each engine config runs once per module in its own subprocess (an SGLang scheduler that
dies can leave an in-process Engine hanging; a subprocess has a timeout).

Known gap (not an sgl_kernel op): SGLang 0.5.23's ``torch_native`` attention backend has no
TARGET_VERIFY path. A verify batch carries no ``extend_prefix_lens`` / ``extend_seq_lens``,
so ``TorchNativeAttnBackend._run_sdpa_forward_extend`` fails on the first verify pass, and
it would ignore ``spec_info.custom_mask`` (the draft tree) anyway. SGLang's CPU spec path
expects ``intel_amx`` (``torch.ops.sgl_kernel.extend_attention_cpu`` with a tree mask).
Until a verify-capable CPU attention backend exists, these tests xfail on exactly that
error and fail on any other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ATTENTION_BACKEND = "torch_native"
TORCH_NATIVE_VERIFY_GAP = "'NoneType' object has no attribute 'shape'"  # extend_prefix_lens
MAX_NEW_TOKENS = 64
DRAFT_TOKENS = 4
ENGINE_TIMEOUT_S = 1800  # a cap for hangs; a loaded 2-core box needs >15 min
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    # repetitive: the continuation repeats n-grams already in the prompt
    "Repeat after me: red green blue, red green blue, red green blue, red green blue,",
    '{"tool": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
    '{"tool": "get_weather", "arguments": {"city": "Oslo", "unit": "F"}}\n'
    '{"tool": "get_weather", "arguments": {"city": ',
]
ENGINE_CONFIGS = {
    "off": {},
    "ngram": {
        "speculative_algorithm": "NGRAM",
        "speculative_num_draft_tokens": DRAFT_TOKENS,
        "disable_overlap_schedule": True,
    },
}

pytestmark = pytest.mark.slow


def _run_engine(config_name: str, out_path: Path, log_path: Path) -> dict:
    cmd = [sys.executable, __file__, config_name, str(out_path)]
    with open(log_path, "wb") as log:
        # own session: on timeout the whole group (scheduler, detokenizer) goes
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
        returncode = _wait_or_kill(proc, log_path)
    if returncode != 0 or not out_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-60:])
        raise RuntimeError(f"engine {config_name!r} failed ({returncode}):\n{tail}")
    return json.loads(out_path.read_text())


def _wait_or_kill(proc: subprocess.Popen, log_path: Path):
    """Exit code, or why the process group was killed: a dead scheduler leaves the Engine
    in the parent waiting forever after SGLang's SIGQUIT notice, so don't wait for it."""
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    while proc.poll() is None:
        if time.monotonic() > deadline:
            reason = "timeout"
        elif "SIGQUIT received" in log_path.read_text(errors="replace"):
            reason = "a child process failed"
        else:
            time.sleep(2)
            continue
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return reason
    return proc.returncode


def _engine_fixture(config_name: str):
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        tmp = tmp_path_factory.mktemp(f"engine_{config_name}")
        try:
            return _run_engine(config_name, tmp / "result.json", tmp / "engine.log")
        except RuntimeError as exc:  # cached: the tests sharing it report it, not re-run
            return exc

    return fixture


engine_off = _engine_fixture("off")
engine_ngram = _engine_fixture("ngram")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _result(value):
    """The engine's result, or xfail on the known torch_native verify gap, or raise."""
    if isinstance(value, Exception):
        if ATTENTION_BACKEND == "torch_native" and TORCH_NATIVE_VERIFY_GAP in str(value):
            pytest.xfail("torch_native attention has no TARGET_VERIFY path (see module doc)")
        raise value
    return value


def test_ngram_token_identical_to_no_speculation(engine_ngram, request):
    spec = _result(engine_ngram)  # first: skips the reference engine when NGRAM cannot run
    ref = _result(request.getfixturevalue("engine_off"))
    for i, (ref_out, spec_out) in enumerate(zip(ref["outputs"], spec["outputs"])):
        a, b = ref_out["output_ids"], spec_out["output_ids"]
        at = first_divergence(a, b)
        assert at is None, (
            f"prompt {i} diverges at output token {at}: off={a[at:at + 5]} ngram={b[at:at + 5]}"
        )
    print(f"\ntok/s: off {ref['tok_per_s']:.2f}, ngram {spec['tok_per_s']:.2f}")


def test_ngram_accepts_drafts(engine_ngram):
    """Speculation really ran: fewer verify passes than tokens on the repetitive prompt."""
    spec = _result(engine_ngram)
    repetitive = spec["outputs"][2]
    tokens, verifies = len(repetitive["output_ids"]), repetitive["spec_verify_ct"]
    assert verifies and tokens / verifies > 1.5, f"{tokens} tokens in {verifies} verify passes"
    print(f"\nNGRAM tokens per verify pass: "
          f"{[round(len(o['output_ids']) / max(o['spec_verify_ct'] or 1, 1), 2) for o in spec['outputs']]}")


# --- worker: one engine in this subprocess ----------------------------------------------


def _worker(config_name: str, out_path: str) -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sglang.srt.entrypoints.engine import Engine

    from sgl_vericache.default_model import ensure_default_model

    engine = Engine(model_path=str(ensure_default_model()), device="cpu",
                    attention_backend=ATTENTION_BACKEND, disable_cuda_graph=True,
                    max_total_tokens=4096, dtype="float32", log_level="warning", sleep_on_idle=True,
                    **ENGINE_CONFIGS[config_name])
    try:
        params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        engine.generate(PROMPTS[0], {**params, "max_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        outs = engine.generate(PROMPTS, params)
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    result = {
        "config": config_name,
        "tok_per_s": sum(len(o["output_ids"]) for o in outs) / elapsed,
        "outputs": [{"output_ids": o["output_ids"],
                     "spec_verify_ct": o["meta_info"].get("spec_verify_ct")} for o in outs],
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
