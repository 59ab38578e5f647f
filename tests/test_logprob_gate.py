"""The gate held to an independent reference: stage 01's logprob probe against the local emulator
(its quirky providers named and set aside), then stage 04's check holding its engine to the
providers' logprobs: the clean target passes, a copy with a zeroed middle-layer MLP fails with the
cause named, and without a usable reference the check says so and falls back."""

import json
import shutil

import pytest
import torch

from draftsmith.config import HiddenConfig, ProvidersConfig
from draftsmith.hidden import check, stage as hidden_stage
from draftsmith.hidden.stage import extract
from draftsmith.paths import Run
from draftsmith.providers import logprobs, outputs, stage
from draftsmith.targets.checkpoint import resolve_target

pytestmark = pytest.mark.emulator

TARGET = "tiny-test"


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """Stage 01 on the default catalogue (the emulator serving tiny-test): (run, its result, what it printed)."""
    root = tmp_path_factory.mktemp("logprob-gate")
    run = Run(root, "r")
    cfg = ProvidersConfig(outputs_dir=str(root), run_name="r", target_model_path=TARGET,
                          emulator={"fault_scale": 0.0, "max_batch": 16},
                          datasets=[{"name": "chat", "path": "data/demo/chat.jsonl", "output_token_budget": 1000}],
                          expected_output_tokens=100, probe_prompts=2, probe_max_tokens=16,
                          logprob_prompts=8, logprob_max_tokens=32)
    import contextlib
    import io
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        result = stage.run(run, cfg)
    return run, result, said.getvalue()


def test_the_probe_names_and_sets_aside_absent_rounded_and_placeholder_logprobs(probed):
    run, result, said = probed
    table = result["logprob_probe"].set_index("tag")
    assert table.loc["novita/int4", "verdict"] == "absent"
    assert table.loc["parasail/int4", "verdict"] == "rounded"
    assert table.loc["siliconflow/int4", "verdict"] == "placeholder"
    assert table.loc["moonshotai/int4", "verdict"] == "usable" and table.loc["deepinfra/int4", "verdict"] == "usable"
    assert "at most $" in said.split("logprob probe:")[1].splitlines()[0]          # the cost, before it is paid
    line = [x for x in said.splitlines() if x.startswith("logprob reference:")][0]
    for tag in ("novita/int4", "parasail/int4", "siliconflow/int4"):
        assert tag in line.split("set aside:")[1]
    rows = logprobs.read_reference(outputs.logprobs_file(run))
    usable = set(table.index[table["verdict"] == "usable"])
    assert rows and {r["provider"] for r in rows} <= usable
    assert all(len(r["tokens"]) == len(r["output_ids"]) == len(r["logprobs"]) for r in rows)
    assert json.loads((run.root / "providers" / "spend.json").read_text())["steps"]["logprob_probe"] > 0


def test_the_verdicts_on_logprob_values():
    V = logprobs.Verdict
    exact = [[-0.123456, -2.5049871], [-0.00012345]]
    assert logprobs.judge(exact) is V.USABLE
    assert logprobs.judge([[round(x, 3) for x in a] for a in exact] + [[-1.2345]]) is V.USABLE  # 3 decimals: fine
    assert logprobs.judge([[round(x, 2) for x in a] for a in exact]) is V.ROUNDED
    assert logprobs.judge([[0.0, 0.0], [0.0]]) is V.PLACEHOLDER
    assert logprobs.judge([[-9999.0, -9999.0], [-9999.0]]) is V.PLACEHOLDER
    assert logprobs.judge([None, None]) is V.ABSENT and logprobs.judge([[None, "x"]]) is V.ABSENT


def test_an_answer_whose_rebuilt_ids_are_not_its_tokens_is_left_out(probed):
    """A provider splitting a token its own way returns logprobs of other ids: left out."""
    run, _, _ = probed
    rows = logprobs.read_reference(outputs.logprobs_file(run))
    from draftsmith.openrouter.client import Reply
    from draftsmith.targets.checkpoint import load_tokenizer
    from draftsmith.targets.rebuild import Reconstructor

    tok = load_tokenizer(resolve_target(TARGET, log=lambda *a: None))
    rebuilder = Reconstructor(tok)
    r = rows[0]
    ids = r["output_ids"]
    ended = ids[-1] == rebuilder.end_of_turn_ids[-1]
    reasoning, _, content = tok.decode(ids[:-1] if ended else ids).partition(rebuilder.layout.think_end)
    finish = "stop" if ended else "length"
    entries = [{"token": t, "logprob": x, "bytes": list(b)}
               for t, x, b in zip(r["tokens"], r["logprobs"], rebuilder.encoder.token_bytes(ids))]
    reply = Reply(content, reasoning or None, finish, finish, "p", None, None, {}, logprobs=entries)
    assert logprobs.rebuild(rebuilder, r["messages"], reply) == (r["prompt_ids"], ids)
    k = next(k for k, e in enumerate(entries) if len(e["bytes"]) > 1)
    b = entries[k]["bytes"]
    split = entries[:k] + [{**entries[k], "bytes": b[:1]}, {**entries[k], "bytes": b[1:]}] + entries[k + 1:]
    assert logprobs.rebuild(rebuilder, r["messages"], Reply(content, reasoning or None, finish, finish, "p", None,
                                                            None, {}, logprobs=split)) is None


def _tokens_file(run: Run) -> None:
    """The reference's answers as a stage-03 tokens file (the target's own answers, as stage 02 would have)."""
    rows = logprobs.read_reference(outputs.logprobs_file(run))
    lines = [{"sample_id": f"chat-{i}", "dataset": "chat", "provider": r["provider"],
              "input_ids": r["prompt_ids"] + r["output_ids"],
              "loss_mask": [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"]), "output_ids": r["output_ids"]}
             for i, r in enumerate(rows)]
    (run.dir("tokens") / "chat.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_stage_04_holds_the_clean_target_to_the_reference_and_passes(probed):
    run, _, _ = probed
    _tokens_file(run)
    said = []
    summary = hidden_stage.run(run, HiddenConfig(outputs_dir=str(run.root.parent), run_name="r", target_model_path=TARGET,
                                                 target_backend="hf", datasets=[], verify_with_hf=False,
                                                 shard_mb=1.0), log=said.append)
    ref = summary["check"]["reference"]
    assert summary["check"]["passed"] and ref["tokens"] >= check.REFERENCE.min_tokens
    assert ref["mean_abs_diff"] <= check.REFERENCE.mean_abs and ref["p95_abs_diff"] <= check.REFERENCE.p95_abs
    assert any("against the providers' logprobs" in m for m in said)
    table = check.check_table(summary["check"])
    assert any(i.startswith("providers' logprobs: mean") for i in table.index) and table["ok"].all()


def _zeroed_mlp_copy(target, into):
    """A copy of the target's folder with its middle layer's MLP output zeroed (down_proj weight)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(target, into)
    n = json.loads((into / "config.json").read_text())["num_hidden_layers"]
    name = f"model.layers.{n // 2}.mlp.down_proj.weight"
    for f in sorted(into.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            if name not in h.keys():
                continue
            meta, tensors = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}
        tensors[name] = torch.zeros_like(tensors[name])
        save_file(tensors, str(f), metadata=meta)
        return into
    raise KeyError(name)


def test_a_zeroed_mlp_inside_the_engine_fails_the_reference_gate_with_the_cause_named(probed, tmp_path):
    run, _, _ = probed
    _tokens_file(run)
    copy = _zeroed_mlp_copy(resolve_target(TARGET, log=lambda *a: None), tmp_path / "zeroed")
    with pytest.raises(check.CheckFailed) as failed:
        extract(copy, [run.root / "tokens" / "chat.jsonl"], tmp_path / "hidden",
                HiddenConfig(target_backend="hf", device="cpu", shard_mb=1.0),
                reference_logprobs=str(outputs.logprobs_file(run)), log=lambda m: None)
    r = failed.value.record
    assert r.reference["mean_abs_diff"] > check.REFERENCE.mean_abs
    assert all("providers' answers" in p or p.startswith("...") for p in r.problems), r.problems
    assert "independent implementation" in r.cause and "wrong kernel" in r.cause
    assert "Likely cause" in str(failed.value)


def test_without_a_usable_reference_the_check_says_so_and_falls_back(probed, tmp_path):
    run, _, _ = probed
    _tokens_file(run)
    said = []
    summary = extract(resolve_target(TARGET, log=lambda *a: None), [run.root / "tokens" / "chat.jsonl"], tmp_path,
                      HiddenConfig(target_backend="hf", device="cpu", shard_mb=1.0, check_answers=True),
                      reference_logprobs=str(tmp_path / "none.jsonl"), log=said.append)
    line = [m for m in said if "no independent reference" in m]
    assert len(line) == 1 and f"mean NLL <= {check.ANSWERS.max_nll}" in line[0]
    assert summary["check"]["answers"]["gated"] and "reference" not in summary["check"]


def test_one_provider_apart_from_the_others_is_named_not_the_engine(probed, tmp_path):
    """A provider whose logprobs disagree while the others agree serves something else: the cause names it."""
    run, _, _ = probed
    _tokens_file(run)
    rows = logprobs.read_reference(outputs.logprobs_file(run))
    odd = sorted({r["provider"] for r in rows})[0]
    assert len({r["provider"] for r in rows}) > 1
    shifted = [{**r, "logprobs": [x - 0.5 for x in r["logprobs"]]} if r["provider"] == odd else r for r in rows]
    path = tmp_path / "logprobs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in shifted))
    with pytest.raises(check.CheckFailed) as failed:
        extract(resolve_target(TARGET, log=lambda *a: None), [run.root / "tokens" / "chat.jsonl"], tmp_path / "h",
                HiddenConfig(target_backend="hf", device="cpu", shard_mb=1.0),
                reference_logprobs=str(path), log=lambda m: None)
    r = failed.value.record
    assert r.reference["per_provider"][odd] > check.REFERENCE.mean_abs
    assert r.cause.startswith(odd) and "serves other weights" in r.cause


@pytest.mark.engine
def test_vllms_bf16_engine_passes_the_reference_gate_on_the_clean_target(probed, tmp_path):
    """The engine the gate is for: vLLM's CPU build in bf16, its prompt logprobs on the probe's ids,
    against the emulator's float32 logprobs: inside the bounds, yet not equal (a real comparison)."""
    run, _, _ = probed
    _tokens_file(run)
    summary = extract(resolve_target(TARGET, log=lambda *a: None), [run.root / "tokens" / "chat.jsonl"], tmp_path,
                      HiddenConfig(target_backend="vllm", shard_mb=1.0),
                      reference_logprobs=str(outputs.logprobs_file(run)), log=lambda m: None)
    ref = summary["check"]["reference"]
    assert summary["check"]["passed"] and ref["tokens"] >= check.REFERENCE.min_tokens, summary["check"]
    assert 1e-4 < ref["mean_abs_diff"] <= check.REFERENCE.mean_abs and ref["p95_abs_diff"] <= check.REFERENCE.p95_abs


def test_a_malformed_reference_line_or_an_id_outside_the_vocabulary_names_the_file_and_line(tmp_path):
    path = tmp_path / "logprobs.jsonl"
    good = {"provider": "p/int4", "messages": [], "tokens": ["a"], "logprobs": [-1.0], "prompt_ids": [1, 2],
            "output_ids": [3]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "logprobs": []}) + "\n")
    with pytest.raises(ValueError, match=r"logprobs.jsonl:2: expected"):
        logprobs.read_reference(path)
    path.write_text(json.dumps(good) + "\n")
    assert logprobs.read_reference(path, vocab_size=4) == [good]
    with pytest.raises(ValueError, match=r"logprobs.jsonl:1: token ids outside the target's vocabulary of 3"):
        logprobs.read_reference(path, vocab_size=3)
    assert logprobs.read_reference(tmp_path / "absent.jsonl") == []


def test_an_endpoint_that_never_answers_is_set_aside_as_unavailable_and_the_probe_goes_on(tmp_path):
    """The emulator with every answer a 429 (past every retry, as a rate-limited provider under the
    demo's load): the probe records each endpoint as unavailable instead of stopping stage 01."""
    from draftsmith.emulator import running
    from draftsmith.openrouter.api import Api
    from draftsmith.targets.rebuild import Reconstructor
    from draftsmith.targets.checkpoint import load_tokenizer

    prompts = [[{"role": "user", "content": "Say one word."}]]
    tags = ["moonshotai/int4", "parasail/int4"]
    with running({"faults": {"rate_limit": 1.0}, "time_scale": 0.0}, state_dir=tmp_path / "emu") as emu:
        api = Api(emu.base_url, emu.key, attempts=2)
        replies = logprobs.ask(api, "moonshotai/kimi-k2.5", tags, prompts, 8, 0, {})
    assert all(isinstance(r, Exception) and "429" in str(r) for r in replies.values()), replies
    table, lines = logprobs.judge_replies(replies, tags, prompts,
                                          Reconstructor(load_tokenizer(resolve_target(TARGET)), source="target"))
    assert list(table["verdict"]) == ["unavailable", "unavailable"] and list(table["failed"]) == [1, 1] and not lines
    assert "no answer came" in logprobs.verdict_line(table)
