"""Logical to physical KV memory, per request: block tables, copy-on-write, prefix hits, swap.

No JAX here. The manager owns one block table per request (a list of physical block ids)
and grows it on demand. Everything it asks of the device is returned as plain data: the
(src, dst) block copies of copy-on-write (`pop_block_copies`) and the device <-> host block
mappings of swap-out and swap-in.

A request is anything with:
    request_id: str
    all_token_ids: list[int]      prompt + generated tokens
    num_computed_tokens: int      tokens whose K/V is already in the cache
    block_hashes: list            scratch list the manager fills (chained full-block hashes)
    extra_key (optional)          mixed into block hashes (a LoRA / adapter id), default None
    max_num_tokens (optional)     prompt + max_tokens: what the contiguous reservations size from

`allocation="contiguous"` is the baseline the paper compares against (Orca's reservation
policies), behind the same interface: at admission a request reserves one run of blocks with
consecutive ids (first fit, so free memory can be broken into runs too short for the next
reservation: external fragmentation) and never grows, shares nothing and hits no prefix cache.
The run's length is set by `contiguous_reserve` ("max_model_len" and "request" are older names):
    "max" / "max_model_len"  Orca (Max): max_model_len tokens
    "pow2"                   Orca (Pow2): prompt + the next power of two >= max_tokens (<= max_model_len)
    "oracle" / "request"     Orca (Oracle): prompt + max_tokens, exact for a request run to max_tokens
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pagedjax.scheduler.block_pool import BlockPool, HostPool, hash_request_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


RESERVATIONS = ("max", "pow2", "oracle", "max_model_len", "request")


@dataclass(frozen=True)
class KVUsage:
    """Accounting at one moment, in blocks and token slots (device pool only)."""

    num_blocks: int              # usable blocks (the null block excluded)
    used_blocks: int
    allocated_slots: int         # used_blocks * block_size
    real_tokens: int             # token slots holding (or about to hold) a real token, shared ones once
    reserved_unused: int         # slots in whole blocks reserved ahead of the last written one
    internal_fragmentation: int  # unfilled slots of each table's last written block
    # contiguous only (0 when paged), counted in slots, together the rest of allocated_slots:
    reserved_for_future: int = 0  # slots the request will still write (up to prompt + max_tokens)
    over_reserved: int = 0        # slots of the reservation it can never write

    @property
    def utilization(self) -> float:
        """Real tokens / allocated slots (1.0 when nothing is allocated)."""
        return self.real_tokens / self.allocated_slots if self.allocated_slots else 1.0

    @property
    def usage(self) -> float:
        """Share of the pool's blocks in use."""
        return self.used_blocks / self.num_blocks


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        allocation: Literal["paged", "contiguous"] = "paged",
        contiguous_reserve: Literal["max", "pow2", "oracle", "max_model_len", "request"] = "max",
        num_host_blocks: int = 0,
    ):
        if allocation not in ("paged", "contiguous"):
            raise ValueError(f"allocation must be 'paged' or 'contiguous', got {allocation!r}")
        if contiguous_reserve not in RESERVATIONS:
            raise ValueError(f"contiguous_reserve must be one of {RESERVATIONS}, got {contiguous_reserve!r}")
        if allocation == "contiguous" and not max_model_len:
            raise ValueError("max_model_len is required for allocation='contiguous' (it sets the reservation)")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.contiguous = allocation == "contiguous"
        self.enable_prefix_caching = enable_prefix_caching and not self.contiguous
        self.pool = BlockPool(num_blocks, block_size, enable_caching=self.enable_prefix_caching)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.allocation = allocation
        self.contiguous_reserve = contiguous_reserve
        self.host = HostPool(num_host_blocks)

        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}   # table prefix already offered to the hash map
        self.num_tokens_held: dict[str, int] = {}     # tokens with a slot (written or written this step)
        self.final_tokens: dict[str, int] = {}        # contiguous: prompt + max_tokens of each holder
        self.swapped: dict[str, tuple[list[int], int]] = {}  # id -> (host table, tokens held)
        self._block_copies: list[tuple[int, int]] = []
        self._pending: set[int] = set()  # registered this step, not yet computed
        # sum over shared blocks of (refcount - 1) * fill: subtracting it from the sum of
        # per-request tokens counts every shared token once, without scanning the tables.
        self._shared_dup = 0

    # -- prefix caching --------------------------------------------------------------------
    def _update_hashes(self, request: Any, num_tokens: int) -> list:
        """Extend request.block_hashes to every full block among its first num_tokens tokens."""
        hashes = request.block_hashes
        n_full = num_tokens // self.block_size
        if len(hashes) < n_full:
            tokens = request.all_token_ids[: n_full * self.block_size]
            new = hash_request_blocks(tokens, self.block_size, getattr(request, "extra_key", None),
                                      start=len(hashes), parents=hashes)
            hashes.extend(new[len(hashes):])
        return hashes

    def get_computed_blocks(self, request: Any) -> tuple[list[int], int]:
        """The longest chain of cached full blocks that starts the request's tokens.

        Never the whole prompt: at most `num_tokens - 1` tokens are a hit, so the last token
        is always computed and there are logits to sample from. None for a request that skips the
        cache (one that still needs its prompt logprobs)."""
        if not self.enable_prefix_caching or request.request_id in self.req_to_blocks or request.skip_prefix_cache:
            return [], 0
        max_hit_tokens = len(request.all_token_ids) - 1
        hashes = self._update_hashes(request, max_hit_tokens)
        blocks = []
        for h in hashes[: max_hit_tokens // self.block_size]:
            block_id = self.pool.get_cached_block(h)
            if block_id is None or block_id in self._pending:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    # -- allocation ----------------------------------------------------------------------
    def reservation(self, request: Any) -> int:
        """Blocks a contiguous reservation takes for `request` (see the module docstring)."""
        if self.contiguous_reserve in ("oracle", "request"):
            return cdiv(request.max_num_tokens, self.block_size)
        if self.contiguous_reserve == "pow2":
            prompt = getattr(request, "num_prompt_tokens", len(request.all_token_ids))
            output = max(1, request.max_num_tokens - prompt)
            span = min(self.max_model_len, prompt + (1 << (output - 1).bit_length()))
            return cdiv(max(span, request.max_num_tokens), self.block_size)
        return cdiv(self.max_model_len, self.block_size)

    def can_reserve(self, sizes: list[int]) -> bool:
        """Whether runs of these many blocks could be taken now, one after another (contiguous:
        each a run of consecutive ids; paged: only their total counts)."""
        if self.contiguous:
            return self.pool.can_place(sizes)
        return sum(sizes) <= self.pool.num_free_blocks

    def allocate_slots(self, request: Any, num_new_tokens: int, new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Give the request slots for `num_new_tokens` more tokens after its computed ones.

        `new_computed_blocks` (first allocation only) are prefix hits from
        `get_computed_blocks`; the caller then advances num_computed_tokens by them.
        Either every block needed is taken and the new ids are returned, or nothing
        changes and None is returned.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        req_id = request.request_id
        table = self.req_to_blocks.get(req_id)
        if table is not None and not new_computed_blocks and not self.contiguous:
            # the hot path (most decode steps): the tokens fit in blocks this request holds alone
            bs = self.block_size
            num_computed = request.num_computed_tokens
            total = num_computed + num_new_tokens
            if total <= len(table) * bs and (num_new_tokens == 0 or self.pool.ref_cnt[table[num_computed // bs]] == 1):
                if total > self.num_tokens_held[req_id]:
                    self.num_tokens_held[req_id] = total
                if self.enable_prefix_caching and total // bs > self.num_cached_blocks[req_id]:
                    self._cache_full_blocks(request, total)
                return []
        if req_id in self.swapped:
            raise ValueError(f"request {req_id!r} is swapped out; swap it in before allocating")
        new_computed_blocks = list(new_computed_blocks or [])
        table = self.req_to_blocks.get(req_id)
        if table and new_computed_blocks:
            raise ValueError(f"request {req_id!r} already holds blocks; prefix hits only apply at admission")
        table = table or []
        bs = self.block_size
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        total = num_computed + num_new_tokens

        if self.contiguous:
            reserve = self.reservation(request)
            if total > reserve * bs:
                raise ValueError(f"request {req_id!r} needs {total} tokens, beyond its contiguous "
                                 f"reservation of {reserve * bs} (max_model_len / max_num_tokens)")
            num_new_blocks = reserve - len(table)
            cow_index = -1
            if not self.pool.can_place([num_new_blocks]):
                return None
        else:
            num_new_blocks = max(0, cdiv(total, bs) - len(table) - len(new_computed_blocks))
            # copy-on-write: the first slot written this step lies in a block another table
            # holds (a fork's shared, partly filled tail; full shared blocks are never written)
            cow_index = num_computed // bs
            if not num_new_tokens or cow_index >= len(table) or self.pool.ref_cnt[table[cow_index]] <= 1:
                cow_index = -1
        # hits on free cached blocks leave the free queue, so they count against it too
        num_revived = sum(1 for b in new_computed_blocks if self.pool.ref_cnt[b] == 0)
        needed = num_new_blocks + (cow_index >= 0) + num_revived
        if needed > self.pool.num_free_blocks:
            return None

        if new_computed_blocks:
            self._touch(new_computed_blocks, bs)
        if self.contiguous:
            new_blocks = self.pool.allocate_run(num_new_blocks)
            self.final_tokens[req_id] = min(getattr(request, "max_num_tokens", None) or reserve * bs, reserve * bs)
        else:
            new_blocks = self.pool.allocate(num_new_blocks + (cow_index >= 0))
        if cow_index >= 0:
            src, dst = table[cow_index], new_blocks[-1]
            self._shared_dup -= self._fill(req_id, cow_index)
            self.pool.free([src])
            table[cow_index] = dst
            self._block_copies.append((src, dst))
            new_blocks_for_table = new_blocks[:-1]
        else:
            new_blocks_for_table = new_blocks
        table.extend(new_computed_blocks)
        table.extend(new_blocks_for_table)
        self.req_to_blocks[req_id] = table
        self.num_tokens_held[req_id] = max(self.num_tokens_held.get(req_id, 0), total)
        self.num_cached_blocks.setdefault(req_id, 0)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, total)
        return new_blocks

    def _cache_full_blocks(self, request: Any, total: int) -> None:
        """Offer every block whose tokens are all known to the hash map. Done at allocation, so
        the map never holds two blocks for one hash; the blocks stay *pending* (not a hit for
        anyone) until `commit()` says the step that fills them has run: the runner writes a
        step's K/V after its layer loop, so a request must not read, in the same step, a block
        another request is filling."""
        req_id = request.request_id
        known = min(total, len(request.all_token_ids) - getattr(request, "num_pending", 0))  # not placeholders
        start = self.num_cached_blocks[req_id]
        n_full = known // self.block_size
        if n_full <= start:
            return
        hashes = self._update_hashes(request, known)
        table = self.req_to_blocks[req_id]
        for i in range(start, n_full):
            if self.pool.cache_block(table[i], hashes[i]):
                self._pending.add(table[i])
        self.num_cached_blocks[req_id] = n_full

    def rollback_step(self, requests) -> None:
        """The step scheduled since the last commit did not run: forget the blocks registered
        for it (they hold nothing) so they are offered again once really filled."""
        for b in self._pending:
            h = self.pool.block_hash[b]
            if h is not None:
                self.pool.block_hash[b] = None
                if self.pool.cached.get(h) == b:
                    del self.pool.cached[h]
        self._pending.clear()
        for req in requests:
            if req.request_id in self.num_cached_blocks:
                self.num_cached_blocks[req.request_id] = min(self.num_cached_blocks[req.request_id],
                                                             req.num_computed_tokens // self.block_size)

    def commit(self) -> None:
        """The step scheduled since the last commit has run: its blocks now hold their content."""
        self._pending.clear()

    def _fill(self, req_id: str, index: int) -> int:
        return max(0, min(self.block_size, self.num_tokens_held.get(req_id, 0) - index * self.block_size))

    def _touch(self, block_ids: list[int], fill: int) -> None:
        for b in block_ids:
            if self.pool.ref_cnt[b] >= 1:
                self._shared_dup += fill
        self.pool.touch(block_ids)

    def pop_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) device block copies owed since the last call (copy-on-write, contiguous
        forks); the runner applies them before the step's forward pass."""
        copies, self._block_copies = self._block_copies, []
        return copies

    # -- fork / free -------------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (paged: refcount + 1, copy-on-write on
        the first divergent write; contiguous: a reservation of its own and a copy of each
        block the parent has written)."""
        if parent_id not in self.req_to_blocks:
            raise ValueError(f"fork: unknown parent request {parent_id!r} (it holds no blocks)")
        if child_id in self.req_to_blocks or child_id in self.swapped:
            raise ValueError(f"fork: child request {child_id!r} already holds blocks")
        parent = self.req_to_blocks[parent_id]
        held = self.num_tokens_held[parent_id]
        if self.contiguous:
            if not self.pool.can_place([len(parent)]):
                raise ValueError(f"fork: a run of {len(parent)} free blocks needed for a contiguous copy, "
                                 f"{self.pool.num_free_blocks} free in runs of at most "
                                 f"{max((n for _, n in self.pool.free_runs()), default=0)}")
            child = self.pool.allocate_run(len(parent))
            self.final_tokens[child_id] = self.final_tokens[parent_id]
            self._block_copies.extend((s, d) for s, d in zip(parent[: cdiv(held, self.block_size)], child))
        else:
            child = list(parent)
            for i, b in enumerate(child):
                self._shared_dup += self._fill(parent_id, i)
            self.pool.touch(child)
        self.req_to_blocks[child_id] = child
        self.num_tokens_held[child_id] = held
        self.num_cached_blocks[child_id] = self.num_cached_blocks[parent_id]

    def free(self, request: Any) -> None:
        """Return every block of a request (shared ones only when their refcount reaches 0).
        Blocks are freed tail first, so the tail is evicted before the shared-looking prefix.
        A swapped-out request gives back its host blocks."""
        req_id = request.request_id if not isinstance(request, str) else request
        if req_id in self.swapped:
            host_table, _ = self.swapped.pop(req_id)
            self._free_host(host_table)
            self.final_tokens.pop(req_id, None)
            self.num_cached_blocks.pop(req_id, None)
            return
        if req_id not in self.req_to_blocks:
            raise ValueError(f"free: unknown request {req_id!r} (never allocated, or already freed)")
        table = self.req_to_blocks.pop(req_id)
        for i, b in enumerate(table):
            if self.pool.ref_cnt[b] > 1:
                self._shared_dup -= self._fill(req_id, i)
        if not isinstance(request, str) and self.enable_prefix_caching:
            # a block registered at allocation whose step never ran holds no such content
            first_uncomputed = request.num_computed_tokens // self.block_size
            for i in range(first_uncomputed, self.num_cached_blocks.get(req_id, 0)):
                b = table[i]
                h = self.pool.block_hash[b]
                if h is not None and self.pool.ref_cnt[b] == 1:
                    self.pool.block_hash[b] = None
                    if self.pool.cached.get(h) == b:
                        del self.pool.cached[h]
        self.pool.free(reversed(table))
        self.num_tokens_held.pop(req_id, None)
        self.final_tokens.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)

    # -- swap ----------------------------------------------------------------------------
    def swap_out(self, request_ids: list[str]) -> list[tuple[int, int]] | None:
        """Move the requests' blocks to the host pool (a group together, so blocks they share
        are copied once). Returns the (device, host) copies, or None with nothing changed if
        the host pool is too small."""
        for r in request_ids:
            if r not in self.req_to_blocks:
                raise ValueError(f"swap_out: unknown request {r!r} (it holds no device blocks)")
        unique = list(dict.fromkeys(b for r in request_ids for b in self.req_to_blocks[r]))
        if len(unique) > self.host.num_free_blocks:
            return None
        dev_to_host = {d: self.host.free_ids.pop() for d in unique}
        for r in request_ids:
            host_table = [dev_to_host[d] for d in self.req_to_blocks[r]]
            for h in host_table:
                self.host.ref_cnt[h] += 1
            held, final = self.num_tokens_held[r], self.final_tokens.get(r)
            self.free(r)
            self.swapped[r] = (host_table, held)
            if final is not None:
                self.final_tokens[r] = final
        return list(dev_to_host.items())

    def can_swap_in(self, request_ids: list[str]) -> bool:
        if self.contiguous:  # nothing is shared: each request comes back into a run of its own
            return self.pool.can_place([len(self.swapped[r][0]) for r in request_ids])
        unique = {h for r in request_ids for h in self.swapped[r][0]}
        return len(unique) <= self.pool.num_free_blocks

    def swap_in(self, request_ids: list[str]) -> list[tuple[int, int]] | None:
        """Bring swapped requests back into fresh device blocks. Returns the (host, device)
        copies, or None with nothing changed if too few device blocks are free."""
        for r in request_ids:
            if r not in self.swapped:
                raise ValueError(f"swap_in: request {r!r} is not swapped out")
        if not self.can_swap_in(request_ids):
            return None
        unique = list(dict.fromkeys(h for r in request_ids for h in self.swapped[r][0]))
        if self.contiguous:
            host_to_dev = {h: d for r in request_ids
                           for h, d in zip(self.swapped[r][0], self.pool.allocate_run(len(self.swapped[r][0])))}
        else:
            host_to_dev = dict(zip(unique, self.pool.allocate(len(unique))))
        # allocate() gave each block one holder; the others are touched below
        first_holder: set[int] = set()
        for r in request_ids:
            host_table, held = self.swapped.pop(r)
            table = [host_to_dev[h] for h in host_table]
            self.req_to_blocks[r] = table
            self.num_tokens_held[r] = held
            for i, d in enumerate(table):
                if d in first_holder:
                    self._shared_dup += self._fill(r, i)
                    self.pool.touch([d])
                else:
                    first_holder.add(d)
            self._free_host(host_table)
            # the full blocks brought back are not registered again (their old device copies
            # may still be); blocks filled from now on are
            self.num_cached_blocks[r] = held // self.block_size
        return list(host_to_dev.items())

    def _free_host(self, host_table: list[int]) -> None:
        for h in host_table:
            self.host.ref_cnt[h] -= 1
            if self.host.ref_cnt[h] == 0:
                self.host.free_ids.append(h)

    # -- accounting ----------------------------------------------------------------------
    def get_block_table(self, req_id: str) -> list[int]:
        return self.req_to_blocks[req_id]

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (no later request can hit a block computed before);
        only possible while no request holds a block. Returns whether it was done."""
        return self.pool.reset_prefix_cache()

    def usage(self) -> KVUsage:
        bs = self.block_size
        used = self.pool.num_used_blocks
        real = sum(self.num_tokens_held.values()) - self._shared_dup
        reserved = future = over = 0
        if self.contiguous:
            for r, table in self.req_to_blocks.items():
                held = self.num_tokens_held[r]
                reserved += (len(table) - cdiv(held, bs)) * bs
                final = max(held, min(self.final_tokens.get(r, held), len(table) * bs))
                future += final - held
                over += len(table) * bs - final
        return KVUsage(
            num_blocks=self.pool.num_blocks - 1,
            used_blocks=used,
            allocated_slots=used * bs,
            real_tokens=real,
            reserved_unused=reserved,
            internal_fragmentation=used * bs - real - reserved,
            reserved_for_future=future,
            over_reserved=over,
        )
