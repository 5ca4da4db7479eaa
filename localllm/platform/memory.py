"""Memory for the repacked weights: handing back a weight's mapped file pages and the heap after
a repack, and holding the repacked bytes in huge pages.

The repacked copy of a weight should replace its file pages in the resident set rather than add
to them: :func:`release_file_pages` drops the pages of a read-only file mapping (they fault back
in from the page cache or the file if read again), and :func:`trim_heap` returns the repack's
freed temporaries to the OS. :func:`huge_page_buffer` gives memory that the kernel backs with 2
MiB pages. All are no-ops (or plain allocations) where the platform has no such calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Iterator

import torch

_MADV_DONTNEED = 4
_LIBC: ctypes.CDLL | None | bool = False


def _libc() -> ctypes.CDLL | None:
    global _LIBC
    if _LIBC is False:
        try:
            _LIBC = ctypes.CDLL(None, use_errno=True)
            _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = None
    return _LIBC


def trim_heap() -> None:
    """Hand the repack's freed temporaries back to the OS (glibc keeps them otherwise: about
    70 MiB of resident memory for SmolLM2-135M; this costs 0.1 s over the whole model)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


MMAP_THRESHOLD_BYTES = 64 << 20
TOP_PAD_BYTES = 128 << 20
_M_TOP_PAD, _M_MMAP_THRESHOLD = -2, -3  # glibc's mallopt parameters


class _HeapState:
    """glibc's heap settings are the process's: the top pad ``fix_heap_policy`` set (``None``: it did
    not), and the ``heap_handed_back`` blocks open now."""

    top_pad: int | None = None
    open_blocks = 0
    lock = threading.Lock()


def fix_heap_policy(threshold: int = MMAP_THRESHOLD_BYTES, top_pad: int = TOP_PAD_BYTES) -> bool:
    """One heap policy for the process (glibc): allocations of ``threshold`` bytes and more get their
    own mappings, always; smaller ones come from the heap, which keeps ``top_pad`` bytes of freed
    memory at its top for the next allocations instead of handing them back at once.

    A prefill's transients (a 512-token prompt through a 1B model: the fused gate/up output alone is
    32 MiB) are allocated and freed layer after layer. With glibc's own policy (an mmap threshold
    that rises with what is freed, up to 32 MiB, and a heap top trimmed above twice that) each of
    them came from fresh pages: 200-240 thousand page faults (0.6 s of system time) per 512-token
    prompt through the 1B-shaped Q4_0 file, prefill 207-215 tok/s; with this policy none after the
    first prompt, 244-258 tok/s, and the same resident memory after it (1255 against 1274 MiB).
    The threshold stays fixed (glibc would raise it as mapped blocks are freed, after which a
    reloaded model's largest tensors came from the heap, where fragmentation kept tens of MiB
    resident after the next unload); what an unloaded model leaves on the heap goes back through
    :func:`trim_heap`. False where there is no glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    done = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)) and libc.mallopt(_M_TOP_PAD, int(top_pad)))
    if done:
        _HeapState.top_pad = int(top_pad)
    return done


@contextlib.contextmanager
def heap_handed_back() -> Iterator[None]:
    """Memory freed inside the block goes back to the OS whole, whichever thread's heap it came from.

    The heap policy's top pad keeps freed memory at the top of every heap, and ``malloc_trim`` only
    trims the main heap's top: a model loaded on a worker thread has its tensors (those under the
    mmap threshold) in that thread's arena, a heap of up to 64 MiB that the pad (128 MiB) never lets
    shrink. Loading and unloading SmolLM2 twice kept 47 MiB after the first unload and, in one run
    of eight (the second load on another worker thread, another arena), 62 MiB more after the
    second; inside this block the pad is zero, so each large free shrinks its own heap at once (16
    runs of 16: 0 MiB kept). On leaving the last block open: ``malloc_trim``, and the pad restored.
    Blocks may overlap on several threads. glibc's setting is the process's: another model's prompt
    running meanwhile hands its freed transients back too, and faults them in again, for that moment."""
    libc = _libc()
    with _HeapState.lock:
        _HeapState.open_blocks += 1
        if _HeapState.open_blocks == 1 and _HeapState.top_pad is not None:
            libc.mallopt(_M_TOP_PAD, 0)  # (a pad was set: libc has mallopt)
    try:
        yield
    finally:
        trim_heap()
        with _HeapState.lock:
            _HeapState.open_blocks -= 1
            if _HeapState.open_blocks == 0 and _HeapState.top_pad is not None:
                libc.mallopt(_M_TOP_PAD, _HeapState.top_pad)


HUGE_PAGE_BYTES = 2 << 20  # x86-64's transparent huge page


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed uint8 memory in a private anonymous mapping of its own, starting on a 2
    MiB boundary, the whole 2 MiB pages it spans advised for transparent huge pages (``MADV_HUGEPAGE``:
    the kernel backs them with huge pages as they are first written, where its ``enabled`` setting is
    ``always`` or ``madvise``, the common defaults).

    A decode step reads every weight once: with 4 KiB pages each 4 KiB of it needs a page walk (a
    1B model's 0.7 GB is 170 thousand pages; the second-level TLB of a Zen 4 holds 3072).
    Here, 2 threads reading 2 GiB: 54.6-57.1 GB/s from 4 KiB pages, 64.4-66.6 GB/s from huge pages.
    The last partial 2 MiB keeps small pages and the alignment's slack is never touched, so the
    resident set grows by ``nbytes``. The memory goes back to the OS when the last view of it is
    freed. Where the platform has no ``MADV_HUGEPAGE`` (not Linux): ``torch.empty``."""
    if nbytes <= 0 or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(max(nbytes, 0), dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # (keeps the mapping alive while any view is)
    skip = -whole.data_ptr() % HUGE_PAGE_BYTES  # (a multiple of the small page: mappings start on one)
    huge = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if huge:
        with contextlib.suppress(OSError):  # (a kernel without transparent huge pages: small pages)
            region.madvise(mmap.MADV_HUGEPAGE, skip, huge)
    return whole[skip:skip + nbytes]


def _mapping_of(address: int) -> tuple[int, int, str, str] | None:
    """``(start, end, perms, path)`` of the mapping holding ``address``, from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                if lo <= address < hi:
                    path = parts[5].strip() if len(parts) > 5 else ""
                    return lo, hi, parts[1], path
    except OSError:
        return None
    return None


def release_file_pages(raw: torch.Tensor) -> bool:
    """Tell the kernel this process no longer needs the pages of ``raw`` resident.

    Only for a read-only mapping of a regular file (the memory-mapped GGUF): there, a later
    read (say the reference path, or an embedding lookup) faults the pages back in from the
    page cache or the file, so nothing is lost. Anything else (anonymous or writable memory,
    where MADV_DONTNEED would discard data) is left alone. Returns whether pages were dropped.
    """
    if not raw.is_cpu or raw.numel() == 0:
        return False
    return release_file_range(raw.data_ptr(), raw.numel() * raw.element_size())


def release_file_range(start: int, nbytes: int) -> bool:
    """:func:`release_file_pages` for the bytes ``[start, start + nbytes)`` of this process."""
    if nbytes <= 0 or not hasattr(os, "sysconf"):
        return False
    end = start + nbytes
    mapping = _mapping_of(start)
    if mapping is None:
        return False
    _, hi, perms, path = mapping
    if "w" in perms or not path.startswith("/") or end > hi:
        return False
    page = mmap.PAGESIZE
    first = (start + page - 1) // page * page  # whole pages only: neighbours keep theirs
    last = end // page * page
    if last <= first:
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise"):
        return False
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) == 0


def free_memory(device: str = "cpu") -> int:
    """Bytes a new model may use now: the kernel's ``MemAvailable`` (psutil elsewhere), or the free
    memory of a CUDA device."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)
