"""KVCacheManager: block accounting, prefix caching, LRU eviction, invariants."""
from __future__ import annotations

import pytest

from trellm.engine.kv_manager import KVCacheManager, hash_block
from trellm.engine.request import Request
from trellm.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int], group_id: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), group_id=group_id, max_model_len=1024)


def compute(kv: KVCacheManager, req: Request, num_tokens: int | None = None) -> list[int]:
    """Admit ``req`` (taking prefix hits), pretend its tokens were computed, cache them."""
    hits, n_hit = kv.get_computed_blocks(req)
    n = (num_tokens if num_tokens is not None else req.num_tokens) - n_hit
    blocks = kv.allocate_slots(req, n, hits)
    assert blocks is not None
    req.num_computed_tokens = n_hit + n
    kv.cache_full_blocks(req, req.num_computed_tokens)
    kv.check_invariants()
    return blocks


def test_allocate_and_free_roundtrip():
    kv = KVCacheManager(8, BS, enable_caching=False)
    req = make_req("a", list(range(10)))
    blocks = kv.allocate_slots(req, 10)
    assert blocks == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5 and kv.usage == pytest.approx(3 / 8)
    kv.check_invariants()
    req.num_computed_tokens = 10
    # 10 -> 12 tokens fits the third block; 13 needs a fourth.
    assert kv.allocate_slots(req, 2) == []
    assert kv.allocate_slots(req, 3) == [3]
    kv.check_invariants()
    kv.free(req)
    kv.check_invariants()
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    assert kv.get_block_ids("a") == []


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(3, BS, enable_caching=True)
    a = make_req("a", list(range(8)))
    compute(kv, a)
    b = make_req("b", list(range(8)))  # would hit a's blocks but needs 2 more fresh
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 4  # never the whole prompt
    assert kv.allocate_slots(b, 4 + 8, hits) is None
    kv.check_invariants()
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1


def test_prefix_hit_shares_blocks_and_caps_last_token():
    kv = KVCacheManager(16, BS, enable_caching=True)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks
    a = make_req("a", prompt)
    compute(kv, a)
    b = make_req("b", prompt)
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 8 and hits == kv.get_block_ids("a")[:2]
    new = kv.allocate_slots(b, 2, hits)
    assert new[:2] == hits and len(new) == 3
    kv.check_invariants()
    # A prompt of exactly two blocks that is fully cached: the last block is dropped.
    c = make_req("c", prompt[:8])
    _, n_hit = kv.get_computed_blocks(c)
    assert n_hit == 4
    # a (10, no hit) + b (10, 8 hit) + c (8, 4 hit)
    assert kv.prefix_cache_stats == (28, 12)


def test_repeated_lookup_while_waiting_counts_once():
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = make_req("a", list(range(9)))
    compute(kv, a)
    b = make_req("b", list(range(9)))
    for _ in range(3):  # a waiting request re-queries each step
        kv.get_computed_blocks(b)
    assert kv.prefix_cache_stats == (18, 8)
    hits, _ = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 1, hits)
    kv.free(b)
    b.num_computed_tokens = 0
    kv.get_computed_blocks(b)  # a new admission (e.g. after preemption) counts again
    assert kv.prefix_cache_stats == (27, 16)
    assert kv.prefix_cache_stats.hit_rate == pytest.approx(16 / 27)


def test_no_hit_for_different_tokens_or_salt():
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(kv, a)
    # Same second block, different first block: chained hashes differ for both.
    b = make_req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b) == ([], 0)
    toks = [1, 2, 3, 4]
    assert hash_block(b"", toks, b"model-a") != hash_block(b"", toks, b"model-b")
    other = KVCacheManager(16, BS, enable_caching=True, hash_salt=b"other")
    other_a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(other, other_a)
    assert other._cached.keys().isdisjoint(kv._cached.keys())


def test_lru_eviction_reuses_least_recently_freed_block():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_req("a", list(range(8)) + [99])
    compute(kv, a)  # blocks 0, 1 full and cached; block 2 partial
    assert kv.get_block_ids("a") == [0, 1, 2]
    kv.free(a)  # freed tail-first: 2, 1, 0 -> free list [3, 2, 1, 0]
    kv.check_invariants()
    assert list(kv._free) == [3, 2, 1, 0]
    b = make_req("b", list(range(50, 62)))  # 3 fresh blocks: takes 3, 2, 1
    assert compute(kv, b) == [3, 2, 1]
    # Block 1 (a's second block) lost its hash; block 0 (a's first) survives.
    c = make_req("c", list(range(8)) + [99])
    hits, n_hit = kv.get_computed_blocks(c)
    assert hits == [0] and n_hit == 4
    assert kv.allocate_slots(c, 5, hits) is None  # block 0 revived, but no fresh block left
    kv.free(b)
    kv.check_invariants()
    assert kv.allocate_slots(c, 5, hits) is not None
    kv.check_invariants()


def test_cached_free_block_is_revived_without_eviction():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_req("a", list(range(9)))
    compute(kv, a)
    kv.free(a)
    b = make_req("b", list(range(9)))
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 8
    blocks = kv.allocate_slots(b, 1, hits)
    assert blocks[:2] == hits
    assert kv.num_free_blocks == 1
    kv.check_invariants()


def test_caching_disabled_registers_only_for_groups():
    kv = KVCacheManager(16, BS, enable_caching=False)
    a = make_req("a", list(range(9)))
    compute(kv, a)
    assert kv._cached == {}
    assert kv.get_computed_blocks(make_req("b", list(range(9)))) == ([], 0)
    g1 = make_req("g#0", list(range(9)), group_id="g")
    compute(kv, g1)
    g2 = make_req("g#1", list(range(9)), group_id="g")
    assert kv.get_computed_blocks(g2) == ([], 0)  # lookup not allowed
    hits, n_hit = kv.get_computed_blocks(g2, allow_lookup=True)
    assert n_hit == 8 and hits == kv.get_block_ids("g#0")[:2]


def test_incremental_hashing_and_duplicate_content():
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = make_req("a", list(range(6)))
    b = make_req("b", list(range(6)))  # same content computed concurrently: no hit yet
    for r in (a, b):
        assert kv.allocate_slots(r, 6) is not None
        r.num_computed_tokens = 6
    kv.cache_full_blocks(a, 6)
    kv.cache_full_blocks(b, 6)
    kv.check_invariants()
    assert len(kv._cached) == 1  # the first block registered wins
    for r in (a, b):
        r.append_output_token(7)
        r.append_output_token(8)
        assert kv.allocate_slots(r, 2) == []
        r.num_computed_tokens = 8
        kv.cache_full_blocks(r, 8)
    assert len(kv._req_hashes["a"]) == 2
    kv.check_invariants()


def test_reset_prefix_cache():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = make_req("a", list(range(9)))
    compute(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    kv.check_invariants()
    assert kv.get_computed_blocks(make_req("b", list(range(9)))) == ([], 0)


def test_check_invariants_detects_corruption():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_req("a", list(range(9)))
    compute(kv, a)
    kv._ref[0] += 1
    with pytest.raises(AssertionError, match="ref"):
        kv.check_invariants()
    kv._ref[0] -= 1
    kv._free[0] = None
    with pytest.raises(AssertionError):
        kv.check_invariants()
    del kv._free[0]
    kv._block_hash[1] = b"bogus"
    with pytest.raises(AssertionError, match="hash"):
        kv.check_invariants()
