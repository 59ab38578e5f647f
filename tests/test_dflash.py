"""The DFlash drafter: one capture of EAGLE-3's and DFlash's layers trains either drafter, the block
objective scores what vLLM's `dflash` drafts, the export is the format vLLM's loader reads, and
training resumes under the same rules as EAGLE-3's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftsmith import layers
from draftsmith.drafter import dflash, outputs, stage
from draftsmith.drafter.model import DrafterShape
from draftsmith.evaluate.decode import Target, decode
from draftsmith.evaluate.methods import Columns, DFlashProposer
from draftsmith.hidden import outputs as shards
from draftsmith.config import HiddenConfig
from draftsmith.hidden.stage import extract
from draftsmith.paths import Run
from draftsmith.targets.checkpoint import load_target, target_config
from conftest import stage_config
from test_drafter import quiet, resumes_identically, small_config, train, write_tokens

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def both_dir(tmp_path_factory, tiny_target, target_tokenizer) -> Path:
    """The tiny-test target's features over 40 chat samples, EAGLE-3's and DFlash's layers in one
    capture (`layer_set: both`), through stage 04's extractor."""
    root = tmp_path_factory.mktemp("dflash_data")
    tokens = write_tokens(root / "chat.jsonl", target_tokenizer, 40)
    extract(tiny_target, [tokens], root / "hidden", HiddenConfig(hidden_dtype="bf16", target_backend="hf",
                                                                 layer_set="both"),
            log=lambda m: None)
    return root / "hidden"


def dflash_config(hidden, target, out, **kw):
    return small_config(hidden, target, out, drafter_kind="dflash", dflash_layers=2, dflash_block_size=4,
                        dflash_anchors=8, export_engine="vllm", **kw)


def tiny_drafter(block_size=4, num_aux=2) -> dflash.DFlashDrafter:
    base = DrafterShape(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                         vocab_size=200, draft_vocab_size=50, target_hidden_size=32)
    cfg = dflash.DFlashConfig(base=base, num_layers=2, block_size=block_size, num_aux=num_aux, mask_token_id=199)
    d2t = torch.arange(50) * 3 - torch.arange(50)   # draft id i -> target id 3i
    t2d = torch.zeros(200, dtype=torch.bool)
    t2d[torch.arange(50) * 3] = True
    m = dflash.build_dflash(cfg, torch.randn(200, 32), d2t, t2d, 0)
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3)
    return m


def test_one_capture_holds_both_drafters_layers_and_each_trains_on_its_own(both_dir, tiny_target):
    hs = shards.HiddenShards(both_dir)
    n = target_config(tiny_target)["num_hidden_layers"]
    stored = hs.index["layer_ids"]
    assert stored == sorted(set(layers.default_layer_ids(n)) | set(layers.dflash_layer_ids(n)))
    assert hs.sample(0)["aux"].shape[1] == len(stored) * hs.hidden_size
    assert layers.training_layer_ids(stored, "eagle3", n) == layers.default_layer_ids(n)
    assert layers.training_layer_ids(stored, "dflash", n) == layers.dflash_layer_ids(n)
    # a DFlash-only capture serves EAGLE-3 with the stored layer nearest each of its three
    assert layers.training_layer_ids([1, 15, 30, 44, 58], "eagle3", 61) == [1, 30, 58]
    assert layers.dflash_layer_ids(36) == [1, 9, 17, 25, 33]       # z-lab's Qwen3-8B drafter
    with pytest.raises(ValueError, match=r"layers \[7\] were not captured"):
        layers.training_layer_ids(stored, "eagle3", n, chosen=[1, 7])


def test_a_block_drafted_among_many_equals_the_block_drafted_alone():
    m = tiny_drafter()
    aux = torch.randn(2, 20, 64)
    ids = torch.randint(0, 200, (2, 20))
    anchors = torch.tensor([[3, 7, 12, -1], [1, 5, 9, 18]])
    together = m.blocks(m.context(aux), anchors, ids.gather(1, anchors.clamp_min(0)))
    for b, a in ((0, 1), (1, 3), (0, 0)):
        pos = int(anchors[b, a])
        alone = m.blocks(m.context(aux[b:b + 1, :pos]), torch.tensor([[pos]]), ids[b:b + 1, pos:pos + 1])
        assert torch.allclose(together[b, a], alone[0, 0], atol=1e-5)
    # what the proposer drafts is that block's argmax, mapped to target ids
    pos = int(anchors[1, 2])
    drafts = m.draft(m.context(aux[1:2, :pos])[0], int(ids[1, pos]))
    assert drafts == m.to_target(m.logits(together[1, 2, 1:]).argmax(-1)).tolist()
    assert all(t % 3 == 0 for t in drafts)


def test_anchors_are_seeded_supervised_and_the_objective_counts_what_the_plan_counts():
    sup = (torch.rand(40) > 0.3).to(torch.uint8)
    a = dflash.anchors_of(sup, sample=3, epoch=1, seed=0, max_anchors=6)
    assert torch.equal(a, dflash.anchors_of(sup, sample=3, epoch=1, seed=0, max_anchors=6))
    assert not torch.equal(a, dflash.anchors_of(sup, sample=3, epoch=2, seed=0, max_anchors=6))
    assert len(a) == 6 and bool(sup[a].all()) and bool((a >= 1).all()) and torch.equal(a, a.sort().values)
    m = tiny_drafter()
    aux, ids = torch.randn(1, 40, 64), torch.randint(0, 200, (1, 40))
    last = torch.randn(int(sup.sum()), 32)
    ce, stats = dflash.DFlashObjective(m, torch.randn(50, 32))(aux, ids, sup[None].bool(), last, a[None])
    assert stats[1].long().tolist() == dflash.block_counts(sup, a, 4).tolist()
    assert dflash.position_weights(16)[1] == pytest.approx(torch.exp(torch.tensor(-1 / 7.0)))


def test_dflash_trains_exports_vllms_format_and_reloads_bit_for_bit(both_dir, tiny_target, tmp_path):
    setup = dflash_config(both_dir, tiny_target, tmp_path / "d", train_epochs=2.0, train_eval_every=9)
    s = train(setup)
    start, end = s["heldout_start"], s["heldout"]
    assert s["finished"] and s["kind"] == "dflash" and len(end["loss_i"]) == 3
    assert end["loss_i"][0] < start["loss_i"][0] - 1.0
    n = target_config(tiny_target)["num_hidden_layers"]
    assert s["layer_ids"] == layers.dflash_layer_ids(n)
    out = Path(s["exports"][-1]["dir"])
    assert out.name == "dflash"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and "layer_types" not in config
    d = config["dflash_config"]
    assert d["block_size"] == 4 and d["target_layer_ids"] == s["layer_ids"]
    vocab = outputs.read_vocab(setup.job.out_dir)
    assert vocab.counts[d["mask_token_id"]] == 0          # never a response token
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    dcfg = dflash.config_of_export(config)
    assert keys == set(dflash.expected_shapes(dcfg)) and "embed_tokens.weight" not in keys
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t",
            "layers.1.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight"} <= keys
    mask = torch.load(out / dflash.MASK_FILE, weights_only=True)
    assert mask["mask_token_id"] == d["mask_token_id"] and mask["embedding"].shape == (config["hidden_size"],)
    ck = torch.load(outputs.checkpoints(Path(setup.job.out_dir))[-1], weights_only=False)
    loaded = dflash.load_exported(out, tiny_target)
    for k, v in loaded.state_dict().items():
        if k not in ("embed_tokens.weight",):
            assert torch.equal(v, ck["model"]["drafter." + k]), k
    assert "vllm serve" in dflash.serving_command(tiny_target, out, 4)


def test_dflash_resumes_from_a_checkpoint_identically_and_refuses_other_settings(both_dir, tiny_target, tmp_path):
    broken = resumes_identically(dflash_config(both_dir, tiny_target, tmp_path / "a"), tmp_path)
    with pytest.raises(ValueError, match="dflash_block_size"):
        train(broken.but(dflash_block_size=6))


def test_our_decoder_drafts_dflash_blocks_losslessly(both_dir, tiny_target, tmp_path):
    s = train(dflash_config(both_dir, tiny_target, tmp_path / "d"))
    drafter = dflash.load_exported(s["exports"][-1]["dir"], tiny_target)
    stored = shards.HiddenShards(both_dir).index["layer_ids"]
    model = load_target(tiny_target, "cpu")
    target = Target(model, stored)
    prompt = shards.HiddenShards(both_dir).sample(0)["input_ids"][:24].tolist()
    plain = decode(target, None, prompt, 0, 20)
    proposer = Columns(DFlashProposer(drafter), [stored.index(k) for k in s["layer_ids"]], len(stored))
    spec = decode(target, proposer, prompt, 3, 20)
    assert spec.output == plain.output
    assert set(spec.drafted) == {3} and max(spec.accepted) <= 3
    with pytest.raises(ValueError, match="at most 3"):
        proposer.propose(4)


def test_stage_05_trains_both_kinds_on_one_capture_into_their_own_folders(both_dir, tiny_target, tmp_path):
    import shutil

    run = Run(tmp_path, "r")
    shutil.copytree(both_dir, run.dir("hidden"), dirs_exist_ok=True)
    cfg = stage_config("05", target_model_path=str(tiny_target), drafter_kinds=["eagle3", "dflash"],
                       draft_vocab_size=512, ttt_steps=2, dflash_layers=1, dflash_block_size=4,
                       dflash_anchors=4, train_epochs=1.0, train_batch_size=4, train_micro_batch_size=2,
                       train_max_len=128, train_eval_every=0, export_fractions=[1.0], export_dtype="float32")
    got = stage.run(run, cfg, log=quiet)
    assert list(got) == ["eagle3", "dflash"]
    assert Path(got["eagle3"]["exports"][-1]["dir"]) == outputs.drafter_dir(run) / "eagle3"
    assert Path(got["dflash"]["exports"][-1]["dir"]) == outputs.drafter_dir(run, "dflash") / "dflash"
    assert got["eagle3"]["layer_ids"] != got["dflash"]["layer_ids"]
    assert outputs.read_summary(outputs.drafter_dir(run, "dflash"))["kind"] == "dflash"
    with pytest.raises(ValueError, match="drafter_kinds"):
        stage.run(run, replace(cfg, drafter_kinds=["medusa"]), log=quiet)


def test_the_kimi_table_of_docs_dflash_md_is_what_stage_04_would_plan():
    from draftsmith.hidden.stage import bytes_per_token

    text = (Path(__file__).parents[1] / "docs" / "dflash.md").read_text()
    for layer_set in ("eagle3", "dflash", "both"):
        ids = layers.capture_layer_ids(61, layer_set)
        row = next(line for line in text.splitlines() if line.startswith(f"| {layer_set} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == ", ".join(map(str, ids))
        assert cells[2] == f"{bytes_per_token(7168, 'bf16', len(ids)):,}"
        assert cells[3] == f"{bytes_per_token(7168, 'fp8', len(ids)):,}"
        assert cells[4] == f"{60e6 * bytes_per_token(7168, 'bf16', len(ids)) / 2**40:.1f} TiB"
        assert cells[5] == f"{60e6 * bytes_per_token(7168, 'fp8', len(ids)) / 2**40:.1f} TiB"


def test_the_transformers_check_and_its_figure_cover_every_stored_layer(both_dir, tiny_target):
    from draftsmith.hidden import figures, verify

    check = verify.verify_sample(tiny_target, both_dir, device="cpu")
    stored = shards.HiddenShards(both_dir).index["layer_ids"]
    assert check["layer_ids"] == stored and len(check["aux_rel_err"]) == len(stored) == 5
    # the check's own bf16 tolerance (stored in bf16, compared in float32): a near-tie in the built target's
    # logits may flip one argmax on another machine, so exact agreement is not what the check promises
    max_err, min_top1 = verify.TOLERANCE["bf16"]
    assert max(check["aux_rel_err"] + [check["last_rel_err"]]) < max_err and check["top1_agreement"] >= min_top1
    assert len(check["stored_aux_norms"]) == len(stored)
    assert set(figures.norm_figures(check, both_dir)) == {"norms"}
