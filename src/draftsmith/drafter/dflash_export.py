"""Export the DFlash drafter the way vLLM's `dflash` method loads it, and load an export back.

`export` writes a folder vLLM serves as is (config.json, model.safetensors, mask_embedding.pt; the
layout is on `export`), with a `draftsmith` block in the config recording the layers, the kind and
the training step; `load_exported` reads it back, and `serving_command` names the engine command
(`--speculative-config '{"method": "dflash", "model": DIR, "num_speculative_tokens": B-1}'`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..targets.checkpoint import target_tensors
from .dflash import DFlashConfig, DFlashDrafter
from .export import DTYPES, _portable, read_export, write_folder
from .model import DrafterShape
from .vocab import used_ids

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
