"""EngineConfig: every knob of the engine, with vLLM's names. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


def platform_token_buckets(max_num_batched_tokens: int, platform: str) -> tuple[int, ...]:
    """A step's token counts T when none are given: powers of two from 8 up to the token budget,
    and on a CPU also 1. On a CPU a step costs about what its padded token count costs (every
    padding row goes through every matmul), so a lone request (a single user's, or the last of
    a batch) decodes in one-token steps: SmolLM2-135M on two cores, ~15 ms a step against ~29 in
    the 8-token bucket. 2 and 4 would save less (~25 against ~30 ms at 4 rows) and cost a
    start-up: each bucket is one more step program, and each new row count S (S follows T)
    another set of sampling programs, to compile or load. An accelerator runs 8 rows as fast
    as one."""
    out = pow2_buckets(min(8, max_num_batched_tokens), max_num_batched_tokens)
    return (1, *out) if platform == "cpu" and out[0] > 1 else out


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo up to the first one >= hi (hi itself last if not a power of two)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None          # KV pool size in blocks (block 0 is the null block)
    gpu_memory_utilization: float = 0.9    # on GPU/TPU with num_blocks=None: share of memory for weights + KV
    num_host_blocks: int | None = None     # swap space in blocks (default: as many as the device pool)
    max_num_seqs: int = 32                 # seats: sequences in one step
    max_num_batched_tokens: int = 512      # token budget of one step (chunked prefill above it)
    max_model_len: int = 2048              # prompt + output tokens of one sequence
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    scheduling: Literal["continuous", "static"] = "continuous"
    allocation: Literal["paged", "contiguous"] = "paged"
    contiguous_reserve: Literal["max", "pow2", "oracle", "max_model_len", "request"] = "max"   # Orca's policies
    attention_backend: Literal["auto", "pallas", "reference", "native", "jnp"] = "auto"   # see pagedjax.attention
    token_buckets: tuple[int, ...] | None = None   # padded sizes of a step's token count T
    seq_buckets: tuple[int, ...] | None = None     # padded sizes of a step's sequence count S
    page_buckets: tuple[int, ...] | None = None    # padded widths of the block tables handed to attention
    tensor_parallel_size: int = 1          # devices the heads and the KV pool are split over (pagedjax.parallel)
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"   # "auto": the model's dtype
    async_scheduling: bool = False         # schedule step N+1 on the host while step N runs (LLMEngine.step)
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        def need(cond, name, limit):
            if not cond:
                raise ValueError(f"{name} must be {limit}, got {getattr(self, name)!r}")

        need(isinstance(self.block_size, int) and self.block_size >= 1, "block_size", "an int >= 1")
        need(self.num_blocks is None or (isinstance(self.num_blocks, int) and self.num_blocks >= 2),
             "num_blocks", "None or an int >= 2 (block 0 is the reserved null block)")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]")
        need(self.num_host_blocks is None or self.num_host_blocks >= 0, "num_host_blocks", "None or >= 0")
        need(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "max_num_seqs", "an int >= 1")
        need(isinstance(self.max_model_len, int) and self.max_model_len >= 2, "max_model_len", "an int >= 2")
        need(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= self.max_num_seqs,
             "max_num_batched_tokens", f">= max_num_seqs ({self.max_num_seqs}), so every seat can decode in one step")
        if not self.enable_chunked_prefill:
            need(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                 f">= max_model_len ({self.max_model_len}) without chunked prefill, or a long prompt never fits")
        need(self.preemption_mode in ("recompute", "swap"), "preemption_mode", "'recompute' or 'swap'")
        need(self.scheduling in ("continuous", "static"), "scheduling", "'continuous' or 'static'")
        need(self.allocation in ("paged", "contiguous"), "allocation", "'paged' or 'contiguous'")
        need(self.contiguous_reserve in ("max", "pow2", "oracle", "max_model_len", "request"), "contiguous_reserve",
             "'max', 'pow2' or 'oracle' ('max_model_len' and 'request' are the older names of 'max' and 'oracle')")
        need(self.attention_backend in ("auto", "pallas", "reference", "native", "jnp"), "attention_backend",
             "'auto', 'pallas', 'reference', 'native' or 'jnp'")
        need(isinstance(self.async_scheduling, bool), "async_scheduling", "True or False")
        need(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1, "tensor_parallel_size",
             "an int >= 1")
        need(self.kv_cache_dtype in ("auto", "bfloat16", "float16", "float32"), "kv_cache_dtype",
             "'auto' (the model's dtype), 'bfloat16', 'float16' or 'float32' (attention accumulates in float32)")
        # whether the token counts are the default, which an engine sets for its platform
        # (platform_token_buckets); until then the accelerators' default
        self.default_token_buckets = self.token_buckets is None
        if self.token_buckets is None:
            self.token_buckets = platform_token_buckets(self.max_num_batched_tokens, "tpu")
        if self.seq_buckets is None:
            self.seq_buckets = pow2_buckets(1, self.max_num_seqs)
        # whether the widths are this default, which an engine may narrow to what its attention
        # needs (the native CPU kernel: one width, see LLMEngine)
        self.default_page_buckets = self.page_buckets is None
        if self.page_buckets is None:
            self.page_buckets = pow2_buckets(min(4, self.max_blocks_per_seq), self.max_blocks_per_seq)
        need(max(self.token_buckets) >= self.max_num_batched_tokens, "token_buckets",
             f"a tuple whose largest size is >= max_num_batched_tokens ({self.max_num_batched_tokens})")
        need(max(self.seq_buckets) >= self.max_num_seqs, "seq_buckets",
             f"a tuple whose largest size is >= max_num_seqs ({self.max_num_seqs})")
        need(max(self.page_buckets) >= self.max_blocks_per_seq, "page_buckets",
             f"a tuple whose largest width is >= max_blocks_per_seq ({self.max_blocks_per_seq})")
        self.token_buckets = tuple(sorted(set(self.token_buckets)))
        self.seq_buckets = tuple(sorted(set(self.seq_buckets)))
        self.page_buckets = tuple(sorted(set(self.page_buckets)))

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
