"""Stage 05: draft vocabulary, TTT alignment, training, resume, DDP, export."""

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftsmith import layers
from draftsmith.config import DrafterConfig, split
from draftsmith.paths import Run
from draftsmith.hidden import outputs as shards
from draftsmith.config import HiddenConfig
from draftsmith.hidden.stage import extract
from draftsmith.drafter import data, export, outputs, stage
from draftsmith.drafter.stage import TrainJob
from draftsmith.drafter.model import DrafterShape, Eagle3Drafter
from draftsmith.drafter.objective import TTTObjective
from draftsmith.drafter.vocab import DraftVocab, token_counts, used_ids

from conftest import stage_config, write_token_rows


WORDS = ("the function returns a list of values from the given file path and raises an error when the "
         "object is not found so the caller can retry with another name or default").split()


def write_tokens(path: Path, tok, n: int, seed: int = 1) -> Path:
    """n random chat samples with reasoning, as stage 03 writes them."""
    rng = random.Random(seed)
    convs = [[{"role": "user", "content": f"What does helper_{rng.randint(0, 99)} do?"},
              {"role": "assistant", "reasoning_content": " ".join(rng.choices(WORDS, k=rng.randint(4, 12))),
               "content": " ".join(rng.choices(WORDS, k=rng.randint(20, 50)))}] for _ in range(n)]
    return write_token_rows(path, tok, convs)


pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def hidden_dir(tmp_path_factory, tiny_target, target_tokenizer) -> Path:
    """Hidden states of the tiny-test target over 40 chat samples, through stage 04's extractor."""
    root = tmp_path_factory.mktemp("drafter_data")
    tokens = write_tokens(root / "chat.jsonl", target_tokenizer, 40)
    extract(tiny_target, [tokens], root / "hidden", HiddenConfig(hidden_dtype="bf16", target_backend="hf"),
            log=lambda m: None)
    return root / "hidden"


@dataclass(frozen=True)
class Setup:
    """One drafter's training as a test states it: stage 05's config and the job; `but` changes
    fields of either by name."""
    cfg: DrafterConfig
    job: TrainJob

    def but(self, **kw) -> "Setup":
        job, cfg = split(TrainJob, kw)
        return Setup(replace(self.cfg, **cfg), replace(self.job, **job))


def train(s: Setup) -> dict:
    return stage.train(s.cfg, s.job, log=quiet)


def launch(s: Setup) -> dict:
    return stage.launch(s.cfg, s.job, log=quiet)


def small_config(hidden_dir, target, out, **kw) -> Setup:
    job = TrainJob(hidden_dir=str(hidden_dir), target_path=str(target), out_dir=str(out))
    base = dict(draft_vocab_size=512, ttt_steps=3, train_epochs=1.0, train_batch_size=4, train_micro_batch_size=2,
                train_max_len=192, train_lr=3e-3, train_warmup_fraction=0.015, train_weight_decay=0.0, train_grad_clip=0.5,
                train_holdout_fraction=0.1, seed=0, train_fsdp=False, train_eval_every=0, train_checkpoint_every=3,
                export_fractions=[0.5, 1.0], export_engine="sglang", export_dtype="float32", train_resume=True)
    return Setup(DrafterConfig(**base), job).but(**kw)


def quiet(*a, **k):
    pass


# -- vocabulary ----------------------------------------------------------------------------------

def test_draft_vocab_keeps_the_most_frequent_tokens_and_d2t_t2d_round_trip(tmp_path):
    counts = torch.zeros(50, dtype=torch.int64)
    counts[[3, 7, 11, 40, 41]] = torch.tensor([5, 9, 1, 9, 2])
    v = DraftVocab.build(counts, 4)
    assert v.used.tolist() == [3, 7, 40, 41]                     # top 4 by count, sorted by id
    assert (torch.arange(4) + v.d2t).tolist() == v.used.tolist()  # target = draft + d2t[draft]
    assert v.t2d.nonzero().flatten().tolist() == v.used.tolist() and v.t2d.dtype == torch.bool
    assert v.d2t.dtype == torch.int64
    assert v.coverage() == pytest.approx(25 / 26)
    assert used_ids(v.d2t, v.t2d).tolist() == v.used.tolist()
    outputs.write_vocab(tmp_path, v, key="k1")
    w = outputs.read_vocab(tmp_path)
    assert torch.equal(w.used, v.used) and torch.equal(w.counts, counts)
    assert outputs.read_vocab(tmp_path, "k1").size == 4 and outputs.read_vocab(tmp_path, "k2") is None
    # fewer distinct tokens than asked: filled with the lowest unused ids, size exact
    f = DraftVocab.build(counts, 8)
    assert f.used.tolist() == [0, 1, 2, 3, 7, 11, 40, 41] and f.coverage() == 1.0
    with pytest.raises(ValueError, match="different draft vocabularies"):
        used_ids(v.d2t, DraftVocab.build(counts, 4).t2d.roll(1))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DraftVocab.build(counts, 51)


def test_vocab_counts_only_loss_masked_tokens(hidden_dir):
    hs = shards.HiddenShards(hidden_dir)
    counts = token_counts(hs, range(len(hs)), 129280)
    expect = torch.zeros(129280, dtype=torch.int64)
    for i in range(len(hs)):
        s = hs.sample(i)
        expect += torch.bincount(s["input_ids"][s["loss_mask"].bool()], minlength=129280)
    assert torch.equal(counts, expect)
    assert counts[128804] == 0 and counts[1] == len(hs)   # the assistant header never, end-of-turn once each


def test_read_heldout_says_to_run_stage_05_first(tmp_path):
    run = Run(tmp_path, "r")
    with pytest.raises(FileNotFoundError, match=r"drafter/heldout.json: .*run stage 05 first"):
        outputs.read_heldout(run)
    outputs.write_heldout(run.dir("drafter"), [("code", "a1"), ("chat", "b 2")], 0.1)
    assert outputs.read_heldout(run) == outputs.read_heldout(run.dir("drafter")) == [("code", "a1"), ("chat", "b 2")]
    (run.dir("drafter") / "heldout.json").write_text('{"samples": [{"dataset": "code"}]}')
    with pytest.raises(ValueError, match="heldout.json: not a held-out sample list"):
        outputs.read_heldout(run)


def test_training_reads_notebook_05s_config_and_a_job_of_only_the_knobs_no_stage_declares():
    """`stage.train` takes stage 05's config itself; `TrainJob` holds what no stage declares (the kind,
    the paths, `step_weight`, `stop_at`), none of them a notebook parameter under its name or a
    `train_` one, and the two survive the JSON file torchrun ranks read (`stage.read_settings`)."""
    from dataclasses import fields

    from draftsmith import parameters

    declared = {name for st in parameters.discover() for name in st.params}
    for f in fields(TrainJob):
        assert f.name not in declared and f"train_{f.name}" not in declared, f.name
    with pytest.raises(TypeError, match="out_dir"):
        TrainJob(hidden_dir="h", target_path="t")


def test_the_settings_torchrun_ranks_read_are_the_config_and_job_handed_over(tmp_path):
    s = small_config("h", "t", tmp_path, drafter_kind="dflash", stop_at=3, train_lr=0.5, dflash_layers=2)
    path = outputs.write_train_config(tmp_path, stage.settings(s.cfg, s.job))
    assert stage.read_settings(path) == (s.cfg, s.job)
    path.write_text(json.dumps({**stage.settings(s.cfg, s.job), "lr": 0.1}))
    with pytest.raises(ValueError, match=r"unknown training settings \['lr'\]"):
        stage.read_settings(path)


def test_a_draft_vocab_larger_than_the_targets_is_refused(tmp_path):
    s = small_config("h", "t", tmp_path)
    stage.check(s.cfg, s.job)
    with pytest.raises(ValueError, match="draft_vocab_size 9 must be at most 8"):
        DraftVocab.build(torch.ones(8, dtype=torch.int64), 9)


# -- supervision and TTT alignment ---------------------------------------------------------------

def test_supervision_needs_a_response_token_next_and_the_teacher_argmax_in_the_draft_vocab(tmp_path):
    # 1 sample, hidden 4, vocab 6; lm_head = identity on the first 4 ids, so argmax(last[u]) is chosen
    ids = torch.tensor([0, 5, 2, 3, 4, 1, 2])
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1])           # response = tokens 3..6
    argmax = [1, 2, 0, 3, 1, 0, 1]                        # teacher argmax at each position
    last = torch.nn.functional.one_hot(torch.tensor(argmax), 4).float() * 5
    shards.write_shard(tmp_path / "s.safetensors", torch.zeros(7, 12), last, ids, mask, torch.tensor([0, 7]))
    shards.write_index(tmp_path, {"dtype": "bf16", "hidden_size": 4, "layer_ids": [1, 3, 4],
                                  "shards": [{"file": "s.safetensors", "samples": [{"sample_id": "a", "dataset": "d"}]}]})
    hs = shards.HiddenShards(tmp_path)
    lm_head = torch.cat([torch.eye(4), torch.zeros(2, 4)])
    t2d = torch.tensor([True, False, True, True, False, False])
    sup = data.supervision(hs, [0], lm_head, t2d, max_len=100, device=torch.device("cpu"))[0]
    # u supervised iff loss_mask[u+1] and t2d[argmax[u]]: u=2, 3, 5 (u=4: argmax 1 is not in the vocab)
    assert sup.tolist() == [0, 0, 1, 1, 0, 1, 0]
    # TTT step i uses u >= 1+i
    assert data.step_counts(sup, 4).tolist() == [3, 3, 2, 1]
    assert data.supervision(hs, [0], lm_head, t2d, max_len=5, device=torch.device("cpu"))[0].tolist() == [0, 0, 1, 1, 0]


def tiny_drafter(seed=0, vocab=300, draft=40) -> Eagle3Drafter:
    cfg = DrafterShape(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
                        vocab_size=vocab, draft_vocab_size=draft, target_hidden_size=16)
    torch.manual_seed(seed)
    m = Eagle3Drafter(cfg, d2t=torch.arange(draft) * 3, t2d=torch.zeros(vocab, dtype=torch.bool))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m.eval()


def test_ttt_step_i_is_chain_drafting_with_a_kv_cache():
    """Step i at position t must see exactly what chain drafting sees when it drafts i+1 tokens past
    position t: the prefix 0..t and its own earlier drafts, at RoPE positions t+1..t+i."""
    m = tiny_drafter()
    n, steps = 12, 4
    aux = torch.randn(1, n, 48)
    ids = torch.randint(0, 300, (1, n))
    with torch.no_grad():
        ttt = list(m.ttt(aux, ids, steps))
        for t in (0, 3, 7):
            cache = m.new_cache()
            h, _ = m.extend(m.project(aux[:, :t + 1]), ids[:, 1:t + 2], cache)     # (aux[p], x[p+1]) for p <= t
            assert torch.allclose(h[:, -1], ttt[0][:, t], atol=1e-5)
            for i in range(1, steps):
                if t + 1 + i >= n:
                    break
                h, _ = m.extend(h[:, -1:], ids[:, t + 1 + i:t + 2 + i], cache)     # own output, true token
                assert torch.allclose(h[:, -1], ttt[i][:, t], atol=1e-5), (t, i)
        # causality: changing later tokens leaves earlier positions of every step unchanged
        ids2 = ids.clone()
        ids2[:, 9:] = (ids2[:, 9:] + 1) % 300
        ttt2 = list(m.ttt(aux, ids2, steps))
        for i in range(steps):
            assert torch.equal(ttt2[i][:, :8 - i], ttt[i][:, :8 - i])


def test_ttt_step_i_predicts_the_token_i_plus_1_ahead_against_the_teacher_there():
    """With one supervised target position u, step i scores the drafter's output at t = u-1-i (whose
    input token is x[u], i.e. it predicts x[u+1], i+1 tokens past x[t+1]) against teacher(last[u])."""
    m = tiny_drafter()
    n, steps, u = 10, 3, 6
    aux, ids = torch.randn(1, n, 48), torch.randint(0, 300, (1, n))
    sup = torch.zeros(1, n, dtype=torch.bool)
    sup[0, u] = True
    head = torch.randn(40, 16)
    last = torch.randn(1, 16)
    obj = TTTObjective(m, head, steps)
    seen = []
    hook = m.norm.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].detach().clone()))
    with torch.no_grad():
        ce, (hits, count, ent) = obj(aux, ids, sup, last)
    hook.remove()
    outs = list(m.ttt(aux, ids, steps))
    p = (last @ head.T).softmax(-1)
    for i in range(steps):
        assert torch.equal(seen[i], outs[i][0, [u - 1 - i]])
        logp = torch.log_softmax(m.logits(outs[i][0, u - 1 - i]), -1)
        assert ce[i].item() == pytest.approx(-(p[0] * logp).sum().item(), rel=1e-5)
        assert hits[i] == float(logp.argmax() == p.argmax()) and count[i] == 1
        assert ent[i].item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-5)
    # a position too close to the start for a step is not supervised by it
    sup[0, u], sup[0, 1] = False, True
    with torch.no_grad():
        _, (_, count, _) = obj(aux, ids, sup, last)
    assert count.tolist() == [1, 0, 0]


# -- training ------------------------------------------------------------------------------------

def test_training_lowers_heldout_loss_below_the_unigram_baseline_and_exports(hidden_dir, tiny_target, tmp_path):
    setup = small_config(hidden_dir, tiny_target, tmp_path / "d", train_epochs=4.0, train_eval_every=4)
    s = train(setup)
    start, end, base = s["heldout_start"], s["heldout"], s["unigram_baseline"]
    assert end["step"] == s["total_steps"] == 36 and s["finished"]
    assert end["loss_i"][0] < start["loss_i"][0] - 1.0
    assert end["loss_i"][0] < base["loss"]
    # (acc_i: the tiny-test target's argmax is one token everywhere, so acc says little here; the
    # demo target's numbers are in the notebook and the report)
    assert 0 < s["vocab"]["train_coverage"] <= 1
    assert [e["step"] for e in s["exports"]] == [18, 36]
    assert [e["dir"] for e in outputs.read_exports(setup.job.out_dir)] == [Path(e["dir"]) for e in s["exports"]]
    # the held-out pairs stage 06 prompts with are the split training scored on
    hs = shards.HiddenShards(hidden_dir)
    _, held = data.split(hs, setup.cfg.train_holdout_fraction)
    assert outputs.read_heldout(setup.job.out_dir) == [(hs.samples[i].dataset, hs.samples[i].sample_id) for i in held]
    assert len(held) == s["heldout_samples"] == 4
    assert Path(s["exports"][-1]["dir"]).name == "eagle3"
    rows = outputs.read_metrics(setup.job.out_dir)
    assert [r["step"] for r in rows if r["split"] == "train"] == list(range(1, 37))

    # the export: exactly EAGLE-3's keys and shapes, the config fields, ids for the engine
    out = Path(s["exports"][-1]["dir"])
    config = json.loads((out / "config.json").read_text())
    mcfg = export.config_of_export(config)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    assert {k: tuple(v.shape) for k, v in weights.items()} == export.expected_shapes(mcfg)
    assert set(weights) == {
        "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
        "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
        "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
        "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert (config["hidden_size"], config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]) \
        == (32, 129280, 512, 32)
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_theta", "model_type"):
        assert key in config
    output_ids = shards.HiddenShards(hidden_dir).index["layer_ids"]
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == layers.engine_layer_ids(output_ids, "sglang")
    assert layers.engine_capture_indices(ids, "sglang") == layers.hf_hidden_state_indices(output_ids)
    vllm = export.for_engine(out, "vllm")
    vids = json.loads((vllm / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert layers.engine_capture_indices(vids, "vllm") == layers.hf_hidden_state_indices(output_ids)
    assert "vllm serve" in export.serving_command("vllm", tiny_target, vllm, 3)

    # reload bit for bit (float32 export) and draft the same as the checkpointed model
    ck = torch.load(outputs.checkpoints(Path(setup.job.out_dir))[-1], weights_only=False)
    loaded = export.load_exported(out, tiny_target)
    for k, v in loaded.state_dict().items():
        if k != "embed_tokens.weight":
            assert torch.equal(v, weights[k]) and torch.equal(v, ck["model"]["drafter." + k]), k
    vocab = outputs.read_vocab(setup.job.out_dir)
    assert torch.equal(loaded.to_target(torch.arange(512)), vocab.used)
    # a bf16 export holds the same weights rounded to bf16
    b16 = export.export(tmp_path / "b16", {k: v for k, v in loaded.state_dict().items()}, mcfg, output_ids,
                        engine="sglang", dtype="bfloat16")
    again = export.load_exported(b16, tiny_target, dtype=torch.bfloat16)
    assert torch.equal(again.fc.weight, loaded.fc.weight.to(torch.bfloat16))


def resumes_identically(straight: Setup, tmp_path: Path) -> Setup:
    """Train `straight` (9 steps) into tmp/a, and again into tmp/b stopped at step 5 with a torn
    metrics line, then resumed: the same weights, schedule and metrics. Returns b's config."""
    train(straight)
    broken = straight.but(out_dir=str(tmp_path / "b"), stop_at=5)
    first = train(broken)
    assert first["steps"] == 5 and not first["finished"]
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:    # killed while writing a row
        f.write('{"split": "train", "step": 6, "lo')
    assert [r["step"] for r in outputs.read_metrics(tmp_path / "b") if r["split"] == "train"] == [1, 2, 3, 4, 5]
    assert [p.name for p in outputs.checkpoints(tmp_path / "b")] == ["step-0000003.pt", "step-0000005.pt"]
    resumed = train(broken.but(stop_at=0))
    assert resumed["finished"]
    a = torch.load(tmp_path / "a" / "checkpoints" / "step-0000009.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "checkpoints" / "step-0000009.pt", weights_only=False)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["scheduler"] == b["scheduler"]
    assert outputs.read_metrics(tmp_path / "a") == outputs.read_metrics(tmp_path / "b")
    return broken


def test_resume_from_a_checkpoint_continues_identically(hidden_dir, tiny_target, tmp_path):
    broken = resumes_identically(small_config(hidden_dir, tiny_target, tmp_path / "a", train_epochs=1.0), tmp_path)
    with pytest.raises(ValueError, match="lr"):
        train(broken.but(train_lr=1e-2))


def test_a_checkpoint_written_under_the_old_setting_names_still_resumes(hidden_dir, tiny_target, tmp_path):
    from draftsmith.targets.checkpoint import target_config

    setup = small_config(hidden_dir, tiny_target, tmp_path / "d", stop_at=3)
    train(setup)
    path = outputs.checkpoints(tmp_path / "d")[-1]
    state = torch.load(path, weights_only=False)
    old = {new: old for old, new in stage.OLD_NAMES.items()}
    state["config"] = {old.get(k, k): v for k, v in state["config"].items()}
    assert "lr" in state["config"] and "train_lr" not in state["config"]
    torch.save(state, path)
    fingerprint = stage.fingerprint(setup.cfg, setup.job, shards.HiddenShards(hidden_dir).index,
                                    target_config(tiny_target))
    found, resumed = stage.latest_checkpoint(tmp_path / "d", fingerprint)
    assert found == path and resumed["step"] == 3
    with pytest.raises(ValueError, match=f"{path}: .*train_lr"):
        stage.latest_checkpoint(tmp_path / "d", {**fingerprint, "train_lr": 1.0})


def test_stage_run_trains_the_runs_drafter_from_notebook_05s_parameters(hidden_dir, tiny_target, tmp_path):
    import shutil

    run = Run(tmp_path, "r")
    shutil.copytree(hidden_dir, run.dir("hidden"), dirs_exist_ok=True)
    cfg = stage_config("05", target_model_path=str(tiny_target), draft_vocab_size=512, ttt_steps=2,
                       train_epochs=1.0, train_batch_size=4, train_micro_batch_size=2, train_max_len=128,
                       train_eval_every=0, export_fractions=[1.0], export_dtype="float32")
    summary = stage.run(run, cfg, log=quiet)["eagle3"]
    assert json.loads(json.dumps(summary)) == outputs.read_summary(run)
    assert summary["finished"] and summary["vocab"]["draft_vocab_size"] == 512
    assert [e["dir"] for e in summary["exports"]] == [str(outputs.drafter_dir(run) / "eagle3")]
    again = stage.run(run, cfg, log=quiet)["eagle3"]    # train_resume: its last checkpoint is the end
    assert again["finished"] and again["steps"] == summary["steps"]


@pytest.mark.engine
def test_two_gloo_processes_train_like_one_process_with_ddp_and_with_fsdp(hidden_dir, tiny_target, tmp_path):
    one = small_config(hidden_dir, tiny_target, tmp_path / "one", train_batch_size=4, train_micro_batch_size=1, train_epochs=1.0)
    s1 = train(one)
    w1 = export.load_exported(Path(s1["exports"][-1]["dir"]), tiny_target).state_dict()
    r1 = [r["loss"] for r in outputs.read_metrics(tmp_path / "one") if r["split"] == "train"]
    for name, fsdp in (("ddp", False), ("fsdp", True)):
        s2 = launch(one.but(out_dir=str(tmp_path / name), train_fsdp=fsdp, train_nproc=2))
        assert s2["world_size"] == 2 and s2["steps"] == s1["steps"] == 9
        w2 = export.load_exported(Path(s2["exports"][-1]["dir"]), tiny_target).state_dict()
        for k in w1:
            assert torch.allclose(w1[k].float(), w2[k].float(), atol=2e-5, rtol=1e-4), (name, k)
        r2 = [r["loss"] for r in outputs.read_metrics(tmp_path / name) if r["split"] == "train"]
        assert r1 == pytest.approx(r2, rel=1e-4), name


@pytest.mark.engine
def test_fsdp_scores_a_held_out_split_that_two_ranks_cannot_share_evenly(hidden_dir, tiny_target, tmp_path):
    """3 held-out micro-batches on 2 FSDP ranks: every forward is a collective, so the rank with one
    fewer repeats one (left out of the sums) instead of leaving the other waiting forever."""
    one = small_config(hidden_dir, tiny_target, tmp_path / "one", train_batch_size=4, train_micro_batch_size=1,
                       train_epochs=1.0, train_holdout_fraction=0.075, export_fractions=[1.0])
    train(one)
    s2 = launch(one.but(out_dir=str(tmp_path / "fsdp"), train_fsdp=True, train_nproc=2))
    assert s2["world_size"] == 2
    held = [[r for r in outputs.read_metrics(tmp_path / d) if r["split"] == "heldout"] for d in ("one", "fsdp")]
    assert held[0][-1]["count_i"][0] > 0 and held[0][-1]["count_i"] == held[1][-1]["count_i"]
    assert held[0][-1]["loss"] == pytest.approx(held[1][-1]["loss"], rel=1e-4)


def test_training_reads_fp8_shards(hidden_dir, tiny_target, tmp_path):
    """The same samples stored as fp8 with per-token scales train through the same path."""
    hs = shards.HiddenShards(hidden_dir)
    rows = [hs.sample(i) for i in range(len(hs))]
    fp8 = tmp_path / "hidden-fp8"
    fp8.mkdir()
    offsets = torch.tensor([0] + [len(r["input_ids"]) for r in rows]).cumsum(0)
    shards.write_shard(fp8 / "shard-00000.safetensors", torch.cat([r["aux"] for r in rows]),
                       torch.cat([r["last"] for r in rows]), torch.cat([r["input_ids"] for r in rows]),
                       torch.cat([r["loss_mask"] for r in rows]), offsets, dtype="fp8")
    shards.write_index(fp8, {**{k: v for k, v in hs.index.items() if k not in ("format", "shards")}, "dtype": "fp8",
                             "shards": [{"file": "shard-00000.safetensors",
                                         "samples": [{"sample_id": s.sample_id, "dataset": s.dataset} for s in hs.samples]}]})
    with safe_open(str(fp8 / "shard-00000.safetensors"), framework="pt") as f:
        assert f.get_slice("aux").get_dtype() == "F8_E4M3"
    s = train(small_config(fp8, tiny_target, tmp_path / "d", train_epochs=1.0, export_fractions=[1.0]))
    assert s["finished"] and s["heldout"]["loss_i"][0] < s["heldout_start"]["loss_i"][0] - 0.5
