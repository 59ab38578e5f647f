"""The target's checkpoint: where it is, its config, tokenizer and weights, and the model itself.

`target_model_path` names either a built-in target (built once into the cache: the Llama-shaped
`tiny`/`tiny-test` of `draftsmith.targets.tiny`, the Kimi-K2.5-shaped `kimi-mini`/`kimi-mini-bf16` of
`draftsmith.targets.kimi_mini`) or a Hugging Face checkpoint folder; `resolve_target` turns it into
the folder. Everything else here reads that folder: the config (`target_config`), the tokenizer, single
tensors straight from its safetensors without building the model (`target_tensors`, `final_norm`),
and the whole model through transformers (`load_target`). What names a checkpoint is one
fingerprint of its config.json and the names, sizes and first MiB of its safetensors (`fingerprint`,
`target_identity`: cheap on a 1 TB checkpoint, changed when the weights are replaced): stage 04
records it in its index, stage 06 keys its measurements by it. Tokenizer code shipped in a folder
(Kimi-K2.5's) that imports what transformers moved is bridged (`bridge_moved_imports`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from . import kimi_mini, tiny

if TYPE_CHECKING:
    import torch

BUILT_IN_TARGETS = (*tiny.VARIANTS, *kimi_mini.VARIANTS)


def checkpoint_problem(target_model_path: str | os.PathLike) -> str | None:
    """Why `target_model_path` names no target (None when it does), without building anything."""
    name = str(target_model_path)
    if name in BUILT_IN_TARGETS or (Path(name).expanduser() / "config.json").is_file():
        return None
    return (f"target_model_path {name!r}: no config.json there; give a Hugging Face checkpoint folder or "
            f"one of the built-in targets {sorted(BUILT_IN_TARGETS)}")


def resolve_target(target_model_path: str | os.PathLike, log=print) -> Path:
    """The folder of the target checkpoint: a built-in variant name (built and cached on first use)
    or the path of an existing checkpoint."""
    problem = checkpoint_problem(target_model_path)
    if problem:
        raise FileNotFoundError(problem)
    name = str(target_model_path)
    if name in tiny.VARIANTS:
        return tiny.build_tiny_target(name, log=log)
    if name in kimi_mini.VARIANTS:
        return kimi_mini.build_kimi_mini(name, log=log)
    return Path(name).expanduser()


def target_config(target_path: str | os.PathLike) -> dict:
    """The checkpoint's config.json as written (multimodal checkpoints nest the text model's under
    `text_config`)."""
    path = Path(target_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint folder (no config.json)")
    return json.loads(path.read_text())


_PLAIN_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(target_model_path: str | os.PathLike, trust_remote_code: bool = False, log=print):
    """The tokenizer of the target (built-in name or checkpoint folder). A checkpoint with a plain
    tokenizer.json (the built-in targets) loads without importing torch, seconds faster than
    AutoTokenizer; any other goes through AutoTokenizer (`trust_remote_code` is opt-in: Kimi-K2.5's
    tiktoken tokenizer needs it). A tokenizer shipped as code is refused without it rather than
    silently replaced by transformers' generic conversion (`bridge_moved_imports`)."""
    path = resolve_target(target_model_path, log=log)
    config = path / "tokenizer_config.json"
    if (path / "tokenizer.json").is_file() and config.is_file() and \
            json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class") in _PLAIN_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    code = tokenizer_code(path)
    if code and not trust_remote_code:
        raise ValueError(remote_code_refusal(path, code))
    if code:
        bridge_moved_imports(path, log=log)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def remote_code_refusal(path: str | os.PathLike, code: str) -> str:
    """Why a checkpoint whose tokenizer is code is not loaded with trust_remote_code false."""
    return (f"trust_remote_code is false, but the tokenizer of {path} is code shipped with the checkpoint "
            f"(tokenizer_config.json auto_map: {code}); without that code transformers may build a "
            f"generic tokenizer that splits text differently. Read the folder's .py files, then set "
            f"trust_remote_code: true")


def tokenizer_code(folder: str | os.PathLike) -> str | None:
    """The `auto_map` entry of the folder's tokenizer_config.json that loads its tokenizer class
    from the folder's own code (Kimi-K2.5's), or None when it has none."""
    config = Path(folder) / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        auto = json.loads(config.read_text(encoding="utf-8")).get("auto_map") or {}
    except ValueError as e:
        raise ValueError(f"{config}: not valid JSON ({e})") from None
    entry = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    if isinstance(entry, list):
        entry = next((e for e in entry if e), None)
    return entry or None


# ---- single tensors, read from the safetensors files --------------------------------------------

def weight_files(target_path: str | os.PathLike) -> dict[str, Path]:
    """tensor name -> safetensors file of a checkpoint (sharded with an index, or plain files)."""
    from safetensors import safe_open

    target_path = Path(target_path)
    index = target_path / "model.safetensors.index.json"
    if index.is_file():
        return {k: target_path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    where: dict[str, Path] = {}
    for f in sorted(target_path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            where.update(dict.fromkeys(h.keys(), f))
    if not where:
        raise FileNotFoundError(f"{target_path}: no model.safetensors or model.safetensors.index.json")
    return where


def _named(names, suffix: str) -> list[str]:
    """Tensor names equal to `suffix` or ending in `.suffix` (nested models prefix theirs), shortest first."""
    return sorted((n for n in names if n == suffix or n.endswith("." + suffix)), key=len)


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def target_tensors(target_path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Only the target's input embedding and lm_head ([V, H] each, checkpoint dtype), read from its
    safetensors without building the model. Tied embeddings give the same tensor for both."""
    files = weight_files(target_path)
    return {"embed": _read(files, _embed_name(target_path, files)), "lm_head": lm_head_weight(target_path, files)}


def lm_head_weight(target_path: str | os.PathLike, files: dict[str, Path] | None = None) -> torch.Tensor:
    """The target's lm_head [V, H] (checkpoint dtype; the embedding when tied), read alone from its
    safetensors: what stage 04's own check multiplies the stored final state with."""
    target_path = Path(target_path)
    files = files or weight_files(target_path)
    head = _named(files, "lm_head.weight")
    if head:
        return _read(files, head[0])
    cfg = target_config(target_path)
    if not cfg.get("text_config", cfg).get("tie_word_embeddings", False):
        raise KeyError(f"{target_path}: no 'lm_head.weight' and tie_word_embeddings is not set")
    return _read(files, _embed_name(target_path, files))


def _embed_name(target_path, files: dict[str, Path]) -> str:
    embed = _named(files, "embed_tokens.weight")
    if not embed:
        raise KeyError(f"{target_path}: no '*embed_tokens.weight' tensor in the checkpoint")
    return embed[0]


def final_norm(target_path: str | os.PathLike) -> tuple[torch.Tensor, float]:
    """The final RMSNorm of a checkpoint: its weight (float32) and eps. Found as the one tensor named
    `model.norm.weight` (or ending in `.model.norm.weight`, e.g. under `language_model.`)."""
    target_path = Path(target_path)
    cfg = target_config(target_path)
    eps = (cfg.get("text_config") or cfg).get("rms_norm_eps", cfg.get("rms_norm_eps"))
    if eps is None:
        raise ValueError(f"{target_path / 'config.json'}: no rms_norm_eps; the vllm backend applies the final "
                         f"norm itself and supports RMSNorm targets only")
    files = weight_files(target_path)
    names = _named(files, "model.norm.weight")
    if len(names) != 1:
        raise ValueError(f"{target_path}: expected one final norm weight named like 'model.norm.weight', found "
                         f"{names or 'none'}")
    return _read(files, names[0]).float(), float(eps)


# ---- the whole model ----------------------------------------------------------------------------

def load_target(path: str | os.PathLike, device: str = "auto", trust_remote_code: bool = False):
    """The target's causal language model in eval mode (transformers), loaded as the checkpoint's own
    architecture: a causal LM as is; a multimodal wrapper (Kimi-K2.5: image-text-to-text) whole, and
    then only its text model is kept (its decoder, with `.layers`, and its lm_head), so every caller
    meets the same interface. `auto`: bf16 on GPU (one GPU per torchrun rank when several ranks
    share a node, else `device_map="auto"` over all visible GPUs), float32 on CPU."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        kw = {"dtype": torch.float32}
    elif device == "cuda":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if local_world > 1:
            kw = {"device_map": {"": f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"}}
        else:
            kw = {"device_map": "auto" if torch.cuda.device_count() > 1 else {"": "cuda:0"}}
        kw["dtype"] = torch.bfloat16
    else:
        kw = {"device_map": {"": device}, "dtype": torch.bfloat16}
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    text = config.get_text_config()
    causal = text is config or type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or _remote_causal_lm(config)
    auto = AutoModelForCausalLM if causal else AutoModelForImageTextToText
    model = auto.from_pretrained(path, trust_remote_code=trust_remote_code, **kw)
    return (model if text is config else _text_model(model, text)).eval()


def _remote_causal_lm(config) -> bool:
    return "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})


def _text_model(wrapper, text_config):
    """The causal LM inside a multimodal `wrapper`: a text-only model of `text_config` whose decoder
    and lm_head are the wrapper's own modules (built on the meta device, so nothing is copied)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(text_config, dtype=wrapper.dtype)
    lm.model = wrapper.get_decoder()
    lm.lm_head = wrapper.get_output_embeddings()
    lm.generation_config = wrapper.generation_config  # the checkpoint's end-of-turn, not the text config's
    if hasattr(wrapper, "hf_device_map"):
        lm.hf_device_map = wrapper.hf_device_map
    return lm


def fingerprint(folder: str | os.PathLike) -> str:
    """16 hex digits of config.json + every `*.safetensors` file's name, size and first MiB."""
    folder = Path(folder)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def target_identity(path: str | os.PathLike, trust_remote_code: bool = False) -> dict:
    """What names the target in the hidden-state index: its shape from the config, and `fingerprint`."""
    from transformers import AutoConfig

    path = Path(path)
    raw = (path / "config.json").read_bytes()
    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config()
    return {"path": str(path), "model_type": cfg.model_type,
            "config_sha256": hashlib.sha256(raw).hexdigest(), "fingerprint": fingerprint(path),
            "num_hidden_layers": int(cfg.num_hidden_layers), "hidden_size": int(cfg.hidden_size),
            "vocab_size": int(cfg.vocab_size), "pad_token_id": cfg.pad_token_id}


_OLD_HOME = "transformers.models.gpt2.tokenization_gpt2"


def bridge_moved_imports(folder: str | Path, log=print) -> bool:
    """Make `from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode` work for the
    folder's tokenizer code, if that code needs it and this transformers lacks it. True if bridged."""
    sources = [p for p in Path(folder).glob("*.py")
               if _OLD_HOME in (text := p.read_text(encoding="utf-8", errors="replace")) and "bytes_to_unicode" in text]
    if not sources:
        return False
    import importlib

    old = importlib.import_module(_OLD_HOME)
    if hasattr(old, "bytes_to_unicode"):
        return False
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    old.bytes_to_unicode = bytes_to_unicode
    log(f"compatibility: {sources[0].name} imports bytes_to_unicode from {_OLD_HOME}, which this transformers "
        f"moved to transformers.convert_slow_tokenizer; bridged (the same function)")
    return True
