"""Physical KV blocks: refcounts, a free queue in eviction order, and the prefix-hash map.

No JAX here. A block is an index into the device KV pool; this module only decides which
indices are free, who holds them and what full-block content they are known to hold.

Block 0 is the null block: it is never handed out, so padding rows of a block table can
point at it and the kernel never reads out of bounds.

Free blocks sit in one queue in eviction order (least recently freed first). A freed block
that holds a cached full-block hash stays findable in the hash map until it is reused, so a
later request with the same prefix takes it straight back out of the queue (O(1)), and the
blocks reused first are the ones whose content was needed least recently (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

NULL_BLOCK = 0


class BlockHash(NamedTuple):
    """Identity of a full block's content.

    `value` chains the parent block's hash, so equal values mean equal prefixes; the token
    ids and the extra key are kept too so that the dict lookup compares content, and a hash
    collision can never map one prefix onto another's block.
    """

    value: int
    token_ids: tuple[int, ...]
    extra_key: Any = None


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_key: Any = None) -> BlockHash:
    """hash(parent hash, the block's token ids, extra key such as a LoRA/adapter id)."""
    tokens = tuple(token_ids)
    parent_value = None if parent is None else parent.value
    return BlockHash(hash((parent_value, tokens, extra_key)), tokens, extra_key)


def hash_request_blocks(token_ids: Sequence[int], block_size: int, extra_key: Any = None,
                        start: int = 0, parents: list[BlockHash] | None = None) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids`, continuing `parents` from block `start`."""
    hashes = list(parents or [])
    parent = hashes[-1] if hashes else None
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key)
        hashes.append(parent)
    return hashes


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens; block 0 reserved.

    - `allocate(n)`: n blocks from the front of the free queue (evicting their cached hashes);
      all or nothing.
    - `allocate_run(n)`: n blocks with consecutive ids (first fit), for contiguous reservations.
    - `touch(ids)`: one more holder for each block (a prefix hit or a fork); a free cached block
      leaves the free queue.
    - `free(ids)`: one holder fewer; blocks reaching refcount 0 join the back of the queue, in
      the order given (pass a request's blocks tail first, so its tail is evicted before the
      prefix other requests are likelier to share).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the reserved null block), got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # OrderedDict as an O(1) doubly linked list: popitem(last=False) takes the LRU block,
        # `del` takes a cached block back out from the middle.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.num_evictions = 0
        self._runs: list[tuple[int, int]] | None = None   # free_runs(), until the free set changes

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no holder, cached or not: all of them can be allocated."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    # -- operations ----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"number of blocks to allocate must be >= 0, got {n}")
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self.free_queue)} free")
        out = []
        self._runs = None
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def free_runs(self) -> list[tuple[int, int]]:
        """(first block id, length) of every run of consecutive free block ids, in id order."""
        if self._runs is not None:
            return self._runs
        runs: list[tuple[int, int]] = []
        for b in sorted(self.free_queue):
            if runs and runs[-1][0] + runs[-1][1] == b:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((b, 1))
        self._runs = runs
        return runs

    def can_place(self, sizes: Sequence[int]) -> bool:
        """Whether `allocate_run` could place runs of these sizes, one after another (first fit)."""
        runs = [length for _, length in self.free_runs()]
        for n in sizes:
            if n <= 0:
                continue
            fit = next((i for i, length in enumerate(runs) if length >= n), None)
            if fit is None:
                return False
            runs[fit] -= n
        return True

    def allocate_run(self, n: int) -> list[int]:
        """n blocks with consecutive ids, from the first free run long enough (first fit): the
        placement of a contiguous allocator, whose free memory can be plentiful in total and
        still too broken up for one more reservation (external fragmentation)."""
        if n <= 0:
            return []
        start = next((b for b, length in self.free_runs() if length >= n), None)
        if start is None:
            raise ValueError(f"cannot allocate {n} consecutive blocks: the longest free run is "
                             f"{max((length for _, length in self.free_runs()), default=0)}")
        out = list(range(start, start + n))
        self._runs = None
        for block_id in out:
            del self.free_queue[block_id]
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        self._runs = None
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        self._runs = None
        for block_id in block_ids:
            if block_id == NULL_BLOCK or self.ref_cnt[block_id] <= 0:
                raise ValueError(f"block {block_id} is not held (refcount {self.ref_cnt[block_id]}): double free")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full block's content. If another block already holds this content, the
        map keeps that one (one block per hash) and this block stays unregistered."""
        if not self.enable_caching or block_hash in self.cached or self.block_hash[block_id] is not None:
            return False
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id
        return True

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            if self.cached.get(h) == block_id:
                del self.cached[h]
            self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when nothing is held (as vLLM's)."""
        if self.num_used_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True


class HostPool:
    """The swap space: host blocks with refcounts (shared device blocks stay shared on host)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))
        self.ref_cnt = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)
