"""Drafting over compressed KV, simulated exactly on a plain-torch Llama (fp32).

Used by bench_compressors.py. The model mirrors transformers' LlamaForCausalLM (RMSNorm,
RoPE, GQA, SiLU MLP, tied embeddings); its full-KV greedy tokens equal transformers'
(bench_compressors.py --check-hf). The draft's attention is the compressor's own
`attend` over its entry plus the draft's provisional KV, exactly as the worker calls it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------- the model, plain torch


class Llama:
    """SmolLM2 / Llama forward in fp32, mirroring transformers' LlamaForCausalLM."""

    def __init__(self, path: Path):
        from safetensors.torch import load_file

        self.cfg = json.loads((path / "config.json").read_text())
        files = sorted(path.glob("*.safetensors"))
        self.w = {k.removeprefix("model."): t.float() for f in files for k, t in load_file(f).items()}
        self.lm_head = self.w.get("lm_head.weight", self.w["embed_tokens.weight"])
        self.num_layers = self.cfg["num_hidden_layers"]
        self.num_heads = self.cfg["num_attention_heads"]
        self.num_kv_heads = self.cfg.get("num_key_value_heads", self.num_heads)
        self.head_dim = self.cfg.get("head_dim") or self.cfg["hidden_size"] // self.num_heads
        self.scale = self.head_dim**-0.5
        self._fuse_weights()
        theta = self.cfg.get("rope_theta") or self.cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim)

    def _fuse_weights(self):
        """One matmul for q/k/v and one for gate/up per layer: fewer, larger ops on a CPU."""
        for layer in range(self.num_layers):
            p = f"layers.{layer}."
            self.w[p + "qkv"] = torch.cat([self.w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            self.w[p + "gate_up"] = torch.cat([self.w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")])

    def norm(self, x, name):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.w[name] * (x * torch.rsqrt(var + self.cfg["rms_norm_eps"]))

    def rope(self, x, positions):  # x [n, H, D], positions [n]
        freqs = positions.float()[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], -1)[:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * emb.cos() + rotated * emb.sin()

    def qkv(self, layer, x, positions):
        """x [n, hidden] -> post-RoPE q [n, H_q, D], k [n, H_kv, D], v [n, H_kv, D]."""
        h = self.norm(x, f"layers.{layer}.input_layernorm.weight")
        qkv = F.linear(h, self.w[f"layers.{layer}.qkv"]).view(len(x), -1, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return self.rope(q, positions), self.rope(k, positions), v.contiguous()

    def finish(self, layer, x, attn):  # attn [n, H_q, D]
        p = f"layers.{layer}."
        x = x + F.linear(attn.reshape(len(x), -1), self.w[p + "self_attn.o_proj.weight"])
        gate, up = F.linear(self.norm(x, p + "post_attention_layernorm.weight"), self.w[p + "gate_up"]).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, self.w[p + "mlp.down_proj.weight"])

    def logits(self, x):
        return F.linear(self.norm(x, "norm.weight"), self.lm_head)

    def sdpa(self, q, k, v, causal):  # [n, H, D] each; GQA by repeating KV, as transformers does
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=causal, scale=self.scale)
        return out.transpose(0, 1)

    @torch.no_grad()
    def forward_full(self, ids):
        """Causal pass over ids -> (logits [n, V], per-layer k, v, q lists)."""
        x, positions = self.w["embed_tokens.weight"][ids], torch.arange(len(ids))
        ks, vs, qs = [], [], []
        for layer in range(self.num_layers):
            q, k, v = self.qkv(layer, x, positions)
            ks.append(k), vs.append(v), qs.append(q)
            x = self.finish(layer, x, self.sdpa(q, k, v, causal=len(ids) > 1))
        return self.logits(x), ks, vs, qs

    @torch.no_grad()
    def greedy(self, prompt, max_new, eos):
        """Full-KV greedy decoding, one token per step, as a serving engine does it."""
        logits, ks, vs, _ = self.forward_full(torch.tensor(prompt))
        out = [int(logits[-1].argmax())]
        while len(out) < max_new and out[-1] not in eos:
            pos = len(prompt) + len(out) - 1
            x = self.w["embed_tokens.weight"][[out[-1]]]
            for layer in range(self.num_layers):
                q, k, v = self.qkv(layer, x, torch.tensor([pos]))
                ks[layer], vs[layer] = torch.cat([ks[layer], k]), torch.cat([vs[layer], v])
                x = self.finish(layer, x, self.sdpa(q, ks[layer], vs[layer], causal=False))
            out.append(int(self.logits(x)[-1].argmax()))
        return out


class ChatTokenizer:
    """tokenizer.json + the checkpoint's chat template, as transformers renders it (its
    import alone costs ~10 s of CPU here; --check-hf compares the ids with it)."""

    def __init__(self, path: Path):
        import jinja2.sandbox
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = json.loads((path / "tokenizer_config.json").read_text())
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.exists() else config["chat_template"]
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(template)
        self.specials = {k: config.get(k) for k in ("bos_token", "eos_token")}
        self.eos_token_id = self.tok.token_to_id(config["eos_token"]) if config.get("eos_token") else None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = self.template.render(messages=messages, add_generation_prompt=True, **self.specials)
        return self.tok.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------- drafting over compressed KV
#
# Both passes run layer by layer over many rows at once (weights read once per layer for
# every row), which is exact because a teacher-forced draft row at layer l depends only on
# its own layer l-1 output, the compressed entry of the true KV and its round's own
# provisional KV. While a round's drafts agree they ARE the reference tokens, so a round
# is an extend pass over reference tokens; tokens after the first miss are ignored.


@dataclass
class Reference:
    ids: list[int]  # prompt + full-KV greedy continuation
    prompt_len: int
    k: list  # per layer [T, H_kv, D] true post-RoPE keys
    v: list
    q: list  # per layer [T, H_q, D]

    @property
    def last(self) -> int:  # the last position whose next token is known
        return len(self.ids) - 1


def prompt_entry(comp, ref: Reference, layer: int):
    n, window = ref.prompt_len, comp.query_window or 0
    queries = ref.q[layer][max(0, n - window) if window else 0 : n] if comp.needs_queries else None
    return comp.compress(ref.k[layer][:n], ref.v[layer][:n], queries)


def append_true(comp, entry, ref: Reference, layer: int, start: int, end: int):
    queries = ref.q[layer][start:end] if comp.needs_queries else None
    return comp.append(entry, ref.k[layer][start:end], ref.v[layer][start:end], queries)


@torch.no_grad()
def forward_rows(model: Llama, tokens: list[int], positions: list[int], attend, progress=None) -> torch.Tensor:
    """Greedy next token of every row; attend(layer, q, k, v) -> [rows, H_q, D] supplies
    the attention (q [rows, H_q, D], k/v [rows, H_kv, D] of the rows themselves)."""
    x, pos = model.w["embed_tokens.weight"][tokens], torch.tensor(positions)
    for layer in range(model.num_layers):
        q, k, v = model.qkv(layer, x, pos)
        x = model.finish(layer, x, attend(layer, q, k, v))
        if progress:
            progress(layer + 1, model.num_layers)
    return torch.cat([model.logits(chunk).argmax(-1) for chunk in x.split(256)])


def agreement_pass(model, ref: Reference, comps: list, progress) -> list[list[bool]]:
    """Teacher-forced: position t reads the entry of the true KV [0, t) plus its own KV."""
    first, count = ref.prompt_len, ref.last - ref.prompt_len

    def attend(layer, q, k, v):
        outs = []
        for c, comp in enumerate(comps):
            entry = prompt_entry(comp, ref, layer)
            for i in range(count):
                r = c * count + i
                outs.append(comp.attend(entry, q[r : r + 1], model.scale, k[r : r + 1], v[r : r + 1]))
                entry = append_true(comp, entry, ref, layer, first + i, first + i + 1)
        return torch.cat(outs)

    positions = list(range(first, ref.last)) * len(comps)
    preds = forward_rows(model, [ref.ids[p] for p in positions], positions, attend, progress)
    target = torch.tensor(ref.ids[first + 1 :])
    return (preds.view(len(comps), count) == target).tolist()


@dataclass
class Drafter:
    """One compressor's VeriCache loop: verified tokens compressed, a round in flight."""

    comp: object
    entries: list  # per layer: entry of the verified tokens' true KV
    verified: int  # tokens in the entries; ids[verified] is the next draft input
    drafted: int = 0  # draft tokens of the current round so far
    extra_k: dict = field(default_factory=dict)  # layer -> [drafted, H_kv, D] provisional KV
    extra_v: dict = field(default_factory=dict)
    rounds: list = field(default_factory=list)  # tokens gained per complete round
    cut_rounds: list = field(default_factory=list)  # tokens of a round the continuation's end cut short
    done: bool = False


def chunk_size(drafted: int, draft_len: int) -> int:
    """A round is drafted in chunks of 4, 8, then the rest: early misses waste little."""
    for boundary in (4, 12):
        if drafted < boundary:
            return min(boundary, draft_len) - drafted
    return draft_len - drafted


def round_pass(model, ref: Reference, comps: list, draft_len: int, progress) -> list[Drafter]:
    """Exact VeriCache rounds: draft over the verified entry, accept agreeing prefix + 1."""
    drafters = [Drafter(c, [prompt_entry(c, ref, l) for l in range(model.num_layers)], ref.prompt_len)
                for c in comps]
    while active := [d for d in drafters if not d.done]:
        plan = [(d, d.verified + d.drafted, min(chunk_size(d.drafted, draft_len), ref.last - d.verified - d.drafted))
                for d in active]
        positions = [p for _, start, size in plan for p in range(start, start + size)]

        def attend(layer, q, k, v):
            outs, row = [], 0
            for d, _, size in plan:
                rows = slice(row, row + size)
                ek = k[rows] if d.drafted == 0 else torch.cat([d.extra_k[layer], k[rows]])
                ev = v[rows] if d.drafted == 0 else torch.cat([d.extra_v[layer], v[rows]])
                d.extra_k[layer], d.extra_v[layer] = ek, ev
                outs.append(d.comp.attend(d.entries[layer], q[rows], model.scale, ek, ev))
                row += size
            return torch.cat(outs)

        preds = forward_rows(model, [ref.ids[p] for p in positions], positions, attend).tolist()
        row = 0
        for d, start, size in plan:
            settle(d, ref, preds[row : row + size], start, draft_len)
            row += size
        progress(min(d.verified for d in drafters) - ref.prompt_len, ref.last - ref.prompt_len)
    return drafters


def settle(d: Drafter, ref: Reference, preds: list[int], start: int, draft_len: int) -> None:
    """Compare a drafted chunk with the reference; close the round on a miss, a full
    draft or the end of the continuation (a round cut short there is not counted)."""
    hits = [p == ref.ids[start + 1 + i] for i, p in enumerate(preds)]
    if False in hits:
        accepted = d.drafted + hits.index(False)
        d.rounds.append(accepted + 1)
    else:
        d.drafted += len(preds)
        if d.drafted < draft_len and start + len(preds) < ref.last:
            return  # keep drafting
        accepted = d.drafted
        (d.rounds if d.drafted == draft_len else d.cut_rounds).append(accepted + 1)
    gained = min(accepted + 1, ref.last - d.verified)  # the bonus token needs a next position
    d.entries = [append_true(d.comp, e, ref, l, d.verified, d.verified + gained) for l, e in enumerate(d.entries)]
    d.verified += gained
    d.drafted, d.extra_k, d.extra_v = 0, {}, {}
    d.done = d.verified >= ref.last
