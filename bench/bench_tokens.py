"""Stage 03 speed: rebuilding ids vs a bare encode of the same texts, for both kinds of tokenizer.

The texts are whole conversations as the target saw them (prompt with its template, reasoning,
`</think>`, answer, end-of-turn), made of standard-library docstrings at about the shape of a
reasoning model's responses; every fourth answer ends in a Kimi-style tool-call section (returned
as text: its markers are single ids for the Kimi-style tokenizer, text for the fast one). Two targets in one run: the built-in `tiny-test` (a fast tokenizer,
tokenizers' Rust BPE) and a Kimi-style checkpoint (remote-code tokenizer over tiktoken:
`--kimi PATH`, a checkpoint folder; default: the tokenizer files of
`draftsmith.targets.kimi_mini.write_tokenizer_files` written to a temporary folder). Each method runs `--repeat` times, interleaved, best time kept (the machine is
shared). Rows per target:
  bare encode              the reference: one batched call of the tokenizer library itself on the
                           full texts (tokenizers `encode_batch_fast` / tiktoken `encode_batch`)
  tokenizer(...)           the transformers tokenizer on the same texts (fast: one batched call;
                           Kimi: its own `encode`, one text at a time, as engines call it)
  Reconstructor.rebuild    what stage 03 does per batch: render the template, two batched calls,
                           assemble prompt + reasoning + </think> + answer + end-of-turn
  + checks + JSON          rebuild, per-sample checks and the output line, as the stage writes it
Goals: rebuild >= 0.9x the bare encode with the Kimi-style tokenizer, >= 0.85x with the fast one.

    .venv/bin/python bench/bench_tokens.py [--samples 400] [--repeat 3] [--kimi PATH]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from draftsmith import parameters, tokens
from draftsmith.targets.checkpoint import resolve_target
from draftsmith.targets.corpus import stdlib_docstrings
from draftsmith.tokens import Response, Thresholds
from draftsmith.tokens.outputs import check_row, ids_line


SECTION = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>"
           '{"query": "os.path.join"}<|tool_call_end|><|tool_calls_section_end|>')


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
        answer = text(rng.randint(500, 3000)) + (SECTION if i % 4 == 1 else "")
        samples.append(Response(f"s{i}", "bench", "P", f"g{i}", messages, text(rng.randint(2000, 8000)),
                                answer, "stop", None, None, None, False, False))
    return samples


def kimi_reconstructor(folder: str | None, tmp: str) -> tokens.Reconstructor:
    """Stage 03's rebuild over a Kimi-style tokenizer: the one in `folder`, or our tokenizer files
    written to `tmp` (the rebuild needs nothing else of a checkpoint)."""
    from transformers import AutoTokenizer

    from draftsmith.targets.kimi_mini import write_tokenizer_files

    if folder is None:
        folder = Path(tmp) / "kimi-tokenizer"
        write_tokenizer_files(folder)
    return tokens.Reconstructor(AutoTokenizer.from_pretrained(folder, trust_remote_code=True), source=str(folder))


def methods(rec, samples: list[Response], batch: int) -> dict:
    """name -> a function returning the tokens it encoded, for one target."""
    layout = rec.layout
    full = [rec.prompt_text(s.messages) + s.reasoning + layout.think_end + s.content + layout.end_of_turn
            for s in samples]
    tok = rec.tokenizer
    batches = [samples[i:i + batch] for i in range(0, len(samples), batch)]

    if rec.encoder.kind == "fast":
        backend = tok.backend_tokenizer

        def bare():
            return sum(len(e.ids) for e in backend.encode_batch_fast(full, add_special_tokens=False))

        def wrapped():
            return sum(map(len, tok(full, add_special_tokens=False)["input_ids"]))
        names = ("tokenizers encode_batch_fast [bare]", "tokenizer(texts)")
    else:
        enc = tok.model

        def bare():
            return sum(map(len, enc.encode_batch(full, allowed_special="all")))

        def wrapped():
            return sum(len(tok.encode(t)) for t in full)
        names = ("tiktoken encode_batch [bare]", "tokenizer.encode per text")

    def rebuild():
        return sum(len(b.prompt_ids) + len(b.output_ids) for bt in batches for b in rec.rebuild(bt))

    declared = Thresholds(*(parameters.declaration(n).default
                            for n in ("sample_tolerance", "min_clean_rate", "max_relative_error")))

    def stage():
        n = 0
        for bt in batches:
            for r, b in zip(bt, rec.rebuild(bt)):
                row = check_row(r, b, tokens.check(r, b, layout, declared))
                line = ids_line(b)
                n += len(b.prompt_ids) + len(b.output_ids) + 0 * len(line) * len(row)
        return n

    return {names[0]: bare, names[1]: wrapped, "Reconstructor.rebuild": rebuild, "+ checks + JSON": stage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256, help="samples per rebuild call (the stage's batch)")
    ap.add_argument("--kimi", help="a Kimi-style checkpoint folder (default: our tokenizer files in a temp folder)")
    args = ap.parse_args()

    samples = make_samples(args.samples)
    with tempfile.TemporaryDirectory() as tmp:
        targets = {"Kimi-style (tiktoken)": kimi_reconstructor(args.kimi, tmp),
                   "tiny-test (fast)": tokens.Reconstructor.from_pretrained(str(resolve_target("tiny-test")))}
        table = {t: methods(rec, samples, args.batch) for t, rec in targets.items()}
        best = {(t, m): float("inf") for t in table for m in table[t]}
        cpu = dict(best)
        counts: dict = {}
        for _ in range(args.repeat):
            for t, ms in table.items():
                for m, fn in ms.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    counts[t, m] = fn()
                    best[t, m] = min(best[t, m], time.perf_counter() - t0)
                    cpu[t, m] = min(cpu[t, m], time.process_time() - c0)
    # CPU seconds (all threads of this process) move less than wall seconds on a shared machine
    print(f"{len(samples)} samples, batch {args.batch}, best of {args.repeat}")
    print(f"{'target':22s} {'method':36s} {'tokens':>10s} {'wall s':>7s} {'tokens/s':>11s} {'vs bare':>8s} "
          f"{'cpu s':>6s} {'vs bare':>8s}")
    goals = {"Kimi-style (tiktoken)": 0.9, "tiny-test (fast)": 0.85}
    for t, ms in table.items():
        n = {counts[t, m] for m in ms}
        assert len(n) == 1, f"{t}: methods disagree on the token count: { {m: counts[t, m] for m in ms} }"
        n_tokens = n.pop()
        first = next(iter(ms))
        for m in ms:
            rate = n_tokens / best[t, m]
            print(f"{t:22s} {m:36s} {n_tokens:10,d} {best[t, m]:7.2f} {rate:11,.0f} "
                  f"{best[t, first] / best[t, m]:7.2f}x {cpu[t, m]:6.2f} {cpu[t, first] / cpu[t, m]:7.2f}x")
        m = "Reconstructor.rebuild"
        print(f"{t:22s} rebuild at {best[t, first] / best[t, m]:.2f}x (wall) / {cpu[t, first] / cpu[t, m]:.2f}x "
              f"(cpu) the bare encode (goal >= {goals[t]:.2f}x): 60M tokens in "
              f"{60e6 / (n_tokens / best[t, m]) / 60:.1f} min on this machine")


if __name__ == "__main__":
    main()
