"""The absolute gate of stage 04's own check (`check.ANSWERS`): the engine on the target's own answers.

For each built-in target, its own answers are sampled first (transformers, temperature 1, top_p 1:
stage 02's defaults) to prompts of the demo's chat data, and written as a stage-03 tokens file. Then
stage 04 runs on them the way a user runs it (`extract`, its check on, `check_answers` on): on the
target itself, and on a copy of its folder with one weight perturbed (Gaussian noise of `--scale`
times that weight's RMS, a stand-in for a kernel that computes one projection wrongly), on the same
answers. The table has what the check measured: its self-consistency verdict (the perturbed copy
agrees with itself too: same engine, same weights), the response tokens judged, the engine's mean
NLL of them and how often its argmax is the sampled token, and the verdict with the gate.

`kimi-mini` (INT4 experts) runs through `hf`: vLLM's CPU build has no INT4 MoE kernel.

    .venv/bin/python bench/gate_figures.py                 # tiny (the demo target), kimi-mini, kimi-mini-bf16
    .venv/bin/python bench/gate_figures.py --targets tiny-test --scale 30
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from draftsmith import layers
from draftsmith.hidden import check
from draftsmith.hidden.extract import extract
from draftsmith.targets.checkpoint import load_target, load_tokenizer, resolve_target, target_config

REPO = Path(__file__).resolve().parents[1]
# target -> (backend, the weight a perturbed copy gets noise on, whether vLLM prefills it in chunks:
# its CPU build turns chunked prefill off for MLA, and a prompt longer than a step then never runs)
TARGETS = {
    "tiny": ("vllm", "model.layers.0.mlp.down_proj.weight", True),
    "tiny-test": ("vllm", "model.layers.0.mlp.down_proj.weight", True),
    "kimi-mini": ("hf", "language_model.model.layers.0.self_attn.o_proj.weight", False),
    "kimi-mini-bf16": ("vllm", "language_model.model.layers.0.self_attn.o_proj.weight", False),
}
ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


def prompts(n: int) -> list[list[dict]]:
    """The first `n` conversations of the demo's chat data, up to their last user turn."""
    out = []
    for line in (REPO / "data" / "demo" / "chat.jsonl").read_text().splitlines():
        turns = [{"role": ROLES[t["from"]], "content": t["value"]} for t in json.loads(line)["conversations"]]
        while turns and turns[-1]["role"] != "user":
            turns.pop()
        if turns:
            out.append(turns)
        if len(out) == n:
            break
    return out


def own_answers(target: Path, path: Path, n: int, max_new_tokens: int, seed: int) -> int:
    """Sample the target's own answers to `n` prompts into a stage-03 tokens file; returns the
    number of response tokens."""
    tok = load_tokenizer(target, trust_remote_code=True)
    model = load_target(target, "cpu", True)
    torch.manual_seed(seed)
    rows = []
    for i, turns in enumerate(prompts(n)):
        ids = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id or 0)
        resp = out[0, len(ids):].tolist()
        rows.append({"sample_id": f"chat-{i}", "dataset": "chat", "provider": "self", "input_ids": ids + resp,
                     "loss_mask": [0] * len(ids) + [1] * len(resp), "output_ids": resp, "excluded": False})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return sum(len(r["output_ids"]) for r in rows)


def perturbed_copy(target: Path, weight: str, scale: float, into: Path, seed: int = 1) -> Path:
    """A copy of the target's folder with Gaussian noise of `scale` x RMS added to `weight`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(target, into)
    files = sorted(into.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as h:
            if weight not in h.keys():
                continue
            meta = h.metadata()
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        w = tensors[weight]
        g = torch.Generator().manual_seed(seed)
        rms = w.float().pow(2).mean().sqrt()
        tensors[weight] = (w.float() + scale * rms * torch.randn(w.shape, generator=g)).to(w.dtype)
        save_file(tensors, str(f), metadata=meta)
        return into
    raise KeyError(f"{weight} is in none of {[f.name for f in files]}")


def measure(target: Path, backend: str, tokens: Path, out: Path, samples: int,
            step_tokens: int | None) -> check.CheckRecord:
    """Stage 04 on `tokens` with the check and the gate on: the check's record (passed or not)."""
    cfg = target_config(target)
    n_layers = int((cfg.get("text_config") or cfg)["num_hidden_layers"])
    options = {"trust_remote_code": True}
    if backend == "vllm" and step_tokens:
        options["max_num_batched_tokens"] = step_tokens
    try:
        summary = extract(target, [tokens], out, target_backend=backend, layer_ids=layers.default_layer_ids(n_layers),
                          max_tokens_per_batch=4096, shard_mb=1.0, check_samples=samples, check_answers=True,
                          engine_options=options, device="cpu", log=lambda m: None)
        return check.CheckRecord.from_dict(summary["check"])
    except check.CheckFailed as failed:
        return failed.record


def row(name: str, what: str, r: check.CheckRecord) -> str:
    a = r.answers
    self_ok = not [p for p in r.problems if p not in check.answer_problems(a)]
    gate = "passes" if not check.answer_problems(a) else "FAILS"
    return (f"| {name} | {what} | {r.engine} | {'passes' if self_ok else 'FAILS'} "
            f"({r.logprob_mean_abs_err:.3f}) | {a['tokens']} | {a['mean_nll']:.2f} | {a['argmax_agreement']:.3f} "
            f"| {gate} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", nargs="+", default=["tiny", "kimi-mini", "kimi-mini-bf16"], choices=sorted(TARGETS))
    ap.add_argument("--samples", type=int, default=6, help="answers sampled and checked per target")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--scale", type=float, default=30.0, help="noise on the perturbed weight, times its RMS")
    ap.add_argument("--weight", help="the weight to perturb instead of the target's own choice (TARGETS)")
    ap.add_argument("--step-tokens", type=int, default=64,
                    help="vLLM's max_num_batched_tokens where it prefills in chunks (tiny)")
    args = ap.parse_args(argv)
    b = check.ANSWERS
    print(f"gate: mean NLL <= {b.max_nll} nat, argmax agreement >= {b.min_agreement}, >= {b.min_tokens} tokens; "
          f"perturbed: noise {args.scale:g} x RMS on one weight")
    print("| target | weights | engine | self-consistency (mean error) | answer tokens | mean NLL (nat) | "
          "argmax agreement | gate |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="gate-figures-") as tmp:
        tmp = Path(tmp)
        for name in args.targets:
            backend, weight, chunked = TARGETS[name]
            step = args.step_tokens if chunked else None
            weight = args.weight or weight
            target = resolve_target(name, log=lambda m: None)
            tokens = tmp / name / "chat.jsonl"
            tokens.parent.mkdir(parents=True)
            own_answers(target, tokens, args.samples, args.max_new_tokens, seed=0)
            clean = measure(target, backend, tokens, tmp / name / "clean", args.samples, step)
            print(row(name, "as built", clean), flush=True)
            copy = perturbed_copy(target, weight, args.scale, tmp / name / "perturbed-target")
            bad = measure(copy, backend, tokens, tmp / name / "perturbed", args.samples, step)
            print(row(name, f"{weight.split('model.', 1)[-1]} + noise", bad), flush=True)
            shutil.rmtree(tmp / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
