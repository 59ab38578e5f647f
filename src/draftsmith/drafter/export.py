"""Export the drafter the way SGLang and vLLM load it, and load an export back into draftsmith.

An export folder holds `config.json` (`LlamaForCausalLMEagle3`, one layer, the target's vocab size,
`draft_vocab_size`, `target_hidden_size`, and `eagle_config.eagle_aux_hidden_state_layer_ids`
written in the serving engine's convention via `draftsmith.layers`) and `model.safetensors` with
exactly the keys of docs/eagle3.md, d2t and t2d included; the frozen embedding is not
exported (engines share the target's). A `draftsmith` block in the config records the layer ids
in draftsmith's own (output) convention, the engine they were written for, and the training step.
A vLLM export also writes the ids at the top level, the only place vLLM reads them; no export
holds a path of this machine.

`load_exported(dir, target_path)` rebuilds `Eagle3Drafter` from an export and the target's
embedding: the weights it holds are exactly the exported tensors (upcast to `dtype` if asked).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import layers
from ..targets.checkpoint import target_tensors
from .model import DrafterShape, Eagle3Drafter
from .vocab import used_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CONFIG, WEIGHTS = "config.json", "model.safetensors"   # an export folder's files (EAGLE-3's and DFlash's)


def expected_shapes(cfg: DrafterShape) -> dict[str, tuple[int, ...]]:
    """Every key of an export and its shape."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, cfg.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def export_config(cfg: DrafterShape, layer_ids: list[int], engine: str, dtype: str,
                  extra: dict | None = None) -> dict:
    """config.json of an export; `layer_ids` in draftsmith's (output) convention."""
    engine_ids = layers.engine_layer_ids(layer_ids, engine)
    # what the engine will capture must be what training read
    if layers.engine_capture_indices(engine_ids, engine) != layers.hf_hidden_state_indices(layer_ids):
        raise AssertionError(f"layer ids {engine_ids} for {engine} do not capture output layers {layer_ids}")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": dtype,
        # vLLM reads the ids only at the top level (or as eagle_config.layer_ids) and otherwise
        # falls back to its default (2, N//2, N-3) with a mere warning; SGLang reads eagle_config
        **({"eagle_aux_hidden_state_layer_ids": engine_ids} if engine == "vllm" else {}),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": engine_ids},
        "draftsmith": {"aux_layer_ids": list(layer_ids), "aux_layer_convention": "output",
                       "engine": engine, **_portable(extra or {})},
    }


def _portable(extra: dict) -> dict:
    """`extra` without the target's folder: an export is shared, a path on this machine means
    nothing elsewhere (the target's fingerprint and shape name it)."""
    out = dict(extra)
    if isinstance(out.get("target"), dict):
        out["target"] = {k: v for k, v in out["target"].items() if k != "path"}
    return out


def export(out_dir: str | Path, weights: dict[str, torch.Tensor], cfg: DrafterShape, layer_ids: list[int],
           engine: str, dtype: str, extra: dict | None = None) -> Path:
    """Write an export folder (replacing any old one whole). `weights`: the drafter's state dict;
    the embedding is left out, float tensors are cast to `dtype`."""
    if dtype not in DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    shapes = expected_shapes(cfg)
    tensors = {}
    for key, shape in shapes.items():
        if key not in weights:
            raise KeyError(f"drafter state has no {key!r}")
        t = weights[key].detach().cpu()
        if tuple(t.shape) != shape:
            raise ValueError(f"{key}: shape {tuple(t.shape)}, expected {shape}")
        tensors[key] = t.to(DTYPES[dtype]) if t.is_floating_point() else t
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    used_ids(tensors["d2t"], tensors["t2d"])
    return write_folder(out_dir, tensors, export_config(cfg, layer_ids, engine, dtype, extra))


def write_folder(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict, extra=None) -> Path:
    """Write an export folder whole, replacing any old one: the weights, config.json and `extra`
    (tmp folder -> name), written beside and renamed, so a kill leaves the old export or the new."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / CONFIG).write_text(json.dumps(config, indent=1))
    if extra is not None:
        extra(tmp)
    old = out.with_name(out.name + ".old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def read_weights(export_dir: str | Path) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(export_dir) / WEIGHTS), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_export_config(export_dir: str | Path) -> dict:
    """The config.json of an export folder (FileNotFoundError if the folder holds no export)."""
    return json.loads((Path(export_dir) / CONFIG).read_text())


def is_export(folder: str | Path) -> bool:
    return (Path(folder) / CONFIG).is_file()


def config_of_export(config: dict) -> DrafterShape:
    fields = DrafterShape.__dataclass_fields__
    missing = [f for f in fields if f not in config]
    if missing:
        raise ValueError(f"export config.json lacks {missing}")
    return DrafterShape(**{f: config[f] for f in fields})


def read_export(export_dir: str | Path, architecture: str, config_of, shapes_of) -> tuple[dict, object, dict]:
    """(config.json, the drafter's config, the weights) of an export folder of `architecture`, its
    keys checked against `shapes_of(config_of(config.json))`."""
    config = read_export_config(export_dir)
    if config.get("architectures") != [architecture]:
        raise ValueError(f"{export_dir}/{CONFIG}: architectures {config.get('architectures')}, "
                         f"expected [{architecture!r}]")
    cfg = config_of(config)
    weights = read_weights(export_dir)
    shapes = shapes_of(cfg)
    if set(weights) != set(shapes):
        raise ValueError(f"{export_dir}/{WEIGHTS}: keys differ from {architecture}'s: "
                         f"missing {sorted(set(shapes) - set(weights))}, extra {sorted(set(weights) - set(shapes))}")
    return config, cfg, weights


def load_exported(export_dir: str | Path, target_path: str | Path, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> Eagle3Drafter:
    """The drafter of an export folder, with the target's embedding, in eval mode."""
    _, cfg, weights = read_export(export_dir, ARCHITECTURE, config_of_export, expected_shapes)
    model = Eagle3Drafter(cfg, target_tensors(target_path)["embed"].to(dtype))
    missing, unexpected = model.load_state_dict(
        {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in weights.items()}, strict=False, assign=True)
    assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)
    return model.to(device).eval()


def for_engine(export_dir: str | Path, engine: str) -> Path:
    """An export folder whose config.json speaks `engine`'s layer-id convention: `export_dir`
    itself if it already does (as this version writes it), else a sibling `<name>-<engine>` with the same weights (hard link
    when the filesystem allows) and the config rewritten."""
    src = Path(export_dir)
    config = read_export_config(src)
    cfg = config_of_export(config)
    extra = {k: v for k, v in config["draftsmith"].items() if k not in ("aux_layer_ids", "aux_layer_convention", "engine")}
    wanted = export_config(cfg, config["draftsmith"]["aux_layer_ids"], engine, config["torch_dtype"], extra)
    if config == wanted:
        return src
    dst = src.with_name(f"{src.name}-{engine}")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        os.link(src / WEIGHTS, tmp / WEIGHTS)
    except OSError:
        shutil.copy2(src / WEIGHTS, tmp / WEIGHTS)
    (tmp / CONFIG).write_text(json.dumps(wanted, indent=1))
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return dst


def serving_command(engine: str, target_path: str | Path, export_dir: str | Path, draft_tokens: int,
                    trust_remote_code: bool = False) -> str:
    """The command that serves the target with this drafter (chain drafting, topk 1, `draft_tokens`
    drafted per verification: notebook 06's setting of that name)."""
    trust = " --trust-remote-code" if trust_remote_code else ""
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model-path {target_path} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {export_dir} --speculative-num-steps {draft_tokens} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {draft_tokens + 1}{trust}")
    if engine == "vllm":
        spec = json.dumps({"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": draft_tokens})
        return f"vllm serve {target_path} --speculative-config '{spec}'{trust}"
    raise ValueError(f"engine must be one of {layers.ENGINES}, got {engine!r}")
