"""vLLM on the Kimi kind of target: the CPU build's bugs worked around (each fix probes first), and
what the CPU build cannot run recorded as one GPU-only line with vLLM's own error.

The probe and fix tests run vLLM's real code in this process (no engine). The engine tests start
vLLM on the built-in `kimi-mini` targets (a minute or two per engine on 2 cores).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.targets import vllm_fixes
from draftsmith.targets.vllm_capture import gpu_only_line

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
IM_END = 163586
WNA16 = "No WNA16 MoE backend supports the deployment configuration."
BLOCKS = "No common block size for 128 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])."


# ---- the fixes: each finds its bug, fixes it, and leaves a bug-free vLLM alone ---------------------

@pytest.fixture
def dispatcher(monkeypatch):
    """vLLM's kernel dispatcher as shipped (the builtin `vars`), whatever a fix sets restored after the test."""
    from vllm.triton_utils import dispatcher

    monkeypatch.setattr(dispatcher, "vars", vars, raising=False)
    return dispatcher


def test_the_kernel_rebind_scan_trips_over_llvmlite_until_fixed(dispatcher):
    import numba  # noqa: F401  (loads llvmlite, as the ngram proposer and Kimi's image processor do)

    assert vllm_fixes.kernel_scan_trips(dispatcher._rebind_kernels)
    with pytest.raises(AttributeError, match="'_lib_fn_wrapper' object has no attribute 'get'"):
        dispatcher._rebind_kernels([])                      # the bug, as vLLM 0.32.0's CPU build has it
    assert vllm_fixes.fix_kernel_rebind_scan() is True
    dispatcher._rebind_kernels([])                          # numba still loaded: the scan passes
    assert not vllm_fixes.kernel_scan_trips(dispatcher._rebind_kernels)
    assert vllm_fixes.fix_kernel_rebind_scan() is False     # nothing left to fix: nothing done
    assert vllm_fixes.PROBE_MODULE not in sys.modules


def test_the_fixed_scan_still_rebinds_every_reference_to_a_kernel(dispatcher, monkeypatch):
    import types

    vllm_fixes.fix_kernel_rebind_scan()

    def kernel():
        pass

    def wrapper():
        pass

    class Launcher:  # a class holding the kernel (its namespace is a read-only mapping, not a dict)
        pass

    Launcher.kernel = kernel
    owner = types.SimpleNamespace(kernel=kernel)
    module = types.ModuleType("_test_kernel_holder")
    module.copied, module.owner, module.Launcher = kernel, owner, Launcher
    module.lib = vllm_fixes.DictlessLibrary()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    dispatcher._rebind_kernels([(kernel, wrapper)])
    assert module.copied is wrapper and owner.kernel is wrapper and Launcher.kernel is wrapper


def test_a_scan_without_the_bug_is_left_alone():
    assert not vllm_fixes.kernel_scan_trips(lambda overrides: None)


def test_the_expand_kernel_fix_replaces_only_a_stand_in_that_loses_floats(monkeypatch):
    from vllm.utils import cpu_triton_utils

    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", cpu_triton_utils._expand_kernel_impl)
    assert vllm_fixes.fix_cpu_expand_kernel() is True         # vLLM 0.32.0's CPU build: the bug is there
    assert cpu_triton_utils._expand_kernel_impl is vllm_fixes.expand_to_tokens
    assert vllm_fixes.fix_cpu_expand_kernel() is False        # a correct stand-in is kept
    out = torch.full((5,), -1.0)
    cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.5, 2.0]), torch.tensor([3, 5], dtype=torch.int32), 0, 1)
    assert out.tolist() == [0.5, 0.5, 0.5, 2.0, 2.0]


@pytest.fixture
def platform(monkeypatch):
    """vLLM's platform class, its backend choice restored after the test."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    monkeypatch.setattr(cls, "get_attn_backend_cls", cls.__dict__["get_attn_backend_cls"])
    return cls


def test_an_mla_target_gets_a_backend_that_runs_its_dtype(platform):
    """On a CPU with AMX vLLM 0.32.0 picks its bfloat16-only AMX MLA backend at float32 too (stage
    06's dtype on a CPU); without AMX it picks the reference backend, and the probe finds no bug."""
    def backend(dtype):
        return vllm_fixes.mla_backend_for(dtype, platform.get_attn_backend_cls)

    bf16_before = backend(torch.bfloat16)
    broken = torch.float32 not in backend(torch.float32).supported_dtypes
    assert vllm_fixes.fix_cpu_mla_backend_dtype() is broken
    for dtype in (torch.float32, torch.bfloat16):
        assert dtype in backend(dtype).supported_dtypes
    assert backend(torch.bfloat16) is bf16_before
    assert vllm_fixes.fix_cpu_mla_backend_dtype() is False


def test_the_rank_count_is_counted_uncompiled_on_a_cpu_with_the_same_ranks(monkeypatch):
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    monkeypatch.setattr(logprobs, "batched_count_greater_than", logprobs.batched_count_greater_than)
    monkeypatch.setattr(sampler, "batched_count_greater_than", sampler.batched_count_greater_than)
    compiled = logprobs.batched_count_greater_than
    assert hasattr(compiled, "_torchdynamo_orig_callable")       # vLLM 0.32.0 as shipped: compiled
    assert vllm_fixes.fix_cpu_rank_count_compile() is True
    assert sampler.batched_count_greater_than is logprobs.batched_count_greater_than is compiled._torchdynamo_orig_callable
    x, v = torch.tensor([[0.1, 0.5, 0.3], [0.9, 0.2, 0.4]]), torch.tensor([[0.3], [0.4]])
    assert sampler.batched_count_greater_than(x, v).tolist() == [2, 2]
    assert vllm_fixes.fix_cpu_rank_count_compile() is False      # nothing left to fix: nothing done


def test_a_dflash_drafters_context_keys_are_normed_with_each_layers_own_weight(monkeypatch):
    """vLLM 0.32.0's CPU rms_norm reads only the first row of a stacked [L, d] weight: a DFlash
    drafter's context keys of every layer got layer 1's k_norm (found by stage 06's step-by-step
    comparison with our decoder, tests/test_eval_vllm.py)."""
    from types import SimpleNamespace

    from vllm.model_executor.models import qwen3_dflash

    monkeypatch.setattr(qwen3_dflash.DFlashQwen3Model, "_normalize_context_k",
                        qwen3_dflash.DFlashQwen3Model._normalize_context_k)
    assert vllm_fixes.grouped_rms_norm_is_wrong()                 # vLLM 0.32.0's CPU build as shipped
    assert vllm_fixes.fix_cpu_dflash_context_k_norm() is True
    keys = torch.randn(3, 5, 2, 32)                               # [layers, context tokens, kv heads, head dim]
    weights = torch.rand(3, 32) + 0.5
    got = qwen3_dflash.DFlashQwen3Model._normalize_context_k(
        SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=1e-6), keys)
    want = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6) * weights[:, None, None, :]
    assert torch.allclose(got, want, atol=1e-4)
    assert vllm_fixes.fix_cpu_dflash_context_k_norm() is False   # nothing left to fix: nothing done


def test_apply_fixes_names_and_logs_what_it_fixed(dispatcher, platform, monkeypatch):
    from vllm.utils import cpu_triton_utils

    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", cpu_triton_utils._expand_kernel_impl)
    said = []
    applied = vllm_fixes.apply_fixes(said.append)
    assert applied[:2] == ["fix_kernel_rebind_scan", "fix_cpu_expand_kernel"]   # bugs every CPU build has
    assert set(applied) <= {fix.__name__ for fix, _ in vllm_fixes.FIXES}
    assert len(said) == len(applied) and all("vLLM 0.32.0" in line for line in said)
    assert vllm_fixes.apply_fixes(said.append) == [] and len(said) == len(applied)


def test_an_engine_without_a_tokenizer_drops_only_vllms_warning_that_its_warmup_could_not_render(monkeypatch):
    """Stage 04's and 06's engines start with `skip_tokenizer_init`; vLLM's warm-up still renders a
    chat message and warns, with a traceback, at every start. That warning alone is dropped."""
    import logging

    from vllm.renderers.base import BaseRenderer

    logger = logging.getLogger("vllm.renderers.base")
    monkeypatch.setattr(logger, "filters", [])          # as shipped; restored afterwards
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(f"{record.getMessage()}: {record.exc_info[1]!r}")
    logger.addHandler(handler)
    try:
        assert vllm_fixes.quiet_tokenizerless_warmup() is True
        assert vllm_fixes.quiet_tokenizerless_warmup() is False
        for fail in (lambda: BaseRenderer.get_tokenizer(type("NoTokenizer", (), {"tokenizer": None})()),
                     lambda: {}["chat_template"]):
            try:
                fail()
            except Exception:
                logger.warning("Chat template warmup failed", exc_info=True)
    finally:
        logger.removeHandler(handler)
    assert seen == ["Chat template warmup failed: KeyError('chat_template')"]


# ---- what the CPU build cannot run: one line, vLLM's own ---------------------------------------------

def test_a_cpu_build_limit_is_one_gpu_only_line_with_vllms_error():
    assert gpu_only_line(NotImplementedError(WNA16), "cpu") == f"GPU-only: NotImplementedError: {WNA16}"
    assert gpu_only_line(ValueError(BLOCKS), "cpu") == f"GPU-only: ValueError: {BLOCKS}"
    try:  # re-raised by vLLM around the original
        try:
            raise ValueError(BLOCKS)
        except ValueError as e:
            raise RuntimeError("Engine core initialization failed. See root cause above.") from e
    except RuntimeError as wrapped:
        assert gpu_only_line(wrapped, "cpu") == f"GPU-only: ValueError: {BLOCKS}"


def test_other_errors_and_any_error_on_a_gpu_stay_failures():
    assert gpu_only_line(NotImplementedError(WNA16), "cuda") is None
    assert gpu_only_line(ValueError("max_model_len is too large"), "cpu") is None
    assert gpu_only_line(RuntimeError(WNA16), "cpu") is None       # same words, other error


# ---- engines on the Kimi kind: what the CPU build cannot run is one line, not a traceback ----------

ENGINES = pytest.mark.timeout(900)  # a vLLM start is one to two minutes on a busy 2-core box


def kimi_tokens(run: Path, tokenizer, datasets=("code", "chat"), n: int = 3) -> None:
    """Stage 03's files of a run on the Kimi-style tokenizer: templated prompts + a response."""
    import random

    rng = random.Random(0)
    tokens = run / "tokens"
    tokens.mkdir(parents=True)
    for ds in datasets:
        rows = []
        for i in range(n):
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": " ".join(rng.choice(["why", "sort", "a", "file"]) for _ in range(9))}],
                add_generation_prompt=True, tokenize=True, return_dict=False)
            resp = [rng.randrange(3, 160000) for _ in range(12)] + [IM_END]
            rows.append({"sample_id": f"{ds}-{i}", "dataset": ds, "provider": "p", "input_ids": list(prompt) + resp,
                         "loss_mask": [0] * len(prompt) + [1] * len(resp), "output_ids": resp, "excluded": False})
        (tokens / f"{ds}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@ENGINES
def test_stage_04_in_vllm_on_int4_experts_says_gpu_only_in_one_line(kimi_mini_targets, tmp_path):
    """`draftsmith run 04` with target_backend vllm on `kimi-mini` (INT4 experts, as Kimi-K2.5 ships):
    the stage finishes, its log has vLLM's own error as one GPU-only line and no traceback, the
    index records it (no shards), and the run's summary says it has no features (exit 3)."""
    from transformers import AutoTokenizer

    target = kimi_mini_targets["kimi-mini"]
    outputs = tmp_path / "outputs"
    kimi_tokens(outputs / "kimi-mini", AutoTokenizer.from_pretrained(target, trust_remote_code=True))
    cmd = [str(Path(sys.executable).with_name("draftsmith")), "run", "04", "-f", str(REPO / "params/kimi-mini.yaml"),
           "-p", "outputs_dir", str(outputs), "-p", "target_model_path", "kimi-mini", "-p", "target_backend", "vllm"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=800)
    # the stage ends cleanly, and the run says there is nothing to train on from this machine (exit 3)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"! 04_hidden_states: stopped: no features: GPU-only: NotImplementedError: {WNA16}" in proc.stderr, \
        proc.stderr[-3000:]
    log = (outputs / "kimi-mini" / "logs" / "04_hidden_states.log").read_text()
    said = [line for line in log.splitlines() if line.endswith(f"GPU-only: NotImplementedError: {WNA16}")]
    assert len(said) == 1 and said[0].startswith("stage 04 on kimi-mini"), said   # (the summary table shows it too)
    assert "Traceback" not in log
    index = json.loads((outputs / "kimi-mini" / "hidden" / "index.json").read_text())
    assert index["gpu_only"] == f"GPU-only: NotImplementedError: {WNA16}"
    assert index["backend"] == "vllm" and index["shards"] == [] and index["layer_ids"] == [1, 3, 4]


def kimi_export(target: Path, out: Path, layer_ids: list[int]) -> Path:
    """A random EAGLE-3 drafter for `target`, exported for vLLM (enough to start an engine)."""
    from draftsmith.drafter.export import export
    from draftsmith.drafter.model import DrafterShape
    from draftsmith.drafter.objective import build_drafter
    from draftsmith.drafter.vocab import DraftVocab
    from draftsmith.targets.checkpoint import target_config, target_tensors

    cfg = DrafterShape.from_target(target_config(target), 512)
    counts = torch.zeros(cfg.vocab_size, dtype=torch.int64)
    counts[torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:600]] = 1
    d = build_drafter(cfg, target_tensors(target)["embed"].float(), DraftVocab.build(counts, 512), 0)
    return export(out, d.state_dict(), cfg, layer_ids, "vllm", "float32",
                  {"step": 1, "target": {"path": str(target), "fingerprint": "f"}})


@pytest.fixture(scope="module")
def eagle3_over_mla(kimi_mini_targets, tmp_path_factory):
    """Stage 06's engines for two exports of a drafter over `kimi-mini-bf16` (an MLA target) in
    vLLM's CPU build, float32 (stage 06's dtype on a CPU); then the same measurement again."""
    from draftsmith import layers
    from draftsmith.config import EvaluateConfig
    from draftsmith.evaluate import engine
    from draftsmith.evaluate.methods import EngineMethod, HeldoutPrompt, speculative_config
    from draftsmith.paths import Run

    target = kimi_mini_targets["kimi-mini-bf16"]
    root = tmp_path_factory.mktemp("kimi-eval")
    export_dir = kimi_export(target, root / "export", [1, 3, 4])
    methods = [EngineMethod(name, "eagle3", f"vllm-{name}", hf_fingerprint=name,
                            speculative_config=speculative_config("eagle3", 3, export_dir),
                            expect_layers=layers.engine_layer_ids([1, 3, 4], "vllm"),
                            info={"fraction": fraction, "final": fraction == 1.0})
               for name, fraction in (("eagle3 50%", 0.5), ("eagle3", 1.0))]
    prompts = [HeldoutPrompt("chat", "p0", (163584, 1000, 2000, 3000, 4000))]
    run = Run(root / "outputs", "kimi")
    cfg = EvaluateConfig(draft_tokens=3, eval_max_new_tokens=8, eval_temperatures=[0.0], seed=0,
                         eval_engine_dtype="float32", eval_tensor_parallel=1, trust_remote_code=True,
                         eval_engine_concurrency=1)
    settings = engine.settings_key(cfg, "f", 8)
    first, again = [], []
    rows = engine.measure(run, cfg, target, methods, prompts, settings, log=first.append)
    rows_again = engine.measure(run, cfg, target, methods, prompts, settings, log=again.append)
    return methods, rows, first, rows_again, again


@ENGINES
def test_eagle3_over_an_mla_target_is_one_gpu_only_line_per_export_from_one_start(eagle3_over_mla):
    from draftsmith.evaluate import metrics

    methods, rows, said, rows_again, said_again = eagle3_over_mla
    line = "GPU-only: ValueError: No common block size for "
    assert [r["method"] for r in rows if r["gpu_only"].startswith(line)] == ["eagle3 50%", "eagle3"]
    assert "CPU_MLA: [16]" in rows[0]["gpu_only"] and rows[0]["gpu_only"] == rows[1]["gpu_only"]
    assert [m for m in said if "GPU-only:" in m] == [f"engine {r['method']!r}: {r['gpu_only']}" for r in rows]
    assert not any("Traceback" in m for m in said)
    report = metrics.engine_report(rows, methods, None, 3, [0.0], "float32", 1)
    assert report["gpu_only"] == {"eagle3 50%": rows[0]["gpu_only"], "eagle3": rows[1]["gpu_only"]}
    assert report["temperatures"]["0"]["methods"] == {}
    # measured again (a re-run of the stage): the lines are kept, no engine starts
    assert rows_again == rows and said_again == []
