"""Stage 04's answer gates on faults planted inside the engine: the old bounds, the new reference gate, its floor.

For each built-in target, its own answers are sampled first (transformers, temperature 1, top_p 1) to
prompts of the demo's chat data and written as a stage-03 tokens file; their per-token logprobs are
computed by float32 transformers on the clean target, as the emulator's providers return them
(`emulator.model.model_logprobs`), and written as stage 01's logprobs.jsonl. Then stage 04 runs on them the way a
user runs it (`extract`, the check on, `check_answers` on, the reference given) on three copies of
the target's folder: as built, its middle layer's MLP zeroed (down_proj weight x 0), and a 15% error
in that MLP's output (down_proj x 0.85). Each row: what the old bounds (mean NLL <= 7 nat, argmax
agreement >= 0.01) say, what the fallback (`check.ANSWERS`) says, and the reference gate's mean and
p95 |engine - reference| against `check.REFERENCE`. The clean row is the gate's noise floor (the
engine's bf16 against float32).

    .venv/bin/python bench/gate_figures.py                      # tiny-test and tiny (the demo's), vLLM
    .venv/bin/python bench/gate_figures.py --targets tiny-test --samples 4
    .venv/bin/python bench/gate_figures.py --check-time --targets tiny   # the seconds the reference adds
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
from draftsmith.config import HiddenConfig
from draftsmith.hidden import check, outputs
from draftsmith.hidden.stage import extract
from draftsmith.targets.checkpoint import load_target, load_tokenizer, resolve_target, target_config

REPO = Path(__file__).resolve().parents[1]
# target -> backend (vLLM's CPU build runs the tiny targets in bf16: the engine the gate judges; the kimi-mini
# targets' middle layer is an MoE layer, with no dense MLP to plant these faults in)
TARGETS = {"tiny": "vllm", "tiny-test": "vllm"}
FAULTS = {"as built": None, "middle-layer MLP zeroed": 0.0, "middle-layer MLP output x 0.85": 0.85}
OLD = check.AnswerBounds(max_nll=7.0, min_agreement=0.01, min_tokens=32)  # the bounds before issue 51
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


def own_answers(target: Path, tokens: Path, reference: Path, n: int, max_new_tokens: int, seed: int) -> int:
    """Sample the target's own answers to `n` prompts into a stage-03 tokens file, and their float32
    logprobs (the emulator's providers') into a logprobs.jsonl; returns the response tokens."""
    from draftsmith.emulator.model import model_logprobs
    from draftsmith.encoding import Encoding

    tok = load_tokenizer(target, trust_remote_code=True)
    enc = Encoding(tok)
    model = load_target(target, "cpu", True)
    torch.manual_seed(seed)
    rows, refs = [], []
    for i, turns in enumerate(prompts(n)):
        ids = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id or 0)
        resp = out[0, len(ids):].tolist()
        rows.append({"sample_id": f"chat-{i}", "dataset": "chat", "provider": "self", "input_ids": ids + resp,
                     "loss_mask": [0] * len(ids) + [1] * len(resp), "output_ids": resp, "excluded": False})
        refs.append({"provider": "float32 transformers", "messages": turns, "tokens": enc.decode_each(resp),
                     "logprobs": model_logprobs(model, ids, resp, 0)[0], "prompt_ids": ids, "output_ids": resp})
    tokens.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reference.write_text("".join(json.dumps(r) + "\n" for r in refs))
    return sum(len(r["output_ids"]) for r in rows)


def middle_mlp(target: Path) -> str:
    """The down projection of the middle layer's MLP (a dense layer's)."""
    cfg = target_config(target)
    text = cfg.get("text_config") or cfg
    prefix = "language_model.model" if "text_config" in cfg else "model"
    layer = int(text["num_hidden_layers"]) // 2
    return f"{prefix}.layers.{layer}.mlp.down_proj.weight"


def planted_copy(target: Path, weight: str, factor: float, into: Path) -> Path:
    """A copy of the target's folder with `weight` multiplied by `factor` (0: zeroed)."""
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
        tensors[weight] = (tensors[weight].float() * factor).to(tensors[weight].dtype)
        save_file(tensors, str(f), metadata=meta)
        return into
    raise KeyError(f"{weight} is in none of {[f.name for f in files]}")


def measure(target: Path, backend: str, tokens: Path, reference: Path | None, out: Path,
            samples: int) -> outputs.CheckRecord:
    """Stage 04 on `tokens` with the check, `check_answers` and the reference (None: without): the check's record."""
    cfg = target_config(target)
    n_layers = int((cfg.get("text_config") or cfg)["num_hidden_layers"])
    try:
        summary = extract(target, [tokens], out, HiddenConfig(target_backend=backend,
                                                              layer_ids=layers.default_layer_ids(n_layers),
                                                              max_tokens_per_batch=4096, shard_mb=1.0,
                                                              check_samples=samples, check_answers=True,
                                                              trust_remote_code=True, device="cpu"),
                          reference_logprobs=str(reference) if reference else None, log=lambda m: None)
        return outputs.CheckRecord.from_dict(summary["check"])
    except check.CheckFailed as failed:
        return failed.record


def verdict(ok: bool) -> str:
    return "passes" if ok else "FAILS"


def row(name: str, what: str, r: outputs.CheckRecord) -> str:
    a, ref = r.answers, r.reference
    old = a["mean_nll"] <= OLD.max_nll and a["argmax_agreement"] >= OLD.min_agreement
    fallback = a["mean_nll"] <= check.ANSWERS.max_nll and a["argmax_agreement"] >= check.ANSWERS.min_agreement
    self_ok = not [p for p in r.problems if p not in check.reference_problems(ref) + check.answer_problems(a)]
    return (f"| {name} | {what} | {verdict(self_ok)} | {a['tokens']} | {a['mean_nll']:.3f} "
            f"| {a['argmax_agreement']:.3f} | {verdict(old)} | {verdict(fallback)} | {ref['tokens']} | {ref['mean_abs_diff']:.4f} "
            f"| {ref['p95_abs_diff']:.4f} | {verdict(not check.reference_problems(ref))} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", nargs="+", default=["tiny-test", "tiny"], choices=sorted(TARGETS))
    ap.add_argument("--samples", type=int, default=6, help="answers sampled per target (all in the reference)")
    ap.add_argument("--check-samples", type=int, default=2, help="stage 04's check_samples (the own-answer figures)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--check-time", action="store_true",
                    help="instead: the check's seconds on the clean target without and with the reference")
    args = ap.parse_args(argv)
    if args.check_time:
        return check_time(args)
    b, ref = check.ANSWERS, check.REFERENCE
    print(f"old bounds: mean NLL <= {OLD.max_nll} nat, argmax agreement >= {OLD.min_agreement}; fallback "
          f"(check.ANSWERS): <= {b.max_nll} nat, >= {b.min_agreement}; reference gate (check.REFERENCE): mean "
          f"|engine - float32 reference| <= {ref.mean_abs} nat, p95 <= {ref.p95_abs}. The clean rows are the floor.")
    print("| target | engine weights | agrees with itself | answer tokens | mean NLL (nat) | argmax agreement | "
          "old bounds | fallback | reference tokens | mean abs diff (nat) | p95 abs diff (nat) | reference gate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="gate-figures-") as tmp:
        tmp = Path(tmp)
        for name in args.targets:
            target = resolve_target(name, log=lambda m: None)
            here = tmp / name
            here.mkdir(parents=True)
            tokens, reference = here / "chat.jsonl", here / "logprobs.jsonl"
            own_answers(target, tokens, reference, args.samples, args.max_new_tokens, seed=0)
            weight = middle_mlp(target)
            for what, factor in FAULTS.items():
                copy = target if factor is None else planted_copy(target, weight, factor, here / f"copy-{factor}")
                r = measure(copy, TARGETS[name], tokens, reference, here / f"out-{factor}", args.check_samples)
                print(row(name, what if factor is None else f"{what} ({weight.split('model.', 1)[-1]})", r), flush=True)
            shutil.rmtree(here)
    return 0


def check_time(args) -> int:
    """The time the reference adds to stage 04's check: the check's own seconds on the clean target,
    without the reference and with it, in one run."""
    print("| target | check without reference (s) | with reference (s) | reference tokens | ratio |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="gate-time-") as tmp:
        for name in args.targets:
            target = resolve_target(name, log=lambda m: None)
            here = Path(tmp) / name
            here.mkdir(parents=True)
            tokens, reference = here / "chat.jsonl", here / "logprobs.jsonl"
            own_answers(target, tokens, reference, args.samples, args.max_new_tokens, seed=0)
            without = measure(target, TARGETS[name], tokens, None, here / "without", args.check_samples)
            held = measure(target, TARGETS[name], tokens, reference, here / "with", args.check_samples)
            print(f"| {name} | {without.seconds:.2f} | {held.seconds:.2f} | {held.reference['tokens']} | "
                  f"{held.seconds / without.seconds:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
