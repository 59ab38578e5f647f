"""Keep freed big buffers in the process's heap while a training loop runs on the CPU.

glibc gives every freed block above its mmap threshold (at most 32 MiB by default) back to the
operating system, and the next allocation of the same size faults each of its pages in again,
zeroed. A training step on the CPU allocates and frees its logits, their softmax and their gradients
every step: ~480 MB for the tiny target's build, whose steps spent about half their time in page
faults. Inside `keep_freed_buffers` those blocks come from the heap and are reused step after step;
on leaving, glibc's thresholds are set back to its defaults and the heap is trimmed. Where the C
library is not glibc (macOS, musl) it changes nothing. `bench/bench_target_build.py` measures it.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt's parameter numbers (malloc.h)
_DEFAULT = 128 * 1024                            # glibc's default for both
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
        libc.mallopt(_M_MMAP_THRESHOLD, _DEFAULT)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT)
        libc.malloc_trim(0)
