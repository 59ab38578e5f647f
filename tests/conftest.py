"""Shared fixtures: the test-sized tiny target (built once into the cache) and a throwaway API key."""

import json
import os
import secrets
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DRAFTSMITH_PROGRESS", "log")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    """Folder of the `tiny-test` target (same architecture as the demo target, built in seconds)."""
    from draftsmith.target.checkpoint import resolve_target

    return resolve_target("tiny-test", log=lambda *a: None)


@pytest.fixture(scope="session")
def kimi_mini_targets() -> dict[str, Path]:
    """Folders of the Kimi-K2.5-shaped built-in targets, {"kimi-mini": INT4 experts, "kimi-mini-bf16":
    bf16 experts} (one build writes both, about two minutes; cached like tiny-test's)."""
    from draftsmith.target.checkpoint import resolve_target

    return {name: resolve_target(name, log=lambda *a: None) for name in ("kimi-mini", "kimi-mini-bf16")}


@pytest.fixture(scope="session")
def target_tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture
def api_key_file(tmp_path) -> tuple[Path, str]:
    """A key file holding a fresh random key, for tests that check the key never leaks."""
    key = "sk-or-v1-" + secrets.token_hex(32)
    path = tmp_path / "openrouter.key"
    path.write_text(key + "\n")
    return path, key


def python() -> str:
    return sys.executable


@pytest.fixture(scope="module")
def one_thread():
    """Tiny-model CPU work runs fastest on one thread (stages 04-06 do the same); extra OpenMP
    threads only spin on a shared 2-core box. Restores the setting afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write_token_rows(path: Path, tok, convs: list[list[dict]], prefix: str = "s", answer=None) -> Path:
    """A stage-03-shaped tokens file from conversations ending in an assistant turn (with
    `reasoning_content`): input_ids = the templated conversation, loss 0 on the prompt and 1 on
    the response (reasoning, `</think>`, answer, end-of-turn). `answer` (prompt ids -> response
    ids) replaces the conversation's own response, e.g. by the target's (`greedy_answers`)."""
    import json

    rows = []
    for k, conv in enumerate(convs):
        prompt = tok.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
        if answer is None:
            full = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
            assert full[:len(prompt)] == prompt
        else:
            full = prompt + answer(prompt)
        rows.append({"sample_id": f"{prefix}{k}", "input_ids": full,
                     "loss_mask": [0] * len(prompt) + [1] * (len(full) - len(prompt))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def greedy_answers(target: Path, new_tokens: int = 48):
    """prompt ids -> the target's own greedy response (up to `new_tokens`, its end of turn included):
    what a drafter has to predict at T = 0. The test-sized target is weak: its greedy decode soon
    loops on one token, and which token depends on the machine and threads it was built with (its
    weights do), so a drafter trained on the corpus's responses alone may never draft it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def answer(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False)
        return out[0, len(prompt):].tolist()
    return answer


def stage_05_run(run: Path, target: Path, tok, *, epochs: float, export_fractions: list[float],
                 layer_ids: list[int] | None = None, target_answers: bool = False, lr: float = 3e-3) -> Path:
    """`run` as stages 03-05 leave it: tokens of two datasets (16 samples each), hidden states at
    `layer_ids` (None: the default), a drafter trained with 20% held out and exported at `export_fractions`.
    `target_answers`: the code dataset's responses are the target's own greedy ones (`greedy_answers`),
    the chat dataset keeps the corpus's, so the drafter learns what greedy decoding and sampling meet."""
    from draftsmith.drafter.config import TrainConfig
    from draftsmith.drafter.train import train
    from draftsmith.hidden.extract import extract
    from draftsmith.target.corpus import chat_examples

    tokens = run / "tokens"
    tokens.mkdir(parents=True)
    convs = chat_examples(seed=3)
    files = [write_token_rows(tokens / "code.jsonl", tok, convs[:16], "code",
                              greedy_answers(target) if target_answers else None),
             write_token_rows(tokens / "chat.jsonl", tok, convs[16:32], "chat")]
    extract(target, files, run / "hidden", layer_ids=layer_ids, dtype="bf16", log=lambda *a: None)
    train(TrainConfig(hidden_dir=str(run / "hidden"), target_path=str(target), out_dir=str(run / "drafter"),
                      draft_vocab_size=512, ttt_steps=3, epochs=epochs, batch_size=4, micro_batch_size=4,
                      max_len=160, lr=lr, warmup_fraction=0.015, weight_decay=0.0, grad_clip=0.5,
                      holdout_fraction=0.2, seed=0, fsdp=False, eval_every=0, checkpoint_every=100,
                      export_fractions=export_fractions, export_engine="sglang", export_dtype="float32",
                      resume=True), log=lambda *a: None)
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())
