"""What the rehearsal feeds the real job: prompt files shaped like its datasets, and the
Kimi-K2.5 endpoints the local emulator plays.

Six prompt files, one per kind of dataset a drafter is trained on: `code` (a task and a piece of
Python source), `math` (a word problem), `chat` (one question, ShareGPT form), `multiturn` (a
system prompt and several earlier turns), `longdoc` (a long document to summarise), `writing` (a
short creative brief). Their text comes from the standard library's source and docstrings
(offline, deterministic for the seed); only their shape matters to the synthetic backend, which
answers from the same corpus: prompt lengths from ~60 to ~3000 tokens, both input formats.

The catalogue: Kimi-K2.5 endpoints with 2026's prices ($0.40-0.60/M in, $1.90-2.50/M out), a
per-stream speed and time to first token each, a concurrency capacity beyond which the provider
answers 429 (some with Retry-After), the usual background faults (429/5xx before the first
token; errors inside a 200, cut and hung connections after it, billed or not, as OpenRouter
documents), and the endpoints stage 01 must keep out: two fp4/nvfp4 (below the native int4), one
`unknown`, one down, and one cheap int4 endpoint that secretly serves another model (the fidelity
probe's job). No provider quirk that stage 03 would flag: the rehearsal's validation must come
out clean, as the reference run's did.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path

from draftsmith.emulator.backends import corpus_sentences

DATASETS = ("code", "math", "chat", "multiturn", "longdoc", "writing")

# Kimi-K2.5 as a reasoning model: most of a response is reasoning; lengths are lognormal around
# this median (the synthetic backend's shape), so ~1% of responses run into max_tokens = 8192.
MEDIAN_RESPONSE_TOKENS = 2500
REASONING_FRACTION = 0.7

_BACKGROUND = {"rate_limit": 0.01, "bad_gateway": 0.004, "unavailable": 0.004, "timeout": 0.002,
               "overloaded": 0.002, "error_200": 0.004, "mid_stream": 0.004, "empty_200": 0.003,
               "hang": 0.0005, "cut_after_billing": 0.0005}


def _endpoint(slug, name, quant, p_in, p_out, ttft, tok_s, capacity, retry_after=None, **extra) -> dict:
    return {"slug": slug, "name": name, "quantization": quant, "prompt_price": p_in, "completion_price": p_out,
            "latency_s": {"median": ttft, "sigma": 0.4}, "tokens_per_s": {"median": tok_s, "sigma": 0.25},
            "capacity": capacity, "retry_after_s": retry_after, "faults": dict(_BACKGROUND), **extra}


def catalogue() -> list[dict]:
    """The emulator's `providers` list: Kimi-K2.5 endpoints (prices USD per million tokens)."""
    E = _endpoint
    return [
        E("moonshotai", "Moonshot AI", "int4", 0.60, 2.50, 1.4, 35, 500, retry_after=2),
        E("deepinfra", "DeepInfra", "int4", 0.45, 2.25, 0.8, 45, 600),
        E("parasail", "Parasail", "int4", 0.50, 2.20, 1.0, 50, 400, retry_after=1),
        E("together", "Together", "int4", 0.50, 2.30, 0.9, 55, 500),
        E("novita", "Novita", "int4", 0.55, 2.40, 1.5, 30, 300),
        E("siliconflow", "SiliconFlow", "int4", 0.50, 2.20, 2.0, 25, 300),
        # kept out by stage 01: below native precision, unknown, down, answers like another model
        E("deepinfra", "DeepInfra", "fp4", 0.40, 1.90, 0.7, 70, 400),
        E("fireworks", "Fireworks", "nvfp4", 0.60, 2.50, 0.5, 110, 600),
        E("atlas-cloud", "AtlasCloud", "unknown", 0.45, 2.10, 1.2, 40, 300),
        E("baseten", "BaseTen", "fp4", 0.60, 2.50, 0.6, 90, 300, status=-2, uptime_last_30m=12.0),
        E("chutes", "Chutes", "int4", 0.40, 1.90, 2.5, 25, 600, uptime_last_30m=97.0,
          quirks={"perturbed_model": 0.5}),
    ]


def emulator_config(time_scale: float, credits: float, admin_key: str, seed: int = 0) -> dict:
    """The emulator config of the rehearsal: the catalogue above, the synthetic backend, a clock
    `time_scale` times the real one. Waits the emulator counts in real seconds (a hung
    connection's silence) are scaled here so that they keep their simulated length."""
    return {"backend": "synthetic", "target_model_path": None, "seed": seed, "time_scale": time_scale,
            "providers": catalogue(), "credits": credits, "admin_key": admin_key,
            "synthetic_tokens": MEDIAN_RESPONSE_TOKENS, "synthetic_reasoning_fraction": REASONING_FRACTION,
            "hang_s": max(1.0, 300.0 * time_scale)}


# --- prompt files ---------------------------------------------------------------------------------

def _python_snippets(limit: int = 3000) -> list[str]:
    """Source of top-level functions of the standard library, 4-60 lines each."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno <= 60:
                out.append("\n".join(lines[node.lineno - 1:node.end_lineno]))
                if len(out) >= limit:
                    return out
    return out


_CODE_TASKS = ["Find the bug in this function and fix it.", "Add type hints and a docstring to this function.",
               "Write pytest tests for this function, covering its edge cases.",
               "Rewrite this function to be faster; explain the complexity before and after.",
               "Port this function to Rust, keeping its behaviour.", "Explain what this function does, line by line."]
_WRITING = ["a short story", "a sonnet", "a product description", "a cover letter", "a eulogy", "a limerick",
            "a blog post", "a speech", "a fable", "a dialogue"]


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 50)
    return rng.choice([
        f"A train leaves at {a % 12 + 1}:00 travelling {b} km/h; a second leaves {c} minutes later at {b + c} km/h. "
        f"When does the second catch up? Show your reasoning.",
        f"Find all integers n with 1 <= n <= {a * 10} such that n^2 + {b} is divisible by {c}.",
        f"Prove that the sum of the first {a} odd numbers is a perfect square, then compute it.",
        f"A bag holds {b} red and {c} blue balls. Three are drawn without replacement. What is the probability "
        f"that exactly two are red? Give an exact fraction.",
        f"Solve for x: {a}x^2 - {b}x + {c} = 0, and say whether the roots are real.",
        f"How many ways can {c % 9 + 4} people sit around a round table if two of them refuse to sit together?"])


def _prompt(kind: str, rng: random.Random, sentences: list[str], snippets: list[str]) -> dict:
    def text(n: int) -> str:
        return " ".join(rng.choice(sentences) for _ in range(n))

    if kind == "code":
        return {"messages": [{"role": "user", "content": f"{rng.choice(_CODE_TASKS)}\n\n```python\n"
                                                         f"{rng.choice(snippets)}\n```"}]}
    if kind == "math":
        return {"messages": [{"role": "user", "content": _math(rng)}]}
    if kind == "chat":  # ShareGPT form
        return {"conversations": [{"from": "human", "value": f"{text(rng.randint(1, 4))} Can you explain this?"}]}
    if kind == "multiturn":
        msgs = [{"role": "system", "content": "You are a careful assistant. " + text(2)}]
        for _ in range(rng.randint(2, 5)):
            msgs += [{"role": "user", "content": text(rng.randint(1, 3)) + "?"},
                     {"role": "assistant", "content": text(rng.randint(3, 12))}]
        msgs.append({"role": "user", "content": "Given all that, " + text(1).lower()})
        return {"messages": msgs}
    if kind == "longdoc":
        return {"messages": [{"role": "user", "content": "Summarise the following document in five bullet points, "
                                                         "then list its open questions.\n\n" + text(rng.randint(40, 160))}]}
    if kind == "writing":
        return {"messages": [{"role": "user", "content": f"Write {rng.choice(_WRITING)} about this: {text(1)}"}]}
    raise ValueError(f"unknown dataset kind {kind!r}")


def write_datasets(folder: Path, prompts_per_dataset: int, seed: int = 0) -> list[dict]:
    """One JSONL prompt file per kind under `folder`; returns their {name, path} entries. A file
    already written with the same size and seed is kept."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = folder / "datasets.json"
    entries = [{"name": k, "path": str(folder / f"{k}.jsonl")} for k in DATASETS]
    want = {"prompts_per_dataset": prompts_per_dataset, "seed": seed, "datasets": entries}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return entries
    sentences, snippets = corpus_sentences(), _python_snippets()
    for k, e in zip(DATASETS, entries):
        rng = random.Random(f"{seed}|{k}")
        with open(e["path"], "w", encoding="utf-8") as f:
            for i in range(prompts_per_dataset):
                f.write(json.dumps({"id": f"{k}-{i:06d}", **_prompt(k, rng, sentences, snippets)},
                                   ensure_ascii=False) + "\n")
    stamp.write_text(json.dumps(want))
    return entries
