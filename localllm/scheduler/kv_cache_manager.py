"""Paged KV-cache bookkeeping: a block pool with reference counts, LRU eviction, prefix caching.

Plain Python, no tensors: the manager hands out block ids; the model runner owns the memory.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from localllm.scheduler.request import Request

BlockHash = bytes
HashFn = Callable[[BlockHash | None, Sequence[int]], BlockHash]


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """SHA-256 of the parent block's hash and this block's token ids.

    Chained this way, a block's hash names the whole prefix up to the block's end, so two
    requests share a block only if every token before it matches as well.
    """
    h = hashlib.sha256(parent_hash or b"")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@dataclass(slots=True)
class KVCacheBlock:
    """One block of ``block_size`` token slots.

    ``serial`` is unique per allocation: it tells this use of the block from earlier ones.
    While the block is registered in the prefix cache, ``block_hash`` is its key,
    ``token_ids`` its own tokens and ``parent_serial`` the serial of the block before it in
    the request that computed it (-1 for a first block). A hit must match all three, so a
    hash collision can cost a missed hit but never wrong KV.
    """

    block_id: int
    ref_count: int = 0
    serial: int = -1
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    parent_serial: int = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables for live requests, shared through a prefix cache of full blocks.

    Invariants (checked by the tests after every operation):

    - Every block is either referenced (``ref_count > 0``, equal to the number of live
      requests whose table holds it) or in the free queue (``ref_count == 0``), never both,
      so ``num_free_blocks + referenced == num_blocks``.
    - The free queue is in eviction order: allocation takes from the head. A freed block
      that carries a hash goes to the tail and stays findable by prefix lookups until it is
      taken for reuse; a freed block without one holds nothing reusable and goes to the head.
    - The hash map points only at blocks whose ``block_hash`` is that key. Only full blocks
      whose tokens have all been computed are ever registered, and a hit is verified
      exactly (see :class:`KVCacheBlock`), whatever ``hash_fn`` is.
    - A request's table covers at least ``ceil(allocated tokens / block_size)`` blocks and
      only grows until :meth:`free`.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,
        on_uncache: Callable[[int], None] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        # told the id of each block that leaves the prefix cache (taken for reuse, or the cache reset):
        # what is kept beside a cached block (a hybrid model's state checkpoints) goes with it
        self.on_uncache = on_uncache
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._serials = itertools.count()
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._req_blocks: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading table blocks already offered to the cache
        self.prefix_cache_queries = 0  # tokens of requests at their first allocation
        self.prefix_cache_hits = 0  # of those, tokens served from the cache
        # (block id, hash, tokens) of each block registered since the last take_registered(), where
        # something keeps blocks beyond this cache (a disk tier): None where nothing does
        self.registered: list[tuple[int, BlockHash, tuple[int, ...]]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def free_block_ids(self) -> list[int]:
        """The free queue, next to be evicted first."""
        return list(self._free)

    def block_ids(self, req_id: str) -> list[int]:
        """A copy of the request's block table; empty if it holds no blocks."""
        return list(self._req_blocks.get(req_id, ()))

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        return tuple(req.token_ids_slice(i * self.block_size, (i + 1) * self.block_size))

    def _block_hashes(self, req: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first ``num_blocks`` full blocks, computed once per request."""
        hashes = req.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(self.hash_fn(hashes[-1] if hashes else None, self._block_tokens(req, i)))
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request's full blocks: ``(block_ids, num_tokens)``.

        Never covers the last token (the model must compute at least one token to produce
        logits), so ``num_tokens <= req.num_tokens - 1`` rounded down to a block. No side
        effects: the blocks are taken only by :meth:`allocate_slots`.
        """
        if not self.enable_caching or req.num_tokens <= 1:
            return [], 0
        block_ids = self.cached_prefix(req, (req.num_tokens - 1) // self.block_size)
        return block_ids, len(block_ids) * self.block_size

    def cached_prefix(self, req: Request, max_blocks: int) -> list[int]:
        """The cached blocks that hold the request's first full blocks, up to ``max_blocks`` of them,
        each verified exactly (its tokens and the block before it): the blocks a hit would take,
        whether the request's own table holds them or another's. No side effects."""
        if not self.enable_caching:
            return []
        max_blocks = min(max_blocks, req.num_tokens // self.block_size)
        hashes = self._block_hashes(req, max_blocks)
        block_ids: list[int] = []
        parent_serial = -1
        for i in range(max_blocks):
            block_id = self._cached.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_serial != parent_serial or block.token_ids != self._block_tokens(req, i):
                break
            block_ids.append(block_id)
            parent_serial = block.serial
        return block_ids

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Grow the request's table to hold ``req.num_computed_tokens + num_new_tokens`` tokens.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, only on a request's first
        allocation, with ``req.num_computed_tokens == 0``) are taken first: referenced, and
        revived from the free queue if nobody held them; the new tokens then come after
        them. The caller advances ``num_computed_tokens`` past those cached tokens.

        Returns a copy of the whole table, or ``None`` (changing nothing) if there are not
        enough free blocks.
        """
        table = self._req_blocks.get(req.req_id)
        hit = computed_blocks or []
        if hit:
            assert table is None and req.num_computed_tokens == 0, "cached blocks only on first allocation"
        num_tokens = req.num_computed_tokens + len(hit) * self.block_size + num_new_tokens
        num_needed = max(0, cdiv(num_tokens, self.block_size) - len(table or ()) - len(hit))
        num_revived = sum(1 for b in hit if self.blocks[b].ref_count == 0)
        if num_needed + num_revived > len(self._free):
            return None

        if table is None:
            table = self._req_blocks[req.req_id] = []
            self._num_registered[req.req_id] = len(hit)
            if self.enable_caching:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += len(hit) * self.block_size
        for block_id in hit:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            table.append(block_id)
        for _ in range(num_needed):
            table.append(self._take_free_block())
        return list(table)

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                if self.on_uncache is not None:
                    self.on_uncache(block_id)
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        block.serial = next(self._serials)
        return block_id

    def cache_full_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_computed_tokens`` tokens.

        Registered blocks can be found by other requests' :meth:`get_computed_blocks`. A block
        whose content is already cached under another block id stays private (it is freed
        like an uncached block).
        """
        table = self._req_blocks.get(req.req_id)
        if not self.enable_caching or table is None:
            return
        start = self._num_registered[req.req_id]
        end = min(num_computed_tokens // self.block_size, len(table))
        if end <= start:
            return
        hashes = self._block_hashes(req, end)
        for i in range(start, end):
            block = self.blocks[table[i]]
            if block.block_hash is None and hashes[i] not in self._cached:
                block.block_hash = hashes[i]
                block.token_ids = self._block_tokens(req, i)
                block.parent_serial = self.blocks[table[i - 1]].serial if i > 0 else -1
                self._cached[hashes[i]] = block.block_id
                if self.registered is not None:
                    self.registered.append((block.block_id, hashes[i], block.token_ids))
        self._num_registered[req.req_id] = end

    def take_registered(self) -> list[tuple[int, BlockHash, tuple[int, ...]]]:
        """The blocks registered since the last call (see ``registered``), and start a new list."""
        if self.registered is None:
            return []
        taken, self.registered = self.registered, []
        return taken

    def block_hashes(self, req: Request, num_blocks: int) -> list[BlockHash]:
        """The chain hashes of the request's first ``num_blocks`` full blocks."""
        return self._block_hashes(req, min(num_blocks, req.num_tokens // self.block_size))

    def adopt_blocks(self, req: Request, first: int, count: int) -> list[int]:
        """Register free blocks as the cached copies of the request's full blocks ``first`` ..
        ``first + count - 1``, whose contents come from elsewhere (a disk tier), the block before
        ``first`` being cached here already (``cached_prefix``); the caller fills them before the
        next step. They go to the free queue's tail, as a finished request's cached blocks do,
        behind the prefix they continue. Fewer than ``count`` where the free queue is short; none
        without caching."""
        if not self.enable_caching or count <= 0:
            return []
        hashes = self._block_hashes(req, first + count)
        prefix = self.cached_prefix(req, first)
        if len(prefix) != first:
            return []
        for block_id in prefix:  # kept: the adopted blocks continue them
            if block_id in self._free:
                self._free.move_to_end(block_id)
        count = min(count, len(self._free) - sum(1 for b in prefix if b in self._free))
        adopted: list[int] = []
        parent_serial = self.blocks[prefix[-1]].serial if prefix else -1
        for i in range(first, first + count):
            if hashes[i] in self._cached:
                break
            block_id = self._take_free_block()
            block = self.blocks[block_id]
            block.ref_count = 0
            block.block_hash = hashes[i]
            block.token_ids = self._block_tokens(req, i)
            block.parent_serial = parent_serial
            self._cached[hashes[i]] = block_id
            self._free[block_id] = None
            parent_serial = block.serial
            adopted.append(block_id)
        return adopted

    def drop_adopted(self, block_ids: list[int]) -> None:
        """Unregister adopted blocks whose contents never came (``adopt_blocks``): free, holding nothing."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count == 0, f"block {block_id} is in use"
            if block.block_hash is not None and self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
            self._free.move_to_end(block_id, last=False)

    def free(self, req: Request) -> None:
        """Release the request's blocks. Idempotent; unknown requests are a no-op.

        Blocks go back in reverse table order, so a prefix's later blocks are evicted before
        its earlier ones (which more requests are likely to share).
        """
        self._num_registered.pop(req.req_id, None)
        table = self._req_blocks.pop(req.req_id, None)
        for block_id in reversed(table or ()):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Live requests keep their blocks, now unshared."""
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = ()
        if self.on_uncache is not None:
            for block_id in self._cached.values():
                self.on_uncache(block_id)
        self._cached.clear()
