"""VeriCache configuration: one frozen dataclass; the ``--vericache-*`` flags are generated
from its fields (defaults and help text included) and the parsed config reaches every
SGLang process through one environment variable (``ServerArgs`` cannot be extended)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

ENV_VAR = "VERICACHE_CONFIG"
FLAG_PREFIX = "--vericache-"
AUTO = "auto"  # --vericache-compressor auto: chosen per request among AUTO_CANDIDATES
AUTO_CANDIDATES = ("streamingllm", "kivi4")  # a token dropper and a quantizer


def compressor_names() -> list[str]:
    """What --vericache-compressor (and a request's vericache_compressor) accepts."""
    from sgl_vericache.mem_cache.compress.registry import available_compressors

    return [AUTO] + list(available_compressors())



def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class VeriCacheConfig:
    enable: bool = _opt(
        True, "Speculative decoding with VeriCache (draft over compressed KV, verify over full KV)."
    )
    compressor: str = _opt(
        "auto", "KV compressor the draft reads (see mem_cache/compress); auto = per request, the candidate "
        "(streamingllm, a token dropper; kivi4, a 4-bit quantizer) with the most expected tokens per second at its "
        "context length, re-chosen when its measured acceptance says so (kivi4 only on models whose head_dim its "
        "group size divides). A compressor that cannot serve the model's heads is refused when the server starts.")
    ratio: float = _opt(
        4.0, "Target compression ratio against the full KV (droppers: kept-token budget).", min=1.0, max=64.0
    )
    draft_len: int = _opt(16, "Tokens drafted per verify round (with --vericache-adaptive: the most a round "
                          "drafts).", min=1, max=64)
    adaptive: bool = _opt(
        True, "Decide every iteration, by expected tokens per second (step costs measured online, each request's "
        "acceptance), whether to speculate at all (else SGLang's plain one-token decode step) and how many tokens "
        "to draft; off = every iteration drafts --vericache-draft-len tokens. A request's own "
        "vericache_draft_len always drafts that many.")
    draft_weights: str = _opt(
        "auto", "Weights the draft passes multiply by: model (as loaded), fp16 or int8 (a cheaper copy; "
        "verify always uses the model's own, so outputs are unchanged and only acceptance can move); "
        "auto = the fp16 copy for draft products of at most 2 rows of an fp32 model on a CPU (one without "
        "native fp16 loses beyond that), the model's own weights otherwise; fp16 of a 16-bit model on a GPU "
        "is refused (a second copy of every weight for nothing).",
        choices=("auto", "model", "fp16", "int8"),
    )
    cpu_linear: str = _opt(
        "auto", "Dense fp32 weight products on a CPU device, for every forward with speculation on or off: "
        "packed = oneDNN prepacked weights (1.1-2.5x faster than F.linear on the CPUs measured, one more copy "
        "of the weights), torch = F.linear as SGLang does; auto = packed when PyTorch has oneDNN. "
        "Deterministic mode always uses torch.",
        choices=("auto", "packed", "torch"),
    )
    deterministic: bool = _opt(
        False, "Verify logits bit-equal to one-token decode logits (row-invariant kernels; the CPU engine only)."
    )
    tier_checksums: bool = _opt(
        True, "Checksum every KV page written to a HiCache storage tier (file, mooncake) and treat a page "
        "read back with other bytes as a miss, recomputed.")
    compressed_cache_mb: int = _opt(
        512, "Budget (MiB) for compressed KV entries kept per token prefix after their requests finish, "
        "so that a request extending a cached prefix (the next turn of a conversation, a shared system "
        "prompt sent again) compresses only its new tokens; LRU; 0 turns it off.", min=0, max=1 << 20,
    )
    keep_preempted_kv: bool = _opt(
        True, "A request preempted under memory pressure (SGLang retracts it) leaves its KV (prompt and "
        "every verified token) in the radix tree, so it resumes from its cached tokens, or from HiCache's "
        "host tier once evicted, instead of recomputing them; its compressed entry is kept as well. For "
        "every engine, speculation on or off; off = SGLang's behaviour (recompute).")
    full_device_budget: int = _opt(
        -1, "Tokens of running requests' own full KV (their prompts and what they generated, less a prefix "
        "SGLang's radix tree already held when they arrived) on the device per verify. Verifies are staggered: each iteration verifies the requests that fit "
        "(longest-waiting first, at least one); the others draft with their full KV parked in host memory, "
        "copied back layer by layer while the drafts of the round they verify in run, verify waiting per layer. "
        "0 = one request verifies per iteration, loading from host; -1 = off. Needs --radix-cache-backend "
        "vericache (set for you) and page size 1.",
        min=-1, max=1 << 40,
    )
    fetch_draft_tokens: int = _opt(
        64, "Tokens a greedy request drafts while SGLang holds it back for its prefix to stream in from a "
        "HiCache storage tier (--hicache-storage-backend, prefetch policy wait_complete or timeout): it drafts "
        "from the prefix's compressed entry (VeriCache's compressed prefix cache), teacher-forcing the rest of "
        "its prompt, and its first rounds verify those drafts once admitted, so the fetch hides drafting. "
        "Output is unchanged (verify decides every token). 0 = off; off with tensor parallelism (its drafts run "
        "in a time budget, which ranks would spend apart).", min=0, max=4096,
    )
    fetch_draft_tier_fraction: float = _opt(
        0.25, "With a storage tier behind the compressed prefix cache, fetch drafting reads a prefix's "
        "compressed entry back from the tier only when it is expected to arrive within this fraction of the "
        "time the prefix's full KV takes to stream in (both estimated from their sizes and each transfer's "
        "measured speed), leaving the rest of the fetch to draft in; a later entry costs more than its drafts "
        "save. 1 = always read, 0 = never.", min=0.0, max=1.0,
    )
    warm_up_kernels: bool = _opt(
        True, "On a GPU, compile the draft attention kernels for the configured compressor(s), and the verify "
        "kernel for blocks of up to draft_len + 1 tokens, while the server starts (seconds per compressor on a "
        "first start; Triton keeps them on disk for the next) instead of in the first requests' rounds. No "
        "effect where attention runs on torch (CPU).")
    reserve_draft_memory: bool = _opt(
        True, "Size SGLang's KV pool to leave room in its budget (--mem-fraction-static) for the compressed "
        "entries of the requests it holds (the configured compressor's bytes at a 4096-token request), the dense "
        "draft buffers where drafts do not run on the kernels, and the compressed prefix cache's budget; the split "
        "is logged and in /server_info. Off = SGLang's own sizing: drafting that then runs out of device memory "
        "decodes plainly for a while.")
    compressor_options: str = _opt(
        "", "Compressor method options as name=value pairs, e.g. 'group_size=32,residual_length=32' (kivi4 / kivi2: "
        "group_size must divide the model's head_dim, or be at least it)."
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _validate_field(f, getattr(self, f.name))
        if self.compressor not in compressor_names():
            raise ValueError(f"{FLAG_PREFIX}compressor {self.compressor!r} is not one of {', '.join(compressor_names())}")
        self.options()
        if self.compressor == AUTO and self.compressor_options:
            raise ValueError(f"{FLAG_PREFIX}compressor-options {self.compressor_options!r} need a named compressor, "
                             f"not {AUTO} (each candidate has options of its own)")

    def options(self) -> dict:
        from sgl_vericache.mem_cache.compress.registry import parse_options

        try:
            return parse_options(self.compressor_options)
        except ValueError as exc:
            raise ValueError(f"{FLAG_PREFIX}compressor-options: {exc}") from None

    def build_compressor(self, name: Optional[str] = None):
        """The configured compressor (``name``: another method with this ratio; ``auto``:
        the first candidate); bad ratio or options raise ValueError naming them."""
        from sgl_vericache.mem_cache.compress import get_compressor

        name = name or self.compressor
        if name == AUTO:
            return get_compressor(AUTO_CANDIDATES[0], self.ratio)
        return get_compressor(name, self.ratio, **(self.options() if name == self.compressor else {}))

    # -- transport to child processes -------------------------------------------------
    def to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> Optional["VeriCacheConfig"]:
        return cls.from_json(os.environ.get(ENV_VAR))

    @classmethod
    def from_json(cls, raw: Optional[str]) -> Optional["VeriCacheConfig"]:
        """The config ``to_env`` wrote (None for an empty value)."""
        return cls(**json.loads(raw)) if raw else None


def _flag(name: str) -> str:
    return FLAG_PREFIX + name.replace("_", "-")


_KINDS = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}
_KIND_NAMES = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}


def _check_type(name: str, f: dataclasses.Field, value: Any) -> None:
    """``value`` is of ``f``'s type (a JSON number for a float; never a bool for a number)."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    ok = isinstance(value, _KINDS[kind]) and (kind == "bool" or not isinstance(value, bool))
    if ok and kind == "float" and not math.isfinite(value):
        ok = False
    if not ok:
        raise ValueError(f"{name} {value!r} is not {_KIND_NAMES[kind]}; accepted: {_accepted(f).replace('`', '')}")


def _validate_field(f: dataclasses.Field, value: Any, name: Optional[str] = None) -> None:
    """Type, choices and range of one field; errors name it as ``name`` (default: its flag)."""
    flag = name or _flag(f.name)
    _check_type(flag, f, value)
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{flag} {value!r} is not one of {', '.join(choices)}")
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if lo is not None and not (lo <= value <= hi):
        raise ValueError(f"{flag} {value!r} is out of range; accepted: {lo} to {hi}")


def _accepted(f: dataclasses.Field) -> str:
    """What a flag accepts, as the docs say it."""
    if f.type in ("bool", bool):
        return "on / off"
    if f.metadata.get("choices"):
        return ", ".join(f"`{c}`" for c in f.metadata["choices"])
    if f.metadata.get("min") is not None:
        return f"{f.metadata['min']} to {f.metadata['max']}"
    if f.name == "compressor":
        return ", ".join(f"`{c}`" for c in compressor_names())
    return "text"


def flag_table(names: Optional[Sequence[str]] = None) -> str:
    """A markdown table of the ``--vericache-*`` flags (``names``: these fields only, in
    this order), generated from ``VeriCacheConfig``: flag, default, accepted values, help."""
    fields = {f.name: f for f in dataclasses.fields(VeriCacheConfig)}
    rows = ["| flag | default | accepts | meaning |", "|---|---|---|---|"]
    for name in names or list(fields):
        f = fields[name]
        flag = f"`{_flag(f.name)}` / `--no-{_flag(f.name)[2:]}`" if f.type in ("bool", bool) else f"`{_flag(f.name)}`"
        default = ("on" if f.default else "off") if f.type in ("bool", bool) else f"`{f.default}`"
        rows.append(f"| {flag} | {default} | {_accepted(f)} | {f.metadata['help'].replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("VeriCache (sgl_vericache)")
    for f in dataclasses.fields(VeriCacheConfig):
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if f.type in ("bool", bool):
            group.add_argument(_flag(f.name), dest=f"vericache_{f.name}", action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
            continue
        kind = {"int": int, "float": float, "str": str}[f.type]
        group.add_argument(_flag(f.name), dest=f"vericache_{f.name}", type=kind, default=f.default,
                           metavar=f.name.upper(), help=help_text)


def parse_known(argv: Sequence[str]) -> tuple[VeriCacheConfig, list[str]]:
    """Parse our flags out of ``argv``; return the config and the rest (for SGLang).

    An unknown ``--vericache-*`` flag is an error here rather than something SGLang
    would reject with a less helpful message."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_cli_args(parser)
    ours, rest = parser.parse_known_args(list(argv))
    unknown = [a.split("=", 1)[0] for a in rest if a.startswith(FLAG_PREFIX)]
    if unknown:
        known = ", ".join(_flag(f.name) for f in dataclasses.fields(VeriCacheConfig))
        raise ValueError(f"unknown flag {unknown[0]}; VeriCache flags are: {known}")
    values = {f.name: getattr(ours, f"vericache_{f.name}") for f in dataclasses.fields(VeriCacheConfig)}
    return VeriCacheConfig(**values), rest


# Per-request overrides, passed as sampling_params.custom_params {"vericache_<field>": value}.
REQUEST_KEYS = ("compressor", "ratio", "draft_len", "compressor_options")


def request_config(custom_params: Any, server: VeriCacheConfig, layouts: Sequence[tuple[int, int]] = ()
                   ) -> VeriCacheConfig:
    """The config one request runs with: the server's, with its overrides applied. Every
    bad value raises ValueError naming its key and what is accepted (the request gets a
    400). ``vericache_compressor_options`` may be a ``name=value,...`` string or an object
    of option values. A draft length above the server's is refused (the verify width is
    fixed at start), and so is a compressor that cannot serve the model's ``layouts``
    ((num_kv_heads, head_dim) of its attention layers; ``auto`` picks among those that can)."""
    if custom_params is None:
        return server
    if not isinstance(custom_params, dict):
        raise ValueError(f"custom_params {custom_params!r} is not an object")
    fields = {f.name: f for f in dataclasses.fields(VeriCacheConfig)}
    overrides = {}
    for key, value in custom_params.items():
        if not isinstance(key, str) or not key.startswith("vericache_"):
            continue
        name = key[len("vericache_"):]
        if name not in REQUEST_KEYS:
            accepted = ", ".join("vericache_" + k for k in REQUEST_KEYS)
            raise ValueError(f"unknown custom_params key {key!r}; per-request VeriCache keys are: {accepted}")
        if name == "compressor_options" and isinstance(value, dict):
            value = _options_text(key, value)
        _validate_field(fields[name], value, f"custom_params {key}")
        if name == "compressor" and value not in compressor_names():
            raise ValueError(f"custom_params {key} {value!r} is not one of {', '.join(compressor_names())}")
        overrides[name] = value
    if not overrides:
        return server
    if overrides.get("draft_len", 0) > server.draft_len:
        raise ValueError(f"custom_params vericache_draft_len {overrides['draft_len']} exceeds the server's "
                         f"--vericache-draft-len {server.draft_len}; accepted: an integer from 1 to {server.draft_len}")
    try:
        cfg = dataclasses.replace(server, **overrides)
        compressor = cfg.build_compressor()  # bad ratio or options for this method: named here, not at the first round
        if cfg.compressor != AUTO:
            check_layouts(compressor, layouts)
    except ValueError as exc:
        raise ValueError(f"bad VeriCache custom_params {overrides!r}: {exc}") from None
    return cfg


def check_layouts(compressor, layouts: Sequence[tuple[int, int]]) -> None:
    """``compressor.check_layout`` for each (num_kv_heads, head_dim) of ``layouts``."""
    for num_kv_heads, head_dim in layouts:
        compressor.check_layout(num_kv_heads, head_dim)


def _options_text(key: str, options: dict) -> str:
    """``{"group_size": 32}`` -> ``"group_size=32"`` (option values: numbers or strings)."""
    items = []
    for name, value in options.items():
        if not isinstance(value, (int, float, str)) or isinstance(value, bool) or any(c in str(value) for c in ",="):
            raise ValueError(f"custom_params {key} option {name!r}: {value!r} is not a number or a plain string")
        if any(c in str(name) for c in ",=") or not str(name).strip():
            raise ValueError(f"custom_params {key}: option name {name!r} is not a plain name")
        items.append(f"{name}={value}")
    return ",".join(items)
