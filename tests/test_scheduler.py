"""The scheduler with no model (vLLM's style): build it with N blocks, call schedule(), feed
back fake tokens, assert on block tables, queues and counters."""

import random
import subprocess
import sys
import zlib

import numpy as np
import pytest

from pagedjax.config import EngineConfig
from pagedjax.sampling_params import SamplingParams
from pagedjax.scheduler.batch import BatchPacker
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.sequence import Request, RequestStatus
from pagedjax.scheduler.sim import SimExecutor, VirtualClock, simulate


def make_sched(num_blocks=64, clock=None, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_model_len", 256)
    cfg = EngineConfig(num_blocks=num_blocks, **kw)
    return Scheduler(cfg, clock=clock or VirtualClock())


def req(rid, prompt_len=5, max_tokens=4, arrival=0.0, n=1, prompt=None, seed=None, **sp):
    # random tokens drawn from the id: str hash() changes from process to process, and the runs of
    # consecutive ids it used to give two requests now and then shared a first block in the prefix
    # cache (a flaky preemption test)
    h = zlib.crc32(rid.encode())
    prompt = prompt if prompt is not None else np.random.default_rng(h).integers(3, 100, prompt_len).tolist()
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, n=n, **sp),
                   arrival_time=arrival, seed=seed if seed is not None else h % 1000)


def step(s, token=7):
    """One step with every sampled token = `token`."""
    out = s.schedule()
    s.update_from_output(out, [token] * out.num_rows)
    return out


def random_requests(n, seed=0, max_prompt=60, max_out=40, n_choices=(1,), arrival_span=0.5):
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(1, max_prompt))],
                    SamplingParams(max_tokens=rng.randint(1, max_out), n=rng.choice(n_choices)),
                    arrival_time=rng.random() * arrival_span, seed=i) for i in range(n)]


def run_sim(requests, num_blocks, *, check_kv=True, **kw):
    clock = VirtualClock()
    s = make_sched(num_blocks, clock, **kw)
    ex = SimExecutor(num_blocks, s.config.block_size, num_host_blocks=num_blocks, check_kv=check_kv)
    res = simulate(s, ex, requests, clock)
    return {k: tuple(r.output_token_ids) for k, r in res.finished.items()}, res, s


# -- order, budget, seats, chunked prefill ----------------------------------------------------------
def test_fcfs_order_and_limits_hold_every_step():
    s = make_sched(max_num_seqs=3, max_num_batched_tokens=16)
    for i in range(6):
        s.add_request(req(f"r{i}", prompt_len=5, max_tokens=3, arrival=i))
    admitted = []
    while s.has_unfinished_requests():
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= 16
        assert sum(1 for r in out.scheduled) <= 3
        assert len(s.running) <= 3
        admitted += [r.request_id for r in out.scheduled if r.request_id not in admitted]
        s.update_from_output(out, [1] * out.num_rows)
    assert admitted == [f"r{i}" for i in range(6)]


def test_long_prompt_chunked_while_others_decode():
    s = make_sched(num_blocks=1024, block_size=16, max_num_batched_tokens=512, max_model_len=4096)
    for i in range(3):
        s.add_request(req(f"d{i}", prompt_len=10, max_tokens=50))
    step(s)  # the three short prompts
    s.add_request(req("long", prompt_len=3000, max_tokens=5))
    chunks = []
    for _ in range(6):
        out = s.schedule()
        rows = {r.request_id: n for r, n in zip(out.scheduled, out.num_new_tokens)}
        assert all(rows[f"d{i}"] == 1 for i in range(3)), "running requests decode in every chunk step"
        chunks.append(rows["long"])
        assert out.total_num_scheduled_tokens <= 512
        s.update_from_output(out, [5] * out.num_rows)
    assert chunks == [509] * 5 + [455]  # 3 decode tokens + 509 prompt tokens per step
    assert sum(chunks) == 3000
    long = s.requests["long"]
    assert long.num_output_tokens == 1 and long.num_computed_tokens == 3000


def test_no_chunking_when_disabled_waits_for_budget():
    s = make_sched(max_num_batched_tokens=256, max_model_len=256, enable_chunked_prefill=False)
    s.add_request(req("a", prompt_len=200, max_tokens=2))
    s.add_request(req("b", prompt_len=100, max_tokens=2))
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["a"] and out.num_new_tokens == [200]


# -- preemption -----------------------------------------------------------------------------------------
def test_preemption_picks_the_newest():
    s = make_sched(num_blocks=9, max_num_batched_tokens=64)  # 8 usable blocks of 4
    for i, arrival in enumerate([0.0, 1.0, 2.0]):
        s.add_request(req(f"r{i}", prompt_len=8, max_tokens=20, arrival=arrival))
    step(s)  # 3 x 2 blocks = 6 of 8
    preempted = []
    for _ in range(4):
        out = step(s)
        preempted += out.preempted
    assert preempted and preempted[0] == "r2"
    assert s.requests["r2"].status == RequestStatus.PREEMPTED
    assert s.requests["r2"].num_computed_tokens == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_identical_tokens(mode):
    reqs = lambda: random_requests(120, seed=3, n_choices=(1, 1, 2))
    ample, _, _ = run_sim(reqs(), 4000)
    tight, res, s = run_sim(reqs(), 40, preemption_mode=mode)
    assert res.preemptions > 10
    assert tight == ample
    assert s.kv.pool.num_free_blocks == 39 and s.kv.usage().used_blocks == 0
    assert not s.kv.swapped and s.kv.host.num_free_blocks == s.kv.host.num_blocks


def test_swapped_blocks_come_back_intact():
    """check_kv reads every row's whole context back through its table each step."""
    _, res, s = run_sim(random_requests(60, seed=5, max_prompt=30), 24, preemption_mode="swap", check_kv=True)
    assert any(s2.num_swapped for s2 in s.metrics.steps)


# -- n > 1 -----------------------------------------------------------------------------------------------
def test_n4_shares_prompt_blocks_and_copies_the_tail_once_each():
    s = make_sched()
    s.add_request(req("p", prompt_len=10, max_tokens=5, n=4))  # 2 full blocks + a 2-token tail
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["p", "p#1", "p#2", "p#3"]
    assert out.num_new_tokens == [10, 0, 0, 0] and out.sample_from == [0, 0, 0, 0]
    assert s.kv.usage().used_blocks == 3  # the prompt, once
    s.update_from_output(out, [11, 12, 13, 14])
    out = s.schedule()
    # each sample's first write into the shared tail: 3 copies, the last holder writes in place
    assert len(out.block_copies) == 3
    assert s.kv.usage().used_blocks == 2 + 4  # prompt blocks + one tail each
    tables = [s.kv.get_block_table(r) for r in ("p", "p#1", "p#2", "p#3")]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 4
    s.update_from_output(out, [1, 2, 3, 4])
    assert [s.requests[r].output_token_ids for r in ("p", "p#1")] == [[11, 1], [12, 2]]


def test_n_samples_have_distinct_seeds_and_reproduce():
    a, _, _ = run_sim([req("x", prompt_len=9, max_tokens=12, n=3, seed=1)], 64)
    b, _, _ = run_sim([req("x", prompt_len=9, max_tokens=12, n=3, seed=1)] + random_requests(20, seed=9), 64)
    assert len({a["x"], a["x#1"], a["x#2"]}) == 3
    assert all(a[k] == b[k] for k in a)


# -- prefix caching --------------------------------------------------------------------------------------
def test_shared_system_prompt_computed_once():
    system = list(range(100, 612))  # 512 tokens = 32 blocks of 16
    rng = random.Random(0)
    reqs = [Request(f"q{i}", system + [rng.randrange(1000) for _ in range(rng.randint(5, 30))],
                    SamplingParams(max_tokens=8), arrival_time=0.01 * i, seed=i) for i in range(100)]
    _, res, s = run_sim(reqs, 4000, block_size=16, max_num_batched_tokens=1024, max_model_len=1024)
    st = s.metrics.step_summary()
    computed = st["prefill_tokens"]
    tails = sum(len(r.prompt_token_ids) - 512 for r in reqs)
    assert computed == 512 + tails  # the system prompt once, then only each request's own tail
    assert st["prefix_hit_tokens"] == 99 * 512
    assert len(res.finished) == 100


def test_replays_after_preemption_are_not_cache_hits():
    reqs = random_requests(80, seed=11, max_prompt=40)
    _, res, s = run_sim(reqs, 30)
    assert res.preemptions > 0
    st = s.metrics.step_summary()
    # unrelated random prompts share nothing: any hit would be a replay hitting its own blocks
    assert st["prefix_hit_tokens"] == 0
    assert st["prefix_query_tokens"] == sum(len(r.prompt_token_ids) for r in reqs)


# -- static vs continuous -----------------------------------------------------------------------------------
def test_static_and_continuous_same_tokens_static_idles_seats():
    reqs = lambda: random_requests(40, seed=2, max_out=60, arrival_span=0.0)
    cont, rc, sc = run_sim(reqs(), 2000)
    stat, rs, ss = run_sim(reqs(), 2000, scheduling="static")
    assert cont == stat
    assert rs.num_steps > rc.num_steps
    idle = lambda sched: sum(seat is None for row in sched.metrics.occupancy_matrix() for seat in row)
    assert idle(ss) > idle(sc)
    # static: once a batch forms, no request outside it runs until the batch has finished
    batches, current = [], set()
    for row in ss.metrics.occupancy_matrix():
        ids = {x for x in row if x}
        if ids and not (ids & current) and current:
            batches.append(current)
            current = set()
        current |= ids
    assert len(batches) >= 4


# -- abort ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("state", ["waiting", "running", "mid_prefill", "preempted", "swapped", "forked"])
def test_abort_in_every_state_restores_the_pool(state):
    s = make_sched(num_blocks=12, max_num_batched_tokens=16,
                   preemption_mode="swap" if state == "swapped" else "recompute")
    free0 = s.kv.num_free_blocks()
    if state == "waiting":
        s.add_request(req("x"))
    elif state == "running":
        s.add_request(req("x"))
        step(s)
    elif state == "mid_prefill":
        s.add_request(req("x", prompt_len=40, max_tokens=4))
        step(s)
        assert 0 < s.requests["x"].num_computed_tokens < 40
    elif state in ("preempted", "swapped"):
        s.add_request(req("a", prompt_len=12, max_tokens=30, arrival=0))
        s.add_request(req("x", prompt_len=12, max_tokens=30, arrival=1))
        while s.requests["x"].status not in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED):
            step(s)
    elif state == "forked":
        s.add_request(req("x", prompt_len=6, max_tokens=8, n=3))
        step(s)
        step(s)
    aborted = s.abort_request("x")
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    for other in list(s.requests):
        s.abort_request(other)
    assert s.kv.num_free_blocks() == free0 and s.kv.usage().used_blocks == 0
    assert not s.running and not s.waiting and not s.swapped and not s.seats
    assert s.kv.host.num_free_blocks == s.kv.host.num_blocks


def test_abort_unknown_refused():
    s = make_sched()
    with pytest.raises(ValueError, match="request_id 'nope'"):
        s.abort_request("nope")


# -- bad input --------------------------------------------------------------------------------------------------
def test_bad_requests_refused_at_once_others_keep_running():
    s = make_sched(num_blocks=10, max_model_len=64)  # 9 usable blocks = 36 tokens
    s.add_request(req("good", prompt_len=5, max_tokens=10))
    step(s)
    with pytest.raises(ValueError, match=r"prompt \(length 64\) is longer than the maximum model length of 64"):
        s.add_request(req("long", prompt_len=64, max_tokens=10))
    # a prompt that fits but leaves less room than max_tokens runs to max_model_len (as in vLLM),
    # if the pool could hold that; here it could not
    with pytest.raises(ValueError, match=r"needs 16 KV blocks but the pool has only 9"):
        s.add_request(req("long", prompt_len=60, max_tokens=10))
    with pytest.raises(ValueError, match=r"needs 10 KV blocks but the pool has only 9"):
        s.add_request(req("huge", prompt_len=30, max_tokens=10))
    with pytest.raises(ValueError, match="request_id 'good' is already in use"):
        s.add_request(req("good"))
    with pytest.raises(ValueError, match=r"n \(9\) exceeds max_num_seqs \(8\)"):
        s.add_request(req("wide", n=9))
    with pytest.raises(ValueError, match="at least 1 token"):
        s.add_request(req("empty", prompt=[]))
    while s.has_unfinished_requests():
        step(s)
    assert s.metrics.finished[-1].request_id == "good" and s.metrics.finished[-1].num_output_tokens == 10


@pytest.mark.parametrize("field,value,limit", [
    ("max_num_batched_tokens", 4, "max_num_seqs"), ("block_size", 0, ">= 1"), ("num_blocks", 1, ">= 2"),
    ("preemption_mode", "drop", "'recompute' or 'swap'"), ("scheduling", "fifo", "'continuous' or 'static'"),
    ("max_num_seqs", 0, ">= 1")])
def test_bad_config(field, value, limit):
    with pytest.raises(ValueError, match=field) as e:
        EngineConfig(**{field: value})
    assert limit in str(e.value)


# -- packing ----------------------------------------------------------------------------------------------------
def test_packing_shapes_follow_buckets_not_membership():
    s = make_sched(num_blocks=200, max_num_batched_tokens=64, max_model_len=128)
    packer = BatchPacker(s.config)
    shapes = set()
    for i in range(5):
        s.add_request(req(f"r{i}", prompt_len=3 + i, max_tokens=6 + i))
    buffers = set()
    while s.has_unfinished_requests():
        out = s.schedule()
        step = packer.pack(out, s.kv)
        b = step.attention
        shapes.add(step.bucket)
        buffers.add(id(step.token_ids))
        T, S, P = step.bucket
        assert step.token_ids.shape == (T,) and b.block_tables.shape == (S, P) and b.query_start_loc.shape == (S + 1,)
        n = step.num_tokens
        assert n == sum(out.num_new_tokens)
        assert (b.slot_mapping[n:] == -1).all() and (b.slot_mapping[:n] >= 0).all()
        assert not b.context_lens[int(b.num_seqs):].any()
        for row, (r, k) in enumerate(zip(out.scheduled, out.num_new_tokens)):
            lo, hi = b.query_start_loc[row], b.query_start_loc[row + 1]
            assert hi - lo == k
            assert list(step.token_ids[lo:hi]) == r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens + k]
            table = s.kv.get_block_table(r.request_id)
            assert list(b.block_tables[row, :len(table)]) == table and not b.block_tables[row, len(table):].any()
            assert b.context_lens[row] == r.num_computed_tokens + k
        s.update_from_output(out, [3] * out.num_rows)
    assert len(buffers) == len(shapes)  # one buffer set per bucket, reused in place
    assert all(T in s.config.token_buckets and S in s.config.seq_buckets for T, S, _ in shapes)


def test_host_side_imports_no_jax():
    code = ("import sys; import pagedjax.scheduler.scheduler, pagedjax.scheduler.batch, "
            "pagedjax.scheduler.sim, pagedjax.metrics; assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_metrics_definitions():
    from pagedjax.metrics import RequestRecord
    r = RequestRecord("a", "a", 5, 4, arrival=1.0, first_scheduled=1.5, first_token=2.0, finished=5.0,
                      token_times=[2.0, 3.0, 4.0, 5.0], finish_reason="length", num_preemptions=0,
                      num_cached_tokens=0)
    assert (r.queue_time, r.ttft, r.e2e, r.tpot, r.itls) == (0.5, 1.0, 4.0, 1.0, [1.0, 1.0, 1.0])
    assert np.isclose(r.tpot, (r.e2e - r.ttft) / (r.num_output_tokens - 1))
