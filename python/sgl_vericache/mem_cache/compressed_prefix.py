"""Compressed KV entries of token prefixes, shared by the requests that extend them
(no SGLang imports).

SGLang's radix tree keeps a prefix's *full* KV so that a request starting with it skips
prefill. This is the compressed side of the same idea: when a request leaves (or first
compresses its prompt), its per-layer compressed entries are filed under its token ids;
a later request whose verified tokens start with such a prefix takes those entries and
only compresses what follows (``KVCompressor.append``), instead of reading and
compressing its whole context again. Multi-turn agents are the case it is for: turn n+1's
context is turn n's plus the answer and a tool result.

Entries are values (``compress``/``append`` never modify their inputs), so an entry can
be handed to any number of requests and evicted from here at any time without copying or
locking: a request that took it keeps its own reference. Drafting from an entry built on
another request's KV never changes output (verify decides every token), only acceptance.

The tree is a radix tree over token ids; an entry sits at the node where its prefix ends,
one per compressor (different methods or ratios never share entries). Eviction is LRU over
entries, within a byte budget; nodes left with no entry and no child are removed, and a
node with no entry and one child is merged into it.

With a ``spill`` function (a storage tier behind the cache, ``compressed_tier.py``) an
evicted entry -- or one larger than the whole budget -- is handed to it instead of being
dropped, and the node keeps the stub it returns: no bytes here, found by
``match_spilled`` (``match`` sees resident entries only). At most ``max_spilled`` stubs
are kept, the least recently used dropped first.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

from sgl_vericache.mem_cache.compress import CompressedLayer
from sgl_vericache.mem_cache.compress.rows import held_nbytes


@dataclass(eq=False)
class _Entry:
    layers: Optional[tuple[CompressedLayer, ...]]  # None: spilled to the storage tier
    nbytes: int  # bytes held here (0 when spilled)
    tick: int  # last use (insert or hit), for LRU
    spilled: object = None  # the storage tier's stub for a spilled entry


@dataclass(eq=False)
class _Node:
    edge: tuple[int, ...]  # tokens from the parent to this node
    parent: Optional["_Node"]
    children: dict[int, "_Node"] = field(default_factory=dict)  # first token of the edge -> child
    entries: dict[Hashable, _Entry] = field(default_factory=dict)  # compressor key -> entry

    def depth(self) -> int:
        n, node = 0, self
        while node is not None:
            n, node = n + len(node.edge), node.parent
        return n


def entry_nbytes(layers: Sequence[CompressedLayer]) -> int:
    """What an entry keeps alive: its tensors' bytes, spare rows included (a tensor that
    grows in place holds its whole buffer, ``compress.rows``), each buffer once."""
    return held_nbytes(t for layer in layers for t in layer.tensors())


class CompressedPrefixCache:
    def __init__(self, budget_bytes: int, spill=None, max_spilled: int = 4096):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"compressed prefix cache budget {budget_bytes!r} is invalid; accepted: bytes >= 0")
        if isinstance(max_spilled, bool) or not isinstance(max_spilled, int) or max_spilled < 0:
            raise ValueError(f"max_spilled {max_spilled!r} is invalid; accepted: an int >= 0")
        self.budget_bytes = budget_bytes
        self.spill = spill  # (tokens, key, layers) -> stub or None; None: evicted entries are dropped
        self.max_spilled = max_spilled
        self.num_spilled = 0
        self.spilled_hits = 0
        self.root = _Node(edge=(), parent=None)
        self.nbytes = 0
        self.num_entries = 0
        self._clock = itertools.count(1)
        # counters (for metrics)
        self.lookups = 0
        self.hits = 0
        self.hit_tokens = 0
        self.inserted = 0
        self.evicted = 0

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: Sequence[int], key: Hashable,
              count: bool = True) -> tuple[int, Optional[tuple[CompressedLayer, ...]]]:
        """The longest prefix of ``tokens`` with an entry for ``key``: (its length, the
        per-layer entries), or (0, None). ``count=False``: a look that the hit counters
        leave out (the request will be looked up again when it runs)."""
        self.lookups += count
        tokens = tuple(tokens)
        best_len, best = 0, None
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or tokens[pos : pos + len(child.edge)] != child.edge:
                break
            node, pos = child, pos + len(child.edge)
            entry = node.entries.get(key)
            if entry is not None and entry.layers is not None:
                best_len, best = pos, entry
        if best is None:
            return 0, None
        best.tick = next(self._clock)
        self.hits += count
        self.hit_tokens += best_len * count
        return best_len, best.layers

    def match_spilled(self, tokens: Sequence[int], key: Hashable) -> tuple[int, object]:
        """The longest prefix of ``tokens`` whose entry for ``key`` went to the storage
        tier: (its length, the tier's stub), or (0, None)."""
        tokens = tuple(tokens)
        best_len, best = 0, None
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or tokens[pos : pos + len(child.edge)] != child.edge:
                break
            node, pos = child, pos + len(child.edge)
            entry = node.entries.get(key)
            if entry is not None and entry.layers is None:
                best_len, best = pos, entry
        if best is None:
            return 0, None
        best.tick = next(self._clock)
        self.spilled_hits += 1
        return best_len, best.spilled

    # ------------------------------------------------------------------ insert / evict

    def insert(self, tokens: Sequence[int], key: Hashable, layers: Sequence[CompressedLayer]) -> bool:
        """File ``layers`` (one compressed entry per layer, each representing exactly
        ``tokens``) under ``tokens`` for ``key``, replacing an older entry there. False if
        the entry alone exceeds the budget (nothing changes then) or ``tokens`` is empty."""
        tokens = tuple(tokens)
        layers = tuple(layers)
        if not tokens or not layers:
            return False
        bad = [l.num_tokens for l in layers if l.num_tokens != len(tokens)]
        if bad:
            raise ValueError(f"an entry for {len(tokens)} tokens has layers of {bad[0]} tokens")
        nbytes = entry_nbytes(layers)
        if nbytes > self.budget_bytes:
            stub = self.spill(tokens, key, layers) if self.spill is not None and self.max_spilled else None
            if stub is None:
                return False
            node = self._node_for(tokens)
            self._drop(node, key)
            node.entries[key] = _Entry(None, 0, next(self._clock), stub)
            self.num_spilled += 1
            self.inserted += 1
            self._trim_spilled()
            return True
        node = self._node_for(tokens)
        self._drop(node, key)
        node.entries[key] = _Entry(layers, nbytes, next(self._clock))
        self.nbytes += nbytes
        self.num_entries += 1
        self.inserted += 1
        self.evict(self.budget_bytes)
        return True

    def _drop(self, node: _Node, key: Hashable) -> None:
        old = node.entries.pop(key, None)
        if old is None:
            return
        if old.layers is None:
            self.num_spilled -= 1
        else:
            self.nbytes -= old.nbytes
            self.num_entries -= 1

    def evict(self, target_bytes: int) -> int:
        """Drop least recently used entries until at most ``target_bytes`` remain; returns
        the bytes freed (an entry just inserted has the newest tick: it goes last)."""
        freed = 0
        if self.nbytes <= target_bytes:
            return 0
        victims = sorted(((e.tick, node, k) for node, k, e in self._entries() if e.layers is not None),
                         key=lambda t: t[0])
        for _, node, k in victims:
            if self.nbytes <= target_bytes:
                break
            entry = node.entries.pop(k)
            self.nbytes -= entry.nbytes
            self.num_entries -= 1
            self.evicted += 1
            freed += entry.nbytes
            stub = None
            if self.spill is not None and self.max_spilled:
                stub = self.spill(self._path(node), k, entry.layers)
            if stub is not None:
                node.entries[k] = _Entry(None, 0, entry.tick, stub)
                self.num_spilled += 1
            else:
                self._prune(node)
        self._trim_spilled()
        return freed

    def _trim_spilled(self) -> None:
        """Keep at most ``max_spilled`` stubs (the tier's own eviction bounds its bytes)."""
        if self.num_spilled <= self.max_spilled:
            return
        stubs = sorted(((e.tick, node, k) for node, k, e in self._entries() if e.layers is None), key=lambda t: t[0])
        for _, node, k in stubs[: self.num_spilled - self.max_spilled]:
            del node.entries[k]
            self.num_spilled -= 1
            self._prune(node)

    def _path(self, node: _Node) -> tuple[int, ...]:
        edges = []
        while node is not None:
            edges.append(node.edge)
            node = node.parent
        return tuple(t for edge in reversed(edges) for t in edge)

    def clear(self) -> None:
        self.root = _Node(edge=(), parent=None)
        self.nbytes = 0
        self.num_entries = 0
        self.num_spilled = 0

    # ------------------------------------------------------------------ tree plumbing

    def _node_for(self, tokens: tuple[int, ...]) -> _Node:
        """The node at exactly ``tokens`` (made, splitting an edge if needed)."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = _Node(edge=tokens[pos:], parent=node)
                node.children[tokens[pos]] = new
                return new
            common = _common_len(child.edge, tokens[pos:])
            if common < len(child.edge):
                child = self._split(child, common)
            node, pos = child, pos + common
        return node

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s edge after ``at`` tokens; the new upper node is returned (the
        entries stay with ``node``, whose prefix is unchanged)."""
        upper = _Node(edge=node.edge[:at], parent=node.parent)
        node.parent.children[upper.edge[0]] = upper
        node.edge = node.edge[at:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        return upper

    def _prune(self, node: _Node) -> None:
        """Remove ``node`` if it holds nothing; merge an empty pass-through node into its child."""
        while node is not self.root and not node.entries:
            parent = node.parent
            if not node.children:
                del parent.children[node.edge[0]]
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[child.edge[0]] = child
            break

    def _entries(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            for k, e in node.entries.items():
                yield node, k, e
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Every edge non-empty and filed under its first token, parents consistent, every
        entry's layers exactly as long as its node's prefix, no leaf or pass-through node
        without an entry, and the byte / entry totals equal to the entries held."""
        total, count, spilled = 0, 0, 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.edge and child.edge[0] == first, (first, child.edge[:4])
                assert child.parent is node, "child's parent pointer is wrong"
                stack.append(child)
            if node is not self.root:
                assert node.entries or len(node.children) >= 2, "an empty node that should have been pruned"
            depth = node.depth()
            for key, entry in node.entries.items():
                if entry.layers is None:
                    assert entry.nbytes == 0 and entry.spilled is not None, key
                    assert getattr(entry.spilled, "num_tokens", depth) == depth, (key, depth)
                    spilled += 1
                    continue
                assert all(l.num_tokens == depth for l in entry.layers), (key, depth)
                assert entry.nbytes == entry_nbytes(entry.layers), key
                total += entry.nbytes
                count += 1
        assert total == self.nbytes, (total, self.nbytes)
        assert count == self.num_entries, (count, self.num_entries)
        assert spilled == self.num_spilled <= self.max_spilled, (spilled, self.num_spilled, self.max_spilled)
        assert self.nbytes <= self.budget_bytes, (self.nbytes, self.budget_bytes)


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
