"""Stage 04 on vLLM: does capturing the features cost the engine much, and is the format lean?

Rows, measured in one run over the same samples, each engine started once (start-up not counted):
  plain prefill      vLLM alone, each sample a prompt with max_tokens=1, no capture: the limit
  capture bf16       `hidden.stage.extract(target_backend="vllm")` end to end: the engine's capture, the files
                     it hands over, the final norm, shard writes (fsync'd), index
  capture fp8        the same with fp8 storage
Each round runs every row once, back to back; a row's ratio is the median over rounds of its speed
over the plain prefill's in the same round (the machine is shared and noisy).
Targets: capture >= 0.8x the plain prefill; bytes on disk <= 1.02x the raw bytes of the tensors a
shard holds (aux, last, scales, input_ids, loss_mask, offsets).

  .venv/bin/python bench/bench_hidden_vllm.py [--target tiny] [--tokens 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_hidden import print_disk_table, raw_tensor_bytes, synthetic_tokens

from draftsmith import layers
from draftsmith.config import HiddenConfig
from draftsmith.hidden.stage import extract
from draftsmith.hidden.outputs import HiddenShards
from draftsmith.targets.checkpoint import resolve_target, target_config
from draftsmith.targets.vllm import VllmCapture, vllm_env
from draftsmith.targets.vllm_capture import engine_kwargs
from draftsmith.tokens import read_tokens


def plain_engine_child(kwargs: dict, prompts_file: str) -> None:
    """In the child: a vLLM engine without the capture; each line on stdin runs every prompt once
    and answers the seconds it took."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM prints to stdout too: keep that out of the answers
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {k: v for k, v in kwargs.items() if k not in ("speculative_config", "kv_transfer_config")}
    llm = LLM(**kwargs)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(Path(prompts_file).read_text())]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    print("ready", file=answers, flush=True)
    for _ in sys.stdin:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        print(time.perf_counter() - t0, file=answers, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens-per-batch", type=int, default=8192)
    ap.add_argument("--shard-mb", type=float, default=8.0)
    ap.add_argument("--plain-child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.plain_child:
        return plain_engine_child(json.loads(a.plain_child[0]), a.plain_child[1])

    target = resolve_target(a.target)
    cfg = target_config(target)
    ids = layers.default_layer_ids(cfg["num_hidden_layers"])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        synthetic_tokens(tmp / "bench.jsonl", cfg["vocab_size"], a.tokens)
        samples = read_tokens([tmp / "bench.jsonl"])
        tokens = sum(len(s) for s in samples)
        longest = max(len(s) for s in samples)
        (tmp / "prompts.json").write_text(json.dumps([s.input_ids.tolist() for s in samples]))
        print(f"target {target.name}: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers; "
              f"{len(samples)} samples, {tokens:,} tokens; starting two vLLM engines (minutes on a small CPU)")

        kw = engine_kwargs(str(target), [k + 1 for k in ids] + [cfg["num_hidden_layers"]], max_model_len=longest + 1)
        with open(tmp / "plain.log", "w") as log:
            plain = subprocess.Popen([sys.executable, __file__, "--plain-child", json.dumps(kw), str(tmp / "prompts.json")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     env=vllm_env())
        capture = VllmCapture(target, ids, max_model_len=longest + 1, log_file=tmp / "capture.log", log=lambda m: None)
        try:
            if plain.stdout.readline().strip() != "ready":
                raise SystemExit(f"the plain engine failed:\n{(tmp / 'plain.log').read_text()[-3000:]}")

            def plain_round() -> float:
                plain.stdin.write("go\n")
                plain.stdin.flush()
                return float(plain.stdout.readline())

            times: dict[str, list[float]] = {"plain prefill": [], "capture bf16": [], "capture fp8": []}
            disk: dict[str, tuple[int, int]] = {}
            plain_round()  # warm-up
            for r in range(a.rounds):
                times["plain prefill"].append(plain_round())
                for dtype in ("bf16", "fp8"):
                    out = tmp / f"{dtype}-{r}"
                    s = extract(target, [tmp / "bench.jsonl"], out,
                                HiddenConfig(layer_ids=ids, hidden_dtype=dtype, target_backend="vllm",
                                             max_tokens_per_batch=a.max_tokens_per_batch, shard_mb=a.shard_mb),
                                capture=capture, log=lambda m: None)
                    assert s["tokens_extracted"] == tokens
                    times[f"capture {dtype}"].append(s["extract_s"])
                    disk[dtype] = (s["bytes"], raw_tensor_bytes(HiddenShards(out)))
        finally:
            capture.close()
            plain.stdin.close()
            plain.wait()

    base = times["plain prefill"]
    print(f"\n{'':20s}{'tokens/s':>10s}{'vs plain':>10s}   (target >= 0.80; medians of {a.rounds} rounds)")
    for name, ts in times.items():
        ratio = statistics.median(p / t for p, t in zip(base, ts))
        print(f"{name:20s}{tokens / statistics.median(ts):10,.0f}{ratio:10.2f}")
    H = cfg["hidden_size"]
    print_disk_table(disk, tokens, H)


if __name__ == "__main__":
    main()
