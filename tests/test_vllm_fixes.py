"""targets/vllm_fixes.py on a GPU platform: the CPU build's workarounds stay out of a CUDA engine.
vLLM's `current_platform` is replaced by one that says CUDA; nothing here needs a GPU."""

from __future__ import annotations

import types

import pytest

from draftsmith.targets import vllm_fixes

pytestmark = pytest.mark.unit


@pytest.fixture
def cuda_platform(monkeypatch):
    """vLLM's `current_platform` reads CUDA (a module attribute wins over vllm.platforms' lazy lookup)."""
    import vllm.platforms

    platform = types.SimpleNamespace(device_type="cuda", is_cpu=lambda: False, is_cuda=lambda: True)
    monkeypatch.setattr(vllm.platforms, "current_platform", platform, raising=False)
    return platform


def test_on_cuda_the_kernel_rebind_scan_is_left_alone_and_never_probed(cuda_platform, monkeypatch):
    from vllm.triton_utils import dispatcher

    def probe(scan):
        raise AssertionError("the probe walked the loaded modules on a CUDA platform")

    monkeypatch.setattr(vllm_fixes, "kernel_scan_trips", probe)
    before = getattr(dispatcher, "vars", None)
    assert vllm_fixes.fix_kernel_rebind_scan() is False
    assert getattr(dispatcher, "vars", None) is before


def test_on_cuda_no_cpu_build_fix_is_applied(cuda_platform, monkeypatch):
    """Every fix named for the CPU build returns without changing anything; only the log filter for
    the tokenizer-less warm-up (any platform) may be added."""
    monkeypatch.setattr(vllm_fixes, "kernel_scan_trips", lambda scan: True)  # as if the scan tripped here
    logged = []
    applied = vllm_fixes.apply_fixes(log=logged.append)
    assert set(applied) <= {"quiet_tokenizerless_warmup"}
    assert not any("CPU build" in line for line in logged)


def test_on_the_cpu_the_gate_lets_the_probe_decide(monkeypatch):
    """The real CPU platform: the fix reaches its probe (here told the scan trips) and replaces `vars`."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    assert current_platform.device_type == "cpu"
    monkeypatch.setattr(vllm_fixes, "kernel_scan_trips", lambda scan: True)
    monkeypatch.setattr(dispatcher, "vars", vars, raising=False)
    assert vllm_fixes.fix_kernel_rebind_scan() is True
    assert dispatcher.vars is vllm_fixes.instance_dict
