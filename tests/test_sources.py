"""Data from several sources in one training set: stage 02 through OpenRouter (billed), stage 02
against a bare engine that saved its sampled ids, and files imported from elsewhere. Stage 03 keeps
each sample's source, keeps a prompt two sources answered once, reports billed-vs-rebuilt only
where billing exists and ids-vs-text agreement where ids exist; the source reaches the hidden-state
index and the drafter's held-out report. (Stage 02 against a real local vLLM: test_engine_source.py.)"""

import functools
import json

import pytest

from draftsmith import tokens
from draftsmith.config import HiddenConfig
from draftsmith.hidden.stage import extract
from draftsmith.targets.corpus import chat_examples
from draftsmith.config import DrafterConfig
from draftsmith.drafter import stage
from draftsmith.drafter.stage import TrainJob
from draftsmith.imports import parse_imports
from draftsmith.paths import Run
from draftsmith.hidden.outputs import HiddenShards

from test_tokens_stage import stage_03

from conftest import stage_02_at

pytestmark = pytest.mark.unit

SPECS = [{"name": "code", "path": "unused"}, {"name": "chat", "path": "unused"}, {"name": "legacy", "path": "unused"}]


@functools.lru_cache(maxsize=1)
def EXAMPLES():
    return chat_examples(limit=120)


def true_ids(tok, messages, reasoning, content) -> tuple[list[int], list[int]]:
    """Prompt and output ids of a conversation by the template's own tokenization: what an engine
    serving the target samples when it writes this text canonically."""
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tok.apply_chat_template(messages + [{"role": "assistant", "reasoning_content": reasoning,
                                                "content": content}], tokenize=True, return_dict=False)
    assert full[:len(prompt)] == prompt
    return prompt, full[len(prompt):]


def split_one_token(tok, ids: list[int]) -> list[int]:
    """The same text with one word token written as two tokens: a non-canonical split only an
    engine's ids can show."""
    for j, t in enumerate(ids):
        text = tok.decode([t])
        if len(text.strip()) >= 3 and text.strip().isalpha():
            pieces = tok(text[:2], add_special_tokens=False)["input_ids"] + tok(text[2:], add_special_tokens=False)["input_ids"]
            if pieces != [t] and tok.decode(pieces) == text:
                return ids[:j] + pieces + ids[j + 1:]
    raise AssertionError("no word token to split")


def conv(i):
    c = EXAMPLES()[i]
    return c[:1], c[1]["reasoning_content"], c[1]["content"]


def openrouter_row(tok, dataset, i):
    messages, reasoning, content = conv(i)
    prompt, out = true_ids(tok, messages, reasoning, content)
    return {"sample_id": f"{dataset}-{i}", "dataset": dataset, "messages": messages, "content": content,
            "reasoning": reasoning, "finish_reason": "stop", "provider": "Clean", "source": "openrouter",
            "generation_id": f"gen-{dataset}-{i}",
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out), "cost": 2e-6}}


def engine_row(tok, dataset, i, split=False, drop_eot=False):
    """A stage-02 line from a bare vLLM server: its usage has counts but no cost, and the ids it
    sampled are saved."""
    messages, reasoning, content = conv(i)
    prompt, out = true_ids(tok, messages, reasoning, content)
    out = split_one_token(tok, out) if split else out
    return {"sample_id": f"{dataset}-{i}", "dataset": dataset, "messages": messages, "content": content,
            "reasoning": reasoning, "finish_reason": "stop", "provider": "vllm", "source": "vllm",
            "generation_id": f"cmpl-{dataset}-{i}", "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out)},
            "output_ids": out[:-1] if drop_eot else out, "prompt_ids": prompt}


def import_line(tok, i, with_ids, sid=True):
    messages, reasoning, content = conv(i)
    line = {"messages": messages, "reasoning": reasoning, "answer": content, "source": "sglang-h100"}
    if sid:
        line["id"] = f"old-{i}"
    if with_ids:
        line["output_ids"] = true_ids(tok, messages, reasoning, content)[1]
    return line


def write_jsonl(path, rows, extra=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + extra)
    return path


@pytest.fixture(scope="module")
def merged(tmp_path_factory, target_tokenizer, tiny_target):
    """A run whose `code` came through OpenRouter, `chat` through a local engine (plus an import
    that answers one of its prompts again), and `legacy` only from an import file."""
    tok = target_tokenizer
    root = tmp_path_factory.mktemp("sources")
    run = Run(root / "out", "mixed")
    write_jsonl(run.dir("generate/code") / "raw_responses.jsonl", [openrouter_row(tok, "code", i) for i in range(8)])
    write_jsonl(run.dir("generate/chat") / "raw_responses.jsonl",
                [engine_row(tok, "chat", i, split=i == 20, drop_eot=i == 21) for i in range(20, 28)])
    chat_import = write_jsonl(root / "chat_more.jsonl",
                              [import_line(tok, 22, True, sid=False), import_line(tok, 40, False)])
    bad = [json.dumps({**import_line(tok, 50, False), "reasonning": "x"}),
           json.dumps({k: v for k, v in import_line(tok, 51, False).items() if k != "source"}),
           json.dumps({**import_line(tok, 52, False), "messages": EXAMPLES()[52][:1] + [{"role": "assistant", "content": "x"}]}),
           json.dumps({**import_line(tok, 53, False), "output_ids": [10 ** 7]})]
    legacy = write_jsonl(root / "legacy.jsonl", [import_line(tok, i, with_ids=i % 2 == 0) for i in range(60, 68)],
                         extra="\n".join(bad) + "\n")
    imports = [{"name": "chat", "path": str(chat_import)}, {"name": "legacy", "path": str(legacy)}]
    report = stage_03(run, SPECS, tiny_target, imports=imports)
    lines = {name: [json.loads(x) for x in (run.root / "tokens" / f"{name}.jsonl").open()] for name in ("code", "chat", "legacy")}
    return run, report, lines, tok


def test_stage_03_keeps_each_samples_source_and_uses_saved_ids_as_the_truth(merged):
    run, report, lines, tok = merged
    assert {ln["source"] for ln in lines["code"]} == {"openrouter"}
    assert {ln["source"] for ln in lines["legacy"]} == {"sglang-h100"} and len(lines["legacy"]) == 8
    assert [ln["source"] for ln in lines["chat"]] == ["vllm"] * 8 + ["sglang-h100"]
    # the engine's ids are what is trained on, also where the text would tokenize otherwise
    for ln in lines["chat"][:8]:
        i = int(ln["sample_id"].split("-")[1])
        prompt, out = true_ids(tok, *conv(i))
        expect = split_one_token(tok, out) if i == 20 else out
        assert ln["output_ids"] == expect and ln["input_ids"] == prompt + expect  # i == 21: end-of-turn put back
        assert ln["loss_mask"] == [0] * len(prompt) + [1] * len(expect)
        assert ln["checks"]["saved_ids"]["output_agree"] == (i != 20)
        assert ln["billed_completion_tokens"] is None and not ln["flagged"]
    # an import without ids is rebuilt from its text, like a stage-02 line
    by_id = {ln["sample_id"]: ln for ln in lines["legacy"]}
    prompt, out = true_ids(tok, *conv(61))
    assert by_id["old-61"]["input_ids"] == prompt + out and by_id["old-61"]["checks"]["saved_ids"] is None
    assert by_id["old-60"]["checks"]["saved_ids"]["output_agree"] is True


def test_a_prompt_two_sources_answered_is_counted_once(merged):
    run, report, lines, tok = merged
    chat = lines["chat"]
    prompts = [json.dumps(ln["input_ids"][:ln["input_ids"].index(ln["output_ids"][0])]) for ln in chat]
    assert len(chat) == 9 and len(set(ln["sample_id"] for ln in chat)) == 9
    # prompt 22 was answered by the engine (stage 02, listed first) and by the import: one kept
    assert sum(1 for ln in chat if ln["sample_id"] == "chat-22") == 1
    assert [ln["sample_id"] for ln in chat if ln["source"] == "sglang-h100"] == ["old-40"]
    checks = [json.loads(x) for x in (run.root / "tokens" / "checks" / "chat.jsonl").open()]
    dropped = [c for c in checks if c.get("duplicate_of")]
    assert len(checks) == 10 and len(dropped) == 1
    assert dropped[0]["duplicate_of"] == "vllm" and dropped[0]["source"] == "sglang-h100" and dropped[0]["excluded"]
    assert report["sources"]["sglang-h100"]["duplicates_left_out"] == 1
    assert report["datasets"]["chat"]["kept"] == 9 and report["totals"]["kept"] == 8 + 9 + 8
    assert len(set(prompts)) == len(prompts)


def test_report_shows_billed_vs_rebuilt_only_where_billing_exists(merged):
    run, report, lines, tok = merged
    src = report["sources"]
    assert set(src) == {"openrouter", "vllm", "sglang-h100"}
    billed = sum(ln["billed_completion_tokens"] for ln in lines["code"])
    assert src["openrouter"]["billing"] == {"samples": 8, "billed_completion_tokens": billed,
                                            "reconstructed_completion_tokens": billed, "relative_error": 0.0,
                                            "exact_match_rate": 1.0}
    assert src["openrouter"]["saved_ids"] is None
    assert src["vllm"]["billing"] is None and src["sglang-h100"]["billing"] is None
    assert src["vllm"]["saved_ids"]["samples"] == 8 and src["vllm"]["saved_ids"]["output_agreement_rate"] == 7 / 8
    assert src["vllm"]["saved_ids"]["prompt_agreement_rate"] == 1.0
    assert src["sglang-h100"]["saved_ids"] == {"samples": 5, "output_agreement_rate": 1.0, "prompt_agreement_rate": 1.0}
    t = report["totals"]
    assert t["billed_completion_tokens"] == billed and t["relative_error"] == 0
    assert "no_usage" not in t["issues"] and not report["flagged_providers"]
    prov = report["providers"]  # count-based rates only where counts exist
    assert prov["Clean"]["prompt_exact_match_rate"] == 1.0 and prov["Clean"]["exact_match_rate"] == 1.0
    for p in ("vllm", "sglang-h100"):
        assert prov[p]["prompt_exact_match_rate"] is None and prov[p]["exact_match_rate"] is None
        assert prov[p]["relative_error"] is None and prov[p]["clean_rate"] == 1.0
    text = tokens.summary(report)
    assert "source vllm: 8 samples (chat), 8 kept; engine ids = text rebuild on 87.5%" in text
    assert "source openrouter: 8 samples (code), 8 kept; billed vs rebuilt +0.0000%" in text
    assert "1 left out (prompt answered by an earlier source)" in text


def test_bad_import_lines_are_skipped_and_named(merged):
    run, report, lines, tok = merged
    problems = report["datasets"]["legacy"]["problems"]
    assert len(problems) == 4 and all("legacy.jsonl:" in p for p in problems)
    assert "legacy.jsonl:9: unknown fields ['reasonning']" in problems[0]
    assert "legacy.jsonl:10: field 'source' must be a non-empty string" in problems[1]
    assert "legacy.jsonl:11: field 'messages' must end with the user turn" in problems[2]
    assert "legacy.jsonl:12: token id 10000000 in output_ids/prompt_ids is outside the target's vocabulary" in problems[3]


def test_imports_parameter_errors_name_the_entry(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [])
    with pytest.raises(ValueError, match=r"imports\[0\]: dataset 'other' is not one of datasets \['code'\]"):
        parse_imports([{"name": "other", "path": str(f)}], ["code"])
    with pytest.raises(FileNotFoundError, match=r"imports\[1\]: import file of dataset 'code' not found"):
        parse_imports([{"name": "code", "path": str(f)}, {"name": "code", "path": str(tmp_path / "b.jsonl")}], ["code"])
    with pytest.raises(ValueError, match=r"imports\[0\]: unknown keys \['source'\]"):
        parse_imports([{"name": "code", "path": str(f), "source": "x"}], ["code"])
    with pytest.raises(FileNotFoundError, match="no import names it"):
        stage_03(Run(tmp_path, "r"), SPECS[:1], "tiny-test", imports=[])


@pytest.mark.usefixtures("one_thread")
def test_source_reaches_the_hidden_index_and_the_drafters_report(merged, tiny_target, tmp_path):
    run, report, lines, tok = merged
    files = tokens.token_files(run, [s["name"] for s in SPECS])
    extract(tiny_target, files, tmp_path / "hidden", HiddenConfig(target_backend="hf"),
            log=lambda *a: None)
    shards = HiddenShards(tmp_path / "hidden")
    got = {(s.dataset, s.sample_id): s.source for s in shards.samples}
    assert got == {(ln["dataset"], ln["sample_id"]): ln["source"] for name in lines for ln in lines[name]}
    # a rerun keeps the shards and still names each sample's source
    extract(tiny_target, files, tmp_path / "hidden", HiddenConfig(target_backend="hf"),
            log=lambda *a: None)
    assert {(s.dataset, s.sample_id): s.source for s in HiddenShards(tmp_path / "hidden").samples} == got

    cfg = DrafterConfig(draft_vocab_size=512, ttt_steps=2, train_epochs=1.0,
                        train_batch_size=4, train_micro_batch_size=2, train_max_len=128, train_lr=1e-4,
                        train_warmup_fraction=0.015, train_weight_decay=0.0, train_grad_clip=0.5,
                        train_holdout_fraction=0.2, seed=0, train_fsdp=False, train_eval_every=0,
                        train_checkpoint_every=100, export_fractions=[1.0], export_engine="sglang",
                        export_dtype="float32", train_resume=True)
    job = TrainJob(hidden_dir=str(tmp_path / "hidden"), target_path=str(tiny_target), out_dir=str(tmp_path / "drafter"))
    s = stage.train(cfg, job, log=lambda *a: None)
    per = s["sources"]
    assert set(per) == {"openrouter", "vllm", "sglang-h100"}
    # the held-out split is taken per source (20% of 8, 8 and 9 samples, rounded up)
    assert {k: v["heldout_samples"] for k, v in per.items()} == {"openrouter": 2, "vllm": 2, "sglang-h100": 2}
    assert sum(v["train_samples"] + v["heldout_samples"] for v in per.values()) == 25
    by = s["heldout"]["by_source"]
    assert set(by) == set(per)
    # per-source sums add up to the overall held-out numbers
    assert sum(by[k]["count_i"][0] for k in by) == s["heldout"]["count_i"][0] > 0
    total = sum(by[k]["loss_i"][0] * by[k]["count_i"][0] for k in by) / s["heldout"]["count_i"][0]
    assert total == pytest.approx(s["heldout"]["loss_i"][0], rel=1e-5)
    assert all(0 <= by[k]["acc_i"][0] <= 1 and per[k]["heldout"] == by[k] for k in by)


@pytest.mark.emulator
def test_stage_02_does_not_ask_for_prompts_an_import_answers(tmp_path, target_tokenizer):
    """The import file doubles as `legacy`'s prompt file: nothing of it is requested. `chat` has its
    own prompt file, two of whose prompts an import answers (matched by prompt, no shared ids)."""
    from draftsmith import generate
    from draftsmith.emulator import running

    legacy = write_jsonl(tmp_path / "legacy.jsonl", [import_line(target_tokenizer, i, False) for i in range(4)])
    asked = [{"id": f"c{i}", "messages": conv(i)[0]} for i in (10, 11, 12, 13, 14)]
    chat = write_jsonl(tmp_path / "chat.jsonl", asked)
    answers = write_jsonl(tmp_path / "answers.jsonl", [import_line(target_tokenizer, i, False, sid=False) for i in (11, 13)])
    datasets = [{"name": "legacy", "path": str(legacy)}, {"name": "chat", "path": str(chat)}]
    imports = [{"name": "legacy", "path": str(legacy)}, {"name": "chat", "path": str(answers)}]
    run = Run(tmp_path / "out", "r")
    logs = []
    cfg = {"fault_scale": 0, "credits": 10.0, "backend": "synthetic", "synthetic_tokens": 8, "time_scale": 0.0}
    with running(cfg, state_dir=tmp_path / "emulator") as emu:
        res = stage_02_at(emu.base_url, emu.key, run, datasets, model="moonshotai/kimi-k2.5", max_tokens=16,
                                      concurrency=4, spend_limit_usd=1.0, native_precision="int4", imports=imports,
                                      log=logs.append)
        billed = [x for x in emu.ledger_lines() if x["billed"]]
    assert res.complete, res.message
    saved = [json.loads(x)["sample_id"] for x in (run.root / "generate" / "chat" / "raw_responses.jsonl").open()]
    assert sorted(saved) == ["c10", "c12", "c14"] and len(billed) == 3
    assert not (run.root / "generate" / "legacy" / "raw_responses.jsonl").read_text()
    assert any("prompts that an import file answers are skipped" in m for m in logs)
