"""The notebook chain, end to end, as a user runs it: `draftsmith run all -f params/smoke.yaml
--keep-going` (smoke.yaml keeps stage 03's flagged providers, whose failed verdict would end the
chain there: tests/test_exit_codes.py).

One run of all six stages on the test-sized target against the local emulator; then every stage's
main output exists, the report renders with its figures, the run summary (summary.json, the last
lines printed, the top of report.html) holds the numbers of each stage's own report, the terminal
shows no notebook output, and the API key used is nowhere under outputs/ (executed notebooks, logs,
ledgers, shards included).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith import summary
from draftsmith.paths import Run
from draftsmith.tokens.outputs import verdict_line as tokens_verdict

pytestmark = pytest.mark.notebook


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("chain")
    key_path = out / "key.txt"
    import secrets

    key = "sk-or-v1-" + secrets.token_hex(32)
    key_path.write_text(key + "\n")
    cmd = [str(Path(sys.executable).with_name("draftsmith")), "run", "all", "-f", str(REPO / "params/smoke.yaml"),
           "-p", "outputs_dir", str(out / "outputs"), "-p", "api_key_file", str(key_path), "--keep-going"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    failed = summary.read(Run(out / "outputs", "smoke"))["verdict"] == "failed"
    assert proc.returncode == (3 if failed else 0), proc.stderr[-4000:]
    return out / "outputs" / "smoke", key, proc


def test_chain_writes_every_stage_output(smoke_run):
    run, _, _ = smoke_run
    for path in ["providers/routing.json", "generate/code/raw_responses.jsonl", "generate/chat/errors.jsonl", "generate/manifest.json",
                 "tokens/code.jsonl", "tokens/report.json", "hidden/index.json", "drafter",
                 "eval/report.json"]:
        assert (run / path).exists(), path
    for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert (run / "notebooks" / nb.name).exists() and (run / "logs" / f"{nb.stem}.log").exists()


def test_chain_report_has_every_stage_and_its_figures(smoke_run):
    run, _, _ = smoke_run
    html = (run / "report.html").read_text()
    for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert nb.stem in html
    assert html.count("<img") >= 6


def test_chain_never_writes_the_api_key_under_outputs(smoke_run):
    run, key, proc = smoke_run
    assert key not in proc.stdout and key not in proc.stderr
    leaked = [p for p in run.parent.parent.rglob("*") if p.is_file() and p.name != "key.txt"
              and key.encode() in p.read_bytes()]
    assert leaked == []


def read(path: Path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.suffix == ".jsonl" \
        else json.loads(path.read_text())


def test_chain_summary_holds_the_numbers_of_each_stages_own_report(smoke_run):
    run, _, _ = smoke_run
    saved = read(run / "summary.json")
    stages = {s["title"]: s for s in saved["stages"]}
    assert list(stages) == [nb.stem for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
    verdicts = [s["verdict"] for s in stages.values()]
    assert saved["verdict"] == ("failed" if "failed" in verdicts else "warning" if "warning" in verdicts else "ok")

    manifest, timeline = read(run / "generate/manifest.json"), read(run / "generate/timeline.jsonl")
    g = stages["02_generate"]["numbers"]
    assert g["spent_usd"] == manifest["spent_usd"] and g["spend_limit_usd"] == manifest["config"]["spend_limit_usd"]
    assert g["balance_usd"] == timeline[-1]["balance"] and g["status"] == manifest["sessions"][-1]["status"]
    assert {d["name"]: (d["output_tokens"], d["budget"], d["samples"]) for d in g["datasets"]} == {
        name: (d["completion_tokens"], d["budget"], d["samples"]) for name, d in manifest["datasets"].items()}

    tokens = read(run / "tokens/report.json")
    t, totals, kept = stages["03_validate_tokens"], tokens["totals"], tokens["totals_kept"]
    assert (t["numbers"]["samples"], t["numbers"]["kept"], t["numbers"]["excluded"], t["numbers"]["flagged_samples"]) \
        == (totals["samples"], totals["kept"], totals["excluded"], totals["flagged"])
    assert (t["numbers"]["billed_tokens"], t["numbers"]["rebuilt_tokens"], t["numbers"]["tokens_scope"]) == \
        (kept["billed_completion_tokens"], kept["reconstructed_completion_tokens"], "kept")
    assert t["numbers"]["providers_used"] == sorted(tokens["providers"])
    assert set(t["numbers"]["providers_flagged"]) == set(tokens["flagged_providers"])
    # the smoke run keeps flagged data (exclude_flagged off): stage 03's own verdict decides the summary's
    assert (t["verdict"] == "failed") == tokens_verdict(tokens).startswith("verdict: NOT fit")
    if t["verdict"] == "failed":
        assert "03_validate_tokens failed" in summary.headline(summary.build(Run(run.parent, run.name)))

    check = read(run / "hidden/check.json")
    h = stages["04_hidden_states"]["numbers"]
    for key in ("passed", "samples", "positions", "logprob_mean_abs_err", "top1_agreement", "problems"):
        assert h[key] == check[key], key
    assert (h["max_mean_abs_err"], h["min_top1"]) == (check["tolerance"]["mean_abs"], check["tolerance"]["min_top1"])
    assert (h["answers_tokens"], h["answers_mean_nll"], h["answers_argmax_agreement"], h["answers_gated"]) == \
        tuple(check["answers"][k] for k in ("tokens", "mean_nll", "argmax_agreement", "gated"))
    assert stages["04_hidden_states"]["verdict"] == ("ok" if check["passed"] else "failed")

    trained, metrics = read(run / "drafter/summary.json"), read(run / "drafter/metrics.jsonl")
    d = stages["05_train_drafter"]["numbers"]["drafters"][0]
    last_train = [m for m in metrics if m["split"] == "train"][-1]
    # the first draft position's loss, in nats, as stage 05's table shows it (`loss` sums every TTT step's)
    assert (d["steps"], d["finished"], d["train_loss"], d["train_accuracy"]) == \
        (trained["steps"], trained["finished"], last_train["loss_i"][0], last_train["acc_i"][0])
    assert (d["heldout_loss"], d["heldout_loss_start"]) == \
        (trained["heldout"]["loss_i"][0], trained["heldout_start"]["loss_i"][0])

    ev = read(run / "eval/report.json")
    e = stages["06_evaluate"]["numbers"]
    assert e["source"] == "decoder" and ev["engine"] is None   # smoke: eval_backend hf
    expected = []
    for t_ in ev["temperatures"].values():
        m = t_["methods"]
        for ds in sorted(m["eagle3"]["per_dataset"]) + ["all"]:   # each dataset's, then all held-out prompts'
            part = (lambda s: s) if ds == "all" else (lambda s, ds=ds: s["per_dataset"][ds])
            expected.append({"prompt_set": "held-out, all" if ds == "all" else f"held-out {ds}",
                             "temperature": t_["temperature"],
                             "drafter": part(m["eagle3"])["acceptance_length"],
                             "drafter_se": part(m["eagle3"])["acceptance_length_se"],
                             "drafter_prompts": part(m["eagle3"])["prompts"],
                             "ngram": part(m["prompt lookup"])["acceptance_length"],
                             "no_drafter": part(m["none"])["acceptance_length"],
                             "lossless": m["eagle3"]["lossless"]})
    assert [{k: r[k] for k in expected[0]} for r in e["rows"]] == expected and len(expected) == 3 * len(ev["temperatures"])
    h = saved["headline"]   # the headline: all held-out prompts at the greedy temperature
    assert (h["drafter"], h["ngram"], h["prompts"]) == (expected[2]["drafter"], expected[2]["ngram"], expected[2]["drafter_prompts"])


def test_chain_terminal_shows_one_line_per_stage_and_ends_with_the_summary(smoke_run):
    run, _, proc = smoke_run
    printed = proc.stderr.splitlines()
    for chatter in ("Executing cell", "Ending cell", "<Figure size", "<IPython.core.display"):
        assert not any(chatter in line for line in printed), chatter
    assert all(line.strip() for line in printed), "a blank line"
    assert len(printed) == len(set(printed)), "a line printed twice"
    built = summary.build(Run(run.parent, run.name))
    last = summary.lines(built)
    assert printed[-len(last):] == last  # the summary, as summary.json and the report have it
    assert printed[-len(last) - 1] == f"draftsmith: outputs in {run}: report.html, summary.json, logs/"
    during = printed[:-len(last) - 1]
    for s in built.stages:  # one line per stage as it ends: the summary's stage line with the same figures
        line = next(x for x in during if x.startswith(s.title + " "))
        assert line.split()[1] == s.verdict.value and line.endswith("; ".join(f.text for f in s.figures))
    assert len(during) <= 1 + len(built.stages) + sum(x.startswith("draftsmith: warning:") for x in during), during
    assert proc.stdout == ""


def test_chain_report_opens_with_the_summary_linking_each_stage_and_its_log(smoke_run):
    run, _, _ = smoke_run
    html = (run / "report.html").read_text()
    top = html[:html.index('<a id="01_providers">')]
    saved = read(run / "summary.json")
    assert f'Run summary: <span class="{saved["verdict"]}">{saved["verdict"]}</span>' in top
    for s in saved["stages"]:
        assert f'<a href="#{s["title"]}">{s["title"]}</a>' in top and f'<a href="{s["log"]}">log</a>' in top
        assert (run / s["log"]).is_file()
