"""One step's inputs, described once, and the packer that fills them.

The device program is compiled once per bucket (T tokens, S sequence rows, P block-table
columns); which requests are in the batch only changes the *values* of these numpy arrays:

    StepInput
      token_ids       int32[T]     the step's tokens, rows stacked; padding 0
      token_source    int32[T]     >= 0: the token is prev_tokens[token_source] instead, a token the
                                   previous step sampled that the host does not have yet (async
                                   scheduling); -1 otherwise
      prev_tokens     int32[R]     the previous step's sampled tokens by row (R: the largest row
                                   bucket; the runner puts them there on the device)
      positions       int32[T]     each token's position in its sequence; padding 0
      logits_indices  int32[S]     token whose logits row s samples from (a forked sample reads
                                   its parent's last token)
      attention: AttentionMetadata
        slot_mapping    int32[T]     block_id * block_size + offset where its K/V is written; -1 = skip
        block_tables    int32[S, P]  physical blocks of row s; unused entries 0 (the null block)
        context_lens    int32[S]     tokens in the cache for row s after this step's writes; 0 = padding
        query_start_loc int32[S+1]   row s owns tokens query_start_loc[s] : query_start_loc[s+1]
        num_seqs        int32[]      real rows (rows >= num_seqs are padding)
      sampling: SamplingInputs
        temperature, top_p, min_p float32[S]; top_k int32[S] (0 = off); seeds uint32[S, 2]
        sample_positions int32[S]  position of the token being sampled (folded into the seed, so a
                                   request's samples do not depend on its batch)

The host side fills them (plain numpy, no JAX: buffers are allocated once per bucket and rewritten
in place every step); the device side registers the three classes as pytrees (pagedjax.runner,
pagedjax.attention) and the jitted step takes a StepInput as it is. `StepInput.padding(T, S, P)`
is a bucket's padding-only instance: every token writes nowhere, every row is empty; warm-up runs
it and pagedjax.aot takes its shapes. Block copies (copy-on-write, swaps) travel in the
SchedulerOutput and are applied by the runner around the step.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
from dataclasses import dataclass

import numpy as np

from pagedjax.config import EngineConfig
from pagedjax.scheduler.kv_cache_manager import KVCacheManager, cdiv
from pagedjax.scheduler.output import SchedulerOutput
from pagedjax.scheduler.sequence import PLACEHOLDER


def pick_bucket(buckets: tuple[int, ...], n: int, what: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} = {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass
class AttentionMetadata:
    """What the paged attention needs for one step (see the module docstring)."""

    slot_mapping: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray
    num_seqs: np.ndarray


@dataclass
class SamplingInputs:
    """Each row's sampling parameters for one step (see the module docstring)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seeds: np.ndarray
    sample_positions: np.ndarray


@dataclass
class StepInput:
    """Everything the jitted step takes besides the weights and the KV pool."""

    token_ids: np.ndarray
    token_source: np.ndarray
    prev_tokens: np.ndarray
    positions: np.ndarray
    logits_indices: np.ndarray
    attention: AttentionMetadata
    sampling: SamplingInputs

    @property
    def bucket(self) -> tuple[int, int, int]:
        """(T, S, P): the shape key the device program is compiled for."""
        return (self.token_ids.shape[0], self.logits_indices.shape[0], self.attention.block_tables.shape[1])

    @classmethod
    def padding(cls, T: int, S: int, P: int, R: int | None = None) -> StepInput:
        """A bucket's padding-only inputs: every token writes nowhere, every row is empty.
        R: the length of prev_tokens (default S)."""
        i32 = np.int32
        return cls(
            token_ids=np.zeros(T, i32), token_source=np.full(T, -1, i32), prev_tokens=np.zeros(R or S, i32),
            positions=np.zeros(T, i32), logits_indices=np.zeros(S, i32),
            attention=AttentionMetadata(slot_mapping=np.full(T, -1, i32), block_tables=np.zeros((S, P), i32),
                                        context_lens=np.zeros(S, i32), query_start_loc=np.zeros(S + 1, i32),
                                        num_seqs=np.zeros((), i32)),
            sampling=SamplingInputs(temperature=np.zeros(S, np.float32), top_k=np.zeros(S, i32),
                                    top_p=np.ones(S, np.float32), min_p=np.zeros(S, np.float32),
                                    seeds=np.zeros((S, 2), np.uint32), sample_positions=np.zeros(S, i32)))

    def copy(self) -> StepInput:
        """A copy whose arrays the packer will not overwrite next step."""
        return copy.deepcopy(self)

    @property
    def num_tokens(self) -> int:
        """Real tokens this step."""
        return int(self.attention.query_start_loc[int(self.attention.num_seqs)])


def step_fields(cls) -> list[str]:
    """The array (or nested) fields of a step class, for registering it as a pytree."""
    return [f.name for f in dataclasses.fields(cls)]


class BatchPacker:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._buffers: dict[tuple[int, int, int], StepInput] = {}

    def rows_for(self, T: int) -> int:
        """The row bucket S of a token bucket T: the smallest seq bucket holding min(T, max_num_seqs)
        rows. Tying S to T keeps the number of compiled shapes at |T buckets| x |P buckets|."""
        return pick_bucket(self.config.seq_buckets, min(T, self.config.max_num_seqs), "sequences in one step")

    def _buffers_for(self, T: int, S: int, P: int) -> StepInput:
        buf = self._buffers.get((T, S, P))
        if buf is None:
            buf = self._buffers[(T, S, P)] = StepInput.padding(T, S, P, self.config.seq_buckets[-1])
        return buf

    def plan(self, out: SchedulerOutput) -> tuple[tuple[int, int, int], int, list[int]]:
        """The bucket (T, S, P) the step packs into, its real tokens and each row's context length."""
        cfg = self.config
        n_tokens = sum(out.num_new_tokens)
        ctx = [r.num_computed_tokens + n for r, n in zip(out.scheduled, out.num_new_tokens)]
        max_pages = cdiv(max(ctx, default=1), cfg.block_size)
        # rows exceed tokens only by forked samples (rows with no token of their own)
        T = pick_bucket(cfg.token_buckets, max(n_tokens, len(out.scheduled), 1), "tokens in one step")
        P = pick_bucket(cfg.page_buckets, max(max_pages, 1), "blocks per sequence")
        return (T, self.rows_for(T), P), n_tokens, ctx

    def pack(self, out: SchedulerOutput, kv: KVCacheManager) -> StepInput:
        bs = self.config.block_size
        rows = out.scheduled
        tables = [kv.req_to_blocks[r.request_id] for r in rows]
        (T, S, P), n_tokens, ctx = self.plan(out)
        buf = self._buffers_for(T, S, P)
        a, sp = buf.attention, buf.sampling

        # padding: tokens write nowhere, rows read the null block and sample nothing
        buf.token_ids[n_tokens:] = 0
        buf.token_source.fill(-1)
        buf.positions[n_tokens:] = 0
        a.slot_mapping[n_tokens:] = -1
        a.block_tables.fill(0)
        a.context_lens.fill(0)
        buf.logits_indices.fill(0)
        sp.temperature.fill(0)
        sp.top_k.fill(0)
        sp.top_p.fill(1)
        sp.min_p.fill(0)
        sp.seeds.fill(0)
        sp.sample_positions.fill(0)

        # one pass over the rows builds plain lists; each array is then written once
        qsl, last_row = [], []
        tok, pos, slot = [], [], []
        table_lens, table_vals = [], []
        q = 0
        for s, (req, n, table) in enumerate(zip(rows, out.num_new_tokens, tables)):
            qsl.append(q)
            start = req.num_computed_tokens
            if n == 1:  # the decode fast path
                t = req.all_token_ids[start]
                if t == PLACEHOLDER:  # sampled by the step still running: taken from its output
                    buf.token_source[q] = req.pending_row
                tok.append(t)
                pos.append(start)
                slot.append(table[start // bs] * bs + start % bs)
            elif n:
                p = np.arange(start, start + n, dtype=np.int32)
                chunk = req.all_token_ids[start:start + n]
                if req.num_pending and PLACEHOLDER in chunk:
                    raise RuntimeError(f"request {req.request_id!r}: a chunk of {n} tokens holds an unsampled token")
                tok.extend(chunk)
                pos.extend(p.tolist())
                slot.extend((np.asarray(table, np.int32)[p // bs] * bs + p % bs).tolist())
            q += n
            last_row.append(q - 1)
            if len(table) > P:  # a contiguous reservation: attention reads only the filled part
                table = table[:P]
            table_lens.append(len(table))
            table_vals.extend(table)
        R = len(rows)
        if R:
            buf.token_ids[:q] = tok
            buf.positions[:q] = pos
            a.slot_mapping[:q] = slot
            lens = np.asarray(table_lens)
            starts = np.repeat(np.cumsum(lens) - lens, lens)
            a.block_tables[np.repeat(np.arange(R), lens), np.arange(len(table_vals)) - starts] = table_vals
            a.query_start_loc[:R] = qsl
            a.context_lens[:R] = ctx
            # one float64 row per request: temperature, top_k, top_p, min_p, seed low, seed high
            params = np.array([r.sampling_row for r in rows], np.float64)
            sp.temperature[:R] = params[:, 0]
            sp.top_k[:R] = params[:, 1]
            sp.top_p[:R] = params[:, 2]
            sp.min_p[:R] = params[:, 3]
            sp.seeds[:R] = params[:, 4:6]
            sp.sample_positions[:R] = ctx
            buf.logits_indices[:R] = [last_row[src] for src in out.sample_from]
        a.query_start_loc[len(rows):] = q
        a.num_seqs[()] = len(rows)
        return buf
