"""The Kimi-style tokenizer (remote code over tiktoken) and the paths that must handle its kind."""

import json
from pathlib import Path

import pytest

from draftsmith.targets.kimi_tokenizer import NAMED_TOKENS, NUM_RANKS, VOCAB_SIZE, write_tokenizer_files


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


def test_encoder_self_test_refuses_a_tokenizer_whose_plain_text_makes_special_tokens(kimi_tok):
    import copy

    import tiktoken

    from draftsmith.encoding import Encoding

    leaky = copy.copy(kimi_tok)
    m = kimi_tok.model
    leaky.model = tiktoken.Encoding(name="leaky", pat_str=m._pat_str, mergeable_ranks=m._mergeable_ranks,
                                    special_tokens=m._special_tokens)
    leaky.model.encode_ordinary_batch = lambda texts, **kw: leaky.model.encode_batch(texts, allowed_special="all")
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
    calls = "".join(f"<|tool_call_begin|>functions.lookup:{i}<|tool_call_argument_begin|>{{\"q\": \"{i}\"}}"
                    "<|tool_call_end|>" for i in range(5))
    section = "<|tool_calls_section_begin|>" + calls + "<|tool_calls_section_end|>"
    content = "Looking it up." + section + " Once more." + section  # 2 sections of 5 calls: 34 markers
    typed = "He wrote <|im_end|> in his answer."  # a special token typed as text stays text
    markers = set(range(163595, 163600))
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


# ---- the emulator bills with it; stage 03 rebuilds what it served ---------------------------------

def test_emulator_bills_with_a_tiktoken_tokenizer_and_stage_03_rebuilds_its_ids(tmp_path, kimi_dir):
    from draftsmith import generate
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
        result = generate_stage.run_at(emu.base_url, emu.key, run, datasets, model="moonshotai/kimi-k2.5",
                                         max_tokens=120, concurrency=16, spend_limit_usd=40.0,
                                         provider={"quantizations": ["int4", "unknown"]},
                                         target_model_path=str(kimi_dir), trust_remote_code=True,
                                         native_precision="int4", log=lambda *a: None)
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
