"""The run summary (`draftsmith.summary`) from hand-written stage outputs: each stage's verdict and
figures come from its own files, a warned or failed stage is named at the top and at the end, the
report opens with the block, and summary.json holds the same numbers. (tests/test_chain.py checks
the summary of a real chain run against each stage's own report.)"""

import json
import re
from html import unescape

import nbformat
import pytest

from draftsmith import summary
from draftsmith.paths import Run
from draftsmith.report import write_report
from draftsmith.summary import Verdict
from draftsmith.evaluate import results

pytestmark = pytest.mark.unit

TITLES = ["01_providers", "02_generate", "03_validate_tokens", "04_hidden_states", "05_train_drafter", "06_evaluate"]


def executed(run: Run, title: str, seconds: float = 12.0, error: tuple[str, str] | None = None) -> None:
    """An executed notebook as papermill leaves it: its run time, and a cell's error if it failed."""
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("stage.run()")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{title} printed this\n")]
    if error:
        cell.outputs.append(nbformat.v4.new_output("error", ename=error[0], evalue=error[1], traceback=[]))
    nb.cells.append(cell)
    nb.metadata["papermill"] = {"duration": seconds, "exception": True if error else None,
                                "end_time": "2026-12-04T08:00:00"}
    nbformat.write(nb, run.dir("notebooks") / f"{title}.ipynb")


def put(run: Run, rel: str, doc) -> None:
    path = run.root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in doc) if rel.endswith(".jsonl") else json.dumps(doc))


def provider(samples, flagged=False, cause=None, reasons=()):
    return {"samples": samples, "flagged": flagged, "cause": cause, "reasons": list(reasons)}


def method(kind, by_set, lossless=None, final=None, key="acceptance_length"):
    m = {"kind": kind, "lossless": lossless, "per_dataset": {ds: {key: v} for ds, v in by_set.items()}}
    if final is not None:
        m["final"] = final
    return m


def decoder_temperatures(lossless=True):
    return {"0": {"temperature": 0.0, "methods": {
                "none": method("none", {"code": 1.0, "chat": 1.0}, True),
                "prompt lookup": method("prompt_lookup", {"code": 1.4, "chat": 1.2}, True),
                "eagle3 50%": method("eagle3", {"code": 1.5, "chat": 1.3}, True, final=False),
                "eagle3": method("eagle3", {"code": 1.9, "chat": 1.6}, lossless, final=True)}},
            "1": {"temperature": 1.0, "methods": {
                "none": method("none", {"code": 1.0, "chat": 1.0}),
                "prompt lookup": method("prompt_lookup", {"code": 1.1, "chat": 1.05}),
                "eagle3": method("eagle3", {"code": 1.7, "chat": 1.5}, final=True)}}}


@pytest.fixture
def run(tmp_path):
    """A run whose six stages all ran and whose outputs are all fine."""
    run = Run(tmp_path / "outputs", "r")
    for title in TITLES:
        executed(run, title)
    put(run, "providers/summary.json", {"balance_usd": 10.0, "stage_01_spent_usd": 0.004, "fits_fraction": 1.0})
    put(run, "providers/routing.json", {"allowed": ["moonshotai/int4", "parasail/int4", "deepinfra/int4"],
                                        "excluded": [{"tag": "deepinfra/fp4", "reason": "fp4 is below the native int4"}]})
    put(run, "generate/manifest.json", {
        "config": {"spend_limit_usd": 1.0}, "spent_usd": 0.0321,
        "datasets": {"code": {"samples": 40, "completion_tokens": 8100, "budget": 8000, "failed_for_good": 0},
                     "chat": {"samples": 90, "completion_tokens": 20300, "budget": 20000, "failed_for_good": 1}},
        "sessions": [{"status": "finished", "message": ""}]})
    put(run, "generate/timeline.jsonl", [{"spent": 0.01, "balance": 9.99}, {"spent": 0.0321, "balance": 9.9679}])
    totals = {"samples": 130, "kept": 90, "excluded": 40, "flagged": 3, "billed_completion_tokens": 28400,
              "reconstructed_completion_tokens": 27900, "response_tokens_kept": 19000}
    put(run, "tokens/report.json", {
        "exclude_flagged": True, "totals": totals,
        "totals_kept": {**totals, "billed_completion_tokens": 19100, "reconstructed_completion_tokens": 19000},
        "providers": {"Moonshot AI": provider(60), "DeepInfra": provider(32),
                      "Parasail": provider(38, True, "stripped_whitespace", ["strips whitespace"])},
        "flagged_providers": {"Parasail": {"cause": "stripped_whitespace", "reasons": ["strips whitespace"]}},
        "datasets": {"code": {"malformed_lines": 0}, "chat": {"malformed_lines": 0}}})
    put(run, "hidden/check.json", {
        "samples": 4, "positions": 508, "engine": "vllm", "engine_dtype": "float32", "storage_dtype": "bf16",
        "vllm": "0.11.0", "model_runner": "v1",
        "logprob_mean_abs_err": 0.0021, "logprob_max_abs_err": 0.02, "top1_agreement": 1.0,
        "roundtrip_rel_err": {"aux": 0.002, "last": 0.002},
        "health": {"nonfinite": {"aux 1": 0, "last": 0}, "rms": {"aux 1": 10.0, "last": 1.0},
                   "closest_layers": "aux 1 ~ last", "min_layer_distance": 0.5},
        "tolerance": {"mean_abs": 0.02, "max_abs": 0.25, "min_top1": 0.98}, "problems": [], "passed": True,
        "seconds": 1.5,
        "answers": {"tokens": 380, "mean_nll": 5.61, "argmax_agreement": 0.061, "gated": True,
                    "bounds": {"max_nll": 7.0, "min_agreement": 0.02, "min_tokens": 32}}})
    put(run, "hidden/summary.json", {"tokens_extracted": 31000, "shards_written": 5, "shards_rejected": 0})
    put(run, "drafter/summary.json", {
        "kind": "eagle3", "steps": 40, "total_steps": 40, "finished": True,
        "heldout": {"loss": 27.0, "loss_i": [9.5, 8.5, 9.0], "acc_i": [0.41, 0.3, 0.2]},
        "heldout_start": {"loss": 50.0, "loss_i": [16.9, 16.5, 16.6], "acc_i": [0.0, 0.0, 0.0]}})   # loss: the sum
    put(run, "drafter/metrics.jsonl", [{"split": "train", "step": 39, "loss": 9.9, "acc_i": [0.38, 0.3, 0.2]},
                                       {"split": "train", "step": 40, "loss": 29.0, "loss_i": [9.7, 9.6, 9.7],
                                        "acc_i": [0.4, 0.3, 0.2]},
                                       {"split": "heldout", "step": 40, "loss": 9.5, "acc_i": [0.41, 0.3, 0.2]}])
    put(run, "eval/report.json", {"engine": None, "temperatures": decoder_temperatures(), "benchmarks": None})
    return run


def texts(notes: list[summary.Note]) -> list[str]:
    return [n.text for n in notes]


def stage(s: summary.Summary, title: str) -> summary.StageSummary:
    return next(x for x in s.stages if x.title == title)


def test_a_run_whose_stages_are_all_fine_is_ok_with_each_stages_deciding_figures(run):
    s = summary.build(run)
    assert s.verdict == Verdict.OK and [x.title for x in s.stages] == TITLES
    assert all(x.verdict == Verdict.OK and texts(x.notes) == [] and x.seconds == 12.0 for x in s.stages)
    text = "\n".join(summary.lines(s))
    for figure in ("3 endpoints allowed, 1 excluded", "spent $0.0321 of $1.00 limit, balance $9.97",
                   "code 8,100 / 8,000 tokens", "90 of 130 samples kept",
                   "billed vs rebuilt on kept: 19,100 vs 19,000 tokens",
                   "excluded 40 samples: 38 from the flagged providers (Parasail) + 2 flagged one by one from the others",
                   "check passed on 4 samples (508 positions; vllm 0.11.0, model runner v1, float32)",
                   "own answers (380 tokens): mean NLL 5.61 nat (<= 7), argmax agreement 6.1% (>= 2%)",
                   "final train loss 9.7 nat, accuracy 40.0%", "held-out loss 16.9 -> 9.5 nat",
                   "held-out code T=0: acceptance 1.90 vs ngram 1.40, none 1.00, lossless",
                   "held-out chat T=1: acceptance 1.50 vs ngram 1.05, none 1.00"):
        assert figure in text, figure
    assert summary.lines(s)[0] == "run r: ok"
    rows = stage(s, "06_evaluate").numbers.rows
    assert [(r.prompt_set, r.temperature, r.drafter, r.ngram, r.no_drafter, r.lossless) for r in rows] == [
        ("held-out chat", 0.0, 1.6, 1.2, 1.0, True), ("held-out code", 0.0, 1.9, 1.4, 1.0, True),
        ("held-out chat", 1.0, 1.5, 1.05, 1.0, None), ("held-out code", 1.0, 1.7, 1.1, 1.0, None)]


def test_summary_json_and_the_top_of_the_report_hold_the_same_summary(run):
    s = summary.build(run)
    summary.write(run, s)
    saved = summary.read(run)
    assert saved == json.loads(json.dumps(s.to_json())) and saved["verdict"] == "ok"
    gen = saved["stages"][1]
    assert gen["title"] == "02_generate" and gen["numbers"]["spent_usd"] == 0.0321
    assert gen["numbers"]["balance_usd"] == 9.9679 and gen["numbers"]["datasets"][1]["budget"] == 20000
    html = write_report(run, s).read_text(encoding="utf-8")
    top = html[:html.index('<a id="01_providers">')]   # the block comes before the first stage's section
    assert 'Run summary: <span class="ok">ok</span>' in top and 'href="summary.json"' in top
    for title in TITLES:
        assert f'<a href="#{title}">{title}</a>' in top and f'href="logs/{title}.log"' in top
    assert '<a href="#02_generate">spent $0.0321 of $1.00 limit, balance $9.97</a>' in top  # a figure links its section
    assert '<em>stage 02_generate</em> · <span class="ok">ok</span> · <a href="logs/02_generate.log">log</a>' in html


def test_flagged_providers_kept_fail_stage_03_and_the_run_says_so_at_the_top_and_the_end(run):
    report = json.loads((run.root / "tokens/report.json").read_text())
    report["exclude_flagged"] = False
    put(run, "tokens/report.json", report)
    s = summary.build(run)
    assert stage(s, "03_validate_tokens").verdict == Verdict.FAILED and s.verdict == Verdict.FAILED
    assert all(x.verdict == Verdict.OK for x in s.stages if x.title != "03_validate_tokens")  # later stages ran on it
    out = summary.lines(s)
    assert out[0] == "run r: failed (03_validate_tokens failed)"
    assert out[-1].startswith("  ! 03_validate_tokens: not fit to train on as kept: Parasail (stripped_whitespace)")
    assert "exclude_flagged: true" in out[-1]
    html = write_report(run, s).read_text(encoding="utf-8")
    assert 'Run summary: <span class="failed">failed</span>' in html[:html.index('<a id="01_providers">')]


def test_providers_flagged_only_for_how_they_count_tokens_are_fit_to_train_on_as_kept(run):
    report = json.loads((run.root / "tokens/report.json").read_text())
    report["exclude_flagged"] = False
    report["providers"]["Parasail"]["cause"] = "other_tokenizer"
    report["flagged_providers"]["Parasail"]["cause"] = "other_tokenizer"
    put(run, "tokens/report.json", report)
    s = stage(summary.build(run), "03_validate_tokens")
    assert s.verdict == Verdict.OK and "flagged: Parasail (other_tokenizer)" in summary.stage_line(s)
    assert s.numbers.providers_excluded == []


def test_stage_04s_check_failing_fails_the_stage_with_its_problems_and_likely_cause(run):
    check = json.loads((run.root / "hidden/check.json").read_text())
    check.update(passed=False, top1_agreement=0.52, problems=["stored top-1 agreement 0.5200 < 0.98"],
                 cause="the stored final state is before the final norm")
    put(run, "hidden/check.json", check)
    s = summary.build(run)
    h = stage(s, "04_hidden_states")
    assert h.verdict == Verdict.FAILED and s.verdict == Verdict.FAILED
    assert "check FAILED on 4 samples" in summary.stage_line(h) and "top-1 agreement 52.0% (>= 98%)" in summary.stage_line(h)
    assert texts(h.notes) == ["its own check failed: stored top-1 agreement 0.5200 < 0.98; likely cause: the stored final "
                       "state is before the final norm"]
    assert summary.lines(s)[0] == "run r: failed (04_hidden_states failed)"


def test_a_drafter_whose_greedy_outputs_differ_from_no_drafter_fails_stage_06(run):
    put(run, "eval/report.json", {"engine": None, "temperatures": decoder_temperatures(lossless=False)})
    e = stage(summary.build(run), "06_evaluate")
    assert e.verdict == Verdict.FAILED and "NOT lossless" in summary.stage_line(e)
    assert "differ from no drafter's at T=0" in e.notes[0].text


def engine_part(by_set_drafter, ngram=1.3, se=None, prompts=None):
    """vLLM's part of a stage 06 report at T = 0: the final drafter's figures by set (or (length, se))
    against ngram's `ngram` (or (length, se)), each counted over `prompts`."""
    def m(kind, by_set, final=None):
        out = method(kind, {}, True, final=final)
        for ds, v in by_set.items():
            length, e = v if isinstance(v, tuple) else (v, se)
            out["per_dataset"][ds] = {"acceptance_length": length, "acceptance_length_se": e, "prompts": prompts}
        return out

    return {"version": "0.32.0", "temperatures": {"0": {"temperature": 0.0, "methods": {
        "none": m("none", {k: (1.0, 0.0) for k in by_set_drafter}),
        "ngram": m("ngram", {k: ngram for k in by_set_drafter}),
        "eagle3": m("eagle3", by_set_drafter, final=True)}}}}


def test_with_the_engine_the_acceptance_lengths_are_vllms_on_every_prompt_set_and_a_weaker_drafter_is_a_warning(run):
    put(run, "eval/report.json", {"engine": engine_part({"code": 1.8, "chat": 1.2}, se=0.02, prompts=4),
                                  "temperatures": decoder_temperatures(),
                                  "benchmarks": {"engine": engine_part({"mt_bench": 1.25}, se=0.02, prompts=4),
                                                 "temperatures": {}}})
    e = stage(summary.build(run), "06_evaluate")
    assert e.numbers.source == "vllm"
    assert [(r.prompt_set, r.drafter, r.ngram, r.drafter_se, r.drafter_prompts) for r in e.numbers.rows] == [
        ("held-out chat", 1.2, 1.3, 0.02, 4), ("held-out code", 1.8, 1.3, 0.02, 4), ("MT-bench", 1.25, 1.3, 0.02, 4)]
    assert "held-out chat T=0: acceptance 1.20 ± 0.02 (4 prompts) vs ngram 1.30 ± 0.02" in summary.stage_line(e)
    # chat: a gap of -0.10 against 2 SE of the difference 0.057: beyond noise; MT-bench: -0.05, within it
    assert e.verdict == Verdict.WARNING and texts(e.notes) == [
        "the drafter is below ngram beyond noise on held-out chat T=0: 1.20 vs 1.30, gap -0.10 (beyond 2 standard "
        "errors of the difference, 0.06)"]


def test_a_drafter_below_ngram_by_less_than_the_noise_is_no_warning(run):
    """The issue's case: held-out code at T = 0, 1.76 against 1.78 on 3 prompts, each figure +-0.1."""
    put(run, "eval/report.json", {"engine": engine_part({"code": (1.76, 0.1), "chat": (1.9, 0.1)}, ngram=(1.78, 0.08),
                                                        prompts=3), "temperatures": decoder_temperatures()})
    e = stage(summary.build(run), "06_evaluate")
    assert e.verdict == Verdict.OK and texts(e.notes) == []
    code = next(r for r in e.numbers.rows if r.prompt_set == "held-out code")
    assert code.versus_ngram()[0] == results.Versus.WITHIN_NOISE
    # the same gap measured tightly is beyond noise: the margin, not the sign, decides
    put(run, "eval/report.json", {"engine": engine_part({"code": (1.76, 0.004), "chat": (1.9, 0.004)},
                                                        ngram=(1.78, 0.004), prompts=300),
                                  "temperatures": decoder_temperatures()})
    e = stage(summary.build(run), "06_evaluate")
    assert e.verdict == Verdict.WARNING and len(e.notes) == 1
    assert "held-out code T=0: 1.76 vs 1.78, gap -0.02" in e.notes[0].text


def test_the_standard_error_over_prompts_is_one_definition_for_vllms_counters_and_our_decoder():
    from draftsmith.evaluate import metrics

    # per prompt: accepted 2 of 2 drafts and 4 of 2 -> r = 1.5; residuals -1, +1; sqrt(2 * 2) / 4
    assert metrics.acceptance_se([2, 4], [2, 2]) == pytest.approx(0.5)
    assert metrics.acceptance_se([3], [2]) is None and metrics.acceptance_se([0, 0], [0, 0]) == 0.0
    engine_rows = [{"counters": {"drafts": d, "accepted": a, "draft_tokens": 3 * d, "per_pos": [0, 0, 0]},
                    "accepted": [a] + [0] * (d - 1), "output": [1] * 5, "seconds": 1.0}
                   for a, d in ((2, 2), (4, 2), (1, 3))]
    decoder_rounds = [{"drafted": [3] * d + [0], "accepted": [a] + [0] * d, "produced": [1] * (d + 1),
                       "top_prob": [1.0] * (d + 1)} for a, d in ((2, 2), (4, 2), (1, 3))]
    e, o = metrics.engine_acceptance(engine_rows, 3), metrics.acceptance(decoder_rounds, 3)
    assert e["acceptance_length"] == pytest.approx(o["acceptance_length"]) == pytest.approx(1 + 7 / 7)
    assert e["acceptance_length_se"] == pytest.approx(o["acceptance_length_se"]) and o["acceptance_length_se"] > 0
    assert e["prompts"] == o["prompts"] == 3
    # three prompts that happen to agree exactly have no spread over prompts; the steps' own spread
    # (accepted 0..3 at each step) still bounds the figure's noise from below
    same = [2, 2, 2], [2, 2, 2]
    assert metrics.acceptance_se(*same) == 0.0
    steps = [3, 0, 2, 1, 0, 0]
    floor = (sum((x - 1) ** 2 for x in steps) / 5 / 6) ** 0.5
    assert metrics.acceptance_se(*same, steps) == pytest.approx(floor) and floor > 0.4
    assert metrics.acceptance_se([3], [2], [3, 0]) == pytest.approx(1.5)   # one prompt: its steps' spread


def test_a_stage_that_stopped_in_a_cell_or_left_no_output_is_failed_naming_why(run):
    executed(run, "05_train_drafter", error=("RuntimeError", "CUDA out of memory\nmore"))
    (run.root / "eval/report.json").unlink()
    s = summary.build(run)
    assert stage(s, "05_train_drafter").notes[0].text == "stopped: RuntimeError: CUDA out of memory"
    assert texts(stage(s, "06_evaluate").notes) == ["stopped: eval/report.json: no stage 06 report (run stage 06 first)"]
    assert summary.lines(s)[0] == "run r: failed (05_train_drafter failed, 06_evaluate failed)"


def test_a_dataset_whose_prompts_ran_out_below_its_budget_is_no_warning(run):
    manifest = json.loads((run.root / "generate/manifest.json").read_text())
    manifest["datasets"]["chat"]["completion_tokens"] = 12000
    put(run, "generate/manifest.json", manifest)
    g = stage(summary.build(run), "02_generate")
    assert g.verdict == Verdict.OK and texts(g.notes) == []
    assert "chat 12,000 / 20,000 tokens (its prompts ran out)" in summary.stage_line(g)


def test_stage_02_stopped_short_of_its_budgets_is_a_warning_that_says_how_it_ended(run):
    manifest = json.loads((run.root / "generate/manifest.json").read_text())
    manifest["datasets"]["chat"]["completion_tokens"] = 12000
    manifest["sessions"][-1] = {"status": "spend_limit", "message": "the spend limit $1.00 is reached"}
    put(run, "generate/manifest.json", manifest)
    g = stage(summary.build(run), "02_generate")
    assert g.verdict == Verdict.WARNING
    assert texts(g.notes) == ["its last session ended spend_limit: the spend limit $1.00 is reached; re-run stage 02 to go on",
                       "below budget: chat 12,000 of 20,000 tokens"]


def test_only_the_stages_that_ran_are_summed_up(tmp_path):
    run = Run(tmp_path / "outputs", "one")
    executed(run, "01_providers")
    put(run, "providers/summary.json", {"balance_usd": None, "stage_01_spent_usd": 0.0, "fits_fraction": 0.5})
    put(run, "providers/routing.json", {"allowed": ["a/int4"], "excluded": []})
    s = summary.build(run)
    assert [x.title for x in s.stages] == ["01_providers"] and s.verdict == Verdict.WARNING
    assert "balance n/a, the plan fits 50%" in summary.stage_line(s.stages[0])


def test_a_check_written_before_the_stage_recorded_the_engines_answers_is_summed_up_without_them(run):
    check = json.loads((run.root / "hidden/check.json").read_text())
    for key in ("answers", "vllm", "model_runner"):
        del check[key]
    put(run, "hidden/check.json", check)
    h = stage(summary.build(run), "04_hidden_states")
    assert h.verdict == Verdict.OK and h.numbers.answers_mean_nll is None and h.numbers.engine == "vllm, float32"
    assert "own answers" not in summary.stage_line(h)


def test_summary_json_is_data_one_schema_for_every_stage_with_a_headline_meta_and_a_reason_per_note(run):
    engine = engine_part({"code": (1.5, 0.05), "chat": (1.9, 0.05)}, ngram=(1.8, 0.04), prompts=4)
    engine["temperatures"]["0"]["methods"]["eagle3"].update(acceptance_length=1.7, acceptance_length_se=0.04,
                                                            prompts=8)
    engine["temperatures"]["0"]["methods"]["ngram"].update(acceptance_length=1.62, acceptance_length_se=0.03)
    put(run, "eval/report.json", {"engine": engine, "temperatures": decoder_temperatures()})
    (run.root / "params.yaml").write_text("seed: 3\n")
    s = summary.build(run, params_file=str(run.root / "params.yaml"))
    summary.write(run, s)
    saved = summary.read(run)
    # every stage: the same keys, numbers an object of numbers (stage 05's drafters a list inside it)
    assert {tuple(sorted(x)) for x in saved["stages"]} == {
        ("figures", "log", "notes", "numbers", "seconds", "section", "target_build_seconds", "title", "verdict")}
    assert [type(x["numbers"]).__name__ for x in saved["stages"]] == ["dict"] * 6, [x["notes"] for x in saved["stages"]]
    assert saved["stages"][4]["numbers"]["drafters"][0]["heldout_loss"] == 9.5
    assert saved["stages"][5]["notes"] == [{"reason": "below_ngram", "text": saved["stages"][5]["notes"][0]["text"]}]
    assert "held-out code T=0: 1.50 vs 1.80, gap -0.30" in saved["stages"][5]["notes"][0]["text"]
    m = saved["meta"]
    assert m["params_file"].endswith("params.yaml") and len(m["params_sha256"]) == 64
    assert m["versions"]["python"] and m["versions"]["pandas"] and m["date"].startswith("20")
    assert m["commit"] is None or len(m["commit"].split("+")[0]) == 12
    h = saved["headline"]
    assert (h["drafter"], h["drafter_se"], h["prompts"], h["ngram"], h["ngram_se"], h["no_drafter"], h["lossless"]) == \
        (1.7, 0.04, 8, 1.62, 0.03, 1.0, True)
    assert h["text"] == ("headline: final drafter 1.70 ± 0.04 (within noise of ngram), ngram 1.62 ± 0.03, no drafter "
                         "1.00: greedy acceptance length on 8 held-out prompts, vLLM 0.32.0, lossless")
    assert summary.lines(s)[-1] == h["text"]      # the last line `draftsmith run` prints
    html = write_report(run, s).read_text(encoding="utf-8")
    text = [x.strip() for x in unescape(re.sub(r"<[^>]+>", "\n", html[html.index("<body"):])).splitlines()]
    assert [x for x in text if x][:2] == [h["text"], "draftsmith run"]    # report.html's first line, then its title
    assert "params.yaml (sha256 " + m["params_sha256"][:12] in html and "python " + m["versions"]["python"] in html


def test_results_csv_is_one_row_per_method_prompt_set_and_temperature_read_back_with_pandas(run):
    import pandas as pd

    engine = engine_part({"code": (1.5, 0.05), "chat": (1.9, 0.06)}, ngram=(1.8, 0.04), prompts=4)
    for m in engine["temperatures"]["0"]["methods"].values():
        for ds in m["per_dataset"].values():
            ds.update(drafts=40, position_acceptance=[0.5, 0.3, 0.1] if m["kind"] != "none" else [])
        m["k"] = 3
    report = {"engine": engine, "temperatures": decoder_temperatures(), "draft_tokens": 3}
    path = results.write_csv(run, report)
    assert path == run.root / "eval" / "results.csv"
    df = pd.read_csv(path)
    assert list(df.columns) == ["temperature", "prompt_set", "method", "kind", "final", "measured_in",
                                "acceptance_length", "acceptance_length_se", "prompts", "drafts",
                                "draft_acceptance_rate", "k", "lossless", "p_accept_1", "p_accept_2", "p_accept_3"]
    assert len(df) == 6 and not df.duplicated(["method", "prompt_set", "temperature"]).any()
    code = df[(df.prompt_set == "held-out code") & (df.method == "eagle3")].iloc[0]
    assert (code.acceptance_length, code.acceptance_length_se, code.prompts, code.drafts, code.k) == (1.5, 0.05, 4, 40, 3)
    assert (code.p_accept_1, code.p_accept_3, bool(code.final), code.measured_in) == (0.5, 0.1, True, "vLLM 0.32.0")
    assert df[df.kind == "none"].p_accept_1.isna().all()


def test_a_stage_that_built_the_built_in_target_says_how_much_of_its_time_the_build_took(run, tmp_path, monkeypatch):
    from datetime import datetime

    from draftsmith.targets import tiny

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    built = tmp_path / "cache" / "targets"

    def build(work, say):   # a build as build_once runs it: its folder gets the record when it is done
        (work / "out").mkdir()
        (work / "out" / "config.json").write_text("{}")
        return [(work / "out", built / tiny.variant_key("tiny"))]

    tiny.build_once(built, "k", built / tiny.variant_key("tiny"), "a build", build, log=lambda m: None)
    started, finished = tiny.build_record(built / tiny.variant_key("tiny"))
    assert started <= finished
    # stage 01 ran from 100 s before the build finished to 20 s after it, and the build took 98 s of it
    (built / tiny.variant_key("tiny") / tiny.BUILD_RECORD).write_text(json.dumps({"started": 1e9, "finished": 1e9 + 98}))
    nb = run.root / "notebooks" / "01_providers.ipynb"
    doc = json.loads(nb.read_text())
    doc["metadata"]["papermill"].update(duration=120.0, start_time=datetime.fromtimestamp(1e9 - 2).isoformat(),
                                        end_time=datetime.fromtimestamp(1e9 + 118).isoformat())
    nb.write_text(json.dumps(doc))
    (run.root / "run_params.yaml").write_text("target_model_path: tiny\n")
    s = summary.build(run)
    assert stage(s, "01_providers").target_build_seconds == pytest.approx(98)
    assert summary.stage_line(stage(s, "01_providers")).startswith("01_providers  ok       2.0 min (target build 98 s)  ")
    assert stage(s, "02_generate").target_build_seconds is None     # it ran after the build
    (run.root / "run_params.yaml").write_text("target_model_path: /some/checkpoint\n")
    assert stage(summary.build(run), "01_providers").target_build_seconds is None
