"""A timeline sandbox of static vs continuous batching, on the real scheduler with the sim executor.

A few seats, requests with given output lengths (and arrival steps); every step costs one
unit of virtual time, so a request's finish time is counted in steps. Static and continuous
batching run the identical request list; their occupancy timelines (step x seat -> request)
come from the scheduler's own metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.config import EngineConfig
from pagedjax.sampling_params import SamplingParams
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.sequence import Request
from pagedjax.scheduler.sim import SimExecutor, StepCost, VirtualClock, simulate


@dataclass
class TimelineResult:
    scheduling: str
    occupancy: list[list]            # steps x seats of request ids (None: idle)
    finish_steps: dict[str, float]   # request id -> steps from its arrival until it finished
    num_steps: int

    @property
    def mean_finish(self) -> float:
        return sum(self.finish_steps.values()) / len(self.finish_steps)

    @property
    def idle_seat_steps(self) -> int:
        return sum(seat is None for row in self.occupancy for seat in row)


def run_timeline(output_lens: list[int], arrivals: list[int] | None = None, *, seats: int = 4,
                 scheduling: str = "continuous", prompt_len: int = 4) -> TimelineResult:
    """One step = one time unit; prompts are short so every request prefills in its first step."""
    arrivals = arrivals or [0] * len(output_lens)
    cfg = EngineConfig(block_size=16, num_blocks=4096, max_num_seqs=seats, max_num_batched_tokens=max(64, seats * 16),
                       max_model_len=prompt_len + max(output_lens) + 1, scheduling=scheduling,
                       enable_prefix_caching=False)
    clock = VirtualClock()
    sched = Scheduler(cfg, clock=clock)
    executor = SimExecutor(4096, 16, cost=StepCost(fixed=1.0, per_token=0.0, per_context_token=0.0))
    reqs = [Request(f"R{i + 1}", [1 + i] * prompt_len, SamplingParams(max_tokens=n, ignore_eos=True),
                    arrival_time=float(a), seed=i) for i, (n, a) in enumerate(zip(output_lens, arrivals))]
    res = simulate(sched, executor, reqs, clock)
    finish = {rid: r.times.finished - r.arrival_time for rid, r in res.finished.items()}
    return TimelineResult(scheduling, sched.metrics.occupancy_matrix(), finish, res.num_steps)
