"""The node preflight's checks of what breaks multi-GPU PCIe nodes (`draftsmith.node_preflight`):
GPU health, the NCCL vLLM loads, IOMMU and ACS, decode-sized all-reduce latency, /dev/shm, and the
settings the failures call for. Each test fakes a node failing one check the way test_gpu_smoke.py
fakes torch: the node's tools (`tool_output`: nvidia-smi, dmesg, lspci), files (/proc/cmdline,
/sys/class/iommu) and the rank processes' record are what the test writes."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from draftsmith import node_preflight as npf

pytestmark = pytest.mark.unit

GPU_Q = """GPU 00000000:{bus}:00.0
    Product Name                          : NVIDIA RTX PRO 6000 Blackwell Server Edition
    Minor Number                          : {minor}
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 0
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 3
            DRAM Uncorrectable            : {dram}
        Aggregate
            SRAM Correctable              : 0
            DRAM Uncorrectable            : 7
    Retired Pages
        Single Bit ECC                    : N/A
        Pending Page Blacklist            : N/A
    Remapped Rows
        Correctable Error                 : 0
        Uncorrectable Error               : 0
        Pending                           : {pending}
        Remapping Failure Occurred        : No
    Processes{processes}
"""
PROCESS = """
        GPU instance ID                   : N/A
        Compute instance ID               : N/A
        Process ID                        : 4242
            Type                          : C
            Name                          : python3
            Used GPU Memory               : 81234 MiB"""


def smi_q(n=2, dram=(0, 0), pending=("No", "No"), processes=("", "")) -> str:
    head = "==============NVSMI LOG==============\n\nDriver Version                            : 580.95.05\n\n"
    return head + "".join(GPU_Q.format(bus=f"{0x41 + i:02X}", minor=i, dram=dram[i], pending=pending[i],
                                       processes=processes[i] or "                             : None")
                          for i in range(n))


@pytest.fixture
def tools(monkeypatch):
    """The node's tools as the test says: {name: (exit status or None, output)}."""
    said = {"nvidia-smi": (0, smi_q()), "dmesg": (0, "[    3.1] nvidia: loading out-of-tree module\n"),
            "lspci": (0, LSPCI.format(acs="SrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- "
                                          "DirectTrans-"))}
    monkeypatch.setattr(npf, "tool_output", lambda cmd, timeout_s=30.0: said[cmd[0]])
    return said


LSPCI = """00:00.0 Host bridge: Advanced Micro Devices, Inc. [AMD] Device 14a4 (rev 01)
\tSubsystem: ASRock Incorporation Device 14a4
40:01.1 PCI bridge: Advanced Micro Devices, Inc. [AMD] Device 14ab (rev 01) (prog-if 00 [Normal decode])
\tCapabilities: [2a0 v1] Access Control Services
\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-
\t\tACSCtl:\t{acs}
41:00.0 VGA compatible controller: NVIDIA Corporation Device 2bb5 (rev a1)
\tSubsystem: NVIDIA Corporation Device 204e
"""


def test_a_healthy_node_reads_ok(tools):
    [found] = npf.gpu_health_findings()
    assert found.status is npf.Status.OK
    assert found.line == ("2 GPU(s): no process on them, no uncorrectable ECC error, no reset pending; "
                          "no Xid in the kernel log")


def test_a_process_already_on_a_gpu_is_named_with_the_command_that_stops_it(tools):
    tools["nvidia-smi"] = (0, smi_q(processes=("", PROCESS)))
    [found] = npf.gpu_health_findings()
    assert found.status is npf.Status.FAILED
    assert found.line == ("PID 4242 (python3, 81234 MiB) on GPU 00000000:42:00.0: the GPUs are already in use; "
                          "stop it (`kill <PID>`, then `nvidia-smi` should list no process)")


def test_uncorrectable_ecc_errors_and_a_pending_row_remap_each_get_their_line(tools):
    tools["nvidia-smi"] = (0, smi_q(dram=(2, 0), pending=("No", "Yes")))
    ecc, pending = npf.gpu_health_findings()
    assert ecc.status is pending.status is npf.Status.FAILED
    # the volatile count (since the driver loaded), not the aggregate one
    assert ecc.line.startswith("ECC errors since the driver loaded (GPU 00000000:41:00.0: 2 uncorrectable)")
    assert "nvidia-smi -r -i <GPU>" in ecc.line and "CUDA_VISIBLE_DEVICES" in ecc.line
    assert pending.line.startswith("GPU 00000000:42:00.0: memory rows or pages wait for a reset")


def test_a_wedged_gpu_and_a_fatal_xid(tools):
    tools["nvidia-smi"] = (15, "Unable to determine the device handle for GPU0000:42:00.0: Unknown Error\n")
    [found] = npf.gpu_health_findings()
    assert found.status is npf.Status.FAILED
    assert found.line == ("nvidia-smi cannot read every GPU (Unable to determine the device handle for "
                          "GPU0000:42:00.0: Unknown Error): a GPU is wedged; stop what uses it, then "
                          "`nvidia-smi -r -i <GPU>`, or reboot the node")
    tools["nvidia-smi"] = (0, smi_q())
    tools["dmesg"] = (0, "[ 812.5] NVRM: Xid (PCI:0000:42:00): 13, pid=77, Graphics Exception\n"
                         "[ 901.2] NVRM: Xid (PCI:0000:42:00): 79, pid='<unknown>', GPU has fallen off the bus.\n")
    [found] = npf.gpu_health_findings()
    assert found.status is npf.Status.FAILED
    assert found.line == ("Xid 79 (GPU fell off the bus) on PCI:0000:42:00 in the kernel log since boot: "
                          "reboot the node before a long run (`dmesg | grep Xid`)")
    tools["dmesg"] = (0, "[ 812.5] NVRM: Xid (PCI:0000:42:00): 13, pid=77, Graphics Exception\n")
    assert npf.gpu_health_findings()[0].line.endswith("1 other Xid(s) in the kernel log")


def test_the_nccl_vllm_loads_must_be_torchs(monkeypatch):
    monkeypatch.setattr(npf, "torch_nccl_version", lambda: "2.27.7")
    loaded = {}

    def library(name):
        loaded["name"] = name
        if name == "/opt/nccl/libnccl.so":
            return "2.21.5"
        if name == "/nowhere/libnccl.so":
            raise OSError("/nowhere/libnccl.so: cannot open shared object file: No such file or directory")
        return "2.27.7"
    monkeypatch.setattr(npf, "library_nccl_version", library)
    monkeypatch.delenv("VLLM_NCCL_SO_PATH", raising=False)
    found = npf.nccl_finding()
    assert found.status is npf.Status.OK and found.line == "2.27.7, the same in torch and in vLLM's pynccl (libnccl.so.2)"
    found = npf.nccl_finding({"VLLM_NCCL_SO_PATH": "/opt/nccl/libnccl.so"})       # the run's engine_env
    assert found.status is npf.Status.FAILED
    assert found.line == ("torch has NCCL 2.27.7 but vLLM's pynccl loads 2.21.5 from /opt/nccl/libnccl.so: two "
                          "NCCLs in one engine; unset VLLM_NCCL_SO_PATH or point it at torch's libnccl.so.2 "
                          "(`pip show -f nvidia-nccl-cu13`)")
    monkeypatch.setenv("VLLM_NCCL_SO_PATH", "/nowhere/libnccl.so")
    found = npf.nccl_finding()
    assert found.status is npf.Status.FAILED and "cannot load /nowhere/libnccl.so" in found.line


def test_the_library_reader_reads_a_real_ncclgetversion(tmp_path):
    """`library_nccl_version` through ctypes, on a library that answers as NCCL 2.27.3 does."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    import subprocess

    src = tmp_path / "fake.c"
    src.write_text("int ncclGetVersion(int *v) { *v = 22703; return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "libfake.so"), str(src)], check=True)
    assert npf.library_nccl_version(str(tmp_path / "libfake.so")) == "2.27.3"


def iommu_files(tmp_path: Path, cmdline: str, active: bool) -> dict:
    (tmp_path / "cmdline").write_text(cmdline + "\n")
    iommu = tmp_path / "iommu"
    iommu.mkdir(exist_ok=True)
    if active:
        (iommu / "ivhd0").mkdir(exist_ok=True)
    return {"cmdline": tmp_path / "cmdline", "iommu_class": iommu}


def test_an_iommu_translating_gpu_traffic_and_acs_redirects_fail_with_the_kernel_and_bios_fix(tools, tmp_path):
    ok = npf.iommu_findings(8, {}, **iommu_files(tmp_path, "BOOT_IMAGE=/vmlinuz root=/dev/nvme0n1p2 iommu=pt", True))
    assert [f.status for f in ok] == [npf.Status.OK]
    assert ok[0].line == "no IOMMU translating GPU traffic, no PCIe bridge redirecting peer traffic"

    tools["lspci"] = (0, LSPCI.format(acs="SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- "
                                          "DirectTrans-"))
    iommu, acs = npf.iommu_findings(8, {}, **iommu_files(tmp_path, "BOOT_IMAGE=/vmlinuz amd_iommu=on", True))
    assert iommu.status is acs.status is npf.Status.FAILED
    assert iommu.line.startswith("the IOMMU is on and translates GPU traffic (kernel command line: amd_iommu=on): "
                                 "add iommu=pt to GRUB_CMDLINE_LINUX")
    assert "VT-d / AMD-Vi off in the BIOS" in iommu.line
    assert acs.line.startswith("PCIe ACS redirects peer traffic on 1 bridge(s) (40:01.1): turn ACS off in the "
                               "BIOS, or per bridge as root `setpci -s <bridge> ECAP_ACS+0x6.w=0000`")
    assert acs.line.endswith('until then set engine_env: {NCCL_P2P_DISABLE: "1"} and disable_custom_all_reduce: true')
    assert npf.suggested([iommu, acs]) == {"engine_env": {"NCCL_P2P_DISABLE": "1"}, "disable_custom_all_reduce": True}

    # the run already turns P2P off: said, not failed
    kept = npf.iommu_findings(8, {"NCCL_P2P_DISABLE": "1"}, **iommu_files(tmp_path, "amd_iommu=on", True))
    assert [f.status for f in kept] == [npf.Status.OK, npf.Status.OK]
    assert kept[1].line.endswith("NCCL_P2P_DISABLE=1 is set, so NCCL does not use P2P (slower, but safe)")
    assert npf.iommu_findings(1, {})[0].status is npf.Status.SKIPPED
    tools["lspci"] = (None, "lspci is not installed")
    (tmp_path / "off").mkdir()
    iommu, acs = npf.iommu_findings(8, {}, **iommu_files(tmp_path / "off", "quiet", False))
    assert (iommu.status, iommu.line) == (npf.Status.OK, "no IOMMU translating GPU traffic")
    assert (acs.status, acs.line) == (npf.Status.SKIPPED, "PCIe ACS unread: lspci is not installed "
                                                          "(apt-get install pciutils)")


def test_slow_decode_sized_all_reduces_fail_though_the_bandwidth_passes(monkeypatch):
    """256 MiB at PCIe speed, but 16 KiB taking 900 us: what the bandwidth alone does not show."""
    record = {"ranks": 8, "backend": "nccl", "mib": 256, "seconds": 0.02, "correct": True,
              "latency_s": {"16": 900e-6, "256": 1.1e-3, "2048": 2.5e-3}}
    monkeypatch.setattr(npf, "rank_command", lambda rank, world, backend, mib, out: [
        sys.executable, "-c", f"import json, pathlib\nif {rank} == 0: pathlib.Path({str(out)!r}, 'rank0.json')"
                              f".write_text({json.dumps(json.dumps(record))})"])
    bandwidth, latency = npf.all_reduce(8, timeout_s=120)
    assert bandwidth.status is npf.Status.OK and "bus bandwidth 23.5 GB/s" in bandwidth.line
    assert latency.status is npf.Status.FAILED
    assert latency.line.startswith("decode-sized all-reduces over 8 ranks: 16 KiB 900 us, 256 KiB 1,100 us, "
                                   "2 MiB 2,500 us; 16 KiB takes over 500 us, and decode does two a layer every "
                                   "step (61 layers: 110 ms a step): set engine_env: {NCCL_P2P_DISABLE: \"1\"}")
    record["latency_s"] = {"16": 40e-6, "256": 60e-6, "2048": 300e-6}
    monkeypatch.setattr(npf, "rank_command", lambda rank, world, backend, mib, out: [
        sys.executable, "-c", f"import json, pathlib\nif {rank} == 0: pathlib.Path({str(out)!r}, 'rank0.json')"
                              f".write_text({json.dumps(json.dumps(record))})"])
    assert npf.all_reduce(8, timeout_s=120)[1].line == ("decode-sized all-reduces over 8 ranks: 16 KiB 40 us, "
                                                        "256 KiB 60 us, 2 MiB 300 us")


def test_the_all_reduce_runs_in_the_runs_engine_env(monkeypatch):
    """The rank processes see engine_env: here a rank sums right only where NCCL_P2P_DISABLE=1."""
    script = ("import json, os, pathlib\nif {rank} == 0: pathlib.Path({out!r}, 'rank0.json').write_text(json.dumps("
              "dict(ranks=2, backend='nccl', mib=256, seconds=0.02, correct=os.environ.get('NCCL_P2P_DISABLE') == '1')))")
    monkeypatch.setattr(npf, "rank_command", lambda rank, world, backend, mib, out: [
        sys.executable, "-c", script.format(rank=rank, out=str(out))])
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    [found] = npf.all_reduce(2, timeout_s=120)
    assert found.status is npf.Status.FAILED and "returned wrong sums" in found.line
    found = npf.all_reduce(2, timeout_s=120, env={"NCCL_P2P_DISABLE": 1})[0]
    assert found.status is npf.Status.OK
    assert found.line.startswith("2-rank nccl all-reduce of 256 MiB (engine_env: NCCL_P2P_DISABLE=1): ")


def test_a_small_dev_shm_fails_with_the_remount_and_the_container_flag(tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=64 * 2**20))
    found = npf.shm_finding(tmp_path)
    assert found.status is npf.Status.FAILED
    assert found.line == (f"0.06 GiB free in {tmp_path}, under the 1 GiB NCCL needs once P2P is off: "
                          f"`mount -o remount,size=16g {tmp_path}` (a container: run it with --ipc=host or "
                          f"--shm-size=16g)")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=32 * 2**30))
    assert npf.shm_finding(tmp_path).line == f"32.00 GiB free in {tmp_path}"


def test_render_ends_with_the_settings_the_failures_call_for():
    findings = [npf.Finding("all-reduce", npf.Status.FAILED, "hung", settings=npf.P2P_OFF),
                npf.Finding("IOMMU, ACS", npf.Status.FAILED, "acs", settings={
                    "engine_env": {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"},
                    "disable_custom_all_reduce": True}),
                npf.Finding("disk", npf.Status.OK, "fine", settings={"kv_cache_dtype": "fp8"})]  # ok: not suggested
    lines = npf.render(findings)
    assert lines[-3:] == ["  the params file's settings for the failures above (stages 04 and 06 pass them to "
                          "every engine; run the preflight again with them):",
                          '    engine_env: {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"}',
                          "    disable_custom_all_reduce: true"]
