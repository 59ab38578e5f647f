"""The DFlash drafter (vLLM's `dflash` method, `DFlashDraftModel`): a few Qwen3-style decoder layers
that draft a whole block of tokens in one non-causal pass, reading the target's features as keys
and values of every layer.

`DFlashDrafter` is the model, its parameter names the keys vLLM's `qwen3_dflash.py` loads;
`DFlashObjective` trains it with sums shaped like training-time test's, so the training loop, the
held-out scores and the metrics are shared with EAGLE-3. `export` writes the folder vLLM serves as is
(config.json, model.safetensors, mask_embedding.pt; the layout is on `export`), with a `draftsmith`
block recording the layers, the kind and the step; `load_exported` reads one back, and
`serving_command` names the engine command (`--speculative-config '{"method": "dflash", ...}'`)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..targets.checkpoint import target_tensors
from .export import DTYPES, _portable, read_export, write_folder
from .model import MLP, DrafterShape, RMSNorm, repeat_kv, rope
from .objective import init_linears, teacher_distribution
from .vocab import used_ids

# DFlash paper (arXiv 2602.06036, Sec. 4): the loss decay gamma per block size.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def decay_gamma(block_size: int) -> float:
    """The paper's gamma for its block sizes; between them, the same ratio (about B / 2.2)."""
    return PAPER_GAMMA.get(block_size, block_size * 7.0 / 16.0)


def position_weights(block_size: int) -> torch.Tensor:
    """[B-1] weight of block rows k = 1..B-1: exp(-(k-1)/gamma)."""
    g = decay_gamma(block_size)
    return torch.tensor([math.exp(-(k - 1) / g) for k in range(1, block_size)])


@dataclass(frozen=True)
class DFlashConfig:
    base: DrafterShape          # hidden size, heads, MLP width, vocab sizes: the target's shape
    num_layers: int              # draft decoder layers
    block_size: int              # B: the anchor and B-1 drafted tokens
    num_aux: int                 # target layers read
    mask_token_id: int


class BlockAttention(nn.Module):
    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, kv_heads, T, d] of rows x [B, T, H] at `positions` [T] or [B, T]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(k, positions, self.theta), v

    def forward(self, x, positions, ctx_k, ctx_v, mask) -> torch.Tensor:
        """Block rows x [B, Q, H] attend to the context keys [B, kv, C, d] and to their own keys
        under `mask` [B, 1, Q, C + Q] (True: visible)."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        q = rope(q, positions, self.theta)
        k, v = self.keys(x, positions)
        rep = self.heads // self.kv_heads
        k = repeat_kv(torch.cat((ctx_k, k), dim=2), rep)
        v = repeat_kv(torch.cat((ctx_v, v), dim=2), rep)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class BlockLayer(nn.Module):
    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = BlockAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, ctx, ctx_positions, mask) -> torch.Tensor:
        ctx_k, ctx_v = self.self_attn.keys(ctx, ctx_positions)
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """`embed`: the target's input embedding [V, H], used as is and frozen.

        c      = hidden_norm(fc(concat(aux_1 .. aux_n)))     Linear(nH -> H): one row per target position
        x      = embed([anchor, MASK, ..., MASK])            a block of B positions at anchor .. anchor+B-1
        layer  : block rows: q, k, v from input_layernorm(x); q_norm, k_norm per head; RoPE at their positions
                 context rows: k = k_norm(k_proj(c)), v = v_proj(c) (no input norm), RoPE at their positions
                 every block row sees the context rows before the anchor and the whole block (no causal mask)
                 x = x + o_proj(attention);  x = x + mlp(post_attention_layernorm(x))
        logits = lm_head(norm(x))                            block row k (1..B-1) guesses token anchor+k

    The anchor is the last token the target has verified (its own feature is not known yet); the
    context rows are the target's features at every earlier position. Parameters:
    `layers.{i}.self_attn.q_proj.weight`, ..., `fc.weight`, `hidden_norm.weight`, `norm.weight`,
    `lm_head.weight`, `d2t`; the embedding is not exported (vLLM shares the target's). The MASK
    slots take a trained vector of their own, `mask_embedding` (exported as `mask_embedding.pt`,
    which vLLM substitutes for the embedding of `mask_token_id`)."""

    def __init__(self, cfg: DFlashConfig, embed: torch.Tensor | None = None, d2t: torch.Tensor | None = None,
                 t2d: torch.Tensor | None = None):
        super().__init__()
        base = cfg.base
        self.config = cfg
        if embed is not None and tuple(embed.shape) != (base.vocab_size, base.hidden_size):
            raise ValueError(f"target embedding {tuple(embed.shape)} does not fit vocab {base.vocab_size} "
                             f"x hidden {base.hidden_size}")
        self.embed_tokens = nn.Embedding(base.vocab_size, base.hidden_size, _weight=embed, _freeze=True)
        self.mask_embedding = nn.Parameter(self.embed_tokens.weight[cfg.mask_token_id].detach().float().clone())
        self.fc = nn.Linear(cfg.num_aux * base.target_hidden_size, base.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(base.hidden_size, base.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(base) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(base.hidden_size, base.rms_norm_eps)
        self.lm_head = nn.Linear(base.hidden_size, base.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t if d2t is not None else torch.zeros(base.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", t2d if t2d is not None else torch.zeros(base.vocab_size, dtype=torch.bool))

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """[B, L, nH] target features -> [B, L, H] context rows."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def block_embeddings(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[B, A] anchor tokens -> [B, A*block, H]: each anchor's embedding, then MASK slots."""
        b, a = anchor_ids.shape
        dtype = self.fc.weight.dtype
        first = self.embed_tokens(anchor_ids).to(dtype)[:, :, None]
        rest = self.mask_embedding.to(dtype).expand(b, a, self.config.block_size - 1, -1)
        return torch.cat((first, rest), dim=2).reshape(b, a * self.config.block_size, -1)

    def blocks(self, ctx, anchors, anchor_ids) -> torch.Tensor:
        """Draft one block per anchor: ctx [B, C, H] context rows (row p = the target's feature at
        position p; a block sees only rows before its anchor, so padding rows stay unseen),
        anchors [B, A] positions (-1: none, its rows see only their own block), anchor_ids [B, A]
        their tokens. Returns the normed states [B, A, block, H] (lm_head's input)."""
        b, a = anchors.shape
        n = self.config.block_size
        c = ctx.shape[1]
        dev = ctx.device
        k = torch.arange(n, device=dev)
        pos = (anchors.clamp_min(0)[:, :, None] + k).reshape(b, a * n)
        block_of = torch.arange(a, device=dev).repeat_interleave(n)
        sees_ctx = torch.arange(c, device=dev)[None, None, :] < anchors[:, :, None]        # [B, A, C]
        sees_ctx = sees_ctx.repeat_interleave(n, dim=1)                                      # [B, A*n, C]
        sees_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
        mask = torch.cat((sees_ctx, sees_block), dim=2)[:, None]
        x = self.block_embeddings(anchor_ids.clamp_min(0))
        ctx_pos = torch.arange(c, device=dev).expand(b, c)
        for layer in self.layers:
            x = layer(x, pos, ctx, ctx_pos, mask)
        return self.norm(x).view(b, a, n, -1)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(states)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def draft(self, ctx: torch.Tensor, anchor_id: int) -> list[int]:
        """Greedy drafts (block_size-1 target ids) after `anchor_id`, what vLLM's `dflash` drafts:
        ctx [L, H] the context rows (`context`) of the target's features at positions 0..L-1, the
        anchor at position L."""
        L = ctx.shape[0]
        dev = ctx.device
        states = self.blocks(ctx[None], torch.tensor([[L]], device=dev), torch.tensor([[anchor_id]], device=dev))
        return self.to_target(self.logits(states[0, 0, 1:]).argmax(-1)).tolist()


# -- anchors ---------------------------------------------------------------------------------------

def anchors_of(sup: torch.Tensor, sample: int, epoch: int, seed: int, max_anchors: int) -> torch.Tensor:
    """The anchors of one sample in one epoch: up to `max_anchors` positions a >= 1 whose first
    drafted token (a+1) is supervised (sup[a]), drawn without replacement by a generator seeded by
    (seed, epoch, sample), ascending. Block row k of an anchor a is then scored where sup[a+k-1]."""
    cand = sup.nonzero().flatten()
    cand = cand[cand >= 1]
    if len(cand) <= max_anchors:
        return cand
    key = int(hashlib.sha256(f"{seed}/{epoch}/{sample}".encode()).hexdigest()[:15], 16)
    g = torch.Generator().manual_seed(key)
    return cand[torch.randperm(len(cand), generator=g)[:max_anchors]].sort().values


def anchors_for(sup, seed: int, max_anchors: int, sample: int, epoch: int) -> torch.Tensor:
    """`anchors_of` over a `data.Supervision` (picklable with functools.partial, for loader workers)."""
    return anchors_of(sup[sample], sample, epoch, seed, max_anchors)


def block_counts(sup: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B-1] scored rows per block row k = 1..B-1 over these anchors: sup[a+k-1] within the sample."""
    n = len(sup)
    out = torch.zeros(block_size - 1, dtype=torch.int64)
    for k in range(1, block_size):
        u = anchors + k - 1
        u = u[u < n]
        out[k - 1] = int(sup[u].sum())
    return out


class DFlashObjective(nn.Module):
    """The drafter plus the frozen teacher head, as `TTTObjective`: forward(micro-batch) -> per block
    row sums over its scored rows, soft CE [B-1] (with grad), and [3, B-1] without: teacher-argmax
    hits, rows, teacher entropy. Per sample, a seeded set of anchors among the supervised positions
    (`anchors_of`), one block per anchor, all blocks of a sample in one pass under a block mask;
    block row k is scored against the target's distribution for token anchor+k (the teacher of
    `data.py`, position anchor+k-1), weighed by exp(-(k-1)/gamma) (`position_weights`)."""

    def __init__(self, drafter: DFlashDrafter, teacher_head: torch.Tensor):
        super().__init__()
        self.drafter = drafter
        self.steps = drafter.config.block_size - 1
        self.register_buffer("teacher_head", teacher_head, persistent=False)

    def teacher(self, last):
        return teacher_distribution(last, self.teacher_head)

    def forward(self, aux, input_ids, sup, last, anchors):
        p, target, entropy = self.teacher(last)
        b, n = input_ids.shape
        valid = anchors >= 0
        ids = input_ids.gather(1, anchors.clamp_min(0))
        states = self.drafter.blocks(self.drafter.context(aux), anchors, ids)   # [b, A, B, H]
        row_of = sup.flatten().long().cumsum(0) - 1      # teacher row of each supervised position
        ce, hits, count, ent = [], [], [], []
        for k in range(1, self.drafter.config.block_size):
            u = anchors + k - 1
            keep = valid & (u < n)
            keep = keep & sup.gather(1, u.clamp(0, n - 1))
            bi, ai = keep.nonzero(as_tuple=True)
            if len(bi) == 0:   # keep every parameter in the graph (DDP wants all gradients)
                ce.append(0.0 * self.drafter.logits(states[:1, :1, k]).sum())
                z = torch.zeros((), device=aux.device)
                hits.append(z), count.append(z), ent.append(z)
                continue
            rows = row_of[bi * n + u[bi, ai]]
            logits = self.drafter.logits(states[bi, ai, k]).float()
            ce.append(-(p[rows] * F.log_softmax(logits, -1)).sum())
            hits.append((logits.gather(1, target[rows, None]).squeeze(1) >= logits.amax(-1)).sum().float())
            count.append(torch.tensor(float(len(bi)), device=aux.device))
            ent.append(entropy[rows].sum())
        return torch.stack(ce), torch.stack((torch.stack(hits), torch.stack(count), torch.stack(ent)))


def build_dflash(cfg: DFlashConfig, embed: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                 seed: int) -> DFlashDrafter:
    """A freshly initialised DFlash drafter (seeded) with the target's embedding, frozen."""
    torch.manual_seed(seed)
    return init_linears(DFlashDrafter(cfg, embed, d2t, t2d))


# -- export: the folder vLLM's `dflash` method loads -------------------------------------------

ARCHITECTURE = "DFlashDraftModel"
MASK_FILE = "mask_embedding.pt"


def expected_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every key of model.safetensors and its shape."""
    b = cfg.base
    h, hd, f = b.hidden_size, b.head_dim, b.intermediate_size
    q, kv = b.num_attention_heads * hd, b.num_key_value_heads * hd
    out = {"fc.weight": (h, cfg.num_aux * b.target_hidden_size), "hidden_norm.weight": (h,), "norm.weight": (h,),
           "lm_head.weight": (b.draft_vocab_size, h), "d2t": (b.draft_vocab_size,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
    return out


def export_config(cfg: DFlashConfig, layer_ids: list[int], dtype: str, extra: dict | None = None) -> dict:
    b = cfg.base
    if len(layer_ids) != cfg.num_aux:
        raise ValueError(f"{len(layer_ids)} layer ids for a drafter reading {cfg.num_aux} target layers")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": b.hidden_size,
        "intermediate_size": b.intermediate_size,
        "num_attention_heads": b.num_attention_heads,
        "num_key_value_heads": b.num_key_value_heads,
        "head_dim": b.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": b.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": b.rope_theta},
        "rope_theta": b.rope_theta,
        "max_position_embeddings": b.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": b.vocab_size,
        "draft_vocab_size": b.draft_vocab_size,
        "target_hidden_size": b.target_hidden_size,
        "torch_dtype": dtype,
        "dflash_config": {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": list(layer_ids)},
        "draftsmith": {"kind": "dflash", "aux_layer_ids": list(layer_ids), "aux_layer_convention": "output",
                       "engine": "vllm", **_portable(extra or {})},
    }


def export(out_dir: str | Path, weights: dict[str, torch.Tensor], cfg: DFlashConfig, layer_ids: list[int],
           dtype: str, extra: dict | None = None) -> Path:
    """Write a DFlash export folder (replacing any old one whole) from the drafter's state dict:

      config.json        `DFlashDraftModel` (vLLM maps it to `qwen3_dflash.DFlashQwen3ForCausalLM`),
                         `model_type` qwen3, the draft's own `num_hidden_layers`, the target's vocab
                         size and `draft_vocab_size`, `target_hidden_size`, RoPE as `rope_parameters`,
                         no `layer_types` (every layer non-causal, full attention), and
                         `dflash_config` {block_size, mask_token_id, target_layer_ids}: the target
                         layers in DFlash's convention, the OUTPUT of layer k, which is draftsmith's
                         stored convention (vLLM adds 1 itself to reach its input-of-layer ids).
      model.safetensors  `layers.{i}.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`,
                         `lm_head.weight` over the draft vocabulary and `d2t` (vLLM maps draft ids
                         to target ids with it); no embedding (vLLM shares the target's).
      mask_embedding.pt  the trained MASK vector, {"mask_token_id", "embedding"}: vLLM puts it in
                         place of the embedding of `mask_token_id` wherever that id is fed.
    """
    if dtype not in DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    tensors = {}
    for key, shape in expected_shapes(cfg).items():
        if key not in weights:
            raise KeyError(f"drafter state has no {key!r}")
        t = weights[key].detach().cpu()
        if tuple(t.shape) != shape:
            raise ValueError(f"{key}: shape {tuple(t.shape)}, expected {shape}")
        tensors[key] = t.to(DTYPES[dtype]) if t.is_floating_point() else t.to(torch.int64)
    used_ids(tensors["d2t"], weights["t2d"].detach().cpu().bool())
    mask = weights["mask_embedding"].detach().cpu().to(DTYPES[dtype])

    def mask_file(folder: Path) -> None:
        torch.save({"mask_token_id": cfg.mask_token_id, "embedding": mask.contiguous()}, folder / MASK_FILE)
    return write_folder(out_dir, tensors, export_config(cfg, layer_ids, dtype, extra), mask_file)


def config_of_export(config: dict) -> DFlashConfig:
    fields = DrafterShape.__dataclass_fields__
    base = {f: config[f] for f in fields if f in config}
    base["rope_theta"] = float(config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta")))
    missing = [f for f in fields if f not in base]
    if missing:
        raise ValueError(f"DFlash export config.json lacks {missing}")
    d = config["dflash_config"]
    return DFlashConfig(base=DrafterShape(**base), num_layers=int(config["num_hidden_layers"]),
                        block_size=int(d["block_size"]), num_aux=len(d["target_layer_ids"]),
                        mask_token_id=int(d["mask_token_id"]))


def load_exported(export_dir: str | Path, target_path: str | Path, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> DFlashDrafter:
    """The DFlash drafter of an export folder, with the target's embedding, in eval mode."""
    export_dir = Path(export_dir)
    _, cfg, weights = read_export(export_dir, ARCHITECTURE, config_of_export, expected_shapes)
    mask = torch.load(export_dir / MASK_FILE, weights_only=True)
    if mask.get("mask_token_id") != cfg.mask_token_id:
        raise ValueError(f"{export_dir}/{MASK_FILE}: mask_token_id {mask.get('mask_token_id')} differs from "
                         f"config.json's {cfg.mask_token_id}")
    model = DFlashDrafter(cfg, target_tensors(target_path)["embed"].to(dtype))
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in weights.items()}
    state["mask_embedding"] = mask["embedding"].to(dtype)
    t2d = torch.zeros(cfg.base.vocab_size, dtype=torch.bool)
    t2d[torch.arange(cfg.base.draft_vocab_size) + weights["d2t"]] = True
    state["t2d"] = t2d
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)
    return model.to(device).eval()


def serving_command(target_path: str | Path, export_dir: str | Path, block_size: int,
                    trust_remote_code: bool = False) -> str:
    """The command that serves the target with this drafter in vLLM (block_size-1 drafted per step)."""
    spec = json.dumps({"method": "dflash", "model": str(export_dir), "num_speculative_tokens": block_size - 1})
    return f"vllm serve {target_path} --speculative-config '{spec}'" + (" --trust-remote-code" if trust_remote_code else "")
