"""BlockPool and KVCacheManager: one test per operation, nano-vllm's known bugs as regressions."""

import pytest

from helpers import FakeRequest, decode, prefill
from pagedjax.scheduler.block_pool import NULL_BLOCK, BlockPool, hash_block_tokens, hash_request_blocks
from pagedjax.scheduler.kv_cache_manager import KVCacheManager

BS = 4


def mk(num_blocks=16, **kw):
    kw.setdefault("max_model_len", 64)
    return KVCacheManager(num_blocks, BS, **kw)


# -- BlockPool -------------------------------------------------------------------------------
def test_null_block_never_handed_out():
    pool = BlockPool(5, BS)
    got = pool.allocate(4)
    assert NULL_BLOCK not in got and sorted(got) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="only 0 free"):
        pool.allocate(1)


def test_free_queue_is_lru_and_cached_blocks_stay_findable():
    pool = BlockPool(6, BS)
    a, b, c = pool.allocate(3)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert pool.cache_block(b, h)
    pool.free([c, b, a])  # c freed first -> reused first
    assert pool.get_cached_block(h) == b
    # the never-used blocks 4, 5 are at the front, then c, then b
    assert pool.allocate(3) == [4, 5, c]
    assert pool.get_cached_block(h) == b  # not reused yet: still a hit
    pool.touch([b])  # a hit on a free cached block takes it out of the queue
    assert pool.ref_cnt[b] == 1 and b not in pool.free_queue
    assert pool.allocate(1) == [a]
    pool.free([b])
    assert pool.allocate(1) == [b]
    assert pool.get_cached_block(h) is None  # reused: the hash is evicted
    assert pool.num_evictions == 1


def test_one_block_per_hash():
    pool = BlockPool(4, BS)
    a, b = pool.allocate(2)
    h = hash_block_tokens(None, [7] * BS)
    assert pool.cache_block(a, h)
    assert not pool.cache_block(b, h)
    assert pool.cached == {h: a}


def test_hash_chain_depends_on_parent_tokens_and_extra_key():
    x = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS)
    y = hash_request_blocks([9, 2, 3, 4, 5, 6, 7, 8], BS)
    z = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS, extra_key="lora-1")
    assert len(x) == 2 and x[1].token_ids == y[1].token_ids
    assert x[1] != y[1]  # same tokens, other parent
    assert x[0] != z[0]  # same tokens, other adapter
    assert hash_request_blocks([1, 2, 3], BS) == []  # no full block


@pytest.mark.parametrize("num_blocks,block_size,field", [(1, 4, "num_blocks"), (0, 4, "num_blocks"),
                                                        (8, 0, "block_size"), (8, -3, "block_size")])
def test_bad_pool_sizes(num_blocks, block_size, field):
    with pytest.raises(ValueError, match=field):
        BlockPool(num_blocks, block_size)
    with pytest.raises(ValueError, match=field):
        KVCacheManager(num_blocks, block_size, max_model_len=64)


def test_double_free_refused_without_change():
    pool = BlockPool(4, BS)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(ValueError, match="double free"):
        pool.free([a])
    assert pool.num_free_blocks == 3


# -- KVCacheManager: allocation --------------------------------------------------------------
def test_allocate_on_demand_and_all_or_nothing():
    mgr = mk(num_blocks=4)  # 3 usable
    r = FakeRequest("a", list(range(9)))
    assert mgr.allocate_slots(r, 9) is not None  # 3 blocks
    assert len(mgr.get_block_table("a")) == 3
    r.num_computed_tokens = 9
    before = (list(mgr.get_block_table("a")), mgr.num_free_blocks())
    r.all_token_ids += [1, 2, 3, 4]
    assert mgr.allocate_slots(r, 4) is None  # would need one more block: nothing changes
    assert (mgr.get_block_table("a"), mgr.num_free_blocks()) == before
    assert mgr.allocate_slots(r, 3) == []  # fits in the last block's tail


def test_negative_tokens_refused():
    mgr = mk()
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        mgr.allocate_slots(FakeRequest("a", [1, 2]), -1)
    assert mgr.num_free_blocks() == 15


def test_free_unknown_or_twice_refused():
    mgr = mk()
    r = FakeRequest("a", [1, 2, 3])
    with pytest.raises(ValueError, match="unknown request 'a'"):
        mgr.free(r)
    prefill(mgr, r)
    mgr.free(r)
    with pytest.raises(ValueError, match="unknown request 'a'"):
        mgr.free(r)
    assert mgr.num_free_blocks() == 15


def test_fork_unknown_refused():
    mgr = mk()
    with pytest.raises(ValueError, match="unknown parent request 'p'"):
        mgr.fork("p", "c")
    prefill(mgr, FakeRequest("p", [1, 2, 3]))
    mgr.fork("p", "c")
    with pytest.raises(ValueError, match="child request 'c' already holds blocks"):
        mgr.fork("p", "c")


# -- copy-on-write -------------------------------------------------------------------------------
def test_fork_shares_blocks_and_copies_on_first_divergent_write():
    mgr = mk()
    parent = FakeRequest("p", list(range(10)))  # 2 full blocks + a partial one (2 tokens)
    prefill(mgr, parent)
    children = [FakeRequest(f"c{i}", list(parent.all_token_ids), 10) for i in range(3)]
    for c in children:
        mgr.fork("p", c.request_id)
    shared = mgr.get_block_table("p")
    assert all(mgr.get_block_table(c.request_id) == shared for c in children)
    assert [mgr.pool.ref_cnt[b] for b in shared] == [4, 4, 4]
    assert mgr.usage().used_blocks == 3 and mgr.usage().real_tokens == 10

    decode(mgr, children[0], 100)
    (src, dst), = mgr.pop_block_copies()
    assert src == shared[2] and mgr.get_block_table("c0")[2] == dst
    assert mgr.get_block_table("c0")[:2] == shared[:2]
    for i, c in enumerate(children[1:] + [parent]):
        decode(mgr, c, 101 + i)
    # the last holder writes into the original tail in place
    assert len(mgr.pop_block_copies()) == 2
    assert mgr.get_block_table("p")[2] == shared[2]
    # physical blocks = 2 shared prompt blocks + one tail each
    assert mgr.usage().used_blocks == 2 + 4
    assert mgr.usage().real_tokens == 8 + 4 * 3


def test_fork_at_block_boundary_needs_no_copy():
    mgr = mk()
    parent = FakeRequest("p", list(range(8)))
    prefill(mgr, parent)
    child = FakeRequest("c", list(parent.all_token_ids), 8)
    mgr.fork("p", "c")
    decode(mgr, child, 1)
    decode(mgr, parent, 2)
    assert mgr.pop_block_copies() == []
    assert mgr.usage().used_blocks == 4


# -- prefix caching --------------------------------------------------------------------------------
def test_prefix_hit_shares_full_blocks():
    mgr = mk()
    a = FakeRequest("a", list(range(10)))
    b = FakeRequest("b", list(range(8)) + [50, 51, 52])
    assert prefill(mgr, a) == 0
    assert prefill(mgr, b) == 8
    assert mgr.get_block_table("b")[:2] == mgr.get_block_table("a")[:2]
    assert mgr.get_block_table("b")[2] != mgr.get_block_table("a")[2]
    assert mgr.usage().real_tokens == 10 + 3


def test_fully_cached_prompt_still_computes_last_token():
    """nano-vllm regression: a prompt whose every block is cached must still compute its last
    token, or there are no logits to sample the first output token from."""
    mgr = mk()
    a = FakeRequest("a", list(range(8)))
    prefill(mgr, a)
    mgr.free(a)
    b = FakeRequest("b", list(range(8)))
    hits, n = mgr.get_computed_blocks(b)
    assert n == 4 and len(hits) == 1  # only the first block: 7 tokens at most may be a hit
    assert mgr.allocate_slots(b, 8 - n, hits) is not None
    assert len(mgr.get_block_table("b")) == 2
    # the recomputed second block's content is already cached elsewhere: the map keeps one block
    assert len(mgr.pool.cached) == 2


def test_preempted_request_hits_its_own_cached_prefix():
    """nano-vllm regression: a request freed by preemption comes back and hits the blocks it
    filled itself; the hit must cover only full computed blocks and leave the rest to compute."""
    mgr = mk()
    r = FakeRequest("r", list(range(6)))
    prefill(mgr, r)
    for t in range(100, 104):
        decode(mgr, r, t)  # 10 tokens: 2 full blocks + 2
    old = mgr.get_block_table("r")[:2]
    mgr.free(r)
    r.num_computed_tokens = 0  # recompute from prompt + generated tokens
    hits, n = mgr.get_computed_blocks(r)
    assert hits == old and n == 8
    assert mgr.allocate_slots(r, len(r.all_token_ids) - n, hits) is not None
    assert mgr.get_block_table("r")[:2] == old
    assert [mgr.pool.ref_cnt[b] for b in old] == [1, 1]


def test_same_new_prefix_admitted_in_one_step_gets_one_block_per_hash():
    """nano-vllm regression: two requests with the same new prefix admitted in the same step
    must not each register a block for one hash (the map would point at one, the other leaks
    a stale entry). Blocks are registered at allocation, but stay pending until the step that
    fills them has run: the second request computes its own copy, which is not registered."""
    mgr = mk()
    a = FakeRequest("a", list(range(9)))
    b = FakeRequest("b", list(range(9)))
    # one scheduling step: both admitted before either runs
    ha, na = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 9 - na, ha)
    hb, nb = mgr.get_computed_blocks(b)
    mgr.allocate_slots(b, 9 - nb, hb)
    assert nb == 0
    ta, tb = mgr.get_block_table("a"), mgr.get_block_table("b")
    assert set(ta).isdisjoint(tb)
    assert sorted(mgr.pool.cached.values()) == sorted(ta[:2])
    for h, blk in mgr.pool.cached.items():
        assert mgr.pool.block_hash[blk] == h
    mgr.commit()  # the step ran: a third request hits a's blocks
    c = FakeRequest("c", list(range(9)))
    hc, nc = mgr.get_computed_blocks(c)
    assert hc == ta[:2] and nc == 8


def test_uncomputed_registered_blocks_forgotten_on_free():
    """A block registered at allocation whose step never ran must not stay a cache hit."""
    mgr = mk()
    a = FakeRequest("a", list(range(8)))
    mgr.allocate_slots(a, 8)  # num_computed stays 0: the step did not run
    assert len(mgr.pool.cached) == 2
    mgr.free(a)
    assert mgr.pool.cached == {}


def test_prefix_caching_off():
    mgr = mk(enable_prefix_caching=False)
    prefill(mgr, FakeRequest("a", list(range(9))))
    assert prefill(mgr, FakeRequest("b", list(range(9)))) == 0
    assert mgr.pool.cached == {}


def test_lru_eviction_of_cached_prefixes():
    mgr = mk(num_blocks=5)  # 4 usable
    a = FakeRequest("a", list(range(8)))
    prefill(mgr, a)
    mgr.free(a)
    b = FakeRequest("b", list(range(100, 108)))
    prefill(mgr, b)  # takes the two never-used blocks
    mgr.free(b)  # tail first: b's second block is evicted before its first
    c = FakeRequest("c", list(range(200, 212)))
    prefill(mgr, c)  # 3 blocks: a's two (freed earliest), then b's tail
    assert mgr.pool.num_evictions == 3
    mgr.free(c)
    assert prefill(mgr, FakeRequest("b2", list(range(100, 108)) + [1])) == 4
    mgr.free("b2")
    assert prefill(mgr, FakeRequest("a2", list(range(8)) + [1])) == 0


# -- swap ---------------------------------------------------------------------------------------------
def test_swap_out_and_in_keeps_sharing_and_refuses_when_short():
    mgr = mk(num_blocks=8, num_host_blocks=8)
    p = FakeRequest("p", list(range(6)))
    prefill(mgr, p)
    mgr.fork("p", "c")
    out = mgr.swap_out(["p", "c"])
    assert len(out) == 2  # shared blocks copied once
    assert mgr.num_free_blocks() == 7 and mgr.usage().used_blocks == 0
    # fill the device so swap-in cannot fit: it says no and changes nothing
    hog = FakeRequest("hog", list(range(1000, 1024)))
    prefill(mgr, hog)
    assert mgr.swap_in(["p", "c"]) is None
    assert set(mgr.swapped) == {"p", "c"} and mgr.host.num_free_blocks == 6
    mgr.free(hog)
    back = mgr.swap_in(["p", "c"])
    assert len(back) == 2 and mgr.host.num_free_blocks == 8
    assert mgr.get_block_table("p") == mgr.get_block_table("c")
    assert [mgr.pool.ref_cnt[b] for b in mgr.get_block_table("p")] == [2, 2]
    assert {h for h, _ in back} == {h for _, h in out}
    assert mgr.usage().real_tokens == 6


def test_swap_out_refused_when_host_pool_full():
    mgr = mk(num_host_blocks=1)
    r = FakeRequest("r", list(range(6)))
    prefill(mgr, r)
    table = list(mgr.get_block_table("r"))
    assert mgr.swap_out(["r"]) is None
    assert mgr.get_block_table("r") == table


def test_swap_in_unknown_refused():
    mgr = mk(num_host_blocks=4)
    with pytest.raises(ValueError, match="not swapped out"):
        mgr.swap_in(["nope"])


# -- contiguous baseline and accounting -------------------------------------------------------------
def test_contiguous_reserves_max_model_len():
    mgr = mk(num_blocks=40, allocation="contiguous", max_model_len=32)
    r = FakeRequest("r", list(range(5)))
    prefill(mgr, r)
    assert len(mgr.get_block_table("r")) == 8
    u = mgr.usage()
    assert (u.used_blocks, u.real_tokens, u.reserved_unused, u.internal_fragmentation) == (8, 5, 24, 3)
    for t in range(20):
        assert decode(mgr, r, t) == []  # never grows
    assert mgr.usage().reserved_unused == 4 and mgr.usage().internal_fragmentation == 3


def test_contiguous_request_reservation_and_fork_copies():
    mgr = mk(num_blocks=40, allocation="contiguous", contiguous_reserve="request")
    r = FakeRequest("r", list(range(5)), max_num_tokens=10)
    prefill(mgr, r)
    assert len(mgr.get_block_table("r")) == 3
    mgr.fork("r", "c")
    assert len(mgr.pop_block_copies()) == 2  # the written blocks, not the empty reservation
    assert set(mgr.get_block_table("r")).isdisjoint(mgr.get_block_table("c"))


@pytest.mark.parametrize("policy, prompt, max_tokens, blocks", [
    ("max", 5, 10, 16), ("max_model_len", 5, 10, 16),   # max_model_len 64 / BS 4
    ("oracle", 5, 10, 4), ("request", 5, 10, 4),         # 15 tokens
    ("pow2", 5, 10, 6), ("pow2", 5, 16, 6), ("pow2", 5, 17, 10),  # 5 + 16 = 21, 5 + 32 = 37 tokens
    ("pow2", 30, 33, 16),                                  # 30 + 64 capped at max_model_len
])
def test_orca_reservation_policies(policy, prompt, max_tokens, blocks):
    mgr = mk(num_blocks=40, allocation="contiguous", contiguous_reserve=policy)
    r = FakeRequest("r", list(range(prompt)), max_num_tokens=prompt + max_tokens)
    r.num_prompt_tokens = prompt
    prefill(mgr, r)
    assert len(mgr.get_block_table("r")) == blocks
    u = mgr.usage()
    # real + reserved for the request's later tokens + never-written reservation = what it holds
    assert u.real_tokens == prompt and u.reserved_for_future == max_tokens
    assert u.real_tokens + u.reserved_for_future + u.over_reserved == blocks * BS == u.allocated_slots


def test_contiguous_reservations_are_runs_and_fragment_externally():
    mgr = mk(num_blocks=13, allocation="contiguous", contiguous_reserve="oracle")  # 12 usable blocks
    reqs = [FakeRequest(f"r{i}", list(range(8)), max_num_tokens=12) for i in range(4)]  # 3 blocks each
    for r in reqs:
        prefill(mgr, r)
    tables = [mgr.get_block_table(r.request_id) for r in reqs]
    assert all(t == list(range(t[0], t[0] + 3)) for t in tables)
    mgr.free(reqs[0])
    mgr.free(reqs[2])  # 6 blocks free, in two runs of 3
    assert mgr.num_free_blocks() == 6 and mgr.pool.free_runs() == [(tables[0][0], 3), (tables[2][0], 3)]
    big = FakeRequest("big", list(range(8)), max_num_tokens=16)  # 4 blocks: fits the count, not a run
    assert not mgr.can_reserve([4]) and prefill(mgr, big) is None
    assert mgr.usage().used_blocks == 6  # nothing taken by the refusal
    small = FakeRequest("small", list(range(8)), max_num_tokens=12)
    assert prefill(mgr, small) is not None and mgr.get_block_table("small") == tables[0]


def test_paged_accounting():
    mgr = mk()
    prefill(mgr, FakeRequest("a", list(range(5))))
    prefill(mgr, FakeRequest("b", list(range(100, 107))))
    u = mgr.usage()
    assert (u.used_blocks, u.allocated_slots, u.real_tokens, u.reserved_unused) == (4, 16, 12, 0)
    assert u.internal_fragmentation == 4 and u.utilization == 12 / 16
