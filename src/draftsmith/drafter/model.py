"""The EAGLE-3 drafter (`LlamaForCausalLMEagle3`): one Llama decoder layer over the target's features.

`Eagle3Drafter` runs it two ways: `ttt` (training-time test, k steps over whole sequences, for
training) and `extend` (chain drafting with a KV cache, what an engine does and what stage 06
uses). Its parameter names are exactly the exported keys of docs/eagle3.md, plus the frozen
`embed_tokens.weight`, copied from the target and never exported."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DrafterShape:
    """The drafter's architecture (sizes, heads, RoPE, vocabularies), derived from the target's config
    (`from_target`); DFlash's config builds on it (`dflash.DFlashConfig.base`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int            # the target's
    draft_vocab_size: int
    target_hidden_size: int

    @classmethod
    def from_target(cls, target_config: dict, draft_vocab_size: int) -> "DrafterShape":
        """The drafter's shape from the target's config.json: same hidden size (the embedding is
        shared), the target's MLP width, heads and RoPE base. draft_vocab_size's own bound is held by
        stage 05's config (`config.DrafterConfig`); this checks it against the target's vocabulary."""
        c = target_config.get("text_config", target_config)  # multimodal checkpoints nest it
        try:
            h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
            cfg = cls(
                hidden_size=h,
                intermediate_size=int(c["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or h // heads),
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope_theta=float(c.get("rope_theta", 10000.0)),
                max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
                vocab_size=int(c["vocab_size"]),
                draft_vocab_size=int(draft_vocab_size),
                target_hidden_size=h,
            )
        except KeyError as e:
            raise ValueError(f"target config.json has no field {e.args[0]!r}") from None
        if cfg.draft_vocab_size > cfg.vocab_size:
            raise ValueError(f"draft_vocab_size {draft_vocab_size} must be at most {cfg.vocab_size} (the target vocab)")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads")
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Llama's: normalise in float32, scale in the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama rotary embedding of x [B, heads, T, d] at integer positions [T] (or [B, T]: per row)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((ang, ang), dim=-1)
    if emb.dim() == 3:
        emb = emb[:, None]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        o = attend(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The one decoder layer: attention over concat(norm(embedding), norm(hidden)); the residual
    stream is the hidden state."""

    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, hidden, positions, attend) -> torch.Tensor:
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)
        h = hidden + self.self_attn(x, positions, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class TTTAttention:
    """Attention for one training-time-test unroll. Call it once per step with that step's q, k, v
    [B, heads, L, d]: step i's query at position t sees step 0's keys at 0..t (causal) and step
    j's key at t for j = 1..i (diagonal), exactly the keys a chain draft at t+i has in its cache."""

    def __init__(self):
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    def __call__(self, q, k, v):
        self.ks.append(k)
        self.vs.append(v)
        rep = q.shape[1] // k.shape[1]
        n = q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        k0, v0 = repeat_kv(self.ks[0], rep), repeat_kv(self.vs[0], rep)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * repeat_kv(kj, rep)).sum(-1, keepdim=True) * scale for kj in self.ks[1:]]
        p = torch.softmax(torch.cat(scores, dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
        out = p[..., :n] @ v0
        for j, vj in enumerate(self.vs[1:]):
            out = out + p[..., n + j:n + j + 1] * repeat_kv(vj, rep)
        return out


class KVCache:
    """Keys and values of the positions drafted or prefilled so far (chain drafting, batch rows
    share positions). `truncate(n)` keeps the first n positions."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def truncate(self, n: int) -> None:
        if n < 0 or n > len(self):
            raise ValueError(f"cannot truncate a cache of {len(self)} positions to {n}")
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]

    def __call__(self, q, k, v):
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        rep = q.shape[1] // k.shape[1]
        t, s = q.shape[2], self.k.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
        return F.scaled_dot_product_attention(q, repeat_kv(self.k, rep), repeat_kv(self.v, rep), attn_mask=mask)


class Eagle3Drafter(nn.Module):
    """`embed`: the target's input embedding [V, H], used as is (its dtype kept) and frozen.

        h0     = fc(concat(aux_low, aux_mid, aux_high))                     Linear(3H -> H), no bias
        x      = concat(input_layernorm(embed(token)), hidden_norm(h))      2H, embedding first
        h      = h + o_proj(attention(q, k, v = Linear(2H -> heads*head_dim)(x)))    RoPE on q, k
        h      = h + mlp(post_attention_layernorm(h))                       SwiGLU
        logits = lm_head(norm(h))                                           over the draft vocabulary

    Parameters: `fc.weight`, `midlayer.self_attn.q_proj.weight`, ..., `lm_head.weight`, buffers
    `d2t`, `t2d` (docs/eagle3.md), and `embed_tokens.weight` (not exported)."""

    def __init__(self, cfg: DrafterShape, embed: torch.Tensor | None = None, d2t: torch.Tensor | None = None,
                 t2d: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        if embed is not None and tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"target embedding {tuple(embed.shape)} does not fit vocab {cfg.vocab_size} "
                             f"x hidden {cfg.hidden_size}")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embed, _freeze=True)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t if d2t is not None else torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", t2d if t2d is not None else torch.zeros(cfg.vocab_size, dtype=torch.bool))

    # -- pieces ------------------------------------------------------------------------------
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """[B, L, 3H] target features -> [B, L, H] hidden input of the first step."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids).to(self.fc.weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., H] -> logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- training: training-time test --------------------------------------------------------
    def ttt(self, aux: torch.Tensor, input_ids: torch.Tensor, steps: int):
        """Yield the pre-norm hidden output [B, L, H] of each of `steps` steps. At step i, position
        t holds the drafter's guess for token t+2+i, made from its step-(i-1) output at t (step 0:
        fc(aux[t])) and the true token t+1+i; it attends as `TTTAttention` says. Positions whose
        inputs run past the end are garbage and must be masked by the caller."""
        b, n = input_ids.shape
        hidden = self.project(aux)
        attend = TTTAttention()
        base = torch.arange(n, device=input_ids.device)
        for i in range(steps):
            ids = torch.zeros_like(input_ids)
            ids[:, : max(n - 1 - i, 0)] = input_ids[:, 1 + i:]
            hidden = self.midlayer(self.embed(ids), hidden, base + i, attend)
            yield hidden

    # -- inference: chain drafting with a KV cache ----------------------------------------------
    def new_cache(self) -> KVCache:
        return KVCache()

    def extend(self, hidden: torch.Tensor, input_ids: torch.Tensor, cache: KVCache):
        """Run positions len(cache).. : `hidden` [B, T, H] (from `project` for target features, or a
        previous output) with `input_ids` [B, T] (target ids; each position's NEXT token). Returns
        (pre-norm hidden output [B, T, H], draft-vocab logits [B, T, Vd]); the cache grows by T.
        The hidden output is fed to the next step, as SGLang and vLLM do:

            from draftsmith.drafter import load_exported
            d = load_exported(export_dir, target_path)       # eval mode, float32
            cache = d.new_cache()
            # prefix: aux[0..t] from the target, tokens x[1..t+1] (each position gets the NEXT token)
            h, logits = d.extend(d.project(aux), next_ids, cache)       # positions 0..t
            tok = d.to_target(logits[:, -1].argmax(-1))                  # draft 1, a target id
            h, logits = d.extend(h[:, -1:], tok[:, None], cache)         # position t+1 -> draft 2, ...
            cache.truncate(n)   # drop rejected drafts, then extend with the target's new features
        """
        positions = torch.arange(len(cache), len(cache) + input_ids.shape[1], device=input_ids.device)
        out = self.midlayer(self.embed(input_ids), hidden.to(self.fc.weight.dtype), positions, cache)
        return out, self.logits(out)
