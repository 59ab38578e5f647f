"""Stage 03 end to end on a synthetic run: six providers, five of them with one quirk each, written as
stage 02 writes raw_responses.jsonl. Every quirk must be flagged with its cause, the clean provider not;
outputs, exclusion, malformed lines and resuming after an interruption. (The notebook itself runs in
test_tokens_emulator.py.)"""

import functools
import json

import matplotlib.pyplot as plt
import pytest

from draftsmith import tokens
from draftsmith.tokens import stage
from draftsmith.targets.corpus import chat_examples
from draftsmith.paths import Run

from conftest import stage_config

pytestmark = pytest.mark.unit

PROVIDERS = ("Clean", "Strip", "OtherTok", "Split", "Trunc", "Drop")
EXPECTED_CAUSE = {"Strip": "stripped_whitespace", "OtherTok": "other_tokenizer", "Split": "non_canonical_split",
                  "Trunc": "truncated_reasoning", "Drop": "dropped_reasoning"}


@functools.lru_cache(maxsize=1)
def EXAMPLES():
    return chat_examples(limit=300)


def synthetic_rows(tok, dataset: str, n_per_provider: int, offset: int = 0) -> list[dict]:
    """Raw responses with billed counts from the template's own tokenization of what the 'model'
    wrote; each provider then returns or bills it with its quirk."""
    examples = EXAMPLES()
    rows = []
    for i in range(n_per_provider * len(PROVIDERS)):
        provider = PROVIDERS[i % len(PROVIDERS)]
        k = i // len(PROVIDERS)
        conv = examples[offset + i]
        messages = conv[:1]
        reasoning = conv[1]["reasoning_content"]
        content = ("\n\n" if k % 2 else "") + conv[1]["content"]  # the model starts with a blank line half the time
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        full = tok.apply_chat_template(messages + [{"role": "assistant", "reasoning_content": reasoning,
                                                    "content": content}], tokenize=True, return_dict=False)
        billed_p, billed_c = len(prompt), len(full) - len(prompt)
        billed_r = len(tok(reasoning, add_special_tokens=False)["input_ids"])
        quirky = k % 2 == 0
        if provider == "Strip":
            content = content.strip()
        elif provider == "OtherTok":
            billed_p, billed_c = billed_p + billed_p // 7 + 1, billed_c + billed_c // 7 + 1
        elif provider == "Split" and quirky:
            billed_c += 1
        elif provider == "Trunc" and quirky:
            reasoning = reasoning[: len(reasoning) // 2]
        elif provider == "Drop" and quirky:
            reasoning = None
        rows.append({"sample_id": f"{dataset}-{i}", "dataset": dataset, "messages": messages, "content": content,
                     "reasoning": reasoning, "finish_reason": "stop", "native_finish_reason": "stop",
                     "provider": provider, "model": "moonshotai/kimi-k2.5", "generation_id": f"gen-{dataset}-{i}",
                     "usage": {"prompt_tokens": billed_p, "completion_tokens": billed_c, "reasoning_tokens": billed_r,
                               "cost": 1e-6},
                     "request": {"max_tokens": 512}, "attempts": 1, "latency_s": 0.5})
    return rows


def write_raw(run: Run, dataset: str, rows: list[dict], extra: str = "") -> None:
    path = run.dir(f"generate/{dataset}") / "raw_responses.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + extra)


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory, target_tokenizer):
    run = Run(tmp_path_factory.mktemp("out"), "smoke")
    write_raw(run, "code", synthetic_rows(target_tokenizer, "code", 12),
              extra='{"sample_id": "bad", "messages": "oops"}\n'
                    '{"sample_id": "tool", "messages": [{"role": "tool", "content": "42"}], "content": "ok"}\n'
                    '{"sample_id": "torn"')
    write_raw(run, "chat", synthetic_rows(target_tokenizer, "chat", 12, offset=150))
    return run


SPECS = [{"name": "code", "path": "unused"}, {"name": "chat", "path": "unused"}]


def stage_03(run, datasets, target, **params) -> dict:
    """What notebook 03 calls (`stage.run`), its parameters at their defaults but for `params`."""
    return stage.run(run, stage_config("03", datasets=datasets, target_model_path=str(target), **params),
                     log=lambda *a: None)


def test_every_quirky_provider_is_flagged_with_its_cause(synthetic_run, tiny_target):
    report = stage_03(synthetic_run, SPECS, tiny_target)
    prov = report["providers"]
    assert not prov["Clean"]["flagged"] and prov["Clean"]["exact_match_rate"] == 1.0
    assert prov["Clean"]["relative_error"] == 0 and prov["Clean"]["cause"] is None
    for p, cause in EXPECTED_CAUSE.items():
        assert prov[p]["flagged"], p
        assert prov[p]["cause"] == cause, (p, prov[p])
    assert set(report["flagged_providers"]) == set(EXPECTED_CAUSE)
    assert prov["Strip"]["stripped_edges"] == ["content_lead"]
    assert prov["OtherTok"]["prompt_exact_match_rate"] == 0 and prov["Clean"]["prompt_exact_match_rate"] == 1
    assert prov["Drop"]["issues"]["reasoning_missing"] == 12
    t = report["totals"]
    assert t["samples"] == 144 and t["kept"] == 144 and t["relative_error"] > 0
    assert "relative error" in tokens.summary(report) and "FLAGGED Strip: cause stripped_whitespace" in tokens.summary(report)
    # malformed lines are skipped and named with file and line; a torn last line (stage 02 still
    # writing, or killed) is left out as stage 02 itself leaves it out
    code = report["datasets"]["code"]
    assert code["malformed_lines"] == 2
    assert any("raw_responses.jsonl:73: field 'messages'" in p for p in code["problems"])
    assert any(":74: chat template" in p and "unsupported role: tool" in p for p in code["problems"])
    assert not any("torn" in p or ":75" in p for p in code["problems"])
    figs = tokens.figures(synthetic_run, report)
    assert set(figs) == {"delta_hist.png", "provider_deltas.png", "lengths.png"}
    assert len(figs["provider_deltas.png"].axes[0].patches) == len(PROVIDERS)  # one bar per provider
    assert {t.get_text() for t in figs["lengths.png"].axes[0].get_legend().get_texts()} == {"code", "chat"}
    assert sum(p.get_height() for p in figs["delta_hist.png"].axes[0].patches) == 144  # every counted sample
    plt.close("all")
    assert not list((synthetic_run.root / "tokens" / ".work").iterdir())  # work files go once the stage is done


def test_token_files_hold_what_stage_04_reads(synthetic_run, tiny_target, target_tokenizer):
    stage_03(synthetic_run, SPECS, tiny_target)
    lines = [json.loads(x) for x in (synthetic_run.root / "tokens" / "code.jsonl").open()]
    assert len(lines) == 72
    for ln in lines:
        assert {"sample_id", "dataset", "provider", "input_ids", "loss_mask", "output_ids", "billed_completion_tokens",
                "reconstructed_completion_tokens", "checks", "flagged"} <= set(ln)
        p = len(ln["input_ids"]) - len(ln["output_ids"])
        assert ln["input_ids"][p:] == ln["output_ids"] and ln["loss_mask"] == [0] * p + [1] * len(ln["output_ids"])
        assert ln["reconstructed_completion_tokens"] == len(ln["output_ids"]) and ln["dataset"] == "code"
    clean = [ln for ln in lines if ln["provider"] == "Clean"]
    for ln in clean:  # the clean provider's ids are the template's own tokenization of the conversation
        assert ln["checks"]["completion_delta"] == 0 and not ln["flagged"]
        assert ln["input_ids"][-1] == 1 and ln["loss_mask"][-1] == 1


def test_exclude_flagged_keeps_only_clean_providers_but_reports_all(synthetic_run, tiny_target):
    report = stage_03(synthetic_run, SPECS, tiny_target, exclude_flagged=True)
    kept = [json.loads(x) for name in ("code", "chat") for x in (synthetic_run.root / "tokens" / f"{name}.jsonl").open()]
    assert {ln["provider"] for ln in kept} == {"Clean"} and len(kept) == 24
    checks = [json.loads(x) for x in (synthetic_run.root / "tokens" / "checks" / "code.jsonl").open()]
    assert len(checks) == 72 and sum(c["excluded"] for c in checks) == 60
    assert report["totals"]["kept"] == 24 and report["totals"]["excluded"] == 120


def test_an_interrupted_stage_redoes_only_unfinished_datasets(tmp_path, tiny_target, target_tokenizer, monkeypatch):
    run = Run(tmp_path, "r")
    write_raw(run, "code", synthetic_rows(target_tokenizer, "code", 2))
    write_raw(run, "chat", synthetic_rows(target_tokenizer, "chat", 2, offset=100))
    real = tokens.Reconstructor.rebuild
    seen = []

    def crash_on_chat(self, batch):
        seen.append(batch[0].dataset)
        if batch[0].dataset == "chat":
            raise KeyboardInterrupt
        return real(self, batch)

    monkeypatch.setattr(tokens.Reconstructor, "rebuild", crash_on_chat)
    with pytest.raises(KeyboardInterrupt):
        stage_03(run, SPECS, tiny_target)
    assert not (run.root / "tokens" / "code.jsonl").exists()  # nothing final until every dataset is done
    monkeypatch.setattr(tokens.Reconstructor, "rebuild", lambda self, b: (seen.append(b[0].dataset), real(self, b))[1])
    seen.clear()
    report = stage_03(run, SPECS, tiny_target)
    assert seen == ["chat"] and report["totals"]["samples"] == 24
    # a changed source file is rebuilt again
    write_raw(run, "code", synthetic_rows(target_tokenizer, "code", 1))
    seen.clear()
    report = stage_03(run, SPECS, tiny_target)
    assert sorted(seen) == ["chat", "code"] and report["totals"]["samples"] == 18


def test_duplicates_and_empty_responses_are_left_out(tmp_path, tiny_target, target_tokenizer):
    run = Run(tmp_path, "r")
    rows = synthetic_rows(target_tokenizer, "code", 1)[:2]
    empty = {**rows[0], "sample_id": "empty", "generation_id": "gen-empty", "reasoning": None, "content": "",
             "finish_reason": "length", "usage": {"completion_tokens": 48, "reasoning_tokens": 48}}
    rows += [rows[0], {**rows[1], "sample_id": "another"}, empty]
    write_raw(run, "code", rows)
    report = stage_03(run, SPECS[:1], tiny_target)
    issues = report["totals"]["issues"]
    assert issues["duplicate_sample_id"] == 1 and issues["duplicate_generation_id"] == 2 and issues["no_output"] == 1
    ids = [json.loads(x)["sample_id"] for x in (run.root / "tokens" / "code.jsonl").open()]
    assert ids.count(rows[0]["sample_id"]) == 1 and "another" in ids and "empty" not in ids


def test_a_damaged_stage_02_line_stops_the_stage_naming_file_and_line(tmp_path, tiny_target, target_tokenizer):
    run = Run(tmp_path, "r")
    write_raw(run, "code", synthetic_rows(target_tokenizer, "code", 1)[:2])
    raw = run.root / "generate" / "code" / "raw_responses.jsonl"
    raw.write_text(raw.read_text() + "not json\n" + raw.read_text().splitlines()[0] + "\n")
    with pytest.raises(ValueError, match=r"raw_responses\.jsonl:3: not valid JSON"):
        stage_03(run, SPECS[:1], tiny_target)


def test_a_missing_stage_02_output_names_the_file(tmp_path, tiny_target):
    with pytest.raises(FileNotFoundError, match="run stage 02"):
        stage_03(Run(tmp_path, "r"), SPECS, tiny_target)
