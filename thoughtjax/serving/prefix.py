"""Prefix cache: the prompt keys of one path, kept per block of tokens so requests that share a prefix (a system
prompt, a chat template's fixed rows, a few-shot block, earlier turns) skip its prefill.

>>> cache = PrefixCache(block_tokens=16, max_bytes=128 << 20)
>>> chain = cache.lookup(ids, limit=len(ids) - 1)        # the cached blocks of ids' longest cached prefix
>>> first = cache.first_missing(ids)                      # index of ids' first full block not cached yet
>>> cache.add(ids, first, arrays)                         # arrays[j]: block first + j's keys

Layout: a trie of blocks. A node holds the keys of ``block_tokens`` prompt tokens (one array of any shape,
e.g. [L, 2, K, block, E]: every path block's K and V) and is found by (its parent node, its tokens), so a block
stands for its whole prefix: equal tokens after different prefixes are different nodes, and prefixes shared by
many prompts are stored once. Keys are the token tuples themselves (no hash stands in for them): a match is an
exact match. A ``scope`` (e.g. a client's ``cache_salt``) roots a chain of its own: requests of different scopes
never share a block, so one cannot learn from its reuse what another sent.

Bound: at most ``max_bytes`` of node arrays are held; adding past it evicts the least recently used blocks
first. A lookup or an add marks every node of its chain used, leaf first, so a parent is always more recent than
its children and the least recently used node is always a leaf: eviction never leaves a child without its
parent. Counters (``hits``, ``misses``, ``tokens_reused``, ``evictions``) and ``nbytes``/``blocks`` are read by
the server's metrics. Thread-safe.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from thoughtjax.errors import UserError

DEFAULT_BLOCK_TOKENS = 16
DEFAULT_MAX_BYTES = 128 << 20


class PrefixCacheError(UserError, ValueError):
  """A prefix cache setting that cannot be used; the message names it and the valid range."""


@dataclasses.dataclass(eq=False)
class _Node:
  key: tuple  # (parent node id, the block's tokens)
  id: int
  parent: _Node | None
  array: Any  # the block's keys (a device array)
  nbytes: int
  children: int = 0


def _root(scope: str) -> int | tuple:
  """The parent key of a scope's first blocks: 0 (no node has id 0) for the shared scope, else the scope's own."""
  return ("scope", scope) if scope else 0


class PrefixCache:
  """A bounded cache of prompt keys by token prefix, in blocks of ``block_tokens`` (see the module docstring)."""

  def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS, max_bytes: int = DEFAULT_MAX_BYTES):
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or not 1 <= block_tokens <= 1024:
      raise PrefixCacheError(f"prefix cache block_tokens: expected an integer in [1, 1024], got {block_tokens!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
      raise PrefixCacheError(f"prefix cache max_bytes: expected an integer >= 0 (0: off), got {max_bytes!r}")
    self.block_tokens, self.max_bytes = block_tokens, max_bytes
    self._lock = threading.Lock()
    self._nodes: dict[tuple, _Node] = {}
    self._lru: collections.OrderedDict[int, _Node] = collections.OrderedDict()  # least recently used first
    self._ids = 0
    self.nbytes = 0
    self.hits = self.misses = self.tokens_reused = self.evictions = 0

  @property
  def blocks(self) -> int:
    """Blocks held."""
    return len(self._nodes)

  def _walk(self, ids: Sequence[int], blocks: int, scope: str) -> list[_Node]:
    """The cached chain of ``ids``' first ``blocks`` full blocks in ``scope``, as far as it goes."""
    B, chain, parent = self.block_tokens, [], _root(scope)
    for j in range(blocks):
      node = self._nodes.get((parent, tuple(ids[j * B : (j + 1) * B])))
      if node is None:
        break
      chain.append(node)
      parent = node.id
    return chain

  def _touch(self, chain: list[_Node]) -> None:
    for node in reversed(chain):  # leaf first: each parent ends up more recent than its children
      self._lru.move_to_end(node.id)

  def peek(self, ids: Sequence[int], limit: int, scope: str = "") -> int:
    """Tokens of ``ids`` a :meth:`lookup` with this ``limit`` would reuse now; counts and marks nothing."""
    with self._lock:
      return len(self._walk(ids, max(limit, 0) // self.block_tokens, scope)) * self.block_tokens

  def lookup(self, ids: Sequence[int], limit: int, scope: str = "") -> list[Any]:
    """The arrays of the longest cached prefix of ``ids`` in ``scope`` of at most ``limit`` tokens (whole blocks),
    first block first; [] on a miss. Counts a hit or a miss and the tokens reused; marks the chain used."""
    with self._lock:
      chain = self._walk(ids, max(limit, 0) // self.block_tokens, scope)
      self._touch(chain)
      if chain:
        self.hits += 1
        self.tokens_reused += len(chain) * self.block_tokens
      else:
        self.misses += 1
      return [n.array for n in chain]

  def first_missing(self, ids: Sequence[int], scope: str = "") -> int:
    """Index of the first full block of ``ids`` not cached in ``scope`` (the number of full blocks when all are)."""
    with self._lock:
      return len(self._walk(ids, len(ids) // self.block_tokens, scope))

  def add(self, ids: Sequence[int], first: int, arrays: Sequence[Any], scope: str = "") -> int:
    """Cache ``arrays[i]`` as the keys of block ``first + i`` of ``ids`` in ``scope`` (blocks already cached are
    kept as they are). Nothing is added past a block whose parent is no longer cached, nor what the bound cannot
    hold beside the chain itself. Returns the blocks added."""
    B = self.block_tokens
    with self._lock:
      chain = self._walk(ids, first, scope)
      if len(chain) < first:  # a parent was evicted meanwhile: the blocks would hang from nothing
        return 0
      self._touch(chain)
      on_chain = {n.id for n in chain}
      added = 0
      for i, array in enumerate(arrays):
        j = first + i
        tokens = tuple(ids[j * B : (j + 1) * B])
        if len(tokens) < B:
          break
        parent = chain[-1] if chain else None
        key = (parent.id if parent else _root(scope), tokens)
        node = self._nodes.get(key)
        if node is None:
          size = int(array.nbytes)
          if not self._make_room(size, on_chain):
            break
          self._ids += 1
          node = _Node(key, self._ids, parent, array, size)
          self._nodes[key] = node
          self._lru[node.id] = node
          self.nbytes += size
          if parent is not None:
            parent.children += 1
          added += 1
        chain.append(node)
        on_chain.add(node.id)
        self._touch(chain)
      return added

  def _make_room(self, size: int, keep: set[int]) -> bool:
    """Evict least recently used blocks until ``size`` more bytes fit; False when only ``keep`` is left."""
    while self.nbytes + size > self.max_bytes:
      if not self._lru:
        return False
      victim = next(iter(self._lru.values()))
      if victim.id in keep:  # everything left is the chain being extended
        return False
      self._evict(victim)
    return True

  def _evict(self, node: _Node) -> None:
    del self._lru[node.id]
    del self._nodes[node.key]
    self.nbytes -= node.nbytes
    self.evictions += 1
    if node.parent is not None:
      node.parent.children -= 1

  def clear(self) -> None:
    """Drop every block (the counters stay)."""
    with self._lock:
      self._nodes.clear()
      self._lru.clear()
      self.nbytes = 0

  def stats(self) -> dict:
    return {
      "prefix_cache_hits": self.hits,
      "prefix_cache_misses": self.misses,
      "prefix_cache_tokens_reused": self.tokens_reused,
      "prefix_cache_evictions": self.evictions,
      "prefix_cache_blocks": self.blocks,
      "prefix_cache_bytes": self.nbytes,
    }
