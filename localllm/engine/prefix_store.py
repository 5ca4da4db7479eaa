"""Prefix-cache blocks kept on disk, so that a prefix outlives the process, a model switch and its
blocks' eviction from memory.

Each full block the prefix cache registers is written, off the engine thread, as one file named by
its block hash (the chain hash of every token up to the block's end, the scheduler's
``hash_block_tokens``): its token ids, each layer's rows of the block as the KV cache holds them
(any cache type: float rows, or a split cache's coded rows), and a SHA-256 of all of it. The files
of one model live in a directory named by the model's fingerprint and everything that makes its KV
values (the KV cache types, the block size, the dtype, the kernels), so a block is only ever read
back into a cache that would have computed the same bytes.

A request's prompt is looked up when it is added: the blocks after its in-memory prefix hit that
are on disk are read, checked (the digest, the header, the tokens) and put in the memory prefix
cache, where the scheduler finds them as any cached block. A file that fails a check is deleted
and its block computed again; a file is written under a temporary name and renamed into place,
so a torn write is never read. The directory is bounded by ``limit_bytes``, least recently used
files first out.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from localllm.config.paths import home_dir
from localllm.quant.kv_rows import SplitKvCache
from localllm.scheduler.kv_cache_manager import KVCacheManager
from localllm.scheduler.request import Request

log = logging.getLogger(__name__)

MAGIC = b"LLKVBLK1"
_SUFFIX = ".kvb"
_DIGEST = 32
_QUEUED_BYTES = 64 << 20  # rows waiting for the writer; past it new blocks are not kept (a busy disk)


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """What one block's rows are in every layer: their shapes and dtypes (the file's header must match)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def of(cls, rows: list[torch.Tensor]) -> BlockLayout:
        return cls(tuple(tuple(t.shape) for t in rows), tuple(str(t.dtype).removeprefix("torch.") for t in rows))


def model_fingerprint(path: Path, *parts: object) -> str:
    """A model file's identity (its size and its first and last MiB: the header and the last tensors)
    with ``parts`` (what else makes its KV values), as a short hex digest."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(size - (1 << 20), 0))
            h.update(fh.read(1 << 20))
    h.update(repr(parts).encode())
    return h.hexdigest()[:32]


def encode_block(tokens: tuple[int, ...], rows: list[torch.Tensor]) -> bytes:
    """A block's file: MAGIC, the header's length, the header (JSON: tokens, shapes, dtypes), each
    layer's rows' bytes, then the SHA-256 of everything before it."""
    layout = BlockLayout.of(rows)
    header = json.dumps({"tokens": list(tokens), "shapes": layout.shapes, "dtypes": layout.dtypes}).encode()
    parts = [MAGIC, struct.pack("<I", len(header)), header]
    parts += [t.contiguous().view(torch.uint8).numpy().tobytes() for t in rows]
    body = b"".join(parts)
    return body + hashlib.sha256(body).digest()


def decode_block(data: bytes, tokens: tuple[int, ...], layout: BlockLayout) -> list[torch.Tensor] | None:
    """The rows of a block's file, or None where it is not the block of ``tokens`` in ``layout``
    (torn, corrupted, another version, another block)."""
    if len(data) < len(MAGIC) + 4 + _DIGEST or not data.startswith(MAGIC):
        return None
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        return None
    (length,) = struct.unpack_from("<I", body, len(MAGIC))
    offset = len(MAGIC) + 4 + length
    try:
        header = json.loads(body[len(MAGIC) + 4 : offset])
        same = (tuple(header["tokens"]) == tokens and tuple(map(tuple, header["shapes"])) == layout.shapes
                and tuple(header["dtypes"]) == layout.dtypes)
    except (ValueError, KeyError, TypeError):
        return None
    if not same:
        return None
    rows = []
    payload = bytearray(body[offset:])
    start = 0
    for shape, dtype in zip(layout.shapes, layout.dtypes):
        dt = getattr(torch, dtype)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        if start + n > len(payload):
            return None
        rows.append(torch.frombuffer(payload, dtype=torch.uint8, offset=start, count=n).view(dt).reshape(shape))
        start += n
    return rows if start == len(payload) else None


def block_rows(kv_caches: list, block_id: int) -> list[torch.Tensor]:
    """A copy, on the CPU, of one block's rows in every layer's cache (a float cache's
    ``[2, block_size, nkv, hd]``, a split cache's coded ``[block_size, nkv, row bytes]``)."""
    return [_block_view(c, block_id).to("cpu", copy=True) for c in kv_caches]


def write_block_rows(kv_caches: list, block_id: int, rows: list[torch.Tensor]) -> None:
    """Put one block's rows (``block_rows``') in every layer's cache."""
    for cache, r in zip(kv_caches, rows, strict=True):
        _block_view(cache, block_id).copy_(r)


def caches_are_blocks(kv_caches: list) -> bool:
    """Whether every layer's cache is paged KV blocks in host memory (not a recurrent state, not on a
    GPU, where a step's copies would wait on the device) that this store can read."""
    def readable(c) -> bool:
        if isinstance(c, SplitKvCache):
            return c.data.device.type == "cpu"
        return isinstance(c, torch.Tensor) and c.dim() == 5 and c.shape[0] == 2 and c.device.type == "cpu"

    return all(map(readable, kv_caches))


def _block_view(cache, block_id: int) -> torch.Tensor:
    return cache.data[block_id] if isinstance(cache, SplitKvCache) else cache[:, block_id]


class DiskPrefixStore:
    """One model's block files under ``root / key``, at most ``limit_bytes`` of them (see the module)."""

    def __init__(self, root: Path, key: str, limit_bytes: int) -> None:
        self.dir = Path(root) / key
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()  # the index: the engine thread reads it, the writer changes it
        self._index: OrderedDict[str, int] = OrderedDict()  # hash hex -> file bytes, least recent first
        self._bytes = 0
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(_SUFFIX):
                stat = entry.stat()
                found.append((stat.st_mtime_ns, entry.name.removesuffix(_SUFFIX), stat.st_size))
            elif entry.name.endswith(".tmp"):  # a write that a crash cut short
                Path(entry.path).unlink(missing_ok=True)
        for _, name, size in sorted(found):
            self._index[name] = size
            self._bytes += size
        self.reads = self.writes = self.rejected = 0
        self._closed = False
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0  # (written by both threads under _lock)
        self._writer = threading.Thread(target=self._write_loop, name="prefix-store-writer", daemon=True)
        self._writer.start()

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def _path(self, name: str) -> Path:
        return self.dir / f"{name}{_SUFFIX}"

    def has(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash.hex() in self._index

    def read(self, block_hash: bytes, tokens: tuple[int, ...], layout: BlockLayout) -> list[torch.Tensor] | None:
        """The block's rows, checked; None where it is not on disk or fails a check (the file is then
        deleted: the block is computed again)."""
        name = block_hash.hex()
        try:
            data = self._path(name).read_bytes()
        except OSError:
            self._forget(name)
            return None
        rows = decode_block(data, tokens, layout)
        if rows is None:
            log.warning("prefix cache on disk: block %s failed its check; it is deleted and computed again", name)
            self.rejected += 1
            self._forget(name, delete=True)
            return None
        self.reads += 1
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
        with contextlib.suppress(OSError):
            os.utime(self._path(name))  # its recency survives a restart
        return rows

    def wants(self, block_hash: bytes) -> bool:
        """Whether a ``put`` of this block would keep it: not on disk yet, and the writer keeping up."""
        return self._queued_bytes < _QUEUED_BYTES and not self.has(block_hash)

    def put(self, block_hash: bytes, tokens: tuple[int, ...], rows: list[torch.Tensor]) -> None:
        """Keep a block (its rows copied by the caller: they are written later, on the writer thread);
        never blocks: with the writer more than ``_QUEUED_BYTES`` behind, the block is not kept."""
        if self._closed or not self.wants(block_hash):
            return
        size = sum(r.numel() * r.element_size() for r in rows)
        with self._lock:
            self._queued_bytes += size
        self._queue.put((block_hash.hex(), tokens, rows, size))

    def flush(self) -> None:
        """Wait until every block put so far is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer; later blocks are not kept."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()

    def _forget(self, name: str, delete: bool = False) -> None:
        with self._lock:
            self._bytes -= self._index.pop(name, 0)
        if delete:
            self._path(name).unlink(missing_ok=True)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                name, tokens, rows, size = item
                try:
                    self._write(name, tokens, rows)
                finally:
                    with self._lock:
                        self._queued_bytes -= size
            except Exception:  # noqa: BLE001 - a failed write costs a future hit, never the engine
                log.warning("prefix cache on disk: a block could not be written", exc_info=True)
            finally:
                self._queue.task_done()

    def _write(self, name: str, tokens: tuple[int, ...], rows: list[torch.Tensor]) -> None:
        data = encode_block(tokens, rows)
        if len(data) > self.limit_bytes:
            return
        path = self._path(name)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except OSError:  # a full disk: no torn file left behind
            tmp.unlink(missing_ok=True)
            raise
        self.writes += 1
        with self._lock:
            self._bytes += len(data) - self._index.pop(name, 0)
            self._index[name] = len(data)
            while self._bytes > self.limit_bytes and self._index:
                old, size = self._index.popitem(last=False)
                self._bytes -= size
                self._path(old).unlink(missing_ok=True)


class DiskPrefixTier:
    """The disk store beside one engine's memory prefix cache: ``restore`` a request's prompt blocks
    from disk before it is queued, ``persist`` the blocks the cache registered in a step."""

    def __init__(self, store: DiskPrefixStore, kv: KVCacheManager, kv_caches: list) -> None:
        self.store = store
        self.kv = kv
        self.kv_caches = kv_caches
        self.layout = BlockLayout.of(block_rows(kv_caches, 0))
        kv.registered = []  # the cache now records what it registers, for persist

    def restore(self, req: Request) -> int:
        """Put the request's prompt blocks that follow its in-memory prefix hit, and are on disk, in
        the memory cache, where the scheduler finds them; the number of blocks restored."""
        kv = self.kv
        usable = (req.num_tokens - 1) // kv.block_size  # (as get_computed_blocks: never the last token)
        if usable <= 0 or req.sampling_params.prompt_logprobs is not None:
            return 0
        first = len(kv.cached_prefix(req, usable))
        hashes = kv.block_hashes(req, usable)
        count = 0
        while first + count < usable and self.store.has(hashes[first + count]):
            count += 1
        blocks = kv.adopt_blocks(req, first, count) if count else []
        for i, block_id in enumerate(blocks):
            rows = self.store.read(hashes[first + i], kv.blocks[block_id].token_ids, self.layout)
            if rows is None:  # failed its check: it and what follows are computed again
                kv.drop_adopted(blocks[i:])
                return i
            write_block_rows(self.kv_caches, block_id, rows)
        return len(blocks)

    def persist(self) -> None:
        """Hand the blocks registered since the last call to the store's writer (their rows copied now)."""
        for block_id, block_hash, tokens in self.kv.take_registered():
            if self.store.wants(block_hash):
                self.store.put(block_hash, tokens, block_rows(self.kv_caches, block_id))


def open_disk_tier(config, model_path: Path, kv: KVCacheManager, kv_caches: list,
                   key_parts: tuple) -> DiskPrefixTier | None:
    """The engine's disk tier, where ``config.prefix_cache_disk`` asks for one and the model's caches are
    all KV blocks (a hybrid model's recurrent states are not kept); ``key_parts``: what besides the
    model file makes its KV values. None where there is none (or its directory cannot be made)."""
    if config.prefix_cache_disk <= 0 or not config.enable_prefix_caching or not caches_are_blocks(kv_caches):
        return None
    root = Path(config.prefix_cache_dir) if config.prefix_cache_dir else home_dir() / "prefix-cache"
    try:
        store = DiskPrefixStore(root, model_fingerprint(model_path, *key_parts), config.prefix_cache_disk)
    except OSError as exc:
        log.warning("prefix cache on disk: off (%s)", exc)
        return None
    return DiskPrefixTier(store, kv, kv_caches)
