"""The soak logic (pagedjax/soak.py, scripts/soak.py) on a few hundred requests: nothing lost,
nothing leaked, preemption and aborts in both modes, tokens equal to an ample-memory run."""

import pytest

from pagedjax.scheduler.sim import run_alone
from pagedjax.soak import VOCAB, SoakSetup, ample_run, quiet_preemption_warnings, run_soak, soak_requests

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
