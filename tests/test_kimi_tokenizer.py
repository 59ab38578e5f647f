"""The Kimi-style tokenizer (remote code over tiktoken) and the paths that must handle its kind."""

import json
from pathlib import Path

import pytest

from draftsmith.targets.kimi_mini import (ADDITIONAL_SPECIAL_TOKENS, NAMED_TOKENS, NUM_RANKS, VOCAB_SIZE,
                                          write_tokenizer_files)

pytestmark = pytest.mark.unit

MARKERS = set(range(163595, 163600))  # the tool-call markers


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    """A tokenizer-only Kimi-style checkpoint folder (enough for the tokenizer, stage 03 and the
    emulator's synthetic backend)."""
    out = tmp_path_factory.mktemp("kimi-tok")
    write_tokenizer_files(out)
    (out / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                 "model_type": "kimi_k25", "text_config": {"vocab_size": VOCAB_SIZE}}))
    return out


@pytest.fixture(scope="module")
def kimi_tok(kimi_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kimi_dir, trust_remote_code=True)


def test_autotokenizer_loads_the_remote_code_tokenizer_with_kimis_ids(kimi_dir, kimi_tok):
    assert type(kimi_tok).__name__ == "TikTokenTokenizer"
    assert json.loads((kimi_dir / "tokenizer_config.json").read_text())["auto_map"] == {
        "AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    assert len(kimi_tok) == VOCAB_SIZE and kimi_tok.model.n_vocab == VOCAB_SIZE
    assert len((kimi_dir / "tiktoken.model").read_text().splitlines()) == NUM_RANKS
    ids = kimi_tok.convert_tokens_to_ids(["[BOS]", "[EOS]", "<|im_end|>", "<|tool_calls_section_begin|>",
                                          "<|tool_call_end|>"])
    assert ids == [163584, 163585, 163586, 163595, 163599]
    # tool-call markers are added tokens but not special: decoding keeps them
    assert 163597 not in kimi_tok.all_special_ids and 163586 in kimi_tok.all_special_ids
    text = "Hello 世界 <|tool_call_begin|>x"
    assert kimi_tok.decode(kimi_tok.encode(text), skip_special_tokens=True) == text


def test_config_is_laid_out_as_kimi_k25s_so_transformers_knows_only_twelve_of_its_tokens(kimi_dir, kimi_tok):
    from draftsmith.targets.kimi_remote import tokenization_kimi

    cfg = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    assert cfg["additional_special_tokens"] == ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                                "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]
    assert tuple(cfg["additional_special_tokens"]) == tokenization_kimi.ADDITIONAL_SPECIAL_TOKENS  # the code's default
    assert "extra_special_tokens" not in cfg
    listed = {int(i): t for i, t in cfg["added_tokens_decoder"].items()}
    for i in (*MARKERS, 163606, 163607):  # tool-call markers, <think>, </think>: named there only, not special
        assert not listed[i]["special"] and listed[i]["content"] not in cfg["additional_special_tokens"]
    # the code keeps added_tokens_decoder for its own table; transformers hears of bos/eos/unk/pad and the 8
    assert sorted(t.content for t in kimi_tok.added_tokens_decoder.values()) == sorted(
        [*ADDITIONAL_SPECIAL_TOKENS, "[BOS]", "[EOS]", "[UNK]", "[PAD]"])
    # ...while its own encode makes every one of the 256 special and reserved strings its single id
    table = kimi_tok.special_tokens
    assert sorted(table.values()) == list(range(NUM_RANKS, VOCAB_SIZE))
    assert table["<|reserved_token_163592|>"] == 163592 and table["<|tool_call_begin|>"] == 163597
    assert all(kimi_tok.encode(t, allow_special_tokens=True) == [i] for t, i in table.items())


def test_kimi_pattern_splits_han_runs_and_letter_case(kimi_tok):
    pieces = [kimi_tok.decode([i]) for i in kimi_tok.encode("HelloWorld 你好世界", allow_special_tokens=False)]
    assert "".join(pieces) == "HelloWorld 你好世界"
    assert "Hello" in pieces and "World" in pieces  # case-split letter runs
    assert not any(("你" in p or "界" in p) and " " in p for p in pieces)  # Han runs stand alone


def test_encode_cuts_long_runs_and_specials_typed_as_text_stay_text_only_when_asked(kimi_tok):
    from draftsmith.targets.kimi_remote.tokenization_kimi import MAX_RUN_CHARS, split_long_runs

    long = "a" * (2 * MAX_RUN_CHARS + 7) + "  b"
    assert [len(p) for p in split_long_runs(long)] == [MAX_RUN_CHARS, MAX_RUN_CHARS, 10]
    assert kimi_tok.encode("x<|im_end|>", allow_special_tokens=True)[-1] == 163586
    assert 163586 not in kimi_tok.encode("x<|im_end|>", allow_special_tokens=False)


def test_chat_template_renders_kimi_turns_tool_calls_and_results(kimi_tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A", "tool_calls": [
                {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "functions.f:0", "content": "42"}]
    text = kimi_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>U<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|><think></think>A<|tool_calls_section_begin|>"
                    '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|>'
                    "<|tool_calls_section_end|><|im_end|><|im_system|>tool<|im_middle|>## Return of functions.f:0\n"
                    "42<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    assert {NAMED_TOKENS[i][0] for i in range(163595, 163600)} <= set(kimi_tok.get_vocab())


# ---- the encoder layer ----------------------------------------------------------------------------

def test_tiktoken_fast_path_encodes_as_the_checkpoints_own_code(kimi_tok):
    from draftsmith.encoding import Encoding

    enc = Encoding(kimi_tok)
    assert enc.describe() == {"kind": "tiktoken", "class": "TikTokenTokenizer", "vocab_size": VOCAB_SIZE}
    texts = ["Hello <|im_end|> 世界 HelloWorld\n\n", "x" * 30_000 + " " * 26_000 + "y", ""]
    assert enc.template(texts) == [kimi_tok.encode(t, allow_special_tokens=True) for t in texts]
    assert enc.plain(texts) == [kimi_tok.encode(t, allow_special_tokens=False) for t in texts]
    assert enc.one_id("<|im_end|>", "end-of-turn") == 163586
    with pytest.raises(ValueError, match="end-of-turn '<｜end▁of▁sentence｜>' is .* not one token"):
        enc.one_id("<｜end▁of▁sentence｜>", "end-of-turn")


def test_cuts_fall_where_the_remote_codes_character_loop_cuts_windows_included():
    import random

    from draftsmith.encoding import windows
    from draftsmith.targets.kimi_remote import tokenization_kimi

    rng = random.Random(0)
    for n in range(6):
        runs = [rng.choice(" \n\tab字") * rng.choice([1, 7, 24_999, 25_000, 25_001, 26_000, 50_001, 80_000])
                for _ in range(12 + 8 * n)]
        text = "".join(runs)
        assert windows(text) == list(tokenization_kimi.windows(text)), n
    assert len(text) > 400_000  # the last text crosses a window boundary


def test_encoder_self_test_refuses_a_tokenizer_whose_plain_text_makes_special_tokens(kimi_tok):
    import copy

    import tiktoken

    from draftsmith.encoding import Encoding

    leaky = copy.copy(kimi_tok)
    m = kimi_tok.model
    leaky.model = tiktoken.Encoding(name="leaky", pat_str=m._pat_str, mergeable_ranks=m._mergeable_ranks,
                                    special_tokens=m._special_tokens)
    leaky.model.encode_ordinary = lambda text: leaky.model.encode(text, allowed_special="all")
    with pytest.raises(RuntimeError, match="special-token strings typed as text became their tokens"):
        Encoding(leaky)


# ---- refused before anything runs: remote code without trust_remote_code, code that fails ---------

def _params(tmp_path, target: Path, **extra) -> Path:
    import yaml

    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"run_name": "r", "outputs_dir": str(tmp_path / "out"), "target_model_path": str(target),
                                 **extra}))
    return f


def test_a_remote_code_tokenizer_without_trust_remote_code_is_refused_naming_the_field(tmp_path, kimi_dir, capsys):
    from draftsmith import cli

    f = _params(tmp_path, kimi_dir)
    assert cli.main(["run", "03", "-f", str(f), "--check"]) == 2
    err = capsys.readouterr().err
    assert "default of 01_providers.ipynb: trust_remote_code is false, but the tokenizer of" in err
    assert "auto_map: tokenization_kimi.TikTokenTokenizer" in err
    assert not (tmp_path / "out" / "r").exists()
    f = _params(tmp_path, kimi_dir, trust_remote_code=True)
    assert cli.main(["run", "03", "-f", str(f), "--check"]) == 0
    # the library call refuses it as well, instead of transformers' generic conversion
    from draftsmith.targets.checkpoint import load_tokenizer

    with pytest.raises(ValueError, match="trust_remote_code is false"):
        load_tokenizer(kimi_dir)


@pytest.fixture
def old_import_dir(tmp_path, kimi_dir) -> Path:
    """A stand-in for an older Kimi checkpoint: its tokenizer code imports bytes_to_unicode from
    where transformers 4 had it."""
    import shutil

    out = tmp_path / "old-kimi"
    shutil.copytree(kimi_dir, out)
    code = out / "tokenization_kimi.py"
    new = "from transformers.convert_slow_tokenizer import bytes_to_unicode"
    assert new in code.read_text()
    code.write_text(code.read_text().replace(new, "from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode"))
    return out


def test_check_loads_the_tokenizer_and_bridges_the_moved_bytes_to_unicode_import(tmp_path, old_import_dir, capsys):
    from draftsmith import cli

    f = _params(tmp_path, old_import_dir, trust_remote_code=True)
    assert cli.main(["run", "03", "-f", str(f), "--check"]) == 0
    err = capsys.readouterr().err
    assert "compatibility: tokenization_kimi.py imports bytes_to_unicode from transformers.models.gpt2." in err
    from draftsmith.targets.checkpoint import load_tokenizer

    assert load_tokenizer(old_import_dir, trust_remote_code=True, log=lambda m: None).encode("<|im_end|>") == [163586]


def test_check_shows_a_checkpoint_tokenizer_that_fails_to_import_before_anything_runs(tmp_path, kimi_dir, capsys):
    import shutil

    from draftsmith import cli

    broken = tmp_path / "broken-kimi"
    shutil.copytree(kimi_dir, broken)
    code = broken / "tokenization_kimi.py"
    code.write_text(code.read_text().replace("import tiktoken\n", "import tiktoken\nfrom transformers import NoSuchThing\n", 1))
    assert cli.main(["run", "03", "-f", str(_params(tmp_path, broken, trust_remote_code=True)), "--check"]) == 2
    err = capsys.readouterr().err
    assert f"target_model_path {str(broken)!r}: its tokenizer does not load: ImportError" in err and "NoSuchThing" in err


# ---- stage 03: tool calls -------------------------------------------------------------------------

CALL = {"id": "functions.lookup:0", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}


def _raw(sid: str, content: str, billed: int, **extra) -> dict:
    return {"sample_id": sid, "dataset": "d", "messages": [{"role": "user", "content": "Look it up."}],
            "content": content, "reasoning": "I should call the tool.", "finish_reason": "stop",
            "native_finish_reason": "stop", "provider": "P", "model": "m", "generation_id": f"gen-{sid}",
            "usage": {"completion_tokens": billed}, "request": {}, "attempts": 1, "latency_s": 0.1, **extra}


def _stage_03(tmp_path, target, rows, **kw) -> dict:
    from draftsmith.paths import Run
    from test_tokens_stage import stage_03

    run = Run(tmp_path, "r")
    (run.dir("generate/d") / "raw_responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = stage_03(run, [{"name": "d", "path": "unused"}], target, **kw)
    return report, {r["sample_id"]: r for r in map(json.loads, (run.root / "tokens" / "d.jsonl").open())}


def test_tool_call_markers_in_returned_text_are_rebuilt_as_their_single_ids(tmp_path, kimi_dir, kimi_tok):
    # as with Kimi-K2.5's files: transformers' table lacks the markers, the tokenizer's own encode has them
    assert not {t.content for t in kimi_tok.added_tokens_decoder.values()} & {NAMED_TOKENS[i][0] for i in MARKERS}
    calls = "".join(f"<|tool_call_begin|>functions.lookup:{i}<|tool_call_argument_begin|>{{\"q\": \"{i}\"}}"
                    "<|tool_call_end|>" for i in range(5))
    section = "<|tool_calls_section_begin|>" + calls + "<|tool_calls_section_end|>"
    content = "Looking it up." + section + " Once more." + section  # 2 sections of 5 calls: 34 markers
    typed = "He wrote <|im_end|> in his answer."  # a special token typed as text stays text
    markers = MARKERS
    emitted = kimi_tok.encode("I should call the tool.</think>" + content + "<|im_end|>")  # as the model sampled it
    assert sum(i in markers for i in emitted) == 34
    typed_ids = kimi_tok.encode("I should call the tool.</think>", allow_special_tokens=True) + \
        kimi_tok.encode(typed, allow_special_tokens=False) + [163586]
    report, rows = _stage_03(tmp_path, kimi_dir, [_raw("calls", content, len(emitted)),
                                                  _raw("typed", typed, len(typed_ids))], trust_remote_code=True)
    assert rows["calls"]["output_ids"] == emitted
    assert sum(i in markers for i in rows["calls"]["output_ids"]) == 34
    assert rows["typed"]["output_ids"] == typed_ids and 163586 not in rows["typed"]["output_ids"][:-1]
    assert report["target"]["tokenizer_kind"] == "tiktoken" and report["target"]["vocab_size"] == VOCAB_SIZE
    assert report["target"]["tool_call_tokens"] == {NAMED_TOKENS[i][0]: i for i in sorted(MARKERS)}
    assert report["target"]["tool_call_opening"] == "<|tool_calls_section_begin|>"
    assert report["totals"]["flagged"] == 0


def test_a_tool_calls_field_is_rendered_through_the_template_or_the_sample_is_flagged(tmp_path, kimi_dir, kimi_tok,
                                                                                     tiny_target):
    msgs = [{"role": "user", "content": "Look it up."}]
    prompt = kimi_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    full = kimi_tok.apply_chat_template(msgs + [{"role": "assistant", "content": "Sure.", "tool_calls": [CALL]}],
                                        tokenize=False)
    assert full.startswith(prompt)  # what follows is "</think>Sure.<tool-call section><|im_end|>"
    emitted = kimi_tok.encode("I should call the tool." + full[len(prompt):])
    report, rows = _stage_03(tmp_path / "kimi", kimi_dir, [_raw("field", "Sure.", len(emitted), tool_calls=[CALL])],
                             trust_remote_code=True)
    assert rows["field"]["output_ids"] == emitted and report["totals"]["flagged"] == 0
    # the DeepSeek-style template of the built-in tiny target renders no tool calls: flagged with that cause
    report, rows = _stage_03(tmp_path / "tiny", tiny_target, [_raw("field", "Sure.", 10, tool_calls=[CALL])])
    checks = rows["field"]["checks"]
    assert "tool_calls_not_rendered" in checks["issues"] and checks["cause"] == "tool_calls_not_rendered"


# ---- stage 03: each case against the remote code's own encode ------------------------------------

REASONING = "I should call the tool."
SECTION = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>"
           '{"q": "x"}<|tool_call_end|><|tool_calls_section_end|>')  # CALL as the template renders it


def kimi_cases(tok) -> tuple[list[dict], dict[str, tuple[list[int], list[int], str, str]]]:
    """Stage 02 lines, one per case, billed as an honest provider bills what the model wrote; and
    per sample what the remote code's own `encode` makes of that: (prompt ids, output ids, layout,
    what decides the layout)."""
    enc = tok.encode
    asked = [{"role": "user", "content": "Look it up."}]
    typed = [{"role": "user", "content": "What is <|tool_call_begin|> for? And <|im_end|>?"}]
    long_prompt = [{"role": "user", "content": "a" + " " * 26_000 + "z" * 26_000 + " b"}]
    answer_typed = "It opens a call; <|im_end|> ends a turn."
    # sample: (prompt, reasoning, content, tool_calls, what the model wrote, layout, decided by)
    cases = {
        "section_in_content": (asked, REASONING, "Looking it up." + SECTION, None,
                               REASONING + "</think>Looking it up." + SECTION, "reasoning_tool_calls", "text"),
        "tool_calls_field": (asked, REASONING, "Sure.", [CALL], REASONING + "</think>Sure." + SECTION,
                             "reasoning_tool_calls", "text"),
        "reasoning_then_think_end_then_tool_calls": (asked, REASONING, "", [CALL], REASONING + "</think>" + SECTION,
                                                     "reasoning_tool_calls", "billed_count"),
        "reasoning_into_tool_calls": (asked, REASONING, "", [CALL], REASONING + SECTION, "reasoning_into_tool_calls",
                                      "billed_count"),
        "reasoning_into_tool_calls_in_content": (asked, REASONING, SECTION, None, REASONING + SECTION,
                                                 "reasoning_into_tool_calls", "billed_count"),
        "marker_typed_by_user": (typed, REASONING, answer_typed, None, None, "reasoning_answer", "text"),
        "run_of_25000_spaces": (asked, REASONING, "a" + " " * 25_000 + "b", None, None, "reasoning_answer", "text"),
        "run_of_26000_spaces": (asked, REASONING, "a" + " " * 26_000 + "b", None, None, "reasoning_answer", "text"),
        "run_of_25000_characters": (asked, REASONING, "z" * 25_000, None, None, "reasoning_answer", "text"),
        "run_of_26000_characters": (asked, REASONING, "z" * 26_000, None, None, "reasoning_answer", "text"),
        "run_cut_inside_a_marker": (asked, REASONING, "z" * 24_975 + SECTION, None, None, "reasoning_tool_calls",
                                    "text"),
        "run_of_26000_spaces_in_reasoning": (asked, "x" + " " * 26_000 + "y", "Done.", None, None, "reasoning_answer",
                                             "text"),
        "runs_of_26000_in_the_prompt": (long_prompt, REASONING, "Done.", None, None, "reasoning_answer", "text"),
    }
    rows, expected = [], {}
    for sid, (messages, reasoning, content, calls, wrote, layout, by) in cases.items():
        prompt = enc(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        if sid == "marker_typed_by_user":  # the answer's typed <|im_end|> is text; the prompt's markers are tokens
            output = enc(reasoning + "</think>") + enc(content, allow_special_tokens=False) + [163586]
        elif sid == "run_cut_inside_a_marker":  # the 25,000th character of "tool.</think>zz..." is inside the
            # section's opening marker: encode cuts it into text, the model emitted it as its id
            opening = "<|tool_calls_section_begin|>"
            output = enc(reasoning + "</think>" + "z" * 24_975) + [163595] + enc(SECTION[len(opening):] + "<|im_end|>")
        else:
            output = enc((wrote or reasoning + "</think>" + content) + "<|im_end|>")
        row = {"sample_id": sid, "dataset": "d", "messages": messages, "content": content, "reasoning": reasoning,
               "finish_reason": "tool_calls" if calls else "stop", "native_finish_reason": "stop", "provider": "P",
               "model": "moonshotai/kimi-k2.5", "generation_id": f"gen-{sid}",
               "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output)}, "request": {},
               "attempts": 1, "latency_s": 0.1}
        rows.append({**row, "tool_calls": calls} if calls else row)
        expected[sid] = prompt, output, layout, by
    # the engine's own ids saved: they are the truth, and the layout is read off them
    ids = enc(REASONING + SECTION + "<|im_end|>")
    rows.append({**rows[3], "sample_id": "saved_ids", "generation_id": "gen-saved", "output_ids": ids})
    expected["saved_ids"] = expected["reasoning_into_tool_calls"][:2] + ("reasoning_into_tool_calls", "saved_ids")
    return rows, expected


def test_every_case_rebuilds_the_ids_the_remote_codes_own_encode_gives(tmp_path, kimi_dir, kimi_tok):
    rows, expected = kimi_cases(kimi_tok)
    report, out = _stage_03(tmp_path, kimi_dir, rows, trust_remote_code=True)
    for sid, (prompt, output, layout, by) in expected.items():
        row = out[sid]
        assert row["output_ids"] == output, sid
        assert row["input_ids"] == prompt + output, sid
        assert (row["checks"]["layout"], row["checks"]["layout_by"]) == (layout, by), sid
        assert not row["flagged"] and row["checks"]["issues"] == [], (sid, row["checks"]["issues"])
    assert sum(i in MARKERS for i in out["marker_typed_by_user"]["input_ids"]) == 1  # the user's, in the prompt
    cut = REASONING[-5:] + "</think>" + "z" * 24_975 + SECTION + "<|im_end|>"
    assert kimi_tok.encode(cut).count(163595) == 0  # encode of the whole text spells the cut marker as text
    assert out["saved_ids"]["checks"]["saved_ids"]["output_agree"]
    assert not report["flagged_providers"] and report["totals"]["flagged"] == 0
    layouts = report["totals"]["layouts"]
    assert layouts["reasoning_into_tool_calls"] == 3 and layouts["reasoning_tool_calls"] == 4
    assert sum(layouts.values()) == len(expected) == report["totals"]["samples"]
    assert report["totals"]["layout_decided_by"] == {"text": 10, "billed_count": 3, "saved_ids": 1}


def test_without_a_count_reasoning_that_meets_a_tool_call_is_taken_as_closed_and_says_so(kimi_tok):
    from draftsmith.tokens import Reconstructor, Response

    rec = Reconstructor(kimi_tok)
    r = Response("s", "d", "P", None, [{"role": "user", "content": "Look it up."}], REASONING, "", "tool_calls",
                 None, None, None, False, False, tool_calls=[CALL])
    b = rec.rebuild([r])[0]
    assert b.output_ids == kimi_tok.encode(REASONING + "</think>" + SECTION + "<|im_end|>")
    assert (b.layout, b.layout_by) == ("reasoning_tool_calls", "assumed")


# ---- the emulator bills with it; stage 03 rebuilds what it served ---------------------------------

@pytest.mark.emulator
def test_emulator_bills_with_a_tiktoken_tokenizer_and_stage_03_rebuilds_its_ids(tmp_path, kimi_dir):
    from draftsmith import generate
    from draftsmith.config import GenerateConfig
    from draftsmith.generate import stage as generate_stage
    from draftsmith.emulator import running
    from draftsmith.emulator.catalogue import Quirks, default_catalogue
    from draftsmith.paths import REPO_ROOT, Run
    from test_tokens_stage import stage_03

    run = Run(tmp_path, "kimi")
    datasets = [{"name": "code", "path": str(REPO_ROOT / "data" / "demo" / "code.jsonl"), "output_token_budget": 6000}]
    cfg = {"fault_scale": 0, "credits": 50.0, "backend": "synthetic", "target_model_path": str(kimi_dir),
           "synthetic_tokens": 60}
    with running(cfg, state_dir=tmp_path / "emulator") as emu:
        cfg = GenerateConfig(datasets=datasets, model="moonshotai/kimi-k2.5", max_tokens=120, concurrency=16,
                             spend_limit_usd=40.0, provider={"quantizations": ["int4", "unknown"]},
                             target_model_path=str(kimi_dir), trust_remote_code=True, native_precision="int4")
        result = generate_stage.run_at(emu.base_url, emu.key, run, cfg, log=lambda *a: None)
        assert result.complete, result.message
        ledger = {line["generation_id"]: line for line in emu.ledger_lines() if line["billed"]}
    eos = [led["output_ids"][-1] for led in ledger.values() if led["finish_reason"] == "stop"]
    assert eos and set(eos) == {163586}  # <|im_end|>, read off the template
    report = stage_03(run, datasets, kimi_dir, trust_remote_code=True)
    assert report["target"]["tokenizer_kind"] == "tiktoken" and report["target"]["end_of_turn_ids"] == [163586]
    quirks = {e.tag: e.quirks for e in default_catalogue()}
    honest = lambda led: quirks[led["endpoint"]].model_copy(update={"perturbed_model": 0.0}) == Quirks()  # noqa: E731
    rows = [json.loads(x) for x in (run.root / "tokens" / "code.jsonl").open()]
    clean = [r for r in rows if honest(ledger[r["generation_id"]])]
    assert len(clean) >= 20 and all(r["output_ids"] == ledger[r["generation_id"]]["output_ids"] for r in clean)
    for name, s in report["providers"].items():  # no honest provider flagged; the wrong billing tokenizer named
        tags = {ledger[r["generation_id"]]["endpoint"] for r in rows if r["provider"] == name}
        if all(honest({"endpoint": t}) for t in tags):
            assert not s["flagged"], (name, s)
        if any(quirks[t].billing_tokenizer != "target" for t in tags):
            assert s["flagged"] and s["cause"] == "other_tokenizer", (name, s)


def test_emulator_refuses_an_end_of_turn_the_tokenizer_does_not_have(kimi_tok):
    import copy

    from draftsmith.emulator.backends import Vocab
    from draftsmith.targets import tiny

    vocab = Vocab(kimi_tok)
    assert (vocab.eos, vocab.end_think) == (163586, 163607)  # <|im_end|> and </think>, from the template
    mismatched = copy.copy(kimi_tok)
    mismatched.chat_template = tiny.CHAT_TEMPLATE  # DeepSeek's end-of-sentence is no token of Kimi's vocabulary
    with pytest.raises(ValueError, match="end-of-turn '<｜end▁of▁sentence｜>' is .* not one token of its vocabulary"):
        Vocab(mismatched)


def test_the_built_in_kimi_shaped_target_is_refused_without_trust_remote_code_before_any_build(tmp_path, capsys):
    from draftsmith import cli

    f = tmp_path / "p.yaml"
    f.write_text(f"run_name: r\noutputs_dir: {tmp_path / 'out'}\ntarget_model_path: kimi-mini\n")
    assert cli.main(["run", "03", "-f", str(f), "--check"]) == 2
    assert "trust_remote_code is false, but the tokenizer of kimi-mini is code" in capsys.readouterr().err
