"""The soak logic (pagedjax/benchmarks/soak.py, scripts/soak.py) on a few hundred requests: nothing lost,
nothing leaked, preemption and aborts in both modes, tokens equal to an ample-memory run."""

import pytest

from pagedjax.scheduler.sim import run_alone
from pagedjax.benchmarks.soak import VOCAB, SoakSetup, ample_run, quiet_preemption_warnings, run_soak, soak_requests

N = 300


@pytest.fixture(scope="module")
def reference():
    quiet_preemption_warnings()
    return ample_run(N, seed=1, check_kv=True)


def test_ample_run_is_each_request_alone(reference):
    assert reference["preemptions"] == 0 and reference["unfinished"] == 0
    setup = SoakSetup()
    for req in soak_requests(N, seed=1, max_model_len=setup.max_model_len):
        want = run_alone(req, setup.max_model_len, VOCAB)
        assert reference["outputs"][req.request_id] == (tuple(want[0]), want[1])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_soak_small(reference, mode):
    r = run_soak(N, mode, seed=1, abort_rate=0.1, error_rate=2e-3, check_kv=True, reference=reference)
    assert r["ok"], r
    assert r["lost"] == 0 and r["blocks_leaked"] == 0 and not r["block_problems"] and r["exception"] is None
    assert r["preemptions"] > 50 and r["aborted"] > 10 and r["errored"] > 0
    assert r["tokens_match_ample"] and r["tokens_compared"] == r["finished"]
    assert r["finished"] + r["aborted"] + r["errored"] == r["sequences"]
    if mode == "swap":
        assert r["abort_states"].get("swapped", 0) + r["abort_states"].get("running (decode)", 0) > 0


def test_soak_notices_a_leak(reference, monkeypatch):
    """The soak's checks can fail: an abort that forgets to free a running request's blocks."""
    from pagedjax.scheduler.scheduler import Scheduler
    from pagedjax.scheduler.sequence import RequestStatus

    real_finish = Scheduler._finish

    def leaky_finish(self, req, status, now):
        if status == RequestStatus.FINISHED_ABORTED and req.status == RequestStatus.RUNNING:
            self.kv.free = lambda r: None  # shadows the method for this one call
            try:
                return real_finish(self, req, status, now)
            finally:
                del self.kv.free
        return real_finish(self, req, status, now)

    monkeypatch.setattr(Scheduler, "_finish", leaky_finish)
    r = run_soak(N, "recompute", seed=1, abort_rate=0.1, reference=reference)
    assert not r["ok"] and (r["blocks_leaked"] > 0 or r["block_problems"] or r["exception"])


# -- the real engine ------------------------------------------------------------------------------------
ENGINE_N = 60
# one step bucket per pool shape keeps the compiles of this test to a few seconds
ENGINE_SETUP = dict(token_buckets=(32,), page_buckets=(16,))


@pytest.fixture(scope="module")
def engine_reference():
    from pagedjax.benchmarks.soak import EngineSoakSetup, engine_ample_run

    quiet_preemption_warnings()
    ref = engine_ample_run(ENGINE_N, seed=3, setup=EngineSoakSetup(**ENGINE_SETUP))
    assert ref["preemptions"] == 0 and ref["unfinished"] == 0 and len(ref["outputs"]) == ENGINE_N
    # the comparison means something: greedy continuations depend on the context, not one repeated token
    long = [toks for toks, _ in ref["outputs"].values() if len(toks) >= 10]
    assert len(long) > ENGINE_N // 2 and sum(len(set(t)) > len(t) // 2 for t in long) > 0.8 * len(long)
    return ref


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_soak_engine_small(engine_reference, mode):
    from pagedjax.benchmarks.soak import EngineSoakSetup, soak_engine

    r = soak_engine(ENGINE_N, mode, seed=3, abort_rate=0.15, setup=EngineSoakSetup(**ENGINE_SETUP),
                    reference=engine_reference)
    assert r["ok"], r
    assert r["lost"] == 0 and r["blocks_leaked"] == 0 and not r["block_problems"] and r["exception"] is None
    assert r["preemptions"] > 10 and r["aborted"] > 3 and r["unfinished"] == 0
    assert r["tokens_match_ample"] and r["tokens_compared"] == r["finished"]
    assert r["finished"] + r["aborted"] + r["errored"] == ENGINE_N
    assert len(r["abort_states"]) >= 2  # aborted in more than one state


def test_soak_engine_notices_a_corrupt_cache(engine_reference, monkeypatch):
    """The comparison can fail: swap-ins that leave the device blocks as they were (stale or
    another request's K/V) change the greedy tokens of the requests swapped back in."""
    from pagedjax.runner import ModelRunner
    from pagedjax.benchmarks.soak import EngineSoakSetup, soak_engine

    monkeypatch.setattr(ModelRunner, "swap_in", lambda self, pairs: None)
    r = soak_engine(ENGINE_N, "swap", seed=3, abort_rate=0.15, setup=EngineSoakSetup(**ENGINE_SETUP),
                    reference=engine_reference)
    assert not r["ok"] and r["token_mismatches"] > 5, r
    assert r["lost"] == 0 and r["blocks_leaked"] == 0  # the host side is still consistent
