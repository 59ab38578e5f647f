"""targets.tiny.keep_freed_buffers: freed big blocks are reused inside it, handed back to the OS outside.

The faults are counted in a new Python process: in a long-lived one (the test session, after
hundreds of tests' allocations) a free stretch of the heap can already hold a big block's pages, and
glibc serves the block from there, faulting nothing, whatever the thresholds say."""

import json
import subprocess
import sys

import pytest

from draftsmith.targets import tiny

pytestmark = pytest.mark.unit

CHILD = """
import json, resource
from draftsmith.targets import tiny

BIG = 64 << 20                 # above glibc's largest automatic mmap threshold (32 MiB)


def faults_of_a_big_buffer():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = bytearray(BIG)       # allocated, zero-filled, freed
    del buf
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


faults_of_a_big_buffer()
outside = faults_of_a_big_buffer()
with tiny.keep_freed_buffers():
    faults_of_a_big_buffer()
    inside = faults_of_a_big_buffer()
after = faults_of_a_big_buffer()
print(json.dumps({"pages": BIG // resource.getpagesize(), "outside": outside, "inside": inside, "after": after}))
"""


@pytest.mark.skipif(tiny._glibc() is None, reason="the C library is not glibc")
def test_a_freed_big_buffer_is_reused_inside_and_faulted_in_again_outside():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)
    assert f["outside"] > f["pages"] // 2, f   # glibc's defaults: mapped afresh every time
    assert f["inside"] < f["pages"] // 10, f   # the heap's block again, its pages already in
    assert f["after"] > f["pages"] // 2, f     # handed back again, the heap trimmed
