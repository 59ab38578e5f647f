"""Each GPU requirements file is one whole, pinned environment that pip can resolve, checked without a GPU.

requirements/gpu-vllm.txt (`make gpu-venv`) and requirements/gpu-sglang.txt (`make sglang-venv`)
are installed on GPU machines only, so nothing else on CI would notice when they stop resolving
(vLLM and SGLang pin different torch releases: one file holding both never could). Here pip's
resolver works each one out as on a clean machine: `--dry-run --ignore-installed`, the public
index, no pip configuration files (a machine's own may cap torch or add local wheels). Nothing is
installed and no wheel is fetched whole: pip reads each wheel's metadata alone (PEP 658 where the
index serves it, else HTTP range requests: pip's `fast-deps`), so the CUDA wheels (torch's alone
is 0.5 GB) stay where they are. The resolve is skipped only when the package index cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.network_resolver

ROOT = Path(__file__).resolve().parents[1]
COMMON = "requirements/common.txt"
GPU_FILES = sorted(f"requirements/{p.name}" for p in (ROOT / "requirements").glob("gpu*.txt"))
# what reaches the index (a mirror, a proxy, a certificate); every other PIP_* setting is dropped
PIP_NETWORK_SETTINGS = {"PIP_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_TRUSTED_HOST", "PIP_PROXY",
                        "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES"}
WHOLE_DOWNLOAD_LIMIT_MB = 20.0   # larger files must be read by their metadata alone
READ_LIMIT_BYTES = 500 * 2**20   # all pip reads, network and files: ~130 MB measured; one CUDA torch wheel is 526 MB
# pip in a child process that reports, on its last stderr line, the bytes it read (Linux: /proc/self/io)
MEASURED_PIP = """
import os, runpy, sys
sys.argv = ["pip", *sys.argv[1:]]
try:
    runpy.run_module("pip", run_name="__main__", alter_sys=True)
finally:
    if os.path.exists("/proc/self/io"):
        io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines() if ": " in line)
        print(f"pip read {io['rchar']} bytes", file=sys.stderr)
"""


def requirement_lines(name: str) -> list[str]:
    """The requirement lines of one requirements file, comments and blank lines left out."""
    lines = (line.split("#", 1)[0].strip() for line in (ROOT / name).read_text().splitlines())
    return [line for line in lines if line]


def project_name(requirement: str) -> str:
    return re.split(r"[\[=<>!~;@ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def clean_pip_env() -> dict[str, str]:
    """This environment as pip on a clean machine sees it: no configuration files, no PIP_* settings
    but those that reach the index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in PIP_NETWORK_SETTINGS}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def index_unreachable() -> str | None:
    """Why the package index cannot be reached, or None when it answers (any HTTP status counts)."""
    context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    try:
        urllib.request.urlopen(f"{index_url()}/pip/", timeout=20, context=context).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as e:
        return f"{type(e).__name__}: {getattr(e, 'reason', e)}"
    return None


def resolve(requirements: Path, report: Path) -> dict:
    """pip's resolver on one requirements file, nothing installed; returns its exit code, output,
    seconds, bytes read, the files it downloaded whole (name, MB) and its install report."""
    cmd = [sys.executable, "-c", MEASURED_PIP, "install", "--dry-run", "--ignore-installed", "--no-cache-dir",
           "--use-feature=fast-deps", "--progress-bar", "off", "--report", str(report), "-r", str(requirements)]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=clean_pip_env(), capture_output=True, text=True, timeout=540)
    output = done.stdout + done.stderr
    read = re.findall(r"^pip read (\d+) bytes$", done.stderr, re.M)
    scale = {"kB": 1e-3, "MB": 1.0, "GB": 1e3}
    whole = [(name, float(size) * scale[unit])
             for name, size, unit in re.findall(r"Downloading (\S+) \(([\d.]+) (kB|MB|GB)\)", output)]
    return {"rc": done.returncode, "output": output, "seconds": time.monotonic() - start,
            "bytes_read": int(read[-1]) if read else None, "whole_downloads": whole,
            "install": json.loads(report.read_text())["install"] if done.returncode == 0 else []}


def test_there_is_one_gpu_environment_per_engine():
    assert GPU_FILES == ["requirements/gpu-sglang.txt", "requirements/gpu-vllm.txt"], (
        f"GPU requirements files: {GPU_FILES}; each engine has its own environment (docs/design/gpu.md)")


@pytest.mark.parametrize("name", ["requirements.txt", *GPU_FILES])
def test_every_environment_is_the_common_file_plus_its_own_exact_pins(name):
    lines = requirement_lines(name)
    include = os.path.relpath(ROOT / COMMON, (ROOT / name).parent)   # pip reads -r relative to the file
    assert lines[0] == f"-r {include}", f"{name} must start from the project's own requirements: -r {include}"
    loose = [line for line in lines[1:] if line.startswith("-") or not re.fullmatch(r"[\w.\-\[\],]+==[\w.+!]+", line)]
    assert not loose, f"{name}: every requirement is pinned with == (one environment, the same on every machine): {loose}"
    common = {project_name(line) for line in requirement_lines(COMMON)}
    again = sorted(common & {project_name(line) for line in lines[1:]})
    assert not again, f"{name} pins {again} again: they are pinned once, in {COMMON}"


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory) -> dict[str, dict]:
    """Every GPU file resolved, side by side (the time is the index's answers, not CPU)."""
    why = index_unreachable()
    if why:
        pytest.skip(f"package index {index_url()} unreachable ({why}): {', '.join(GPU_FILES)} not resolved")
    out = tmp_path_factory.mktemp("gpu-resolve")
    with ThreadPoolExecutor(len(GPU_FILES)) as pool:
        return dict(zip(GPU_FILES, pool.map(lambda n: resolve(ROOT / n, out / f"{Path(n).name}.report.json"), GPU_FILES)))


@pytest.mark.parametrize("name", GPU_FILES)
def test_gpu_environment_resolves_to_cuda_builds_without_downloading_them(name, resolutions):
    r = resolutions[name]
    tail = "\n".join(r["output"].strip().splitlines()[-25:])
    assert r["rc"] == 0, f"pip cannot resolve {name} (exit {r['rc']}, {r['seconds']:.0f} s):\n{tail}"
    big = [(f, mb) for f, mb in r["whole_downloads"] if mb >= WHOLE_DOWNLOAD_LIMIT_MB]
    assert not big, f"pip downloaded whole wheels instead of reading their metadata: {big}"
    if r["bytes_read"] is not None:
        assert r["bytes_read"] < READ_LIMIT_BYTES, f"pip read {r['bytes_read'] / 2**20:.0f} MiB resolving {name}"
    versions = {project_name(i["metadata"]["name"]): i["metadata"]["version"] for i in r["install"]}
    assert "+" not in versions["torch"], f"{name} resolved torch {versions['torch']}, not PyPI's CUDA build"
    assert any(n.startswith("nvidia-") for n in versions), f"{name} resolved no CUDA libraries: {sorted(versions)}"
    read = f"{r['bytes_read'] / 2**20:.0f} MiB read" if r["bytes_read"] is not None else "bytes not measured"
    print(f"{name}: {len(versions)} packages resolved in {r['seconds']:.0f} s, {read}, "
          f"{len(r['whole_downloads'])} files under {WHOLE_DOWNLOAD_LIMIT_MB:g} MB fetched whole; torch {versions['torch']}")
