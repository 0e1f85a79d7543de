"""The daemon's one malloc setting: blocks of 128 KiB and more are mmapped and go back to
the kernel when freed.

glibc starts with that threshold and then raises it to the largest mmapped block freed so
far (up to 32 MiB). After the first large scrape body, history query or page JSON is
freed, every later one is carved from the heap instead, and the heap's top stays in the
RSS for the daemon's life: 0.3 MiB at 4 GPUs and 0.6 MiB at 32 after the first scrapes
(bench/memory.py, issue 15). Fixing the threshold keeps glibc from moving it (and its
trim threshold with it)."""
from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc malloc.h
LARGE_BLOCK = 128 * 1024  # glibc's own starting threshold


def return_large_blocks() -> bool:
    """Fix the mmap threshold at LARGE_BLOCK. False where the C library does not take it
    (musl's mallopt does nothing and says so): nothing else changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK) == 1
