"""Stage 06's decoding loop on CPU: one intra-op thread against all of them, in one run.

Speculative decoding runs one sequence at a time, so on a small target every matrix product is
tiny and thread start-up dominates; stage 06 decodes with one thread (`evaluate.cpu_threads`).
This prints, for no drafter and prompt lookup on the tiny-test target, the seconds per decode with
1 thread and with torch's default, and their ratio.

    .venv/bin/python bench/bench_evaluate.py [--target tiny-test] [--prompts 4] [--tokens 48]
"""

from __future__ import annotations

import argparse
import time

import torch

from draftsmith import evaluate as ev
from draftsmith.hidden import load_target
from draftsmith.target import chat_examples, make_tokenizer, resolve_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tiny-test")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    tok = make_tokenizer()
    prompts = [tok.apply_chat_template(c[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
               for c in chat_examples(seed=7)[:args.prompts]]
    target = ev.Target(load_target(resolve_target(args.target, log=lambda *a: None), "cpu"))
    default = torch.get_num_threads()
    rows = []
    for name, make in (("no drafter", lambda: None), ("prompt lookup", ev.PromptLookup)):
        times = {}
        for threads in (1, default):
            with ev.cpu_threads(threads, "cpu"):
                ev.decode(target, make(), prompts[0], 3, 8)   # warm-up
                t0 = time.perf_counter()
                for p in prompts:
                    ev.decode(target, make(), p, 3, args.tokens)
                times[threads] = (time.perf_counter() - t0) / len(prompts)
        rows.append((name, times[1], times[default], times[default] / times[1]))
    print(f"target {args.target}, {args.prompts} prompts x {args.tokens} tokens, k = 3; torch default "
          f"threads = {default}")
    print(f"{'method':<16}{'1 thread s/decode':>20}{f'{default} threads s/decode':>22}{'ratio':>8}")
    for name, one, many, ratio in rows:
        print(f"{name:<16}{one:>20.3f}{many:>22.3f}{ratio:>7.2f}x")


if __name__ == "__main__":
    main()
