"""Small fakes shared by the host-side tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest


@dataclass
class FakeRequest:
    """Just what KVCacheManager reads from a request."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list = field(default_factory=list)
    extra_key: object = None
    max_num_tokens: int | None = None
    skip_prefix_cache: bool = False


def prefill(mgr, req, use_cache=True):
    """Admit `req` as the scheduler does: prefix hits, then slots for the rest of its tokens;
    returns the number of hit tokens (None if it did not fit)."""
    hits, n_hit = mgr.get_computed_blocks(req) if use_cache else ([], 0)
    new = mgr.allocate_slots(req, len(req.all_token_ids) - req.num_computed_tokens - n_hit, hits)
    if new is None:
        return None
    req.num_computed_tokens = len(req.all_token_ids)
    mgr.commit()
    return n_hit


def decode(mgr, req, token):
    """Append one sampled token and give it a slot, as one decode step does."""
    req.all_token_ids.append(token)
    new = mgr.allocate_slots(req, 1)
    if new is None:
        req.all_token_ids.pop()
        return None
    req.num_computed_tokens += 1
    mgr.commit()
    return new


def require_native_matmul():
    """For tests of the native matmul: skip where it is not built for this CPU (it is written for
    AVX-512 and for AVX2 with FMA; elsewhere the projections are XLA's, which the other tests
    cover)."""
    from pagedjax import native

    if native.compiler() is None or not native.matmul_cpu_supported():
        pytest.skip("the native matmul needs a C++ compiler and a CPU with AVX-512, or AVX2 and FMA")
    if not native.matmul_available():
        pytest.fail(f"the native matmul did not build: {native.matmul_unavailable_reason()}")


def require_native():
    """For tests of the native CPU kernel: skip on a machine with no C++ compiler; fail, with
    the compiler's message, where there is one and the kernel does not build."""
    from pagedjax import native

    if native.compiler() is None:
        pytest.skip("no C++ compiler: the native CPU kernel cannot be built here")
    reason = native.unavailable_reason()
    if reason is not None:
        pytest.fail(f"the native CPU kernel did not build: {reason}")
