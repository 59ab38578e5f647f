"""Stage 06 in vLLM: the export is served by the engine with the layers it was trained on, greedy
speculative decoding in vLLM is token-exact, and the engine's acceptance agrees with our evaluator's.

One stage-06 run in vLLM (three engines in one process: none, ngram, the drafter) serves the
engine tests; it is the slowest test here (~2-3 min on 2 cores) and the only one that decodes in vLLM.
"""

import json
from pathlib import Path

import pytest
import torch

from draftsmith import hidden, layers, vllm_eval
from draftsmith.drafter.export import export, for_engine
from draftsmith.drafter.model import DrafterConfig, target_config, target_tensors
from draftsmith.drafter.train import TrainConfig, build_drafter, train
from draftsmith.drafter.vocab import DraftVocab
from draftsmith.target import chat_examples

from conftest import write_token_rows

CUSTOM = [2, 3, 5]          # output ids; not the default [1, 3, 4] of 8 layers
VLLM_IDS = [3, 4, 6]        # what vLLM must capture for them (input of layers 3, 4, 6)
VLLM_DEFAULT = [2, 4, 5]    # vLLM's fallback (2, N//2, N-3) for N = 8
# Greedy acceptance, engine vs our evaluator, over all held-out prompts: both accept a draft while it
# equals the target's argmax and both run float32 over the same weights and features. Measured here
# (4 prompts, 24 new tokens): vLLM 3.88, ours 3.68, the same outputs on every prompt, yet different
# per-step counts. Likely cause (not yet verified): our decoder drafts at most the tokens left before
# max_new_tokens, vLLM drafts k in the last step as well, so short outputs count differently at their
# end. Until that is pinned down the tolerance is the measured gap plus margin.
TOLERANCE = 0.25


def quiet(*a, **k):
    pass


# the engine fixture (training a drafter, three vLLM engines, our decoder) takes ~3 min on 2 idle cores
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(1500)]


def random_export(tiny_target, out: Path, layer_ids, engine="vllm") -> Path:
    cfg = DrafterConfig.from_target(target_config(tiny_target), 512)
    counts = torch.zeros(cfg.vocab_size, dtype=torch.int64)
    counts[torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:600]] = 1
    d = build_drafter(cfg, target_tensors(tiny_target)["embed"], DraftVocab.build(counts, 512), 0)
    return export(out, d.state_dict(), cfg, layer_ids, engine, "float32",
                  {"step": 1, "target": {"path": str(tiny_target), "fingerprint": "f"}})


def old_export(new: Path, out: Path) -> Path:
    """The same export as the previous version wrote it: ids only under eagle_config."""
    out.mkdir()
    (out / "model.safetensors").symlink_to(new / "model.safetensors")
    config = json.loads((new / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def strings(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from strings(v)
    elif isinstance(x, str):
        yield x


def test_a_vllm_export_writes_the_ids_where_vllm_reads_them_and_no_path_of_this_machine(tiny_target, tmp_path):
    new = random_export(tiny_target, tmp_path / "e", CUSTOM)
    config = json.loads((new / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == VLLM_IDS == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert config["draftsmith"]["target"] == {"fingerprint": "f"}
    assert not [s for s in strings(config) if s.startswith("/") or str(tmp_path) in s or str(tiny_target) in s]
    sglang = for_engine(new, "sglang")
    assert "eagle_aux_hidden_state_layer_ids" not in json.loads((sglang / "config.json").read_text())
    # an export written by the previous version is rewritten for vLLM, not served as is
    old = old_export(new, tmp_path / "old")
    assert for_engine(old, "vllm") != old and for_engine(new, "vllm") == new


def test_custom_layer_ids_reach_vllm_from_the_new_export_and_not_from_the_old(tiny_target, tmp_path):
    """vLLM itself parses both exports: GPU vLLM (Model Runner V2) reads no ids from the old one and
    would capture its default layers; from the new one both runners read the trained layers."""
    new = random_export(tiny_target, tmp_path / "new", CUSTOM)
    old = old_export(new, tmp_path / "old")
    read = vllm_eval.read_layer_ids(tiny_target, [old, new])

    def captured(ids):
        return ids or VLLM_DEFAULT

    assert layers.engine_capture_indices(VLLM_IDS, "vllm") == layers.hf_hidden_state_indices(CUSTOM)
    assert captured(read[str(old)]["gpu_runner"]) != VLLM_IDS            # the old export: served wrong
    assert captured(read[str(new)]["gpu_runner"]) == VLLM_IDS
    assert captured(read[str(new)]["cpu_runner"]) == VLLM_IDS


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory, tiny_target, target_tokenizer):
    """A run as stages 03-05 leave it, features captured at the custom layers, one export."""
    run = tmp_path_factory.mktemp("outputs") / "vllm"
    tokens = run / "tokens"
    tokens.mkdir(parents=True)
    convs = chat_examples(seed=3)
    files = [write_token_rows(tokens / "code.jsonl", target_tokenizer, convs[:16], "code"),
             write_token_rows(tokens / "chat.jsonl", target_tokenizer, convs[16:32], "chat")]
    hidden.extract(tiny_target, files, run / "hidden", layer_ids=CUSTOM, dtype="bf16", log=quiet)
    train(TrainConfig(hidden_dir=str(run / "hidden"), target_path=str(tiny_target), out_dir=str(run / "drafter"),
                      draft_vocab_size=512, ttt_steps=3, epochs=2.0, batch_size=4, micro_batch_size=4,
                      max_len=160, lr=3e-3, holdout_fraction=0.2, export_fractions=[1.0],
                      export_dtype="float32"), log=quiet)
    return run


@pytest.fixture(scope="module")
def engine_report(custom_run):
    from draftsmith import cli
    from draftsmith.paths import REPO_ROOT

    assert cli.main(["run", "06", "-f", str(REPO_ROOT / "params" / "smoke.yaml"), "-p", "outputs_dir",
                     str(custom_run.parent), "-p", "run_name", custom_run.name, "-p", "train_holdout_fraction", "0.2",
                     "-p", "eval_backend", "vllm", "-p", "eval_prompts_per_dataset", "2",
                     "-p", "eval_max_new_tokens", "24"]) == 0
    return json.loads((custom_run / "eval" / "report.json").read_text())


def test_vllm_serves_the_drafter_with_the_layers_it_was_trained_on(engine_report, custom_run):
    index = json.loads((custom_run / "hidden" / "index.json").read_text())
    assert index["layer_ids"] == CUSTOM
    d = engine_report["engine"]["temperatures"]["0"]["methods"]["eagle3"]
    assert d["aux_layers_engine"] == VLLM_IDS and d["aux_layers_gpu_runner"] == VLLM_IDS


def test_greedy_vllm_with_the_drafter_gives_exactly_the_tokens_of_vllm_without_it(engine_report, custom_run):
    rows = [json.loads(line) for line in (custom_run / "eval" / "engine_rounds.jsonl").read_text().splitlines()]
    greedy = [r for r in rows if r["temperature"] == 0]
    ref = {(r["dataset"], r["sample_id"]): r["output"] for r in greedy if r["kind"] == "none"}
    assert len(ref) == 4
    for r in greedy:
        assert r["output"] == ref[(r["dataset"], r["sample_id"])], f"{r['method']}: {r['sample_id']} differs"
    drafted = [r for r in greedy if r["kind"] == "eagle3"]
    assert sum(r["counters"]["accepted"] for r in drafted) > 0        # the drafter was really used
    assert all(sum(r["drafted"]) == r["counters"]["draft_tokens"] for r in drafted)   # per step == counters
    methods = engine_report["engine"]["temperatures"]["0"]["methods"]
    assert all(m["lossless"] for m in methods.values())


def test_the_engines_greedy_acceptance_agrees_with_our_evaluators(engine_report):
    engine = engine_report["engine"]["temperatures"]["0"]["methods"]["eagle3"]["acceptance_length"]
    ours = engine_report["temperatures"]["0"]["methods"]["eagle3"]["acceptance_length_vllm"]
    print(f"greedy acceptance: vLLM {engine:.4f}, ours {ours:.4f}")
    assert engine > 1.0
    assert abs(engine - ours) <= TOLERANCE
