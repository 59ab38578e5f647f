"""Stage 03 speed: rebuilding ids vs the limit, a bare batched `tokenizer(texts)` on the same texts.

The texts are whole conversations as the target saw them (prompt with its template, reasoning,
`</think>`, answer, end-of-turn), made of standard-library docstrings at about the shape of a
reasoning model's responses. Each method runs `--repeat` times, interleaved, best time kept (the
machine is shared). Rows:
  tokenizer(texts)         the limit: one batched transformers call on the full texts
  backend.encode_batch     the Rust tokenizer alone, no transformers wrapper (for scale)
  Reconstructor.rebuild    what stage 03 does per batch: render the template, two batched calls,
                           assemble prompt + reasoning + </think> + answer + end-of-turn
  + checks + JSON          rebuild, per-sample checks and the output line, as the stage writes it
Target: rebuild >= 0.7x the limit, so 60M tokens take minutes.

    .venv/bin/python bench/bench_tokens.py [--samples 400] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import time

from draftsmith import tokens
from draftsmith.target.checkpoint import resolve_target
from draftsmith.target.corpus import stdlib_docstrings
from draftsmith.tokens import Response, Thresholds
from draftsmith.tokens.outputs import check_row, ids_line


def make_samples(n: int, seed: int = 0) -> list[Response]:
    docs = [d for _, _, d in stdlib_docstrings(3000)]
    rng = random.Random(seed)

    def text(chars: int) -> str:
        out = []
        while sum(map(len, out)) < chars:
            out.append(rng.choice(docs))
        return "\n\n".join(out)

    samples = []
    for i in range(n):
        messages = [{"role": "user", "content": text(rng.randint(200, 1500))}]
        if i % 4 == 0:  # some multi-turn prompts
            messages = [{"role": "system", "content": "Be precise."}, messages[0],
                        {"role": "assistant", "content": text(400)}, {"role": "user", "content": text(200)}]
        samples.append(Response(f"s{i}", "bench", "P", f"g{i}", messages, text(rng.randint(2000, 8000)),
                                text(rng.randint(500, 3000)), "stop", None, None, None, False, False))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256, help="samples per rebuild call (the stage's batch)")
    args = ap.parse_args()

    rec = tokens.load_reconstructor(str(resolve_target("tiny-test")))
    samples = make_samples(args.samples)
    layout = rec.layout
    full = [rec.prompt_text(s.messages) + s.reasoning + layout.think_end + s.content + layout.end_of_turn
            for s in samples]
    tok, backend = rec.tokenizer, rec.tokenizer.backend_tokenizer
    batches = [samples[i:i + args.batch] for i in range(0, len(samples), args.batch)]

    def limit():
        return sum(map(len, tok(full, add_special_tokens=False)["input_ids"]))

    def rust():
        return sum(len(e.ids) for e in backend.encode_batch_fast(full, add_special_tokens=False))

    def rebuild():
        return sum(len(b.prompt_ids) + len(b.output_ids) for batch in batches for b in rec.rebuild(batch))

    def stage():
        n = 0
        for batch in batches:
            for r, b in zip(batch, rec.rebuild(batch)):
                row = check_row(r, b, tokens.check(r, b, layout, Thresholds()))
                line = ids_line(b)
                n += len(b.prompt_ids) + len(b.output_ids) + 0 * len(line) * len(row)
        return n

    methods = {"tokenizer(texts)  [limit]": limit, "backend.encode_batch": rust,
               "Reconstructor.rebuild": rebuild, "+ checks + JSON": stage}
    best = {name: float("inf") for name in methods}
    counts = {}
    for _ in range(args.repeat):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            counts[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    n_tokens = counts["tokenizer(texts)  [limit]"]
    assert len(set(counts.values())) == 1, f"methods disagree on the token count: {counts}"
    lim = n_tokens / best["tokenizer(texts)  [limit]"]
    print(f"{len(samples)} samples, {n_tokens:,} tokens (prompt + response), batch {args.batch}, "
          f"best of {args.repeat}")
    print(f"{'method':28s} {'seconds':>8s} {'tokens/s':>12s} {'vs limit':>9s}")
    for name in methods:
        rate = n_tokens / best[name]
        print(f"{name:28s} {best[name]:8.2f} {rate:12,.0f} {rate / lim:8.2f}x")
    r = n_tokens / best["Reconstructor.rebuild"]
    print(f"rebuild at {r / lim:.2f}x the limit (target >= 0.70x): 60M tokens in {60e6 / r / 60:.1f} min on this machine")


if __name__ == "__main__":
    main()
