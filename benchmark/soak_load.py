"""The soak's load (benchmark/bench_soak.py): client loops drawing a request of a random
kind at a time, and how each ended. A request ends ``completed`` (a whole answer),
``refused`` (4xx), ``failed`` (5xx, an error event, an answer without its end), ``lost``
(neither an answer nor an error: the connection dropped or timed out, a stream ended
without ``[DONE]``) or ``dropped`` (the client itself went away mid-stream, on purpose).
Greedy and seeded answers keep what a replay on a speculation-off server needs."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from bench_decode import filler_text
from bench_tiers import system_prompt

ROOT = Path(__file__).resolve().parents[1]
CORPUS = json.loads((ROOT / "test" / "fuzz_corpus.json").read_text())
BAD_CORPUS = [case for case in CORPUS if case["status"] >= 400]
# weights: agent turns most (their prefixes are what the tiers and the faults act on)
KINDS = {"agent": 5, "greedy": 1, "seeded": 1, "sampled": 1, "stream": 1, "dropped_stream": 1, "grammar": 1,
         "compressor": 1, "chat": 1, "bad": 1}
REPLAYED = ("agent", "greedy", "seeded", "stream", "grammar", "compressor")
COMPRESSORS = ("kivi4", "kivi2", "int8", "fp8", "streamingllm", "snapkv", "quest", "h2o", "full")

@dataclass
class Outcome:
    kind: str
    result: str  # completed | refused | failed | lost | dropped
    status: int
    seconds: float
    detail: str = ""
    replay: dict | None = None  # path, body and the answer to compare, for REPLAYED kinds


def chatml(system: str, turns: list[tuple[str, str]], user: str) -> str:
    text = f"<|im_start|>system\n{system}<|im_end|>\n"
    for question, answer in turns:
        text += f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
    return text + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


class Client:
    """One client's loop: a request of a random kind at a time; an agent conversation of its own."""

    def __init__(self, index: int, url: str, cfg, deadline: float, outcomes: list, gate: threading.Event):
        self.index, self.url, self.cfg, self.deadline, self.outcomes = index, url, cfg, deadline, outcomes
        self.gate = gate  # cleared while a fault needs the server idle (SGLang flushes only then)
        self.rng = random.Random(cfg.seed * 1000 + index)
        self.turns: list[tuple[str, str]] = []

    def run(self) -> None:
        kinds, weights = zip(*KINDS.items())
        while time.monotonic() < self.deadline:
            self.gate.wait()
            kind = self.rng.choices(kinds, weights)[0]
            t0 = time.monotonic()
            try:
                outcome = getattr(self, kind)()
            except requests.RequestException as exc:  # no answer and no error: the connection broke or timed out
                outcome = Outcome(kind, "lost", 0, 0.0, f"{type(exc).__name__}: {exc}"[:300])
            except Exception as exc:  # an answer that is not what the API promises (bad JSON, missing fields)
                outcome = Outcome(kind, "failed", 0, 0.0, f"{type(exc).__name__}: {exc}"[:300])
            outcome.seconds = round(time.monotonic() - t0, 3)
            self.outcomes.append(outcome)

    def prompt(self) -> str:
        i = self.rng.randrange(10 ** 6)
        return self.rng.choice([f"Write a Python function number {i} that", f"Q{i}: What is {i} + {i % 97}? A:",
                                f"The {i}th city on the list is", f"# file {i}\n" + filler_text(1)])

    def sampling(self, **kw) -> dict:
        return {"max_new_tokens": self.cfg.max_new_tokens, "temperature": 0, **kw}

    def generate(self, kind: str, body: dict, replay: bool) -> Outcome:
        r = requests.post(self.url + "/generate", json=body, timeout=self.cfg.request_timeout_s)
        if r.status_code != 200:
            return Outcome(kind, "refused" if r.status_code < 500 else "failed", r.status_code, 0, r.text[:300])
        out = r.json()
        if not out.get("meta_info", {}).get("finish_reason"):
            return Outcome(kind, "failed", 200, 0, f"no finish_reason: {r.text[:300]}")
        record = {"path": "/generate", "body": body, "output_ids": out["output_ids"], "text": out["text"]}
        return Outcome(kind, "completed", 200, 0, replay=record if replay else None)

    def agent(self) -> Outcome:
        if len(self.turns) >= self.rng.randint(3, 6):
            self.turns = []
        user = (f"Agent {self.index}, tool result {len(self.turns)}:\n{filler_text(1)}\n"
                f"Exit code {self.rng.randrange(4)}. What next?")
        text = chatml(system_prompt(), self.turns, user)
        outcome = self.generate("agent", {"text": text, "sampling_params": self.sampling()}, True)
        if outcome.result == "completed":
            self.turns.append((user, outcome.replay["text"]))
        return outcome

    def greedy(self) -> Outcome:
        return self.generate("greedy", {"text": self.prompt(), "sampling_params": self.sampling()}, True)

    def seeded(self) -> Outcome:
        params = self.sampling(temperature=0.8, top_p=0.95, sampling_seed=self.rng.randrange(2 ** 31))
        return self.generate("seeded", {"text": self.prompt(), "sampling_params": params}, True)

    def sampled(self) -> Outcome:
        return self.generate("sampled", {"text": self.prompt(), "sampling_params": self.sampling(temperature=1.0)},
                             False)

    def grammar(self) -> Outcome:
        constraint = self.rng.choice([{"json_schema": json.dumps({"type": "object", "properties": {
            "tool": {"type": "string"}, "city": {"type": "string"}}, "required": ["tool"]})},
            {"regex": "(yes|no), because [a-z ]{3,20}\\."}])
        text = chatml(system_prompt(), [], "Call a tool for the weather in Paris.")
        return self.generate("grammar", {"text": text, "sampling_params": self.sampling(**constraint)}, True)

    def compressor(self) -> Outcome:
        custom = {"vericache_compressor": self.rng.choice(COMPRESSORS),
                  "vericache_draft_len": self.rng.randint(1, self.cfg.draft_len),
                  "vericache_ratio": self.rng.choice([2.0, 4.0, 8.0])}
        body = {"text": self.prompt(), "sampling_params": self.sampling(custom_params=custom)}
        return self.generate("compressor", body, True)

    def stream(self, drop: bool = False) -> Outcome:
        kind = "dropped_stream" if drop else "stream"
        body = {"text": self.prompt(), "stream": True, "sampling_params": self.sampling()}
        with requests.post(self.url + "/generate", json=body, timeout=self.cfg.request_timeout_s, stream=True) as r:
            if r.status_code != 200:
                return Outcome(kind, "refused" if r.status_code < 500 else "failed", r.status_code, 0, r.text[:300])
            last, done = None, False
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                last = json.loads(line[6:])
                if "error" in last:
                    return Outcome(kind, "failed", 200, 0, json.dumps(last["error"])[:300])
                if drop:
                    return Outcome(kind, "dropped", 200, 0)  # the client goes away mid-stream
        if not done or last is None:
            return Outcome(kind, "lost", 200, 0, "stream ended without [DONE]")
        return Outcome(kind, "completed", 200, 0,
                       replay={"path": "/generate", "body": {**body, "stream": False},
                               "output_ids": last["output_ids"]})

    def dropped_stream(self) -> Outcome:
        return self.stream(drop=True)

    def chat(self) -> Outcome:
        body = {"model": "default", "messages": [{"role": "user", "content": self.prompt()}],
                "max_tokens": self.cfg.max_new_tokens, "temperature": 0}
        r = requests.post(self.url + "/v1/chat/completions", json=body, timeout=self.cfg.request_timeout_s)
        if r.status_code != 200:
            return Outcome("chat", "refused" if r.status_code < 500 else "failed", r.status_code, 0, r.text[:300])
        ok = bool(r.json().get("choices"))
        return Outcome("chat", "completed" if ok else "failed", 200, 0, "" if ok else r.text[:300])

    def bad(self) -> Outcome:
        case = self.rng.choice(BAD_CORPUS)
        r = requests.post(self.url + case["path"], json=case["body"], timeout=self.cfg.request_timeout_s)
        text = r.text
        streams = isinstance(case["body"], dict) and case["body"].get("stream")  # some bodies are not objects
        if streams and r.status_code == 200:
            return Outcome("bad", "failed", 200, 0, f"{case['name']}: a stream, not a refusal")
        result = "refused" if 400 <= r.status_code < 500 else "failed"
        return Outcome("bad", result, r.status_code, 0, f"{case['name']}: {text[:200]}")



def run_load(url: str, cfg, side=None) -> list[Outcome]:
    """``cfg.clients`` clients against ``url`` for ``cfg.minutes``; ``side(gate)`` (the faults)
    runs beside them on a thread of its own and may hold new requests back with ``gate``."""
    deadline = time.monotonic() + cfg.minutes * 60
    outcomes: list[Outcome] = []
    gate = threading.Event()
    gate.set()
    threads = [threading.Thread(target=Client(i, url, cfg, deadline, outcomes, gate).run, daemon=True)
               for i in range(cfg.clients)]
    if side is not None:
        threads.append(threading.Thread(target=side, args=(gate,), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=cfg.minutes * 60 + cfg.request_timeout_s + 900)
    return outcomes



def summarize(outcomes: list[Outcome]) -> dict:
    counts = {k: sum(o.result == k for o in outcomes) for k in ("completed", "refused", "failed", "lost", "dropped")}
    by_kind = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, {}).setdefault(o.result, 0)
        by_kind[o.kind][o.result] += 1
    good_refused = [asdict(o) for o in outcomes if o.result == "refused" and o.kind != "bad"]
    bad_served = [asdict(o) for o in outcomes if o.kind == "bad" and o.result != "refused"]
    lat = sorted(o.seconds for o in outcomes if o.result == "completed")
    pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3)) if lat else (lambda q: None)
    return {"sent": len(outcomes), **counts, "by_kind": by_kind,
            "good_requests_refused": [{k: v for k, v in o.items() if k != "replay"} for o in good_refused][:20],
            "bad_requests_not_refused": bad_served[:20],
            "problems": [{k: v for k, v in asdict(o).items() if k != "replay"}
                         for o in outcomes if o.result in ("failed", "lost")][:30],
            "latency_s": {"p50": pct(0.5), "p99": pct(0.99), "mean": round(statistics.fmean(lat), 3) if lat else None}}
