"""heap.keep_freed_buffers: freed big blocks are reused inside it, handed back to the OS outside."""

import resource

import pytest

from draftsmith import heap

BIG = 64 << 20                 # above glibc's largest automatic mmap threshold (32 MiB)
PAGES = BIG // resource.getpagesize()


def _faults_of_a_big_buffer() -> int:
    """Minor page faults of allocating, zero-filling and freeing one BIG buffer."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = bytearray(BIG)
    del buf
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(heap._glibc() is None, reason="the C library is not glibc")
def test_a_freed_big_buffer_is_reused_inside_and_faulted_in_again_outside():
    _faults_of_a_big_buffer()
    assert _faults_of_a_big_buffer() > PAGES // 2          # glibc's defaults: mapped afresh every time
    with heap.keep_freed_buffers():
        _faults_of_a_big_buffer()
        assert _faults_of_a_big_buffer() < PAGES // 10      # the heap's block again, its pages already in
    assert _faults_of_a_big_buffer() > PAGES // 2          # handed back again, the heap trimmed
