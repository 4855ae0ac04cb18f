"""A hypothesis state machine over the KV cache manager, with a shadow device.

The shadow device plays the runner: it applies every copy the manager asks for (copy-on-write,
swap-out, swap-in) and writes each scheduled token's id into the slot its block table names.
The invariants then check the accounting *and* the content: every computed token of every
request is where its table says, and every cached hash names a block holding those tokens.
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import FakeRequest
from pagedjax.scheduler.block_pool import NULL_BLOCK
from pagedjax.scheduler.kv_cache_manager import KVCacheManager

PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9], [5] * 12]


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 32), block_size=st.sampled_from([1, 2, 3, 4]),
                caching=st.booleans(), num_host=st.integers(0, 16))
    def setup(self, num_blocks, block_size, caching, num_host):
        self.bs = block_size
        self.mgr = KVCacheManager(num_blocks, block_size, max_model_len=64,
                                  enable_prefix_caching=caching, num_host_blocks=num_host)
        self.device = {b: [None] * block_size for b in range(num_blocks)}
        self.host = {b: [None] * block_size for b in range(num_host)}
        self.reqs: dict[str, FakeRequest] = {}
        self.state: dict[str, str] = {}  # running | waiting | swapped
        self.next_id = 0

    # -- helpers -----------------------------------------------------------------------------
    def _ids(self, state):
        return sorted(r for r, s in self.state.items() if s == state)

    def _apply_copies(self, pairs, src_mem, dst_mem):
        for src, dst in pairs:
            dst_mem[dst] = list(src_mem[src])

    def _write(self, req, start, end):
        table = self.mgr.get_block_table(req.request_id)
        for pos in range(start, end):
            self.device[table[pos // self.bs]][pos % self.bs] = req.all_token_ids[pos]

    def _schedule(self, req, num_new, hits=()):
        """allocate + run one step for `req`: True if it fit."""
        new = self.mgr.allocate_slots(req, num_new, list(hits))
        if new is None:
            return False
        self._apply_copies(self.mgr.pop_block_copies(), self.device, self.device)
        start = req.num_computed_tokens + len(hits) * self.bs
        self._write(req, start, start + num_new)
        req.num_computed_tokens = start + num_new
        self.mgr.commit()
        return True

    # -- rules -------------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(10, 13), min_size=1, max_size=9))
    def add(self, prefix, tail):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.reqs[rid] = FakeRequest(rid, prefix + tail)
        self.state[rid] = "waiting"

    @precondition(lambda self: self._ids("waiting"))
    @rule(data=st.data())
    def admit(self, data):
        req = self.reqs[data.draw(st.sampled_from(self._ids("waiting")))]
        hits, n_hit = self.mgr.get_computed_blocks(req)
        remaining = len(req.all_token_ids) - n_hit
        chunk = data.draw(st.integers(1, remaining))
        if self._schedule(req, chunk, hits):
            self.state[req.request_id] = "running"

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data(), token=st.integers(10, 13))
    def step(self, data, token):
        """A prefill chunk or, once the prompt is computed, one decode token."""
        req = self.reqs[data.draw(st.sampled_from(self._ids("running")))]
        remaining = len(req.all_token_ids) - req.num_computed_tokens
        if remaining == 0:
            if len(req.all_token_ids) >= 64:
                return
            req.all_token_ids.append(token)
            if not self._schedule(req, 1):
                req.all_token_ids.pop()
        else:
            self._schedule(req, data.draw(st.integers(1, remaining)))

    @precondition(lambda self: any(self.reqs[r].num_computed_tokens == len(self.reqs[r].all_token_ids)
                                   for r in self._ids("running")))
    @rule(data=st.data())
    def fork(self, data):
        ready = [r for r in self._ids("running")
                 if self.reqs[r].num_computed_tokens == len(self.reqs[r].all_token_ids)]
        parent = self.reqs[data.draw(st.sampled_from(ready))]
        cid = f"r{self.next_id}"
        self.next_id += 1
        self.mgr.fork(parent.request_id, cid)
        self.reqs[cid] = FakeRequest(cid, list(parent.all_token_ids), parent.num_computed_tokens,
                                     list(parent.block_hashes))
        self.state[cid] = "running"
        if data.draw(st.booleans()):
            # diverge at once (as n > 1 samples do): each writes its own token into a shared tail
            for req, token in ((self.reqs[cid], 20), (parent, 21)):
                if len(req.all_token_ids) < 64:
                    req.all_token_ids.append(token)
                    if not self._schedule(req, 1):
                        req.all_token_ids.pop()

    # forks are what copy-on-write and shared accounting hinge on: give them a second rule
    # so hypothesis draws them as often as the plain steps
    fork_again = fork

    @precondition(lambda self: self._ids("running") or self._ids("swapped"))
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(self._ids("running") + self._ids("swapped")))
        self.mgr.free(self.reqs[rid])
        del self.reqs[rid], self.state[rid]

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data())
    def preempt_recompute(self, data):
        req = self.reqs[data.draw(st.sampled_from(self._ids("running")))]
        self.mgr.free(req)
        req.num_computed_tokens = 0
        self.state[req.request_id] = "waiting"

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(self._ids("running")))
        before = self.mgr.num_free_blocks()
        out = self.mgr.swap_out([rid])
        if out is None:
            assert self.mgr.num_free_blocks() == before
            return
        self._apply_copies(out, self.device, self.host)
        self.state[rid] = "swapped"

    @precondition(lambda self: self._ids("swapped"))
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(self._ids("swapped")))
        back = self.mgr.swap_in([rid])
        if back is None:
            assert rid in self.mgr.swapped
            return
        self._apply_copies(back, self.host, self.device)
        self.state[rid] = "running"

    @rule()
    def free_everything(self):
        for rid in list(self.reqs):
            if self.state[rid] != "waiting":
                self.mgr.free(self.reqs[rid])
        self.reqs.clear()
        self.state.clear()
        pool = self.mgr.pool
        assert pool.num_free_blocks == pool.num_blocks - 1
        assert self.mgr.host.num_free_blocks == self.mgr.host.num_blocks
        assert self.mgr.usage().real_tokens == 0 and self.mgr.usage().used_blocks == 0

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def blocks_are_null_free_or_owned(self):
        if not hasattr(self, "mgr"):
            return
        pool = self.mgr.pool
        holders = [0] * pool.num_blocks
        for table in self.mgr.req_to_blocks.values():
            assert len(set(table)) == len(table)
            for b in table:
                holders[b] += 1
        assert NULL_BLOCK not in pool.free_queue and holders[NULL_BLOCK] == 0 and pool.ref_cnt[0] == 0
        for b in range(1, pool.num_blocks):
            assert pool.ref_cnt[b] == holders[b] >= 0
            assert (b in pool.free_queue) != (pool.ref_cnt[b] > 0)
        owned = sum(1 for b in range(1, pool.num_blocks) if pool.ref_cnt[b] > 0)
        assert pool.num_free_blocks + owned == pool.num_blocks - 1

    @invariant()
    def every_computed_token_is_where_the_table_says(self):
        if not hasattr(self, "mgr"):
            return
        for rid, state in self.state.items():
            req = self.reqs[rid]
            if state == "running":
                table, mem = self.mgr.get_block_table(rid), self.device
            elif state == "swapped":
                table, mem = self.mgr.swapped[rid][0], self.host
            else:
                continue
            got = [mem[table[p // self.bs]][p % self.bs] for p in range(req.num_computed_tokens)]
            assert got == req.all_token_ids[: req.num_computed_tokens]

    @invariant()
    def hashes_name_full_blocks_of_their_own_content(self):
        if not hasattr(self, "mgr"):
            return
        pool = self.mgr.pool
        for h, b in pool.cached.items():
            assert pool.block_hash[b] == h
            assert self.device[b] == list(h.token_ids) and len(h.token_ids) == self.bs

    @invariant()
    def accounting_matches_a_full_scan(self):
        if not hasattr(self, "mgr"):
            return
        fill = {}
        for rid, table in self.mgr.req_to_blocks.items():
            held = self.mgr.num_tokens_held[rid]
            for i, b in enumerate(table):
                f = max(0, min(self.bs, held - i * self.bs))
                assert fill.setdefault(b, f) == f  # every holder of a shared block sees one fill
        u = self.mgr.usage()
        assert u.real_tokens == sum(fill.values())
        assert u.allocated_slots == len(fill) * self.bs == u.real_tokens + u.internal_fragmentation


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
