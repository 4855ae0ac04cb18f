"""The fragmentation experiment, run through the real allocators.

A KV pool of `capacity` token slots; requests of known final length (prompt + output) are
admitted in order, each allocated through `KVCacheManager`, until the next one does not
fit. Contiguous allocation reserves `max_model_len` per request; paged allocation takes
only the blocks the request fills. What fraction of the allocated slots holds real tokens
is read off the manager's own accounting, not computed by a formula.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagedjax.scheduler.kv_cache_manager import KVCacheManager


@dataclass
class _StudyRequest:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list = field(default_factory=list)


def background_lengths(n: int = 200, seed: int = 7, mean: float = 600, floor: int = 50, max_len: int = 4096) -> list[int]:
    """The text's stream of request lengths: min(max_len, int(expovariate(1/mean)) + floor)."""
    rng = random.Random(seed)
    return [min(max_len, int(rng.expovariate(1 / mean)) + floor) for _ in range(n)]


def admission_study(lengths: list[int], *, capacity: int = 32_768, block_size: int = 16,
                    max_model_len: int = 4096, allocation: str = "paged") -> dict:
    """Admit `lengths` in order until the next does not fit; report what the pool holds."""
    if capacity % block_size:
        raise ValueError(f"capacity ({capacity}) must be a multiple of block_size ({block_size})")
    mgr = KVCacheManager(capacity // block_size + 1, block_size, max_model_len=max_model_len,
                         enable_prefix_caching=False, allocation=allocation)
    admitted = 0
    for i, length in enumerate(lengths):
        req = _StudyRequest(f"r{i}", list(range(length)))
        if mgr.allocate_slots(req, length) is None:
            break
        admitted += 1
    usage = mgr.usage()
    return {
        "allocation": allocation,
        "block_size": block_size,
        "admitted": admitted,
        "allocated_slots": usage.allocated_slots,
        "real_tokens": usage.real_tokens,
        "utilization": usage.utilization,
        "wasted_slots": usage.allocated_slots - usage.real_tokens,
        "wasted_per_request": (usage.allocated_slots - usage.real_tokens) / max(admitted, 1),
    }


def mean_tail_waste(lengths: list[int], block_size: int) -> float:
    """Unfilled slots of the last block, averaged over every request (the text's 7.7 for 16)."""
    return sum(-(-n // block_size) * block_size - n for n in lengths) / len(lengths)
