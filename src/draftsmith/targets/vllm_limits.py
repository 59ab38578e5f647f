"""What vLLM's CPU build cannot run, told from vLLM's own error when an engine starts.

Not our bugs, and not worked around: the engine cannot do it on a CPU, a GPU build can. Where an
engine start fails with one of these on the CPU build, the stage records one line, `GPU-only:
<vLLM's error line>` (stage 04 in its index, stage 06 in its report) instead of failing with a
traceback. Any other error, and any error on a GPU, stays a failure.
"""

from __future__ import annotations

# (exception type name, start of vLLM 0.32.0's message)
CPU_BUILD_LIMITS = (
    # INT4 compressed-tensors MoE (Kimi-K2.5's routed experts): CPU kernels need AMX or zentorch
    ("NotImplementedError", "No WNA16 MoE backend supports the deployment configuration"),
    # EAGLE-3 with a Llama-style drafter over an MLA target: CPU MLA pages by 16, CPU attention by 32
    ("ValueError", "No common block size for"),
)


class GpuOnly(RuntimeError):
    """An engine that cannot start on vLLM's CPU build; `line` is what the stage records."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


def error_line(exc: BaseException) -> str:
    """vLLM's error as one line: `Type: first line of the message`."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def gpu_only_line(exc: BaseException, device_type: str | None = None) -> str | None:
    """`GPU-only: <vLLM's error line>` when `exc`, raised by an engine start on vLLM's CPU build
    (`device_type`, default the running platform's), is one of `CPU_BUILD_LIMITS`; else None."""
    if device_type is None:
        from vllm.platforms import current_platform

        device_type = current_platform.device_type
    if device_type != "cpu":
        return None
    seen = set()
    while exc is not None and id(exc) not in seen:  # vLLM may re-raise it wrapped: look at the causes
        seen.add(id(exc))
        message = str(exc).strip()
        for name, start in CPU_BUILD_LIMITS:
            if type(exc).__name__ == name and message.startswith(start):
                return f"GPU-only: {error_line(exc)}"
        exc = exc.__cause__ or exc.__context__
    return None
