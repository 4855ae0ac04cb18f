"""Pack a SchedulerOutput into a StepInput: numpy arrays whose shapes depend only on the bucket.

The device program is compiled once per bucket (T tokens, S sequence rows, P block-table
columns); which requests are in the batch only changes the *values* of these arrays:

    token_ids      int32[T]      the step's tokens, rows stacked; padding 0
    positions      int32[T]      each token's position in its sequence; padding 0
    slot_mapping   int32[T]      block_id * block_size + offset where its K/V is written; -1 = skip
    query_start_loc int32[S+1]   row s owns tokens query_start_loc[s] : query_start_loc[s+1]
    context_lens   int32[S]      tokens in the cache for row s after this step's writes; 0 = padding
    block_tables   int32[S, P]   physical blocks of row s; unused entries 0 (the null block)
    slot_mask      bool[S]       row is a real sequence
    logits_indices int32[S]      token whose logits row s samples from (a forked sample reads
                                 its parent's last token)
    temperature, top_p, min_p float32[S]; top_k int32[S] (0 = off); seeds uint32[S, 2]
    sample_positions int32[S]    position of the token being sampled (folded into the seed, so a
                                 request's samples do not depend on its batch)
    num_seqs, num_tokens         real rows and tokens (int32 scalars)
    block_copies   int32[C, 2]   (src, dst) device block copies applied before the step; (0, 0) pads

Buffers are allocated once per bucket and rewritten in place every step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from pagedjax.config import EngineConfig
from pagedjax.scheduler.kv_cache_manager import KVCacheManager, cdiv
from pagedjax.scheduler.scheduler import SchedulerOutput


def pick_bucket(buckets: tuple[int, ...], n: int, what: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} = {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass
class StepInput:
    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    slot_mask: np.ndarray
    logits_indices: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seeds: np.ndarray
    sample_positions: np.ndarray
    num_seqs: np.ndarray
    num_tokens: np.ndarray
    block_copies: np.ndarray

    @property
    def bucket(self) -> tuple[int, int, int]:
        """(T, S, P): the shape key the device program is compiled for."""
        return (self.token_ids.shape[0], self.slot_mask.shape[0], self.block_tables.shape[1])

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The arrays the jitted step takes (block copies are applied separately)."""
        return {k: v for k, v in self.__dict__.items() if k != "block_copies"}


class BatchPacker:
    def __init__(self, config: EngineConfig, copy_buckets: tuple[int, ...] = (8, 64, 512)):
        self.config = config
        self.copy_buckets = copy_buckets
        self._buffers: dict[tuple[int, int, int], StepInput] = {}

    def rows_for(self, T: int) -> int:
        """The row bucket S of a token bucket T: the smallest seq bucket holding min(T, max_num_seqs)
        rows. Tying S to T keeps the number of compiled shapes at |T buckets| x |P buckets|."""
        return pick_bucket(self.config.seq_buckets, min(T, self.config.max_num_seqs), "sequences in one step")

    def _buffers_for(self, T: int, S: int, P: int) -> StepInput:
        buf = self._buffers.get((T, S, P))
        if buf is None:
            i32 = np.int32
            buf = StepInput(
                token_ids=np.zeros(T, i32), positions=np.zeros(T, i32), slot_mapping=np.full(T, -1, i32),
                query_start_loc=np.zeros(S + 1, i32), context_lens=np.zeros(S, i32),
                block_tables=np.zeros((S, P), i32), slot_mask=np.zeros(S, bool),
                logits_indices=np.zeros(S, i32), temperature=np.zeros(S, np.float32),
                top_k=np.zeros(S, i32), top_p=np.ones(S, np.float32), min_p=np.zeros(S, np.float32),
                seeds=np.zeros((S, 2), np.uint32), sample_positions=np.zeros(S, i32),
                num_seqs=np.zeros((), i32), num_tokens=np.zeros((), i32),
                block_copies=np.zeros((0, 2), i32))
            self._buffers[(T, S, P)] = buf
        return buf

    def pack(self, out: SchedulerOutput, kv: KVCacheManager) -> StepInput:
        cfg = self.config
        bs = cfg.block_size
        rows = out.scheduled
        n_tokens = sum(out.num_new_tokens)
        tables = [kv.req_to_blocks[r.request_id] for r in rows]
        ctx = [r.num_computed_tokens + n for r, n in zip(rows, out.num_new_tokens)]
        max_pages = cdiv(max(ctx, default=1), bs)
        # rows exceed tokens only by forked samples (rows with no token of their own)
        T = pick_bucket(cfg.token_buckets, max(n_tokens, len(rows), 1), "tokens in one step")
        S = self.rows_for(T)
        P = pick_bucket(cfg.page_buckets, max(max_pages, 1), "blocks per sequence")
        b = self._buffers_for(T, S, P)

        # padding: tokens write nowhere, rows read the null block and sample nothing
        b.token_ids[n_tokens:] = 0
        b.positions[n_tokens:] = 0
        b.slot_mapping[n_tokens:] = -1
        b.block_tables.fill(0)
        b.context_lens.fill(0)
        b.slot_mask.fill(False)
        b.logits_indices.fill(0)
        b.temperature.fill(0)
        b.top_k.fill(0)
        b.top_p.fill(1)
        b.min_p.fill(0)
        b.seeds.fill(0)
        b.sample_positions.fill(0)

        # one pass over the rows builds plain lists; each array is then written once
        qsl, last_row = [], []
        tok, pos, slot = [], [], []
        table_lens, table_vals = [], []
        q = 0
        for s, (req, n, table) in enumerate(zip(rows, out.num_new_tokens, tables)):
            qsl.append(q)
            start = req.num_computed_tokens
            if n == 1:  # the decode fast path
                tok.append(req.all_token_ids[start])
                pos.append(start)
                slot.append(table[start // bs] * bs + start % bs)
            elif n:
                p = np.arange(start, start + n, dtype=np.int32)
                tok.extend(req.all_token_ids[start:start + n])
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
            b.token_ids[:q] = tok
            b.positions[:q] = pos
            b.slot_mapping[:q] = slot
            lens = np.asarray(table_lens)
            starts = np.repeat(np.cumsum(lens) - lens, lens)
            b.block_tables[np.repeat(np.arange(R), lens), np.arange(len(table_vals)) - starts] = table_vals
            b.query_start_loc[:R] = qsl
            b.context_lens[:R] = ctx
            b.slot_mask[:R] = True
            # one float64 row per request: temperature, top_k, top_p, min_p, seed low, seed high
            params = np.array([r.sampling_row for r in rows], np.float64)
            b.temperature[:R] = params[:, 0]
            b.top_k[:R] = params[:, 1]
            b.top_p[:R] = params[:, 2]
            b.min_p[:R] = params[:, 3]
            b.seeds[:R] = params[:, 4:6]
            b.sample_positions[:R] = ctx
            b.logits_indices[:R] = [last_row[src] for src in out.sample_from]
        b.query_start_loc[len(rows):] = q
        b.num_seqs[()] = len(rows)
        b.num_tokens[()] = n_tokens
        b.block_copies = self._pad_pairs(out.block_copies)
        return b

    def _pad_pairs(self, pairs: list[tuple[int, int]]) -> np.ndarray:
        if not pairs:
            return np.zeros((0, 2), np.int32)
        n = len(pairs)
        C = self.copy_buckets[bisect.bisect_left(self.copy_buckets, n)] if n <= self.copy_buckets[-1] else n
        arr = np.zeros((C, 2), np.int32)
        arr[:n] = pairs
        return arr
