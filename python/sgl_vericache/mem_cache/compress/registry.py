"""Compressors by name. Built-in methods import lazily (pure torch, no CUDA needed);
external ones register with `register_compressor`."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from .base import CompressorConfig, KVCompressor

# name -> module (relative to this package) that registers it when imported
_BUILTIN_MODULES = {
    "kivi4": "quant",
    "kivi2": "quant",
    "int8": "quant",
    "fp8": "quant",
    "streamingllm": "drop",
    "snapkv": "drop",
    "h2o": "drop",
    "quest": "quest",
    "full": "full",
}
_REGISTRY: dict[str, type[KVCompressor]] = {}


def register_compressor(name: str, cls: type[KVCompressor] | None = None) -> Callable | type[KVCompressor]:
    """`register_compressor("name", cls)`, or as a class decorator `@register_compressor("name")`."""

    def register(cls: type[KVCompressor]) -> type[KVCompressor]:
        if not (isinstance(cls, type) and issubclass(cls, KVCompressor)):
            raise TypeError(f"register_compressor({name!r}): {cls!r} is not a KVCompressor subclass")
        previous = _REGISTRY.get(name)
        if previous is not None and previous is not cls:
            raise ValueError(f"compressor {name!r} is already registered to {previous.__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return register if cls is None else register(cls)


def available_compressors() -> list[str]:
    """Every name get_compressor accepts (imports nothing)."""
    return sorted(set(_BUILTIN_MODULES) | set(_REGISTRY))


def compressor_class(name: str) -> type[KVCompressor]:
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(f"{__package__}.{_BUILTIN_MODULES[name]}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(available_compressors())}")
    return _REGISTRY[name]


def build_compressor(config: CompressorConfig) -> KVCompressor:
    return compressor_class(config.name)(config)


def get_compressor(name: str, ratio: float | None = None, **options: Any) -> KVCompressor:
    """A compressor by name, e.g. get_compressor("snapkv", 4, window_size=32).
    Unknown names, bad ratios and bad options raise ValueError."""
    return build_compressor(CompressorConfig(name, ratio, options))


def parse_options(text: str) -> dict[str, str]:
    """"group_size=32,residual_length=128" -> {"group_size": "32", ...}; the compressor
    coerces and range-checks the values."""
    options = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"compressor option {item!r} is not of the form name=value")
        options[key.strip()] = value.strip()
    return options
