"""The model backend: the tiny target sampled for real, batched, canonical, ids in the ledger."""

import asyncio

import aiohttp
import pytest
import torch

from draftsmith.emulator import running
from draftsmith.emulator.catalogue import default_catalogue

pytestmark = pytest.mark.emulator

MODEL = "moonshotai/kimi-k2.5"


def test_slot_cache_forward_matches_transformers(tiny_target, target_tokenizer):
    from draftsmith.emulator.backends import Vocab
    from draftsmith.emulator.model import Engine
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    eng = Engine(model, Vocab(target_tokenizer), max_batch=4, canonical=True)
    a = target_tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                             return_dict=False)
    b = target_tokenizer.apply_chat_template([{"role": "user", "content": "what does os.path.join do, please?"}],
                                             add_generation_prompt=True, return_dict=False)
    with torch.inference_mode():
        eng.forward(torch.tensor([2]), torch.tensor([a[:-1]]), torch.tensor([0]))  # prefill, slot 2
        eng.forward(torch.tensor([0]), torch.tensor([b[:-2]]), torch.tensor([0]))  # prefill, slot 0
        eng.forward(torch.tensor([2, 0]), torch.tensor([[a[-1]], [b[-2]]]), torch.tensor([len(a) - 1, len(b) - 2]))
        got = eng.forward(torch.tensor([0]), torch.tensor([[b[-1]]]), torch.tensor([len(b) - 1]))
        ref_a = model(torch.tensor([a])).logits[0, -1]
        ref_b = model(torch.tensor([b])).logits[0, -1]
        got_a = eng.forward(torch.tensor([2]), torch.tensor([[7]]), torch.tensor([len(a)]))  # continues slot 2
        ref_a7 = model(torch.tensor([a + [7]])).logits[0, -1]
        # the full-batch decode path (every slot, the whole cache) gives the same logits
        ids = torch.zeros(4, 1, dtype=torch.long)
        start = torch.full((4,), eng.cap - 1)
        ids[2, 0], start[2] = 9, len(a) + 1
        full = eng.forward(None, ids, start)
        ref_a79 = model(torch.tensor([a + [7, 9]])).logits[0, -1]
    assert torch.allclose(got[0], ref_b, atol=1e-4)
    assert torch.allclose(got_a[0], ref_a7, atol=1e-4)
    assert torch.allclose(full[2], ref_a79, atol=1e-4)
    assert ref_a.shape == got[0].shape


@pytest.fixture(scope="module")
def model_emu(tmp_path_factory, tiny_target):
    providers = [e.model_dump() for e in default_catalogue()]
    for p in providers:
        if p["slug"] == "together":
            p["quirks"]["noncanonical_rate"] = 0.2  # many splits, so a short test sees them
    cfg = {"backend": "model", "target_model_path": str(tiny_target), "fault_scale": 0, "providers": providers,
           "generation_delay_s": 0, "max_batch": 16}
    with running(cfg, state_dir=tmp_path_factory.mktemp("emu-model")) as emu:
        yield emu


async def _post_all(emu, bodies):
    async with aiohttp.ClientSession(headers=emu.key.header()) as s:
        async def one(b):
            async with s.post(emu.base_url + "/chat/completions", json=b) as r:
                text = await r.text()
                assert r.status == 200, text
                return text
        return await asyncio.gather(*[one(b) for b in bodies])


def _req(text, slug, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 40,
            "provider": {"order": [slug], "allow_fallbacks": False}, **kw}


def _canonical(tok, vocab, ids):
    text = tok.decode(ids)
    rebuilt = []
    for n, part in enumerate(text.replace("<｜end▁of▁sentence｜>", "").split("</think>")):
        rebuilt += ([vocab.end_think] if n else []) + tok.encode(part, add_special_tokens=False)
    return rebuilt + ([vocab.eos] if ids and ids[-1] == vocab.eos else []) == ids


def test_model_backend_samples_canonical_masked_text_and_bills_the_sampled_ids(model_emu):

    emu = model_emu
    tok, vocab = emu.emulator.tokenizer, emu.emulator.vocab
    bodies = [_req(f"Explain item {i} of the os module.", "moonshotai", stream=bool(i % 2), temperature=1.0)
              for i in range(16)]
    asyncio.run(_post_all(emu, bodies))
    lines = [x for x in emu.ledger_lines() if x["provider"] == "moonshotai"]
    assert len(lines) == 16
    banned = set(vocab.banned)
    assert emu.emulator.backend.steps < 16 * 40  # decoded together, not one request at a time
    for x in lines:
        ids = x["output_ids"]
        assert not banned & set(ids) and ids.count(vocab.end_think) <= 1
        assert x["completion_tokens"] == len(ids) and x["finish_reason"] in ("stop", "length")
        assert (x["finish_reason"] == "stop") == (ids[-1] == vocab.eos)
        assert x["prompt_tokens"] == len(x["prompt_ids"]) and x["prompt_ids"][-1] == tok.convert_tokens_to_ids("<think>")
        assert _canonical(tok, vocab, ids), tok.decode(ids)
        n_reason = ids.index(vocab.end_think) if vocab.end_think in ids else len(ids)
        assert x["reasoning_tokens"] == n_reason


def test_model_backend_honours_seed_and_greedy_and_the_perturbed_provider_differs(model_emu):
    import json

    emu = model_emu
    prompts = [f"What is {w} for?" for w in ("json", "re", "os", "sys")]

    def run(bodies):
        out = [json.loads(t) for t in asyncio.run(_post_all(emu, bodies))]
        return [(o["choices"][0]["message"]["reasoning"], o["choices"][0]["message"]["content"]) for o in out]

    # same seed, same sample, whatever else is in flight
    seeded = [_req(p, "moonshotai", seed=11, max_tokens=24) for p in prompts]
    others = [_req(f"other {i}", "moonshotai", max_tokens=30) for i in range(7)]
    assert run(seeded) == run(others[:3] + seeded + others[3:])[3:7]
    assert run([_req(prompts[0], "moonshotai", seed=12, max_tokens=24)])[0] != run(seeded[:1])[0]
    greedy = run([_req(p, slug, temperature=0, max_tokens=24) for p in prompts
                  for slug in ("moonshotai", "deepinfra", "chutes")])
    first_party, deepinfra, chutes = greedy[0::3], greedy[1::3], greedy[2::3]
    assert first_party == deepinfra  # same weights, temperature 0
    assert sum(a != c for a, c in zip(first_party, chutes)) >= 3  # noisy weights answer differently


def test_model_backend_noncanonical_quirk_splits_tokens(model_emu):
    emu = model_emu
    tok, vocab = emu.emulator.tokenizer, emu.emulator.vocab
    asyncio.run(_post_all(emu, [_req(f"Tell me about {w}.", "together", max_tokens=40) for w in "abcdef"]))
    lines = [x for x in emu.ledger_lines() if x["provider"] == "together"]
    assert any(not _canonical(tok, vocab, x["output_ids"]) for x in lines)
    for x in lines:  # the text stays valid and the bill counts every id served
        assert x["completion_tokens"] == len(x["output_ids"])
