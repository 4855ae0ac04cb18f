"""What a request must satisfy to be accepted: checked once, at admission, so a request that
could never run is refused at once (naming the field and the limit) rather than left waiting."""

from __future__ import annotations

from pagedjax.config import EngineConfig
from pagedjax.scheduler.kv_cache_manager import KVCacheManager, cdiv
from pagedjax.scheduler.sequence import Request


def check_request(req: Request, cfg: EngineConfig, kv: KVCacheManager, num_blocks: int) -> None:
    """Refuse `req` with ValueError, or set its `max_tokens` (what it may generate here)."""
    for sep, what in (("#", "sample k of an n > 1 request"), ("~", "beam k of a beam search")):
        if sep in req.request_id:
            # a collision would give two requests one block table
            raise ValueError(f"request_id {req.request_id!r} must not contain {sep!r}: 'id{sep}k' is "
                             f"reserved for {what}")
    if req.num_prompt_tokens < 1:
        raise ValueError("prompt must contain at least 1 token")
    if req.num_prompt_tokens >= cfg.max_model_len:
        raise ValueError(f"The decoder prompt (length {req.num_prompt_tokens}) is longer than the maximum model length "
                         f"of {cfg.max_model_len} less the one token it must generate (max_model_len)")
    # as vLLM: a request generates up to max_tokens, or until it fills max_model_len ("length")
    room = cfg.max_model_len - req.num_prompt_tokens
    asked = req.sampling_params.max_tokens
    req.max_tokens = room if asked is None else min(asked, room)
    if req.sampling_params.n > cfg.max_num_seqs:
        raise ValueError(f"n ({req.sampling_params.n}) exceeds max_num_seqs ({cfg.max_num_seqs})")
    # a request must be able to run to max_tokens alone, or preemption could never help it
    usable = num_blocks - 1
    if kv.contiguous:
        need = kv.reservation(req) * req.sampling_params.n
        what = f"its contiguous reservation (x n={req.sampling_params.n})"
    else:
        need = cdiv(req.max_num_tokens, cfg.block_size)
        what = "prompt + max_tokens"
    if need > usable:
        raise ValueError(f"{what} needs {need} KV blocks but the pool has only {usable} "
                         f"(num_blocks={num_blocks}, block_size={cfg.block_size})")
