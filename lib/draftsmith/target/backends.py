"""The target behind one seam, for stage 04: `hf` (transformers in this process: the reference, for
tiny targets and cross-checks) and `vllm` (the serving engine users run, in a child process).

Both capture the same features of a batch of samples: the outputs of the three auxiliary layers
side by side (`aux` [T, 3H], output-convention ids, see `draftsmith.layers`) and the final hidden
state after the final norm (`last` [T, H]), sample after sample, on the host. `open_capture` gives
either; calling it on a batch returns (aux, last); `close()` frees it.
"""

from __future__ import annotations

from .checkpoint import load_target
from .hf import Capture
from .vllm import VllmCapture

BACKENDS = ("hf", "vllm")


def open_capture(backend: str, target, output_ids: list[int], *, device: str = "auto", log=print,
                 **vllm_options):
    """A capture of `output_ids` on `target` through `backend` (`hf` or `vllm`)."""
    if backend == "hf":
        return Capture(load_target(target, device, vllm_options.get("trust_remote_code", False)), output_ids)
    if backend == "vllm":
        return VllmCapture(target, output_ids, log=log, **vllm_options)
    raise ValueError(f"target_backend must be one of {BACKENDS}, got {backend!r}")
