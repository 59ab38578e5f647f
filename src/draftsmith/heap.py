"""Keep freed big buffers in the process's heap while a training loop runs on the CPU.

glibc gives every freed block above its mmap threshold (at most 32 MiB by default) back to the
operating system, and the next allocation of the same size faults each of its pages in again,
zeroed. A training step on the CPU allocates and frees its logits, their softmax and their gradients
every step: ~480 MB for the tiny target's build, about a fifth of its step's time in page faults.
Inside `keep_freed_buffers` those blocks come from the heap and are reused step after step. On
leaving, the heap is trimmed and the thresholds are those glibc's own adjustment reaches once a
process has freed a big block (32 MiB, and twice that for trimming): setting a threshold turns that
adjustment off for good, so this is the state a long-running torch process is in anyway. Where the
C library is not glibc (macOS, musl) it changes nothing. `bench/bench_target_build.py` measures it.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt's parameter numbers (malloc.h)
_MMAP_MAX = 32 << 20                             # glibc's DEFAULT_MMAP_THRESHOLD_MAX (64-bit)
_NEVER = 2**31 - 1                               # mallopt takes an int


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


@contextmanager
def keep_freed_buffers():
    """Within: freed blocks of any size stay in the heap for the next allocation (glibc)."""
    libc = _glibc()
    if libc is None:
        yield
        return
    try:
        libc.mallopt(_M_MMAP_THRESHOLD, _NEVER)
        libc.mallopt(_M_TRIM_THRESHOLD, _NEVER)
        yield
    finally:
        libc.malloc_trim(0)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_MAX)
