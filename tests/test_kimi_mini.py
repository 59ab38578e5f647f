"""The Kimi-K2.5-shaped built-in target (`kimi-mini`, `kimi-mini-bf16`): its checkpoint is laid out as
Kimi-K2.5's (config structure, weight names and dtypes, INT4 compressed-tensors experts),
transformers loads it as its own architecture (the multimodal wrapper, then its text model), and the
whole chain runs on it as a user runs it: `draftsmith run all -f params/kimi-mini.yaml`, from the
local emulator through stage 06, stage 04 and 06 in vLLM's CPU build.

The targets are built once per cache by the session fixture `kimi_mini_targets` (conftest.py).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftsmith.targets.checkpoint import load_target, target_config, target_tensors

# The first test to ask for the targets builds them when the cache has none (minutes on two cores),
# and the chain's first test runs the whole chain: pytest-timeout counts fixtures in the test's time.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[1]
BF16_TOLERANCE = 0.02  # relative error per captured layer: bf16 storage and vLLM's bf16 compute vs fp32


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def unpack_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors pack-quantized, read back by hand: eight 4-bit values per int32 along the
    input dimension, low bits first, stored as value + 8; one scale per group of 32 inputs."""
    shifts = torch.arange(8, dtype=torch.int32) * 4
    q = ((packed[..., None] >> shifts) & 0xF).reshape(packed.shape[0], -1).float() - 8
    return q * scale.float().repeat_interleave(32, dim=1)


def test_kimi_mini_is_laid_out_as_kimi_k25_ships(kimi_mini_targets):
    int4, bf16 = kimi_mini_targets["kimi-mini"], kimi_mini_targets["kimi-mini-bf16"]
    cfg = target_config(int4)
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    text = cfg["text_config"]
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"], text["first_k_dense_replace"]) == (512, 64, 1)
    assert "head_dim" not in text and text["vocab_size"] == 163840 and not cfg["tie_word_embeddings"]
    assert {"vt_hidden_size", "vt_num_hidden_layers"} <= set(cfg["vision_config"])
    q = cfg["quantization_config"]
    assert q["format"] == "pack-quantized" and q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert "quantization_config" not in target_config(bf16)
    assert (int4 / "tokenization_kimi.py").is_file() and (int4 / "preprocessor_config.json").is_file()
    assert "AutoTokenizer" in json.loads((int4 / "tokenizer_config.json").read_text())["auto_map"]

    t, b = tensors(int4), tensors(bf16)
    expert = "language_model.model.layers.1.mlp.experts.0.down_proj."
    H, inter = text["hidden_size"], text["moe_intermediate_size"]
    assert t[expert + "weight_packed"].dtype == torch.int32 and t[expert + "weight_packed"].shape == (H, inter // 8)
    assert t[expert + "weight_scale"].dtype == torch.bfloat16 and t[expert + "weight_scale"].shape == (H, inter // 32)
    assert t[expert + "weight_shape"].tolist() == [H, inter]
    assert t["language_model.model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert "language_model.lm_head.weight" in t and "language_model.model.layers.0.mlp.gate_proj.weight" in t
    assert any(k.startswith("vision_tower.encoder.blocks.0.") for k in t)
    assert any(k.startswith("mm_projector.proj.") for k in t)
    others = {k: v.dtype for k, v in t.items() if not k.startswith("language_model.model.layers.1.mlp.experts.")
              and "e_score_correction_bias" not in k and "weight_" not in k}
    assert set(others.values()) == {torch.bfloat16}
    # the bf16 variant's experts are the INT4 experts dequantized; every other tensor is the same
    deq = unpack_int4(t[expert + "weight_packed"], t[expert + "weight_scale"])
    assert torch.allclose(b[expert + "weight"].float(), deq, rtol=2 ** -7, atol=0)
    assert all(torch.equal(b[k], v) for k, v in t.items() if ".experts." not in k)


def test_load_target_gives_the_text_model_of_the_multimodal_wrapper(kimi_mini_targets, one_thread):
    folder = kimi_mini_targets["kimi-mini-bf16"]
    model = load_target(folder, "cpu")
    layers = model.get_decoder().layers
    assert len(layers) == target_config(folder)["text_config"]["num_hidden_layers"]
    assert torch.equal(model.get_output_embeddings().weight.bfloat16(), target_tensors(folder)["lm_head"])
    assert model.generation_config.eos_token_id == 163586  # <|im_end|>, the checkpoint's own
    ids = torch.tensor([[163584, 1000, 2000, 3000, 163586]])
    with torch.inference_mode():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        head = model.get_output_embeddings()(out.hidden_states[-1])
    assert len(out.hidden_states) == len(layers) + 1
    assert torch.allclose(out.logits, head, atol=1e-4)


def test_load_target_reads_the_int4_experts_as_the_bf16_variant_holds_them(kimi_mini_targets):
    """compressed-tensors decompresses the INT4 experts at load (into bf16): the same weights as the
    bf16 variant's, up to the rounding of scale x value in bf16."""
    int4 = load_target(kimi_mini_targets["kimi-mini"], "cpu").model.layers[1].mlp.experts
    bf16 = load_target(kimi_mini_targets["kimi-mini-bf16"], "cpu").model.layers[1].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        a, b = getattr(int4, name).float(), getattr(bf16, name).float()
        assert torch.allclose(a, b, rtol=2 ** -7, atol=0), name


def test_stage_04_check_skips_an_index_that_stage_04_marked_gpu_only(tmp_path):
    """The INT4 variant on vLLM's CPU build stores no features, only the GPU-only line: the check
    against transformers then has nothing to compare and says so with None instead of failing."""
    from draftsmith.hidden import outputs as shards
    from draftsmith.hidden.verify import check_stored

    (tmp_path / shards.INDEX).write_text(json.dumps(
        {"format": shards.FORMAT, "backend": "vllm", "shards": [], "gpu_only": "GPU-only: NotImplementedError: ..."}))
    assert check_stored("kimi-mini", tmp_path, "cpu") is None


@pytest.fixture(scope="module")
def kimi_run(kimi_mini_targets, tmp_path_factory):
    """`draftsmith run all -f params/kimi-mini.yaml`: the emulator through stage 06 (about 8 minutes
    on two cores; three vLLM engines start: stage 04's capture, stage 06's no-drafter and ngram)."""
    import secrets

    out = tmp_path_factory.mktemp("kimi-chain")
    key_file = out / "key.txt"
    key_file.write_text("sk-or-v1-" + secrets.token_hex(32) + "\n")
    cmd = [str(Path(sys.executable).with_name("draftsmith")), "run", "all", "-f", str(REPO / "params/kimi-mini.yaml"),
           "-p", "outputs_dir", str(out / "outputs"), "-p", "api_key_file", str(key_file)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return out / "outputs" / "kimi-mini"


# quirks that change what a sample's tokens look like whenever they are applied, and the cause
# stage 03 must name for them (others, e.g. stripping whitespace an answer does not have or a rare
# non-canonical split, may leave a short sample untouched)
ALWAYS_VISIBLE = {"billing": "other_tokenizer", "reasoning_dropped": "dropped_reasoning"}


def test_kimi_chain_stage_03_clears_honest_providers_and_names_every_quirk(kimi_run):
    """The emulator's ledger says which quirks each provider applied to the samples stage 02 kept."""
    from draftsmith.emulator import read_ledger

    report = json.loads((kimi_run / "tokens" / "report.json").read_text())
    assert report["target"]["tokenizer_kind"] == "tiktoken" and report["target"]["vocab_size"] == 163840
    sampled = {json.loads(row)["generation_id"] for path in (kimi_run / "generate").glob("*/raw_responses.jsonl")
               for row in path.read_text().splitlines()}   # stage 02's samples, not stage 01's probes
    applied: dict[str, set] = {}
    for line in read_ledger(kimi_run / "emulator"):
        if line.get("generation_id") in sampled:
            applied.setdefault(line["provider_name"], set()).update(q.split(":")[0] for q in line["quirks"])
    honest = [name for name, quirks in applied.items() if quirks <= {"perturbed"}]
    assert honest and len(honest) < len(applied), applied
    for name in honest:
        s = report["providers"][name]
        assert not s["flagged"] and s["relative_error"] == 0 and s["exact_match_rate"] == 1, (name, s)
    for name, quirks in applied.items():
        s = report["providers"][name]
        for quirk in quirks & set(ALWAYS_VISIBLE):
            assert s["flagged"] and ALWAYS_VISIBLE[quirk] in s["causes"], (name, quirks, s)
        assert not s["flagged"] or s["cause"], (name, s)
    assert any(quirks & set(ALWAYS_VISIBLE) for quirks in applied.values()), applied


def test_kimi_chain_stage_04_hf_stores_what_vllm_stored_per_layer(kimi_run, tmp_path):
    """`draftsmith run 04 -p target_backend hf` on the same token files (transformers loading the
    multimodal wrapper, float32) against the chain's vLLM run (bf16 experts and compute): every
    captured layer and the final hidden state agree within bf16 error over all samples. (The chain's
    own stage 04 also passed its check against transformers: `verify_with_hf`.)"""
    import shutil

    from draftsmith.hidden.outputs import HiddenShards

    shutil.copytree(kimi_run / "tokens", tmp_path / "outputs" / "kimi-mini" / "tokens")
    cmd = [str(Path(sys.executable).with_name("draftsmith")), "run", "04", "-f", str(REPO / "params/kimi-mini.yaml"),
           "-p", "outputs_dir", str(tmp_path / "outputs"), "-p", "target_backend", "hf"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hf, vllm = HiddenShards(tmp_path / "outputs" / "kimi-mini" / "hidden"), HiddenShards(kimi_run / "hidden")
    assert vllm.index["backend"] == "vllm" and not vllm.index.get("gpu_only") and vllm.index["layer_ids"] == [1, 3, 4]
    assert hf.index["backend"] == "hf" and hf.index["layer_ids"] == vllm.index["layer_ids"]
    for hs in (vllm, hf):  # stage 04's own check ran in each engine, on by default, and passed
        check = hs.index["check"]
        assert check["passed"] and check["engine"] == hs.index["backend"] and check["positions"] > 0, check
        print(f"stage 04's own check, {check['engine']} ({check['engine_dtype']}): captured "
              f"{check['captured']}, stored {check['storage_dtype']} mean {check['logprob_mean_abs_err']}, "
              f"max {check['logprob_max_abs_err']}, top-1 {check['top1_agreement']}, {check['seconds']} s")
    where = {ref.sample_id: i for i, ref in enumerate(vllm.samples)}
    assert sorted(where) == sorted(ref.sample_id for ref in hf.samples)
    H = hf.hidden_size
    pairs = [(hf.sample(i), vllm.sample(where[ref.sample_id])) for i, ref in enumerate(hf.samples)]
    errors = {}
    for j, layer in enumerate(hf.index["layer_ids"]):
        a = torch.cat([x["aux"][:, j * H:(j + 1) * H] for x, _ in pairs])
        b = torch.cat([y["aux"][:, j * H:(j + 1) * H] for _, y in pairs])
        errors[f"layer {layer}"] = float((b - a).norm() / a.norm())
    a, b = torch.cat([x["last"] for x, _ in pairs]), torch.cat([y["last"] for _, y in pairs])
    errors["last"] = float((b - a).norm() / a.norm())
    print("vLLM vs transformers, relative error over all stored tokens:", errors)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in pairs)
    assert max(errors.values()) < BF16_TOLERANCE, errors


def test_kimi_chain_stage_05_exports_a_drafter_over_the_text_model(kimi_run, kimi_mini_targets):
    text = target_config(kimi_mini_targets["kimi-mini-bf16"])["text_config"]
    for export in ("eagle3", "eagle3-vllm"):
        cfg = json.loads((kimi_run / "drafter" / export / "config.json").read_text())
        assert cfg["target_hidden_size"] == text["hidden_size"] and cfg["vocab_size"] == text["vocab_size"]
        assert (kimi_run / "drafter" / export / "model.safetensors").stat().st_size > 0


def test_kimi_chain_stage_06_decoder_and_vllm_baselines_measure_eagle3_over_mla_is_gpu_only(kimi_run):
    report = json.loads((kimi_run / "eval" / "report.json").read_text())
    ours = report["temperatures"]["0"]["methods"]
    assert ours["none"]["acceptance_length"] == 1.0 and ours["eagle3"]["acceptance_length"] >= 1.0
    engine = report["engine"]
    measured = engine["temperatures"]["0"]["methods"]
    assert measured["none"]["acceptance_length"] == 1.0 and measured["ngram"]["acceptance_length"] >= 1.0
    assert engine["gpu_only"] and all(name.startswith("eagle3") for name in engine["gpu_only"])
    assert all("\n" not in line and line for line in engine["gpu_only"].values())
