"""Stage 06 in vLLM: the export is served by the engine with the layers it was trained on, greedy
speculative decoding in vLLM is token-exact, the engine's greedy acceptance equals our decoder's,
and at T > 0 the engine accepts drafts.

One stage-06 run in vLLM (three engines started one after the other in one child process, each with
its engine core in that process: none, the drafter, ngram) serves the engine tests, first with
engine numbers only, then again with our decoder beside them (the engine's rows are reused, no engine
starts). It is the slowest test module (~3-4 min on 2 idle cores) and the only one that decodes in vLLM.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith import layers
from draftsmith.config import EvaluateConfig
from draftsmith.drafter.export import export, for_engine
from draftsmith.drafter.model import DrafterShape
from draftsmith.drafter.objective import build_drafter
from draftsmith.drafter.vocab import DraftVocab
from draftsmith.evaluate import engine, figures, metrics, results
from draftsmith.targets import vllm_fixes
from draftsmith.targets.checkpoint import target_config, target_tensors

from conftest import SHARED_RUN, copy_run

CUSTOM = [2, 3, 5]          # output ids; not the default [1, 3, 4] of 8 layers
VLLM_IDS = [3, 4, 6]        # what vLLM must capture for them (input of layers 3, 4, 6)
CAPTURED = [1, 2, 3, 4, 5]  # one capture: the custom layers and DFlash's five of 8 layers
DFLASH = {"dflash_layers": 2, "dflash_block_size": 4, "dflash_anchors": 32}
VLLM_DEFAULT = [2, 4, 5]    # vLLM's fallback (2, N//2, N-3) for N = 8
# Greedy acceptance, engine vs our decoder: both accept a draft while it equals the target's argmax,
# both draft k in every step (the last one too) and count its accepted drafts in full, and both run
# float32 over the same weights and features. So on a prompt both targets decode alike, every step's
# accepted count is the same, and the two acceptance lengths are equal up to float rounding of the sum.
TOLERANCE = 1e-9


def quiet(*a, **k):
    pass


# the engine fixture (training a drafter, three vLLM engines, our decoder) takes ~3-4 min on 2 idle
# cores and is charged to the first test that uses it: 15 min means a hang, not a slow box
pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(900)]


def random_export(tiny_target, out: Path, layer_ids, engine="vllm") -> Path:
    cfg = DrafterShape.from_target(target_config(tiny_target), 512)
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
    read = engine.read_layer_ids(tiny_target, [old, new])

    def captured(ids):
        return ids or VLLM_DEFAULT

    assert layers.engine_capture_indices(VLLM_IDS, "vllm") == layers.hf_hidden_state_indices(CUSTOM)
    assert captured(read[str(old)]["gpu_runner"]) != VLLM_IDS            # the old export: served wrong
    assert captured(read[str(new)]["gpu_runner"]) == VLLM_IDS
    assert captured(read[str(new)]["cpu_runner"]) == VLLM_IDS


@pytest.fixture(scope="module")
def custom_run(shared_run, tmp_path_factory):
    """A run as stages 03-05 leave it: one capture of DFlash's layers and the custom ones, an
    EAGLE-3 export trained on the custom layers and a DFlash export on DFlash's own. The drafters also
    learn the target's own greedy answers (the loop the test-sized target falls into differs from
    machine to machine), for long enough to draft them: the greedy tests need accepts. It is the
    session's shared run (`conftest.shared_run`), copied: stage 06 writes into it."""
    built = (SHARED_RUN["layer_ids"], SHARED_RUN["train_layer_ids"], SHARED_RUN["dflash"], SHARED_RUN["target_answers"])
    assert built == (CAPTURED, CUSTOM, DFLASH, True), f"conftest.SHARED_RUN is no longer this module's run: {built}"
    return copy_run(shared_run, tmp_path_factory.mktemp("outputs") / "vllm")


def run_stage_06(run: Path, crosscheck: bool, *more: str) -> dict:
    """Stage 06 on the 4 held-out prompts and one benchmark of one prompt (`qa`); `more`: -p pairs."""
    from draftsmith import cli
    from draftsmith.paths import REPO_ROOT

    qa = run.parent / "qa.jsonl"
    qa.write_text(json.dumps({"id": "q0", "messages": [{"role": "user", "content": "What is 12 * 7?"}]}) + "\n")
    bench = json.dumps([{"name": "qa", "path": str(qa), "prompts": 1, "max_new_tokens": 8}])
    assert cli.main(["run", "06", "-f", str(REPO_ROOT / "params" / "smoke.yaml"), "-p", "outputs_dir",
                     str(run.parent), "-p", "run_name", run.name,
                     "-p", "eval_backend", "vllm", "-p", "eval_hf_crosscheck", str(crosscheck).lower(),
                     "-p", "eval_prompts_per_dataset", "2", "-p", "eval_max_new_tokens", "24",
                     "-p", "eval_benchmarks", bench, *more]) == 0
    return json.loads((run / "eval" / "report.json").read_text())


@pytest.fixture(scope="module")
def engine_only_report(custom_run):
    """Stage 06 as the real job runs it (eval_hf_crosscheck false): engine numbers only; its engines
    get an `engine_env` (read back in each engine's worker)."""
    return run_stage_06(custom_run, False, "-p", "engine_env", json.dumps(PROBE_ENV))


@pytest.fixture(scope="module")
def engine_report(engine_only_report, custom_run):
    """Then with our decoder beside the engine: the engine's rows are reused, no engine restarts."""
    rows = (custom_run / "eval" / "engine_rounds.jsonl").read_text()
    report = run_stage_06(custom_run, crosscheck=True)
    assert (custom_run / "eval" / "engine_rounds.jsonl").read_text() == rows
    engine_alone = {key: {**t, "vs_ours": None} for key, t in report["engine"]["temperatures"].items()}
    assert engine_alone == engine_only_report["engine"]["temperatures"]
    return report


@pytest.fixture(scope="module")
def sequential_report(engine_only_report, custom_run, tmp_path_factory):
    """The same run measured again in a copy, one request at a time (`eval_engine_concurrency` 1),
    greedy, as a first pass of one prompt per prompt set (`eval_first_pass_prompts` 1)."""
    copy = tmp_path_factory.mktemp("sequential") / custom_run.name
    shutil.copytree(custom_run, copy, ignore=lambda d, names: ["eval"] if Path(d) == custom_run else [])
    report = run_stage_06(copy, False, "-p", "eval_engine_concurrency", "1", "-p", "eval_first_pass_prompts", "1",
                          "-p", "eval_temperatures", "[0.0]")
    return report, [json.loads(line) for line in (copy / "eval" / "engine_rounds.jsonl").read_text().splitlines()]


def test_batched_and_sequential_measurement_give_the_same_greedy_acceptance(engine_only_report, sequential_report,
                                                                            custom_run):
    """The stage's engines decode many prompts at once (`eval_engine_concurrency`, 32 by default: all 5
    here); acceptance is counted per request from vLLM's verify steps, so every greedy decode has the
    same tokens and the same accepted count at every step as when each prompt is decoded alone."""
    report, sequential = sequential_report
    batched = {(r["method"], r["dataset"], r["sample_id"]): r for r in
               (json.loads(line) for line in (custom_run / "eval" / "engine_rounds.jsonl").read_text().splitlines())
               if r["temperature"] == 0}
    assert report["prompts"] == {"code": 1, "chat": 1} and report["eval_first_pass_prompts"] == 1
    assert "**A first pass:** the first 1 prompts" in figures.explain_engine(report)
    assert "each prompt alone" in figures.explain_engine(report)
    assert report["engine"]["concurrency"] == [1] and engine_only_report["engine"]["concurrency"] == [32]
    assert {(r["method"], r["dataset"]) for r in sequential} == {
        (m, ds) for m in ("none", "ngram", "eagle3", "dflash") for ds in ("code", "chat", "qa")} | {
        ("eagle3 50%", "code"), ("eagle3 50%", "chat")}
    for r in sequential:
        b = batched[(r["method"], r["dataset"], r["sample_id"])]
        assert r["concurrency"] == 1 and b["concurrency"] == 32
        assert (r["output"], r["drafted"], r["accepted"], r["counters"]) == \
               (b["output"], b["drafted"], b["accepted"], b["counters"]), (r["method"], r["sample_id"])
    accepted = sum(r["counters"]["accepted"] for r in sequential if r["kind"] in ("eagle3", "dflash"))
    assert accepted > 0                                                 # the drafters were really used
    for name in sorted({r["method"] for r in sequential}):
        seq = [r for r in sequential if r["method"] == name]
        k = len(seq[0]["counters"]["per_pos"])
        alone = metrics.engine_acceptance(seq, k)["acceptance_length"]
        together = metrics.engine_acceptance([batched[(name, r["dataset"], r["sample_id"])] for r in seq], k)
        print(f"{name}: greedy acceptance {alone:.4f} one at a time, {together['acceptance_length']:.4f} batched")
        assert alone == together["acceptance_length"], name


PROBE_ENV = {"DRAFTSMITH_ENGINE_PROBE": "stage 06"}


def test_every_engine_row_of_the_report_and_the_summary_names_the_runner_that_ran(engine_only_report, custom_run):
    """vllm_model_runner (v1 by default) reaches every engine; each records the runner class its
    worker held, and the engine_env its worker read, in the report and the run's summary."""
    from draftsmith.evaluate import results as evaluate_results
    from draftsmith.paths import Run

    for part in (engine_only_report["engine"], engine_only_report["benchmarks"]["engine"]):
        assert part["engines"] and all(e["model_runner"] == "v1" and e["model_runner_class"] and e["started"]
                                       for e in part["engines"].values()), part["engines"]
        assert part["engine_env"] == PROBE_ENV and part["kv_cache_dtype"] == "auto"
        for t in part["temperatures"].values():
            assert all(m["model_runner"] == "v1" and m["model_runner_class"] for m in t["methods"].values())
    assert set(engine_only_report["engine"]["engines"]) == {"none", "ngram", "eagle3 50%", "eagle3", "dflash"}
    numbers, _, figures, _ = evaluate_results.verdict(Run(custom_run.parent, custom_run.name), "eval")
    assert {(e.method, e.prompt_sets, e.model_runner) for e in numbers.engines} == {
        *((m, "held-out", "v1") for m in ("none", "ngram", "eagle3 50%", "eagle3", "dflash")),
        *((m, "benchmarks", "v1") for m in ("none", "ngram", "eagle3", "dflash"))}
    classes = {e.model_runner_class for e in numbers.engines}
    assert len(classes) == 1 and None not in classes
    lines = [f.text for f in figures]
    assert lines[0] == ("vLLM engines (held-out): " + ", ".join(f"{m} v1 ({next(iter(classes))})"
                                                                for m in ("none", "ngram", "eagle3 50%", "eagle3", "dflash")))
    # as the engines held it: vLLM's CPU build turns the custom all-reduce off itself
    assert lines[2] == "engine settings: engine_env DRAFTSMITH_ENGINE_PROBE=stage 06, custom all-reduce off, KV cache auto"


def test_with_no_crosscheck_the_stage_reports_and_plots_the_engines_numbers_alone(engine_only_report, custom_run):
    assert engine_only_report["hf_crosscheck"] is False and engine_only_report["temperatures"] == {}
    assert not (custom_run / "eval" / "rounds.jsonl").exists()          # our decoder never ran
    greedy = engine_only_report["engine"]["temperatures"]["0"]["methods"]
    assert list(greedy) == ["none", "ngram", "eagle3 50%", "eagle3", "dflash"] and greedy["eagle3"]["acceptance_length"] > 1.0
    assert greedy["dflash"]["k"] == DFLASH["dflash_block_size"] - 1 == len(greedy["dflash"]["position_acceptance"])
    figures = {p.name for p in (custom_run / "eval" / "figures").glob("*.png")}
    assert figures == {"acceptance_by_dataset.png", "acceptance_vs_training.png", "per_position.png", "benchmarks.png"}


def test_vllm_serves_the_drafter_with_the_layers_it_was_trained_on(engine_report, custom_run):
    index = json.loads((custom_run / "hidden" / "index.json").read_text())
    assert index["layer_ids"] == CAPTURED
    d = engine_report["engine"]["temperatures"]["0"]["methods"]["eagle3"]
    assert d["aux_layers_engine"] == VLLM_IDS and d["aux_layers_gpu_runner"] == VLLM_IDS
    # DFlash's export names its layers as DFlash configs do (output ids); vLLM captures the input of the next
    f = engine_report["engine"]["temperatures"]["0"]["methods"]["dflash"]
    assert f["aux_layers_engine"] == f["aux_layers_gpu_runner"] == [k + 1 for k in layers.dflash_layer_ids(8)]


def test_the_benchmarks_are_decoded_by_the_final_drafters_and_the_baselines_the_export_along_training_only_held_out(
        engine_only_report, custom_run):
    rows = [json.loads(line) for line in (custom_run / "eval" / "engine_rounds.jsonl").read_text().splitlines()]
    decoded = {}
    for r in rows:
        decoded.setdefault(r["method"], set()).add(r["dataset"])
    assert decoded["eagle3 50%"] == {"code", "chat"}
    assert all(decoded[m] == {"code", "chat", "qa"} for m in ("none", "ngram", "eagle3", "dflash")), decoded
    bench = engine_only_report["benchmarks"]["engine"]["temperatures"]
    assert all(list(t["methods"]) == ["none", "ngram", "eagle3", "dflash"] for t in bench.values())
    assert all(list(t["methods"]) == ["none", "ngram", "eagle3 50%", "eagle3", "dflash"]
               for t in engine_only_report["engine"]["temperatures"].values())


def test_greedy_vllm_with_the_drafter_gives_exactly_the_tokens_of_vllm_without_it(engine_report, custom_run):
    rows = [json.loads(line) for line in (custom_run / "eval" / "engine_rounds.jsonl").read_text().splitlines()]
    greedy = [r for r in rows if r["temperature"] == 0]
    ref = {(r["dataset"], r["sample_id"]): r["output"] for r in greedy if r["kind"] == "none"}
    assert len(ref) == 5                                                 # 4 held-out prompts and the benchmark's
    for r in greedy:
        assert r["output"] == ref[(r["dataset"], r["sample_id"])], f"{r['method']}: {r['sample_id']} differs"
    for kind in ("eagle3", "dflash"):
        drafted = [r for r in greedy if r["kind"] == kind]
        assert sum(r["counters"]["accepted"] for r in drafted) > 0, kind        # the drafter was really used
        assert all(sum(r["drafted"]) == r["counters"]["draft_tokens"] for r in drafted), kind  # per step == counters
    methods = engine_report["engine"]["temperatures"]["0"]["methods"]
    assert all(m["lossless"] for m in methods.values())


def test_the_engines_greedy_acceptance_equals_our_decoders_step_by_step(engine_report):
    """For DFlash too: our `DFlashProposer` drafts the blocks vLLM's `qwen3_dflash` drafts from the
    same export, so the two accept the same number of drafts at every step."""
    t = engine_report["engine"]["temperatures"]["0"]
    # The two targets (vLLM's kernels and transformers', over weights built on this machine) may part on a
    # near-tie of the logits; where they decode a prompt alike the drafts must be accepted alike, step by step.
    same, prompts = t["vs_ours"]["same_no_drafter_output"], t["vs_ours"]["prompts"]
    assert prompts == 4 and same >= 1, t["vs_ours"]
    for kind in ("eagle3", "dflash"):
        engine = t["methods"][kind]["acceptance_length"]
        ours = engine_report["temperatures"]["0"]["methods"][kind]["acceptance_length"]
        print(f"{kind} greedy acceptance: vLLM {engine:.4f}, ours {ours:.4f}; {t['vs_ours']}")
        assert engine > 1.0
        assert t["vs_ours"]["methods"][kind]["same_accepted_per_step"] >= same, kind
        if same == prompts:   # then the sums are over the same steps
            assert abs(engine - ours) <= TOLERANCE, kind
    # the results tables carry the same figures, our decoder's as the cross-check column
    for title, table in results.tables(engine_report).items():
        if not title.startswith("greedy (T = 0) · held-out ") or results.ALL_HELD_OUT in title:
            continue   # each dataset's table (the one of all of them together is the headline's)
        rows, ds = table.set_index("method"), title.split(" · ")[1].split()[1]
        assert title.endswith(f" · vLLM {engine_report['engine']['version']}") and "measured in" not in rows
        for kind, row in (("eagle3", "eagle3 (final)"), ("dflash", "dflash")):
            assert rows.loc[row, "acceptance length"] == t["methods"][kind]["per_dataset"][ds]["acceptance_length"]
            check = rows.loc[row, "our decoder agrees (by how much)"]
            assert check.startswith("yes, ") if same == prompts else check != "not measured", (title, check)


def test_at_t_1_the_engine_accepts_drafts(engine_report):
    """At T > 0 vLLM accepts a draft with the target's probability of it; vLLM 0.32.0's CPU build lost
    the temperatures there and rejected every draft (see `target.vllm_fixes.fix_cpu_expand_kernel`)."""
    for kind in ("eagle3", "dflash"):
        t = engine_report["engine"]["temperatures"]["1"]["methods"][kind]
        print(f"T = 1, {kind}: vLLM {t['accepted_tokens']} of {t['draft_tokens']} drafts")
        assert t["accepted_tokens"] > 0 and t["acceptance_length"] > 1.0, kind


def test_beside_the_engine_our_decoder_measures_the_held_out_prompts_greedily_only(engine_report, custom_run):
    """The cross-check is where the two must agree at every step (T = 0); at T = 1 the engine's
    numbers stand alone, and no comparison is reported there."""
    assert list(engine_report["temperatures"]) == ["0"] and engine_report["hf_scope"]["benchmarks"] is False
    rows = [json.loads(line) for line in (custom_run / "eval" / "rounds.jsonl").read_text().splitlines()]
    assert {r["temperature"] for r in rows} == {0.0} and len(rows) == 5 * 4     # 5 methods x 4 held-out prompts
    assert engine_report["engine"]["temperatures"]["1"]["vs_ours"] is None
    assert "did not measure this temperature" in figures.explain_engine(engine_report)
    assert set(figures.decoder_table(engine_report)["T"]) == {0.0}


def test_an_engine_process_started_early_is_gone_when_the_stage_fails_before_handing_it_a_job():
    """Stage 06 starts the engine process first, so that it imports vLLM while the stage reads its
    prompts and drafters; a stage that fails before `measure` leaves no process waiting."""
    with pytest.raises(ValueError, match="before measuring"):
        with engine.engine_process(EvaluateConfig()) as proc:
            assert proc.poll() is None
            raise ValueError("the stage failed before measuring")
    assert proc.poll() is not None


def test_the_cpu_expand_stand_in_writes_every_requests_value_to_its_tokens():
    out = torch.full((6,), -1.0)
    vllm_fixes.expand_to_tokens(out, torch.tensor([0.7, 0.0, 1.5]), torch.tensor([3, 3, 6], dtype=torch.int32), 0, 1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 0.7, 1.5, 1.5, 1.5])   # request 1 drafted nothing
    ints = torch.zeros(4, dtype=torch.int32)
    vllm_fixes.expand_to_tokens(ints, torch.tensor([4, 9], dtype=torch.int32), torch.tensor([1, 4]), 0, 0)
    assert ints.tolist() == [4, 9, 9, 9]


def test_on_the_cpu_a_new_model_class_is_inspected_in_the_engines_own_process(tmp_path, monkeypatch):
    """vLLM inspects a model class it has not cached in a second Python process (a guard for CUDA),
    one more import of vLLM on every first run; on the CPU the fix inspects it in-process, and the
    result is cached for the next start as vLLM caches its own (bench/bench_engine_start.py)."""
    from vllm.model_executor.models import registry

    # as shipped (another test of this process may have applied the fix already); restored afterwards
    monkeypatch.setattr(registry, "_run_in_subprocess", lambda fn: pytest.fail("inspected in a second process"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))                              # nothing cached yet
    assert vllm_fixes.fix_cpu_model_inspection_process() is True
    assert vllm_fixes.fix_cpu_model_inspection_process() is False                     # applied once

    run = registry.subprocess.run

    def no_second_python(cmd, *args, **kwargs):
        assert cmd != registry._SUBPROCESS_COMMAND, "the class was inspected in a second Python process"
        return run(cmd, *args, **kwargs)

    monkeypatch.setattr(registry.subprocess, "run", no_second_python)
    info = registry._LazyRegisteredModel("vllm.model_executor.models.llama", "LlamaForCausalLM").inspect_model_cls()
    assert info.architecture == "LlamaForCausalLM" and info.is_text_generation_model
    assert [p.name for p in (tmp_path / "modelinfos").iterdir()] == ["vllm-model_executor-models-llama-LlamaForCausalLM.json"]
