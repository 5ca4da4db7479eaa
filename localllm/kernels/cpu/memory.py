"""Handing memory back: a repacked weight's mapped file pages, and the heap after a repack.

The repacked copy of a weight should replace its file pages in the resident set rather than add
to them: :func:`release_file_pages` drops the pages of a read-only file mapping (they fault back
in from the page cache or the file if read again), and :func:`trim_heap` returns the repack's
freed temporaries to the OS. Both are no-ops where the platform has no such calls.
"""

from __future__ import annotations

import ctypes
import mmap
import os

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


MMAP_THRESHOLD_BYTES = 16 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve allocations of ``threshold`` bytes and more with their own mappings, always (glibc).

    glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), so after the
    first unload a reloaded model's large tensors come from the heap, where fragmentation keeps tens
    of MiB resident after the next unload (measured: RSS after unloading SmolLM2 drifted by 30-100 MiB
    from cycle to cycle; with the threshold fixed at 16 MiB it comes back to within 2 MiB every time).
    Only allocations this large pay a fresh mapping (large prompt chunks of big models). False where
    there is no glibc."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))


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
