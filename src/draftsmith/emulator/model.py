"""The model backend: serves a local Llama-architecture checkpoint (the tiny target) with real
sampling, all concurrent requests decoded together.

One worker thread runs a step loop (`Engine.step`): it admits waiting requests (a prefill each,
into a slot of a preallocated KV cache), then decodes one token for every slot in one batched
forward of fixed shapes, so a seeded request samples the same ids under any load. Sampling honours
temperature (0 = greedy), top_p and seed; tokens a real model never emits are masked, and a
candidate that would re-tokenize differently is redrawn (`canonical`). The logprobs it returns are
the model's own, before any sampling setting (`model_logprobs`)."""

from __future__ import annotations

import asyncio
import copy
import os
import queue
import threading
import traceback
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F

from .backends import Job, Vocab
from .faults import uniform

_WINDOW = 48  # re-encode at most about this many ids per check; older ones sit behind a safe boundary
_MAX_REDRAWS = 32


@dataclass
class _Seq:
    job: Job
    put: callable  # thread-safe: put((id, text)) or put(None) at the end
    slot: int = -1
    length: int = 0  # positions filled in the slot's cache
    pending: list[int] = field(default_factory=list)  # ids to feed next
    out: list[int] = field(default_factory=list)
    in_reasoning: bool = True
    n_reasoning: int = 0
    anchor: int = 0  # index in `out` where the re-encoding check starts
    anchor_text: str = ""  # decoded text of out[anchor:]
    gen: torch.Generator | None = None


class Engine:
    """One set of weights and its slot KV cache; `step` advances every active sequence by one id.
    The forward is the checkpoint's own modules (embedding, rotary, attention projections, MLPs,
    norm, head) applied to our slot cache (`test_emulator_model` checks its logits against the
    plain transformers forward). Idle slots are computed along, so a step costs the same for 1 or
    `max_batch` sequences."""

    def __init__(self, model, vocab: Vocab, max_batch: int, canonical: bool):
        m = model.model
        if not all(hasattr(m, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) or \
                not hasattr(m.layers[0].self_attn, "q_proj"):
            raise ValueError(f"model backend serves Llama-architecture checkpoints; got {type(model).__name__}")
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb
        self.model, self.vocab, self.canonical = model, vocab, canonical
        cfg = model.config
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_batch = max_batch
        self.slots = max_batch
        self.cap = 512
        self.k = [torch.zeros(self.slots, self.kv_heads, self.cap, self.head_dim) for _ in m.layers]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.free = list(range(self.slots))[::-1]
        self.active: list[_Seq] = []
        self.waiting: queue.SimpleQueue[_Seq] = queue.SimpleQueue()
        self.banned = torch.tensor(vocab.banned, dtype=torch.long)
        self._tok = vocab.encoding

    # ---- the forward over the slot cache ---------------------------------------------------------

    def _ensure_cap(self, need: int) -> None:
        if need <= self.cap:
            return
        cap = self.cap
        while cap < need:
            cap *= 2
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                grown = torch.zeros(self.slots, self.kv_heads, cap, self.head_dim)
                grown[:, :, : self.cap] = t
                store[i] = grown
        self.cap = cap

    @torch.inference_mode()
    def forward(self, slots: torch.Tensor | None, ids: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Append `ids` [B, n] at positions start[b].. of each slot; logits of the last position [B, V].
        `slots=None`: one id for every slot (B = all slots), attending over the whole cache: shapes
        that never change, so a row's arithmetic does not depend on which other requests are in
        flight (seeded sampling stays reproducible under any load)."""
        m = self.model.model
        B, n = ids.shape
        pos = start[:, None] + torch.arange(n)[None, :]
        self._ensure_cap(int(pos.max()) + 1)
        T = self.cap if slots is None else int(pos.max()) + 1
        h = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(h, pos)
        mask = (torch.arange(T)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, n, T]
        for li, layer in enumerate(m.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(B, n, -1, self.head_dim).transpose(1, 2)
            k = a.k_proj(x).view(B, n, -1, self.head_dim).transpose(1, 2)
            v = a.v_proj(x).view(B, n, -1, self.head_dim).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            K, V = self.k[li], self.v[li]
            if slots is None:  # decode, every slot: grouped-query attention as two batched matmuls
                rows = torch.arange(B)
                K[rows, :, pos[:, 0]] = k[:, :, 0]
                V[rows, :, pos[:, 0]] = v[:, :, 0]
                qg = q.reshape(B, self.kv_heads, -1, self.head_dim)  # [B, kv heads, group, hd]
                scores = torch.matmul(qg, K.transpose(-1, -2)) * a.scaling  # [B, kv heads, group, T]
                scores.masked_fill_(~mask[:, :, 0, None, :].expand_as(scores), float("-inf"))
                att = torch.matmul(torch.softmax(scores, dim=-1), V).reshape(B, -1, 1, self.head_dim)
            else:
                K[slots[:, None], :, pos] = k.transpose(1, 2)
                V[slots[:, None], :, pos] = v.transpose(1, 2)
                # index_select on the whole slot then a view of :T (gathering a strided :T view is 30x slower)
                keys, values = K.index_select(0, slots)[:, :, :T], V.index_select(0, slots)[:, :, :T]
                att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=a.scaling,
                                                     enable_gqa=True)
            h = h + a.o_proj(att.transpose(1, 2).reshape(B, n, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(m.norm(h[:, -1])).float()

    # ---- the step loop ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.active) or not self.waiting.empty()

    def step(self) -> None:
        while self.free and not self.waiting.empty():
            s = self.waiting.get()
            if s.job.cancelled:
                s.put(None)
                continue
            s.slot = self.free.pop()
            s.gen = torch.Generator().manual_seed(s.job.seed if s.job.seed is not None
                                                  else int.from_bytes(os.urandom(8), "little") >> 1)
            s.pending = list(s.job.prompt_ids)
            s.in_reasoning = not s.job.prompt_ids or s.job.prompt_ids[-1] != self.vocab.end_think
            self.active.append(s)
        for s in [s for s in self.active if s.job.cancelled]:
            self._finish(s)
        if not self.active:
            return
        # sequences with more than one id to feed (prompts, split tokens) go alone; the rest together
        batch = [s for s in self.active if len(s.pending) == 1]
        for s in [s for s in self.active if len(s.pending) > 1]:
            self._sample_all([s], self._feed([s]), [0])
        if batch:
            self._sample_all(batch, self._decode_all(batch), [s.slot for s in batch])

    def _decode_all(self, seqs: list[_Seq]) -> torch.Tensor:
        """One id for each of `seqs`, computed as a full batch over every slot (idle slots write a
        dummy entry at the end of their cache, where nothing reads before it is overwritten);
        logits [slots, V], row = slot."""
        ids = torch.zeros(self.slots, 1, dtype=torch.long)
        start = torch.full((self.slots,), self.cap - 1, dtype=torch.long)
        for s in seqs:
            ids[s.slot, 0], start[s.slot] = s.pending[0], s.length
            s.length += 1
            s.pending = []
        return self.forward(None, ids, start)

    def _feed(self, seqs: list[_Seq]) -> torch.Tensor:
        slots = torch.tensor([s.slot for s in seqs])
        ids = torch.tensor([s.pending for s in seqs])
        start = torch.tensor([s.length for s in seqs])
        logits = self.forward(slots, ids, start)
        for s in seqs:
            s.length += len(s.pending)
            s.pending = []
        return logits

    def _finish(self, s: _Seq) -> None:
        self.active.remove(s)
        self.free.append(s.slot)
        s.put(None)

    def _sample_all(self, seqs: list[_Seq], logits: torch.Tensor, rows: list[int]) -> None:
        """Sample the next id of each of `seqs` from its row of `logits` [B, V] (batched softmax and
        inverse-CDF draws; per-row work only for redraws). Only the rows of `seqs` are taken: every
        step below works row by row, so a row's numbers do not depend on which others are there.
        Masked: every added special token except `</think>` (once, in the reasoning) and the
        end-of-turn token (after the reasoning)."""
        v = self.vocab
        if list(rows) != list(range(logits.shape[0])):
            logits = logits[rows]
        logits[:, self.banned] = float("-inf")
        inv_t = torch.ones(len(seqs), 1)
        for r, s in enumerate(seqs):
            # `</think>` once, in the reasoning; a thinking model closes it before ending
            logits[r, v.eos if s.in_reasoning else v.end_think] = float("-inf")
            # greedy rows keep T = 1 (their ranking is all that matters, and must not underflow to ties)
            inv_t[r] = 1.0 / s.job.temperature if s.job.temperature > 0 else 1.0
        # unnormalized probabilities, in place (the draws scale by the total): exp((logit - max) / T)
        probs = logits.sub_(logits.amax(dim=-1, keepdim=True)).mul_(inv_t).exp_()
        blocks = _block_sums(probs)
        for r, s in enumerate(seqs):
            job = s.job
            if s.in_reasoning and job.reasoning_max_tokens is not None and s.n_reasoning >= job.reasoning_max_tokens:
                t = v.end_think
            elif job.temperature <= 0:
                t = self._greedy(s, probs[r])  # exp is monotonic: the ranking of the logits
            elif job.top_p < 1.0:
                nucleus = _top_p(probs[r], job.top_p)
                t = self._draw(s, nucleus, _block_sums(nucleus[None])[0])
            else:
                t = self._draw(s, probs[r], blocks[r])
            self._accept(s, t)

    def _greedy(self, s: _Seq, scores: torch.Tensor) -> int:
        for t in torch.topk(scores, _MAX_REDRAWS).indices.tolist():
            if self._ok(s, t):
                return t
        return self._give_up(s)

    def _draw(self, s: _Seq, probs: torch.Tensor, sums: torch.Tensor) -> int:
        """Inverse-CDF draw in two levels (which block of ids, then which id in it), in float64 so
        that float noise between batch make-ups almost never changes a seeded draw; a rejected id
        is taken out of its block and the draw repeated."""
        sums, removed = sums.clone(), set()
        for _ in range(_MAX_REDRAWS):
            total = float(sums.sum())
            if total <= 0:
                break
            u = float(torch.rand((), generator=s.gen, dtype=torch.float64)) * total
            cb = torch.cumsum(sums, 0)
            b = min(int(torch.searchsorted(cb, torch.tensor([u], dtype=torch.float64), right=True)), len(sums) - 1)
            u -= float(cb[b] - sums[b])
            block = probs[b * _BLOCK:(b + 1) * _BLOCK].to(torch.float64)
            for t in removed:
                if b * _BLOCK <= t < (b + 1) * _BLOCK:
                    block[t - b * _BLOCK] = 0.0
            cw = torch.cumsum(block, 0)
            j = min(int(torch.searchsorted(cw, torch.tensor([u], dtype=torch.float64), right=True)), len(block) - 1)
            t = b * _BLOCK + j
            if block[j] > 0 and self._ok(s, t):
                return t
            removed.add(t)
            sums[b] -= block[j]
        return self._give_up(s)

    def _give_up(self, s: _Seq) -> int:
        """No acceptable candidate: close the current part, as a real model would."""
        return self.vocab.end_think if s.in_reasoning else self.vocab.eos

    def _accept(self, s: _Seq, t: int) -> None:
        """Emit `t`; a provider with the `noncanonical_rate` quirk splits some accepted tokens in two
        on purpose, and the model consumes both halves."""
        v, job = self.vocab, s.job
        pieces = [t]
        if job.noncanonical_rate > 0 and t not in (v.end_think, v.eos) and \
                uniform("split", job.key, len(s.out)) < job.noncanonical_rate and v.split(t):
            pieces = list(v.split(t))
        pieces = pieces[: job.max_tokens - len(s.out)]
        for p in pieces:
            s.put((p, self._emit_text(s, p)))
        if len(pieces) > 1:  # the check restarts after a deliberate split
            s.anchor, s.anchor_text = len(s.out), ""
        s.pending = pieces
        if t == v.eos or len(s.out) >= job.max_tokens:
            self._finish(s)

    def _emit_text(self, s: _Seq, t: int) -> str:
        v = self.vocab
        s.out.append(t)
        if t == v.end_think:
            s.in_reasoning = False
            s.anchor, s.anchor_text = len(s.out), ""
            return ""
        if t == v.eos:
            return ""
        if s.in_reasoning:
            s.n_reasoning += 1
        text = self._tok.decode(s.out[s.anchor:])
        delta = text[len(s.anchor_text):]
        s.anchor_text = text
        self._advance_anchor(s)
        return delta

    def _advance_anchor(self, s: _Seq) -> None:
        if len(s.out) - s.anchor <= _WINDOW:
            return
        for p in range(len(s.out) - 8, s.anchor, -1):
            if _starts_word(self._tok, s.out[p]) and not _ends_space(self._tok, s.out[p - 1]):
                s.anchor_text = s.anchor_text[len(self._tok.decode(s.out[s.anchor:p])):]
                s.anchor = p
                return

    def _ok(self, s: _Seq, t: int) -> bool:
        """Whether `t` may be emitted: with `canonical`, the decoded tail of the current part
        (reasoning or content) from the last safe boundary (`_advance_anchor`), re-encoded, must
        give back the ids."""
        if t in (self.vocab.end_think, self.vocab.eos):
            return True
        ids = s.out[s.anchor:] + [t]
        text = self._tok.decode(ids)
        if text.endswith("\ufffd"):  # half of a multi-byte character: never canonical on its own
            return False
        return not self.canonical or self._tok.plain([text])[0] == ids


@lru_cache(maxsize=200_000)
def _piece(tok, i: int) -> str:
    return tok.token(i)


def _starts_word(tok, i: int) -> bool:
    p = _piece(tok, i)
    return len(p) > 1 and p[0] == "Ġ" and p[1].isalpha()


def _ends_space(tok, i: int) -> bool:
    p = _piece(tok, i)
    return not p or p[-1] in "ĠĊĉ"


_BLOCK = 256


def _block_sums(probs: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B, ceil(V / _BLOCK)] sums of consecutive blocks of ids (summed in float32, short
    enough to stay exact to ~1e-6; the running sums over blocks are float64)."""
    pad = (-probs.shape[-1]) % _BLOCK
    if pad:
        probs = F.pad(probs, (0, pad))
    return probs.view(probs.shape[0], -1, _BLOCK).sum(-1).double()


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely ids whose mass reaches top_p (searches the top 1024
    first, the whole vocabulary only if those do not reach it). `probs` may be unnormalized."""
    probs = probs / probs.sum()
    k = min(1024, probs.numel())
    vals, idx = torch.topk(probs, k)
    if float(vals.sum()) < top_p:
        vals, idx = torch.sort(probs, descending=True)
    keep = (torch.cumsum(vals, 0) - vals) < top_p
    out = torch.zeros_like(probs)
    out[idx[keep]] = vals[keep]
    return out


class ModelBackend:
    """Owns the worker thread and one Engine per weight variant (the target, perturbed copies)."""

    def __init__(self, model_path, vocab: Vocab, max_batch: int = 64, threads: int = 1, canonical: bool = True,
                 seed: int = 0):
        from ..targets.checkpoint import load_target

        self.vocab, self.max_batch, self.canonical, self.seed = vocab, max_batch, canonical, seed
        self.threads = threads
        self.base = load_target(model_path, "cpu")  # float32, eval mode
        self.engines: dict[float, Engine] = {0.0: Engine(self.base, vocab, max_batch, canonical)}
        self._wake = threading.Event()
        self._stop = False
        self._lock = threading.Lock()
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="emulator-model", daemon=True)
        self._thread.start()

    def engine(self, perturbed: float) -> Engine:
        with self._lock:
            if perturbed not in self.engines:
                model = copy.deepcopy(self.base)
                g = torch.Generator().manual_seed(self.seed + 7919)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * p.std() * perturbed)
                self.engines[perturbed] = Engine(model, self.vocab, self.max_batch, self.canonical)
            return self.engines[perturbed]

    def logprobs(self, prompt_ids: list[int], ids: list[int], perturbed: float, top: int):
        """`model_logprobs` of `ids` under the weights that served them (thread-safe: a plain
        forward of the same modules, beside the step loop's own cache)."""
        return model_logprobs(self.engine(perturbed).model, prompt_ids, ids, top)

    async def stream(self, job: Job):
        """Async iterator of (id, text) for `job`, as the worker samples them."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        eng = self.engine(job.perturbed)

        def put(item):
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the server's loop is closed: nobody is listening
                job.cancelled = True

        eng.waiting.put(_Seq(job, put))
        self._wake.set()
        try:
            while (item := await q.get()) is not None:
                if item[0] == "error":
                    raise RuntimeError(f"model backend failed: {item[1]}")
                yield item
        finally:
            job.cancelled = True  # a consumer that stops early frees the slot

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        while not self._stop:
            engines = [e for e in list(self.engines.values()) if e.has_work()]
            if not engines:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            for e in engines:
                try:
                    e.step()
                except Exception as exc:  # a broken step fails its requests, not the server
                    traceback.print_exc()
                    for s in list(e.active):
                        s.put(("error", repr(exc)))
                        e._finish(s)
            self.steps += 1

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)


# ------------------------------------------------------------------------------------------------
# The logprobs an endpoint returns are the served model's own: log_softmax of its float32 logits
# over the whole vocabulary at each position (prompt and answer read in one forward), BEFORE
# temperature, top-p and the masks the sampler applies. That is what vLLM returns by default
# (`logprobs_mode` raw_logprobs) and what a prompt_logprobs pass of another engine reads on the same
# ids, so the two describe one distribution whatever the request's sampling settings (the probe still
# asks at temperature 1 and top_p 1, where the sampled tokens are drawn from that same distribution).
# The endpoint's `logprobs` quirk is applied after (output.logprobs_content).

@torch.inference_mode()
def model_logprobs(model, prompt_ids: list[int], ids: list[int],
                   top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Per id of `ids` (served after `prompt_ids`): its logprob under `model`, and the `top` most
    likely ids with theirs."""
    if not ids:
        return [], []
    seq = torch.tensor([list(prompt_ids) + list(ids)])
    logits = model(seq).logits[0, len(prompt_ids) - 1:-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()
    if top <= 0:
        return chosen, [[] for _ in ids]
    vals, idx = lp.topk(top, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
