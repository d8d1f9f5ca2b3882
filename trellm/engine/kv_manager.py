"""Paged KV-cache block accounting with hash-based prefix caching (vLLM v1 style).

Plain Python, no torch: the manager only hands out block *ids*; the runner owns
the tensors. Each block has a reference count (how many block tables hold it).
Free blocks sit in an LRU-ordered free list: freed blocks go to the tail,
allocation takes from the head. A free block may still carry the hash of the
tokens it holds, so a later request with the same prefix can take it back
without recomputing; when the block is reallocated for new content, its hash
entry is dropped (eviction).

Block hashes chain: ``hash_i = sha256(hash_{i-1} + tokens_i + salt)``, so one hash
identifies the whole prefix up to and including block ``i``. The salt keeps
caches of different models/dtypes apart.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import NamedTuple, Sequence

from trellm.engine.request import Request


class PrefixCacheStats(NamedTuple):
    """Prompt tokens looked up in the prefix cache and how many of them hit."""

    queries: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def hash_block(parent: bytes, token_ids: Sequence[int], salt: bytes = b"") -> bytes:
    """Chained hash of one full block. ``array('q')`` gives a fixed-width byte form
    of the ids (never pickle: its output is not a stable content key)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes() + salt).digest()


class KVCacheManager:
    """Owns the block pool, the per-request block tables and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, hash_salt: bytes = b""):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_salt = hash_salt
        self._ref: list[int] = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        # OrderedDict as an LRU list: O(1) pop from the head, append at the tail,
        # and removal from the middle when a cached free block is hit.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}
        """Per request: leading table blocks already considered by cache_full_blocks."""
        self._queries = 0
        self._hits = 0
        self._pending_query: dict[str, tuple[int, int]] = {}
        """Per request: the stats its last lookup added, until it is admitted. A
        request that waits re-queries every step; only its latest lookup counts."""

    # ---- queries ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty if it holds none)."""
        return list(self._tables.get(request_id, ()))

    # ---- hashing ---------------------------------------------------------------------

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """The request's chained block hashes, extended (only the new blocks are
        hashed) to cover ``num_full_blocks`` blocks, which must be fully known."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        assert num_full_blocks * bs <= request.num_tokens, "hashing a block whose tokens are unknown"
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, request.token_slice(i * bs, (i + 1) * bs), self.hash_salt))
        return hashes

    # ---- prefix cache lookup -----------------------------------------------------------

    def get_computed_blocks(self, request: Request, allow_lookup: bool = False) -> tuple[list[int], int]:
        """Longest chain of cached full blocks matching the request's tokens (prompt
        plus outputs, for a resumed request). Takes no references.

        At least one token is always left to compute so the step produces logits:
        ``(num_tokens - 1) // block_size`` caps the chain, which drops the last block
        when every token would be cached. With caching disabled this returns nothing
        unless ``allow_lookup`` (n>1 siblings sharing their prompt)."""
        if not (self.enable_caching or allow_lookup):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for h in self._block_hashes(request, max_blocks):
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size
        old_q, old_h = self._pending_query.pop(request.request_id, (0, 0))
        self._queries += request.num_tokens - old_q
        self._hits += num_tokens - old_h
        self._pending_query[request.request_id] = (request.num_tokens, num_tokens)
        return blocks, num_tokens

    # ---- allocation --------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's block table to cover ``num_computed_tokens +
        len(new_computed_blocks) * block_size + num_new_tokens`` tokens.

        Takes references on ``new_computed_blocks`` (prefix-cache hits, only at
        admission) and appends fresh blocks from the free-list head. Returns the
        newly appended ids (hits first, then fresh), or None, changing nothing,
        when the pool cannot supply them."""
        rid = request.request_id
        table = self._tables.get(rid, [])
        assert not new_computed_blocks or not table, "cache hits are only taken at admission"
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(table) - len(new_computed_blocks)
        # Hits that sit in the free list leave it when we take them, so they are
        # not available for the fresh part.
        revived = sum(1 for b in new_computed_blocks if self._ref[b] == 0)
        if needed > len(self._free) - revived:
            return None
        for b in new_computed_blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        fresh = [self._take_free_block() for _ in range(max(needed, 0))]
        self._pending_query.pop(rid, None)
        if new_computed_blocks:
            self._num_registered[rid] = len(new_computed_blocks)
        table.extend(new_computed_blocks)
        table.extend(fresh)
        self._tables[rid] = table
        return list(new_computed_blocks) + fresh

    def _take_free_block(self) -> int:
        """Pop the least recently freed block, evicting its cached hash."""
        block, _ = self._free.popitem(last=False)
        h = self._block_hash[block]
        if h is not None:
            if self._cached.get(h) == block:
                del self._cached[h]
            self._block_hash[block] = None
        self._ref[block] = 1
        return block

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register hashes for the request's blocks that are full within its first
        ``num_tokens`` (computed) tokens.

        Registers only when caching is enabled or the request has a ``group_id``:
        n>1 siblings share their prompt blocks even when prefix caching is off.
        If another block already holds the same content (two requests computed it
        concurrently), the existing entry is kept and this block stays unhashed."""
        if not (self.enable_caching or request.group_id is not None):
            return
        rid = request.request_id
        table = self._tables.get(rid, [])
        num_full = min(num_tokens // self.block_size, len(table))
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            block, h = table[i], hashes[i]
            if self._block_hash[block] is None and h not in self._cached:
                self._block_hash[block] = h
                self._cached[h] = block
        self._num_registered[rid] = num_full

    def free(self, request: Request) -> None:
        """Drop the request's references, tail block first so that, among its
        blocks, the last ones (least likely shared) are evicted first. Blocks
        keep their hashes for reuse. Safe for a request that holds no blocks.

        The request's block hashes are dropped too; a preempted request that
        resumes rehashes its tokens once (cheap next to recomputing its KV)."""
        rid = request.request_id
        for block in reversed(self._tables.pop(rid, [])):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
        self._req_hashes.pop(rid, None)
        self._num_registered.pop(rid, None)
        self._pending_query.pop(rid, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change). Blocks in use keep
        their contents; they simply stop being shareable."""
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks

    # ---- consistency -------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first inconsistency found."""
        counts = [0] * self.num_blocks
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"request {rid} holds a block twice: {table}"
            for b in table:
                assert 0 <= b < self.num_blocks, f"request {rid} holds invalid block {b}"
                counts[b] += 1
        assert counts == self._ref, "ref counts differ from block-table occupancy: " + ", ".join(
            f"block {b}: ref {r} vs {c} tables" for b, (r, c) in enumerate(zip(self._ref, counts)) if r != c)
        free = list(self._free)
        assert len(set(free)) == len(free), "duplicate ids in the free list"
        for b in range(self.num_blocks):
            in_free = b in self._free
            assert (self._ref[b] > 0) != in_free, (
                f"block {b}: ref {self._ref[b]} but {'in' if in_free else 'not in'} the free list")
        used = sum(1 for r in self._ref if r > 0)
        assert used + len(free) == self.num_blocks, f"free {len(free)} + used {used} != {self.num_blocks}"
        for h, b in self._cached.items():
            assert self._block_hash[b] == h, f"hash map entry points to block {b} whose hash differs"
        hashed = sum(1 for h in self._block_hash if h is not None)
        assert hashed == len(self._cached), f"{hashed} hashed blocks but {len(self._cached)} map entries"
        for rid, n in self._num_registered.items():
            assert n <= len(self._tables.get(rid, ())), f"request {rid} registered past its table"
