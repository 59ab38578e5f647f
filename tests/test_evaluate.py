"""Stage 06: speculative decoding is lossless, acceptance is counted right, the stage writes its report."""

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from draftsmith.drafter import outputs as drafter_outputs, load_exported
from draftsmith.drafter.export import export
from draftsmith.drafter.model import DrafterShape
from draftsmith.drafter.objective import build_drafter
from draftsmith.drafter.vocab import DraftVocab
from draftsmith import parameters
from draftsmith.evaluate import benchmarks, decode, metrics, outputs, stage
from draftsmith.evaluate.decode import Target
from draftsmith.evaluate.methods import Eagle3Proposer, HeldoutPrompt, PromptLookup, first_of_each, heldout_prompts
from draftsmith.paths import Run
from draftsmith.targets.checkpoint import load_target, target_config, target_tensors
from draftsmith.targets.corpus import chat_examples
from draftsmith.targets.hf import Capture
from draftsmith.tokens import Sample

from conftest import copy_run, stage_config, stage_05_train

LAYER_IDS = [1, 3, 4]   # the default for 8 layers, output convention


def quiet(*a, **k):
    pass


pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def target_model(tiny_target):
    return load_target(tiny_target, "cpu")


@pytest.fixture(scope="module")
def prompts(target_tokenizer):
    """Two chat prompts as the target sees them."""
    return [target_tokenizer.apply_chat_template(c[:-1], add_generation_prompt=True, tokenize=True,
                                                 return_dict=False) for c in chat_examples(seed=5)[:2]]


@pytest.fixture(scope="module")
def greedy(target_model, prompts):
    """The target's own greedy outputs (transformers' generate), 24 new tokens."""
    return [generate(target_model, p, 24) for p in prompts]


@pytest.fixture(scope="module")
def trained_run(shared_run, tmp_path_factory, tiny_target):
    """A run folder as stages 03-05 leave it: tokens of two datasets and hidden states (the
    session's shared run's, copied: `conftest.shared_run`), and a drafter trained on the default
    layers for a few steps with exports at 50% and 100%."""
    run = copy_run(shared_run, tmp_path_factory.mktemp("outputs") / "smoke", parts=("tokens", "hidden"))
    return stage_05_train(run, tiny_target, epochs=1.0, export_fractions=[0.5, 1.0])


def random_export(tiny_target, out: Path, seed: int = 0) -> Path:
    """A drafter that was never trained, exported: drafts garbage, must not change the output."""
    cfg = DrafterShape.from_target(target_config(tiny_target), 512)
    counts = torch.zeros(cfg.vocab_size, dtype=torch.int64)
    counts[torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:600]] = 1
    d = build_drafter(cfg, target_tensors(tiny_target)["embed"], DraftVocab.build(counts, 512), seed)
    return export(out, d.state_dict(), cfg, LAYER_IDS, "sglang", "float32")


class Oracle:
    """Proposes from a known output: per round, from a script of ('right', n) / ('wrong', at) /
    ('none',): n correct tokens, or k tokens that are right except at position `at`, or nothing."""

    def __init__(self, reference: list[int], script: list[tuple]):
        self.reference, self.script = reference, script

    def reset(self, prompt):
        self.done = None         # output tokens committed so far
        self.round = 0

    def advance(self, tokens, aux=None):
        # the first advance (after the prefill) carries the prompt and the first output token
        self.done = 1 if self.done is None else self.done + len(tokens)

    def propose(self, k):
        what = self.script[self.round % len(self.script)]
        self.round += 1
        nxt = self.reference[self.done:self.done + k]
        if what[0] == "none":
            return []
        if what[0] == "right":
            return nxt[:what[1]]
        return [t if i != what[1] else t + 1 for i, t in enumerate(nxt)]


# -- accounting ---------------------------------------------------------------------------------

def test_acceptance_counts_the_fields_length_tokens_per_round_and_per_position_rates_by_hand():
    rounds = [{"start": [1, 5, 7, 8, 12, 14], "drafted": [3, 3, 0, 3, 2, 0], "accepted": [3, 1, 0, 3, 1, 0],
               "produced": [4, 2, 1, 4, 2, 1], "top_prob": [1.0, 0.5, 0.5, 1.0, 1.0, 1.0]}]
    a = metrics.acceptance(rounds, 3)
    assert a["rounds"] == 6 and a["tokens"] == 14
    assert a["acceptance_length"] == pytest.approx(1 + 8 / 4)  # the field's: rounds without drafts not counted
    assert a["tokens_per_round"] == pytest.approx(14 / 6)      # every round, drafting or not
    assert a["draft_acceptance_rate"] == pytest.approx(8 / 11)
    assert a["position_acceptance"] == pytest.approx([1.0, 0.5, 2 / 3])
    assert a["position_acceptance_conditional"] == pytest.approx([1.0, 0.5, 1.0])
    assert a["position1_ceiling"] == pytest.approx(5 / 6)
    before, after = metrics.split_rounds(rounds[0], 8)
    assert before["produced"] == [4, 2, 1] and after["produced"] == [4, 2, 1] and after["top_prob"] == [1.0] * 3
    none = metrics.acceptance([{"start": [1, 2], "drafted": [0, 0], "accepted": [0, 0], "produced": [1, 1],
                                "top_prob": [1.0, 1.0]}], 3)
    assert none["acceptance_length"] == 1.0 and none["tokens_per_round"] == 1.0


def test_a_scripted_drafter_against_the_known_greedy_output_gives_the_hand_computed_acceptance(
        target_model, prompts, greedy):
    # rounds: 3 right -> 4 tokens; right then wrong -> 2; no drafts -> 1; 3 right again, the last round:
    # it drafts k like vLLM does and its 3 accepted drafts count, but only 2 tokens fit in max_new_tokens 10
    target = Target(target_model)
    script = [("right", 3), ("wrong", 1), ("none",)]
    d = decode.decode(target, Oracle(greedy[0], script), prompts[0], 3, 10)
    assert d.output == greedy[0][:10]
    assert d.rounds() == {"start": [1, 5, 7, 8], "drafted": [3, 3, 0, 3], "accepted": [3, 1, 0, 3],
                          "produced": [4, 2, 1, 2], "top_prob": [1.0] * 4}
    a = metrics.acceptance([d.rounds()], 3)
    assert a["tokens_per_round"] == pytest.approx(9 / 4) and a["acceptance_length"] == pytest.approx(1 + 7 / 3)


def test_repeat_start_is_the_first_output_token_closing_an_already_seen_ngram():
    assert metrics.repeat_start([1, 2, 3], [4, 5, 6, 7], n=2) == 4           # nothing repeats
    assert metrics.repeat_start([1, 2, 3], [4, 1, 2, 9], n=2) == 2           # (1, 2) seen in the prompt
    assert metrics.repeat_start([9], [5, 5, 5, 5], n=3) == 3                 # (5, 5, 5) again at index 3


def test_prompt_lookup_continues_the_latest_match_of_the_longest_ngram():
    pl = PromptLookup(lookup_max_ngram=3, lookup_min_ngram=1)
    pl.reset([7, 1, 2, 3, 8, 1, 2, 3, 9, 4])
    pl.advance([1, 2, 3])
    assert pl.propose(2) == [9, 4]                  # latest (1, 2, 3) was followed by 9, 4
    pl.reset([5, 6, 5, 6])
    assert pl.propose(5) == [5, 6, 5, 6, 5]         # a loop is continued past the end of the context
    pl.reset([1, 2, 3])
    assert pl.propose(3) == []                      # nothing to copy from
    with pytest.raises(ValueError, match="lookup_min_ngram <= lookup_max_ngram, got 2, 1"):
        PromptLookup(lookup_max_ngram=1, lookup_min_ngram=2)


# -- lossless ---------------------------------------------------------------------------------------

def generate(model, prompt: list[int], n: int) -> list[int]:
    g = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, temperature=None, top_p=None,
                       top_k=None)
    return g[0, len(prompt):].tolist()


def test_speculative_decoding_outputs_the_targets_greedy_tokens_with_any_drafter(
        target_model, prompts, greedy, trained_run, tiny_target, tmp_path):
    """Trained and untrained exported drafters, prompt lookup, scripted always-right / always-wrong /
    mixed drafts: the output is the target's greedy output (transformers' generate). The tiny target
    loops at once ("the the the"), which a wrongly cut cache could still reproduce, so the same is
    checked on a target of the same shape with random weights, whose greedy output does not loop."""
    exports = drafter_outputs.read_exports(trained_run / "drafter")
    assert [e["fraction"] for e in exports] == [0.5, 1.0]
    trained = Eagle3Proposer(load_exported(exports[-1]["dir"], tiny_target))
    untrained = Eagle3Proposer(load_exported(random_export(tiny_target, tmp_path / "bad"), tiny_target))
    mixed = [("right", 2), ("wrong", 1), ("none",), ("wrong", 0), ("right", 3)]

    torch.manual_seed(0)
    noisy = type(target_model)(target_model.config).eval()
    with torch.no_grad():
        for w in noisy.parameters():
            if w.dim() == 2:
                w.normal_(0, 0.3)    # large random weights: word salad that does not repeat
    noisy_refs = [generate(noisy, p, 24) for p in prompts[:2]]
    assert len(set(noisy_refs[0])) > 12                  # no loop to hide behind
    lookup = dict(lookup_max_ngram=3, lookup_min_ngram=1)
    cases = [(target_model, greedy, {"none": None, "prompt lookup": PromptLookup(**lookup), "trained drafter": trained,
                                     "untrained drafter": untrained}),
             (noisy, noisy_refs, {"untrained drafter": untrained, "prompt lookup": PromptLookup(**lookup)})]
    for model, refs, proposers in cases:
        target = Target(model, LAYER_IDS)
        for i, (p, ref) in enumerate(zip(prompts, refs)):
            scripted = {"always right": Oracle(ref, [("right", 9)]), "always wrong": Oracle(ref, [("wrong", 0)]),
                        "mixed": Oracle(ref, mixed)}
            for name, prop in {**proposers, **scripted}.items():
                d = decode.decode(target, prop, p, 3, 24)
                assert d.output == ref, f"{name}, prompt {i}: output differs from greedy decoding"
                assert sum(d.produced) == len(ref) - 1
            right = decode.decode(target, scripted["always right"], p, 3, 24)
            a = metrics.acceptance([right.rounds()], 3)
            assert a["tokens_per_round"] == pytest.approx(23 / 6) and a["acceptance_length"] == 4.0  # 4 x 5 + 3 fit
        target.close()


def test_chain_drafts_are_what_training_time_test_predicts_on_the_final_sequence(
        target_model, prompts, tiny_target, tmp_path):
    """The drafter at inference reads the same target features, at the same positions, as in
    training: the logits behind every round's first draft equal TTT step 0's (features from stage
    04's extractor over the whole final sequence) at the last committed position."""
    drafter = load_exported(random_export(tiny_target, tmp_path / "rnd", seed=1), tiny_target)
    seen = []

    class Recorder(Eagle3Proposer):
        def reset(self, prompt):
            super().reset(prompt)
            self.n = 0

        def advance(self, tokens, aux):
            super().advance(tokens, aux)
            self.n += len(tokens)

        def propose(self, k):
            # n: drafter positions committed (= committed tokens - 1); logits: what draft 1 is read from
            seen.append((self.n, self.logits.clone()))
            return super().propose(k)

    p = prompts[1]
    d = decode.decode(Target(target_model, LAYER_IDS), Recorder(drafter), p, 3, 20)
    full = list(p) + d.output
    sample = Sample("x", "s", torch.tensor(full, dtype=torch.int32),
                           torch.zeros(len(full), dtype=torch.uint8), "")
    cap = Capture(target_model, LAYER_IDS)
    aux, _ = cap([sample])
    cap.close()
    with torch.no_grad():
        step0 = drafter.logits(next(drafter.ttt(aux[None], torch.tensor([full]), 1)))[0]
    assert len(seen) == sum(n > 0 for n in d.drafted) > 5
    for n, logits in seen:
        assert torch.allclose(logits, step0[n - 1], atol=1e-5, rtol=1e-4), \
            f"round at {n}: max |chain - TTT| = {float((logits - step0[n - 1]).abs().max())}"


def test_sampled_verification_keeps_the_target_distribution():
    """At T > 0 a draft is accepted with probability p(draft) and a rejection resamples from p
    without it: the emitted token is distributed as p whatever the draft."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    gen = torch.Generator().manual_seed(0)
    for draft in (0, 3):
        counts = torch.zeros(4)
        n = 6000
        for _ in range(n):
            a, nxt = decode.verify(logits, [draft], 1.0, gen)
            counts[draft if a else nxt] += 1
        assert torch.allclose(counts / n, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.025)   # > 3 sigma


# -- the stage -------------------------------------------------------------------------------------

@pytest.mark.notebook
def test_stage_06_run_like_a_user_writes_report_json_figures_and_the_run_report(trained_run, tiny_target):
    """`draftsmith run 06` on a run folder that stages 04-05 filled: every export and both baselines
    measured on held-out prompts at T = 0 and 1, report.json, figures, report.html; a re-run
    measures nothing again."""
    from draftsmith import cli
    from draftsmith.paths import REPO_ROOT

    assert cli.main(["run", "06", "-f", str(REPO_ROOT / "params" / "smoke.yaml"), "-p", "outputs_dir",
                     str(trained_run.parent), "-p", "run_name", trained_run.name]) == 0
    report = json.loads((trained_run / "eval" / "report.json").read_text())
    assert report["draft_tokens"] == 3 and report["aux_layer_ids"] == LAYER_IDS
    assert set(report["prompts"]) == {"code", "chat"}
    assert {tuple(x) for x in report["prompt_ids"]} <= set(drafter_outputs.read_heldout(trained_run / "drafter"))
    greedy = report["temperatures"]["0"]["methods"]
    assert list(greedy) == ["none", "prompt lookup", "eagle3 50%", "eagle3"]
    assert greedy["none"]["acceptance_length"] == 1.0
    assert all(m["lossless"] for m in greedy.values())
    assert set(greedy["eagle3"]["per_dataset"]) == {"code", "chat"}
    assert report["temperatures"]["1"]["methods"]["eagle3"]["lossless"] is None   # not comparable token-wise
    assert "--speculative-algorithm EAGLE3" in report["serving"]["sglang_server"]
    figures = {p.name for p in (trained_run / "eval" / "figures").glob("*.png")}
    assert figures == {"acceptance_by_dataset.png", "acceptance_vs_training.png", "per_position.png", "speedup.png"}
    html = (trained_run / "report.html").read_text()
    assert "06 · Acceptance length" in html and html.count("data:image/png") >= 4
    # the results as data, read back as a user would; the run's headline in summary.json and report.html
    import pandas as pd

    df = pd.read_csv(trained_run / "eval" / "results.csv")
    row = df[(df.temperature == 0) & (df.method == "eagle3") & (df.prompt_set == "held-out code")].iloc[0]
    code = greedy["eagle3"]["per_dataset"]["code"]
    assert (row.acceptance_length, row.prompts, row.drafts, row.k) == \
        (pytest.approx(code["acceptance_length"]), code["prompts"], code["drafts"], 3)
    assert len(df) == len(df.drop_duplicates(["method", "prompt_set", "temperature"]))
    headline = json.loads((trained_run / "summary.json").read_text())["headline"]
    assert headline["drafter"] == greedy["eagle3"]["acceptance_length"] and headline["prompts"] == 2
    assert headline["measured_in"] == "our decoder" and headline["text"].split("\n")[0] in html.replace("&#177;", "±")
    # the executed notebook's prose states the figures of the table beside it (tests/test_report_agrees.py)
    from test_report_agrees import prose_disagreements

    from draftsmith.evaluate import figures as eval_figures

    nb = json.loads((trained_run / "notebooks" / "06_evaluate.ipynb").read_text())
    said = ["".join(o["data"]["text/markdown"]) for c in nb["cells"] for o in c.get("outputs", [])
            if "text/markdown" in o.get("data", {})]
    prose = "\n\n".join(p for p in said if "drafter **" in p)
    assert prose_disagreements(prose, eval_figures.decoder_table(report).rename(columns={"±": "± se"})) == []

    rounds = (trained_run / "eval" / "rounds.jsonl").read_text()
    smoke = parameters.effective_params(parameters.discover(), str(REPO_ROOT / "params" / "smoke.yaml"), [])
    recorded = ("draft_tokens", "eval_max_new_tokens", "lookup_min_ngram", "lookup_max_ngram", "draft_cost_ratio",
                "seed")   # the settings report.json records, under notebook 06's names
    assert {name: report[name] for name in recorded} == {name: smoke[name] for name in recorded}
    assert report["eval_max_new_tokens"] == 16    # smoke.yaml's, not the notebook's default
    stage.run(Run(trained_run.parent, trained_run.name), parameters.stage_config("06", smoke), log=quiet)
    assert (trained_run / "eval" / "rounds.jsonl").read_text() == rounds
    again = json.loads((trained_run / "eval" / "report.json").read_text())
    assert again["temperatures"] == report["temperatures"]

    # the README's table, written from this report.json by the results command, and the rows it saved
    from draftsmith.evaluate import results
    page, saved = trained_run / "README.md", trained_run / "results.json"
    page.write_text(f"intro\n{results.README_BEGIN}\nold\n{results.README_END}\nrest\n", encoding="utf-8")
    assert results.main([str(trained_run), "--readme", str(page), "--save", str(saved)]) == 0
    table = results.readme_block(page.read_text(encoding="utf-8"), page)
    assert table == results.readme_table(results.load(saved)) and page.read_text().endswith("rest\n")
    chat = next(line for line in table.splitlines() if line.startswith("| greedy | held-out chat ("))
    expected = [greedy[m]["per_dataset"]["chat"]["acceptance_length"] for m in ("eagle3", "prompt lookup", "none")]
    assert [float(c.strip(" *").split(" ± ")[0]) for c in chat.split("|")[3:6]] == [round(x, 2) for x in expected]
    page.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="README.md: no stage 06 results block"):
        results.main([str(trained_run), "--readme", str(page)])


def test_heldout_prompts_are_the_samples_stage_05_held_out_in_its_order(trained_run, tmp_path):
    run = Run(trained_run.parent, trained_run.name)
    held = drafter_outputs.read_heldout(trained_run / "drafter")
    assert len(held) == drafter_outputs.read_summary(trained_run / "drafter")["heldout_samples"] == 7
    prompts = heldout_prompts(run, trained_run / "drafter", 1)
    assert sorted(p.dataset for p in prompts) == ["chat", "code"]      # one per dataset, as asked
    assert [(p.dataset, p.sample_id) for p in prompts] == [next(h for h in held if h[0] == p.dataset)
                                                           for p in prompts]   # the first of each, in stage 05's order
    assert all(p.ids[-2:] == (128804, 128821) for p in prompts)        # ... <｜Assistant｜><think>
    assert [(p.dataset, p.sample_id) for p in heldout_prompts(run, trained_run / "drafter", 99)] == held
    with pytest.raises(FileNotFoundError, match="heldout.json: .*run stage 05 first"):
        heldout_prompts(run, tmp_path, 1)
    drafter_outputs.write_heldout(tmp_path, [("code", "not-extracted")] + held, 0.2)
    with pytest.raises(ValueError, match="'not-extracted' of 'code': held out by stage 05 .* not in stage 04"):
        heldout_prompts(run, tmp_path, 1)


def test_rounds_file_cuts_a_torn_last_line_and_names_a_damaged_one(tmp_path):
    run = Run(tmp_path, "r")
    path = run.dir("eval") / "rounds.jsonl"
    row = {"settings": "s", "method_fingerprint": "m", "dataset": "code", "sample_id": "a"}
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "sample_id": "b"})[:30])   # killed mid-line
    kept = outputs.RoundsFile(run)
    assert list(kept.rows) == [("s", "m", "code", "a")] and path.read_text() == json.dumps(row) + "\n"
    kept.add({**row, "sample_id": "b"})
    assert len(outputs.RoundsFile(run).rows) == 2
    path.write_text("{oops\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="rounds.jsonl:1: not valid JSON"):
        outputs.RoundsFile(run)


def test_engine_numbers_only_needs_the_engine(tmp_path):
    with pytest.raises(ValueError, match="eval_hf_crosscheck is false and eval_backend is hf"):
        stage.run(Run(tmp_path, "r"), stage_config("06", eval_backend="hf", eval_hf_crosscheck=False),
                  log=quiet)


def test_beside_vllm_our_decoder_cross_checks_the_held_out_prompts_greedily_and_measures_all_where_it_is_alone():
    from draftsmith.evaluate.decode import decoder_scope

    served = [{"kind": "none"}, {"kind": "eagle3"}]                     # the engine measured the drafter
    beside = decoder_scope([0.0, 1.0], eval_hf_crosscheck_all=False, engine_rows=served)
    assert (beside["temperatures"], beside["benchmarks"]) == ([0.0], False)
    assert "T = 0 only" in beside["why"]
    assert decoder_scope([1.0, 0.7], eval_hf_crosscheck_all=False, engine_rows=served)["temperatures"] == [1.0]
    everything = ([0.0, 1.0], True)
    asked = decoder_scope([0.0, 1.0], eval_hf_crosscheck_all=True, engine_rows=served)
    alone = decoder_scope([0.0, 1.0], eval_hf_crosscheck_all=False, engine_rows=None)    # eval_backend hf
    gpu_only = decoder_scope([0.0, 1.0], eval_hf_crosscheck_all=False,
                             engine_rows=[{"kind": "none"}, {"kind": "eagle3", "gpu_only": "MLA: GPU only"}])
    for scope in (asked, alone, gpu_only):
        assert (scope["temperatures"], scope["benchmarks"]) == everything, scope["why"]


def test_the_engines_report_compares_with_our_decoder_only_at_the_temperatures_it_measured():
    from draftsmith.evaluate.methods import EngineMethod

    methods = [EngineMethod("none", "none", "vllm-none"), EngineMethod("eagle3", "eagle3", "vllm-d", hf_fingerprint="d")]
    counters = {"drafts": 2, "draft_tokens": 6, "accepted": 3, "per_pos": [2, 1, 0]}

    def row(fp, kind, t, **more):
        return {"method_fingerprint": fp, "kind": kind, "dataset": "code", "sample_id": "a", "temperature": t,
                "output": [5, 6, 7], "seconds": 1.0, "counters": counters, **more}

    engine = [row(m.fingerprint, m.kind, t, accepted=[2, 1]) for m in methods for t in (0.0, 1.0)]
    ours = [row("none", "none", 0.0, rounds={"accepted": [], "drafted": []}),
            row("d", "eagle3", 0.0, rounds={"accepted": [2, 1], "drafted": [3, 3]})]
    report = metrics.engine_report(engine, methods, ours, draft_tokens=3, eval_temperatures=[0.0, 1.0],
                                   eval_engine_dtype="float32", eval_tensor_parallel=1)
    greedy, sampled = report["temperatures"]["0"], report["temperatures"]["1"]
    assert greedy["vs_ours"] == {"prompts": 1, "same_no_drafter_output": 1,
                                 "methods": {"eagle3": {"same_output": 1, "same_accepted_per_step": 1}}}
    assert sampled["vs_ours"] is None and sampled["methods"]["eagle3"]["acceptance_length"] == 2.5


def test_a_requests_counters_are_summed_from_its_verify_steps_as_vllm_sums_its_own_and_held_to_them():
    """Under batching the global counters' increase covers every request in flight, so each request's
    counters come from its own verify steps; the sum over the engine's requests must be that increase."""
    from draftsmith.evaluate.engine import check_counters, step_counters

    a = step_counters([3, 3, 3, 3], [3, 0, 1, 2], 3)          # 4 steps of k = 3
    assert a == {"drafts": 4, "draft_tokens": 12, "accepted": 6, "per_pos": [3, 2, 1]}
    b = step_counters([3, 1], [1, 1], 3)                       # ngram: a short draft
    assert b == {"drafts": 2, "draft_tokens": 4, "accepted": 2, "per_pos": [2, 0, 0]}
    assert step_counters([], [], 3) == {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0, 0, 0]}
    before = {"drafts": 10, "draft_tokens": 30, "accepted": 5, "per_pos": [3, 1, 1]}
    after = {"drafts": 16, "draft_tokens": 46, "accepted": 13, "per_pos": [8, 3, 2]}
    check_counters("eagle3", before, after, [{"counters": a}, {"counters": b}], 3)
    with pytest.raises(RuntimeError, match="eagle3: vLLM's spec-decode counters rose by .* over 1 decodes"):
        check_counters("eagle3", before, after, [{"counters": a}], 3)
    # the engine without speculation has no counters at all
    none = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    check_counters("none", none, none, [{"counters": step_counters([], [], 3)}], 3)


def test_the_engine_process_reads_its_job_back_as_the_record_the_stage_wrote(tmp_path):
    """The job crosses the process boundary once, as JSON: the stage's config keeps its settings'
    names and forms, the methods stay `EngineMethod`s, the keys done stay tuples."""
    from dataclasses import asdict

    from draftsmith.config import EvaluateConfig
    from draftsmith.evaluate.engine import EngineJob
    from draftsmith.evaluate.methods import EngineMethod, speculative_config

    cfg = EvaluateConfig(draft_tokens=5, eval_temperatures=[0.0, 0.7], engine_env={"NCCL_P2P_DISABLE": "1"},
                         kv_cache_dtype="fp8", eval_engine_concurrency=4)
    methods = [EngineMethod("none", "none", "vllm-none"),
               EngineMethod("ngram", "ngram", "vllm-ngram-1-3", info={"lookup_min_ngram": 1},
                            speculative_config=speculative_config("ngram", 5, lookup_min_ngram=1, lookup_max_ngram=3),
                            skip_datasets=["mt_bench"])]
    job = EngineJob(cfg, "/t", '{"k": 5}', str(tmp_path / "rows.jsonl"), 96,
                    [HeldoutPrompt("code", "a", (1, 2, 3)).job()], methods, [("vllm-none", 0.7, "code", "a")])
    path = outputs.write_engine_job(Run(tmp_path, "r"), asdict(job))
    back = EngineJob.from_json(json.loads(path.read_text()))
    assert back == job and back.cfg.draft_tokens == 5 and back.methods[1].drafts(back.cfg.draft_tokens) == 5
    assert ("vllm-none", 0.7, "code", "a") in set(back.done)


def test_the_time_estimate_scales_the_probe_to_the_workload():
    from draftsmith.evaluate.engine import Probe, Workload, duration, job_line

    probe = Probe(requests=4, prefill_s=2.0, tokens=33, decode_s=3.2)      # 0.1 s per step of 4 tokens
    assert probe.step_s == pytest.approx(0.1) and probe.tokens_per_s == pytest.approx(40)
    eight = ((100,),) * 8                                                   # 8 prompts of one turn
    # 8 turns of 100 tokens, 4 in flight: 8 prefills at 0.5 s, 200 steps at 0.1 s
    assert Workload((eight,), 4).seconds(probe) == pytest.approx(8 * 0.5 + 200 * 0.1)
    # one at a time: the same prefills, 800 steps (a step of one request charged as the probe's)
    assert Workload((eight,), 1).seconds(probe) == pytest.approx(8 * 0.5 + 800 * 0.1)
    # 8 in flight where the probe had 4: a step charged per request in flight
    assert Workload((eight,), 8).seconds(probe) == pytest.approx(8 * 0.5 + 100 * 0.2)
    # two temperatures are two passes; a conversation of 3 turns of 100 is 300 steps however wide
    assert Workload((eight, eight), 4).seconds(probe) == pytest.approx(2 * (8 * 0.5 + 200 * 0.1))
    assert Workload((((100, 100, 100),) + ((10,),) * 3,), 4).seconds(probe) == pytest.approx(6 * 0.5 + 300 * 0.1)
    assert Workload(((), ()), 8).seconds(probe) == 0
    assert (duration(42), duration(720), duration(3.5 * 3600)) == ("42 s", "12 min", "3.5 h")
    line = job_line({"none": Workload((eight,), 4), "eagle3": Workload((eight,), 4)}, probe, 60.0, "none")
    assert line.startswith("estimated time of the 2 engine(s): 2 min (16 decodes of up to 1600 tokens")
    with pytest.raises(ValueError, match="a probe needs"):
        Probe(requests=0, prefill_s=1.0, tokens=8, decode_s=1.0)


def test_a_first_pass_takes_the_first_prompts_of_every_prompt_set_in_order():
    ps = [HeldoutPrompt(ds, f"{ds}{i}", (1, 2)) for ds in ("code", "chat", "mt_bench") for i in range(3)]
    assert [p.sample_id for p in first_of_each(ps[::-1], 2)] == ["mt_bench2", "mt_bench1", "chat2", "chat1",
                                                                 "code2", "code1"]
    assert first_of_each(ps, 5) == ps


def test_serving_commands_name_the_3_1_4_chain_and_trust_the_targets_code_when_asked(tiny_target, tmp_path):
    d = random_export(tiny_target, tmp_path / "e")
    c = benchmarks.serving_commands(d, "/models/Kimi-K2.5", "bench.json", draft_tokens=3, eval_tensor_parallel=8,
                                 trust_remote_code=True)
    for flag in ("--speculative-algorithm EAGLE3", "--speculative-num-steps 3", "--speculative-eagle-topk 1",
                 "--speculative-num-draft-tokens 4", "--trust-remote-code", "--tp 8"):
        assert flag in c["sglang_server"]
    assert all("--trust-remote-code" in c[name] for name in ("sglang_baseline", "sglang_ngram", "vllm_server",
                                                             "vllm_baseline"))
    assert "completion_tokens'] / m['spec_verify_ct']" in c["sglang_acceptance"]
    assert "--trust-remote-code" not in benchmarks.serving_commands(d, "/m", "bench.json", draft_tokens=3,
                                                                    eval_tensor_parallel=1,
                                                                    trust_remote_code=False)["sglang_server"]


@pytest.mark.notebook
def test_stage_06_measures_a_users_benchmark_file_and_mt_bench_apart_from_the_held_out_prompts(
        trained_run, tmp_path):
    """`draftsmith run 06` with `eval_benchmarks` (our decoder, `eval_backend: hf`): a user's JSONL
    file and MT-bench's first question, both turns, the final drafter and both baselines at T = 0 and 1
    (the export along training on the held-out prompts only); a table row per
    benchmark, the bar figure, the commands that measure the same in SGLang and vLLM, and no
    published column for a target that is not Kimi-K2.5."""
    import shutil

    from draftsmith import cli
    from draftsmith.evaluate import figures, results
    from draftsmith.paths import REPO_ROOT

    run = tmp_path / "outputs" / "bench"
    shutil.copytree(trained_run / "hidden", run / "hidden")
    shutil.copytree(trained_run / "drafter", run / "drafter")
    user = tmp_path / "gsm8k.jsonl"
    user.write_text("".join(json.dumps({"id": f"g{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                            for i, q in enumerate(["What is 12 * 7?", "Sum the numbers 1 to 10.", "Is 91 prime?"])))
    spec = json.dumps([{"name": "gsm8k", "path": str(user), "prompts": 2, "max_new_tokens": 8},
                       {"name": "mt_bench", "prompts": 1, "max_new_tokens": 6}])
    assert cli.main(["run", "06", "-f", str(REPO_ROOT / "params" / "smoke.yaml"), "-p", "outputs_dir",
                     str(run.parent), "-p", "run_name", run.name, "-p", "eval_benchmarks", spec]) == 0
    report = json.loads((run / "eval" / "report.json").read_text())
    b = report["benchmarks"]
    assert [(s["name"], s["prompts"], s["turns"], s["max_new_tokens"]) for s in b["sets"]] == \
        [("gsm8k", 2, 1, 8), ("mt_bench", 1, 2, 6)]
    assert set(report["prompts"]) == {"code", "chat"}                   # the held-out numbers are kept apart
    greedy = b["temperatures"]["0"]["methods"]
    # the benchmarks compare the drafter a user ships; the export along training decodes the held-out prompts
    assert list(greedy) == ["none", "prompt lookup", "eagle3"]
    assert "eagle3 50%" in report["temperatures"]["0"]["methods"]
    assert set(greedy["eagle3"]["per_dataset"]) == {"gsm8k", "mt_bench"}
    assert greedy["none"]["acceptance_length"] == 1.0 and all(m["lossless"] for m in greedy.values())
    assert b["references"] is None and b["engine"] is None
    rows = [json.loads(line) for line in (run / "eval" / "rounds.jsonl").read_text().splitlines()]
    mt = [r for r in rows if r["dataset"] == "mt_bench"]
    assert len(mt) == 6 and all(len(r["turns"]) == 2 for r in mt)     # 3 methods x 2 temperatures, both turns
    assert all(len(r["output"]) == sum(t["output_tokens"] for t in r["turns"]) <= 12 for r in mt)
    assert {r["sample_id"] for r in rows if r["dataset"] == "gsm8k"} == {"g0", "g1"}
    tabs = results.tables(report)
    assert list(tabs) == [f"{mode} · {s} · our decoder" for mode in ("greedy (T = 0)", "sampling (T = 1)")
                          for s in ("held-out chat", "held-out code", "held-out, all", "GSM8K", "MT-bench")]
    gsm = tabs["greedy (T = 0) · GSM8K · our decoder"]
    assert list(gsm["method"]) == ["none", "prompt lookup", "eagle3 (final)"] and "P(draft 3)" in gsm
    assert "measured in" not in gsm and "output tok/s per request (measured)" not in gsm
    assert gsm["acceptance length"].tolist() == [greedy[m]["per_dataset"]["gsm8k"]["acceptance_length"]
                                                 for m in ("none", "prompt lookup", "eagle3")]
    assert "--sharegpt-output-len 8 --max-concurrency 1" in b["commands"]["gsm8k"]
    assert len(json.loads((run / "eval" / "bench_gsm8k_sharegpt.json").read_text())) == 2
    assert (run / "eval" / "figures" / "benchmarks.png").is_file()
    assert "The field's benchmarks" in (run / "report.html").read_text()

    # the same report, had the target been Kimi-K2.5
    kimi = {**report, "benchmarks": {**b, "references": benchmarks.REFERENCES}}
    mt = results.tables(kimi)["sampling (T = 1) · MT-bench"].set_index("method")   # two sources: a column
    assert mt.loc["lightseekorg/kimi-k2.5-eagle3", ["measured in", "acceptance length"]].tolist() == [
        results.PUBLISHED, 2.687]
    gsm = results.tables(kimi)["greedy (T = 0) · GSM8K"].set_index("method")
    assert gsm.loc["AQ-MedAI/Kimi-K25-eagle3", "draft acceptance rate"] == 0.5178
    assert pd.isna(gsm.loc["AQ-MedAI/Kimi-K25-eagle3", "acceptance length"])   # a rate is not a length
    assert "lightseekorg/kimi-k2.5-eagle3-mla" in figures.explain_benchmarks(kimi)
    labels = figures.benchmarks(kimi).axes[0].get_legend_handles_labels()[1]
    assert "lightseekorg/kimi-k2.5-eagle3 (published)" in labels and "AQ-MedAI/Kimi-K25-eagle3 (published)" not in labels


def test_our_decoder_agrees_with_the_engine_exactly_when_greedy_and_within_sampling_noise_when_not():
    from draftsmith.evaluate.results import agrees
    engine, ours = {"acceptance_length": 2.0, "drafts": 400}, {"acceptance_length": 2.004, "drafts": 400}
    assert agrees(engine, ours, 0.0, 3) and not agrees(engine, {**ours, "acceptance_length": 2.01}, 0.0, 3)
    # two standard errors of the difference: 2 * hypot(3 / (2 * 20), 3 / (2 * 20)) = 0.212
    assert agrees(engine, {**ours, "acceptance_length": 2.2}, 1.0, 3)
    assert not agrees(engine, {**ours, "acceptance_length": 2.25}, 1.0, 3)
