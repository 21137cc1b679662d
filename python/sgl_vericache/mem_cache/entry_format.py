"""How a compressed prefix entry is stored in a tier, and the index records that find it
again (no SGLang imports); the tier that writes and reads them is ``compressed_tier.py``.

Encoding: a magic naming the format version (``FORMAT_VERSION``), a JSON header (the layer
classes, their fields: scalars, each tensor's dtype, shape and byte range), the tensors'
raw bytes, and a BLAKE2b digest over the format, the entry's compressor key, its token ids,
the header and the bytes. No pickle: a stored entry is data, never code. A read whose
digest does not match (corrupt bytes, a short read, another prefix's entry under a
colliding key) is a miss, counted, never an entry. A shared or persistent store also holds
other builds' entries: one of another format version, or whose layers have other fields
than this build's classes, is a miss that is not decoded, and index records are named per
format version, so another version's entries are not even read. Any other error decoding
an entry is a miss as well: nothing a store holds reaches the scheduler as an exception.

Index records (``encode_index_record``): a fixed ``INDEX_RECORD_BYTES`` of JSON naming an
entry's storage key, its length and a digest of its tokens, stored under ``index_key``: the
compressor key and the entry's first ``INDEX_ANCHOR``-multiple of tokens, in this format
version. ``index_anchors`` lists the names a lookup probes, longest first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from typing import Optional, Sequence

import torch

from sgl_vericache.mem_cache.compress import CompressedLayer

# The entry format: bump it whenever the encoding or a stored layer class's fields (their
# names or meaning) change, so that builds sharing a store never decode each other's entries.
# 1: entries written before the version was part of the digest and the index names.
FORMAT_VERSION = 2
MAGIC = b"VCE" + str(FORMAT_VERSION).encode()
_MAGIC_FAMILY = b"VCE"  # every format version's magic starts so
_DIGEST = 16
_PREFIX = struct.Struct("<4sI")  # magic, header length
assert len(MAGIC) == 4


class CorruptEntryError(ValueError):
    """Stored bytes that are not a valid entry for the prefix asked for."""


class OtherFormatError(CorruptEntryError):
    """An entry written in another format (another version, or layer fields this build's
    classes do not have): another build's, never decoded."""


# ---------------------------------------------------------------------- encoding


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _layer_classes() -> dict[str, type]:
    from sgl_vericache.mem_cache.compress.registry import available_compressors, compressor_class

    for name in available_compressors():  # imports every built-in method's layer classes
        compressor_class(name)
    out, stack = {}, [CompressedLayer]
    while stack:
        cls = stack.pop()
        out[_class_name(cls)] = cls
        stack.extend(cls.__subclasses__())
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptEntryError(f"unknown dtype {name!r}")
    return dtype


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def _entry_digest(key: str, tokens: Sequence[int], body) -> bytes:
    """The format version, compressor key, token ids and header + bytes, in one digest: an
    entry of another version is also named differently (``storage_key``)."""
    return hashlib.blake2b(MAGIC + key.encode() + b"\0" + _tokens_bytes(tokens) + bytes(body),
                           digest_size=_DIGEST).digest()


def encode_entry(tokens: Sequence[int], layers: Sequence[CompressedLayer], key: str = "") -> bytes:
    """The bytes a storage tier holds for the entry of ``tokens`` (one layer per model
    layer) made by the compressor ``key`` names (``repr`` of the cache's key)."""
    blobs, described, offset = [], [], 0
    for layer in layers:
        fields, stored = {}, []
        for f in dataclasses.fields(layer) if dataclasses.is_dataclass(layer) else ():
            value = getattr(layer, f.name)
            if isinstance(value, torch.Tensor):
                raw = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                fields[f.name] = {"tensor": str(value.dtype), "shape": list(value.shape), "at": offset, "n": len(raw)}
                blobs.append(raw)
                stored.append(value)
                offset += len(raw)
            elif isinstance(value, torch.dtype):
                fields[f.name] = {"dtype": str(value)}
            elif value is None or isinstance(value, (bool, int, float, str)):
                fields[f.name] = {"value": value}
            else:
                raise TypeError(f"{type(layer).__name__}.{f.name} is a {type(value).__name__}: not storable")
        if not dataclasses.is_dataclass(layer) or len(stored) != len(layer.tensors()):
            raise TypeError(f"{type(layer).__name__} is not storable: its tensors are not all dataclass fields")
        described.append({"class": _class_name(type(layer)), "fields": fields})
    header = json.dumps({"num_tokens": len(tokens), "layers": described}, separators=(",", ":")).encode()
    body = header + b"".join(blobs)
    return _PREFIX.pack(MAGIC, len(header)) + _entry_digest(key, tokens, body) + body


def decode_entry(data: bytes, tokens: Sequence[int], key: str = "") -> tuple[CompressedLayer, ...]:
    """The layers ``encode_entry(tokens, layers, key)`` wrote, on the CPU;
    ``CorruptEntryError`` for anything else (other tokens or compressor, flipped or missing
    bytes, a header that does not describe layers), ``OtherFormatError`` before any
    decoding for an entry of another format (version, layer class or fields)."""
    header, blob = _verified(data, tokens, key)
    classes = _layer_classes()
    try:
        described = [(_layer_class(d, classes), d["fields"]) for d in header["layers"]]
        layers = tuple(cls(**{name: _field(spec, blob) for name, spec in fields.items()}) for cls, fields in described)
    except CorruptEntryError:
        raise
    except Exception as e:  # a digest-valid header this code cannot build layers from
        raise CorruptEntryError(f"undecodable entry: {type(e).__name__}: {e}") from e
    if any(layer.num_tokens != len(tokens) for layer in layers):
        raise CorruptEntryError(f"layers do not represent {len(tokens)} tokens")
    return layers


def _verified(data, tokens: Sequence[int], key: str):
    """(header, tensor bytes) of an entry of this format whose digest matches."""
    start = _PREFIX.size + _DIGEST
    if data is None or len(data) < start:
        raise CorruptEntryError(f"{0 if data is None else len(data)} bytes: shorter than an entry's header")
    magic, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        error = OtherFormatError if magic.startswith(_MAGIC_FAMILY) else CorruptEntryError
        raise error(f"magic {magic!r}, this build reads {MAGIC!r} (format version {FORMAT_VERSION})")
    body = memoryview(data)[start:]
    if _entry_digest(key, tokens, body) != data[_PREFIX.size:start]:
        raise CorruptEntryError(f"digest mismatch for a {len(tokens)}-token prefix of {key or 'no key'} "
                                f"({len(data)} bytes)")
    try:
        header = json.loads(bytes(body[:header_len]))
    except ValueError as e:
        raise CorruptEntryError(f"unreadable header: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("layers"), list):
        raise CorruptEntryError("the header describes no layers")
    return header, body[header_len:]


def _layer_class(described: dict, classes: dict) -> type:
    """The class of a described layer, if this build's has exactly the fields it names."""
    name, fields = described["class"], described["fields"]
    cls = classes.get(name)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise OtherFormatError(f"unknown layer class {name!r}")
    own = {f.name for f in dataclasses.fields(cls)}
    if set(fields) != own:
        raise OtherFormatError(f"{name} stored with fields {sorted(set(fields) - own)} this build lacks and "
                               f"without {sorted(own - set(fields))}")
    return cls


def _field(spec: dict, blob):
    """One stored field's value: a CPU tensor from its byte range, a dtype or a scalar."""
    if "tensor" in spec:
        dtype, shape = _dtype(spec["tensor"]), spec["shape"]
        raw = blob[spec["at"] : spec["at"] + spec["n"]]
        t = torch.empty(shape, dtype=dtype)
        if len(raw) != t.numel() * t.element_size():
            raise CorruptEntryError(f"{len(raw)} bytes for a {shape} {dtype} field")
        if len(raw):
            t.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        return t
    if "dtype" in spec:
        return _dtype(spec["dtype"])
    return spec["value"]


def move_entry(layers: Sequence[CompressedLayer], device) -> tuple[CompressedLayer, ...]:
    """The entry with every tensor on ``device`` (the layers themselves are values: copies)."""
    def moved(layer):
        changes = {f.name: getattr(layer, f.name).to(device) for f in dataclasses.fields(layer)
                   if isinstance(getattr(layer, f.name), torch.Tensor)}
        return dataclasses.replace(layer, **changes)

    return tuple(moved(layer) for layer in layers)


def storage_key(data: bytes) -> str:
    """Where an encoded entry lives in the tier: named by its digest (which covers the
    compressor key, the token ids and the bytes), so two different entries for one prefix
    (made along different paths) never share a name, and a name never needs rewriting."""
    return "vericache-c-" + bytes(data[_PREFIX.size : _PREFIX.size + _DIGEST]).hex()


INDEX_ANCHOR = 64  # index records name prefixes of a multiple of this many tokens
INDEX_RECORD_BYTES = 256  # fixed, so a reader knows how many bytes to ask the store for
MAX_INDEX_PROBES = 9  # anchors ``find`` tries per lookup, longest first (9: 512 tokens back)


def index_key(key: str, tokens: Sequence[int]) -> str:
    """The name of the index record for entries of compressor ``key`` (its repr) whose
    first ``len(tokens)`` tokens (a multiple of ``INDEX_ANCHOR``) are ``tokens``, in this
    format version (``find`` never reads another version's entries)."""
    digest = hashlib.blake2b(MAGIC + key.encode() + b"\0" + _tokens_bytes(tokens), digest_size=_DIGEST).hexdigest()
    return "vericache-i-" + digest


def tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.blake2b(_tokens_bytes(tokens), digest_size=_DIGEST).hexdigest()


def encode_index_record(tokens: Sequence[int], entry_key: str, nbytes: int) -> bytes:
    """The index record for the stored entry ``entry_key`` (``nbytes``) of ``tokens``."""
    body = json.dumps({"n": len(tokens), "t": tokens_digest(tokens), "key": entry_key, "nbytes": nbytes},
                      separators=(",", ":")).encode()
    assert len(body) <= INDEX_RECORD_BYTES, body
    return body.ljust(INDEX_RECORD_BYTES, b" ")


def decode_index_record(data: Optional[bytes]) -> Optional[tuple[int, str, str, int]]:
    """(entry tokens, digest of those tokens, entry storage key, entry bytes) of an index
    record; None for anything that is not one (missing, short, damaged)."""
    if not data or len(data) != INDEX_RECORD_BYTES:
        return None
    try:
        record = json.loads(bytes(data).decode())
        n, digest, key, nbytes = record["n"], record["t"], record["key"], record["nbytes"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    if not (isinstance(n, int) and isinstance(nbytes, int) and isinstance(key, str) and isinstance(digest, str)) \
            or isinstance(n, bool) or n < INDEX_ANCHOR \
            or nbytes <= _PREFIX.size + _DIGEST or not key.startswith("vericache-c-"):
        return None
    return n, digest, key, nbytes


def index_anchors(num_tokens: int, longer_than: int = 0) -> list[int]:
    """The prefix lengths ``find`` probes for ``num_tokens`` tokens, longest first: the
    multiples of ``INDEX_ANCHOR`` up to ``num_tokens`` whose entries can be longer than
    ``longer_than`` (an entry is at least as long as its anchor), at most ``MAX_INDEX_PROBES``."""
    top = num_tokens // INDEX_ANCHOR * INDEX_ANCHOR
    low = max(INDEX_ANCHOR, longer_than // INDEX_ANCHOR * INDEX_ANCHOR)
    return list(range(top, low - 1, -INDEX_ANCHOR))[:MAX_INDEX_PROBES]
