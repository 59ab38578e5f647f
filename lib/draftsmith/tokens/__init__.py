"""Stage 03: rebuild the exact token ids the target read and wrote, then prove them against billing.

OpenRouter returns text; EAGLE-3 training needs the ids. For each sample of
`generate/<dataset>/raw_responses.jsonl` and of each import file:
  prompt ids  the chat template with the generation prompt, tokenized the way serving engines do
              (template text through the tokenizer: a special-token string typed in a user message
              becomes that token, as it did for the target)
  output ids  reasoning, think_end, content, end_of_turn, in the template's layout
              (`templates.response_layout`). What the model wrote is encoded as plain text: a
              literal "<think>" or tool-call marker in an answer is text, never a special token.
              No end-of-turn when the response stopped on `length`.
  loss_mask   0 on every prompt token (earlier turns included), 1 on every output token
              (end-of-turn included)
Then every sample is checked against what its provider billed (prompt, completion and reasoning
tokens) and for structural faults, and every provider against the others (`analyse`): which
providers disagree, and why. Where the engine's sampled ids were saved (a local engine in stage 02,
or an import file, see `imports`), they are the truth and the text's rebuild only measures how often
the two agree. Each sample keeps its `source`; a prompt two sources answered is kept once
(`sources`). Outputs: `tokens/<dataset>.jsonl` (ids + checks), `tokens/checks/<dataset>.jsonl`
(checks of every sample, kept or not), `tokens/report.json` (per dataset, provider and source), figures.

Tokenizer calls are batched (one Rust call per batch for fast tokenizers), so 60M tokens take
minutes (bench/bench_tokens.py).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from .. import sources
from ..datasets import DatasetSpec, stable_id
from ..imports import parse_imports, source_files, to_raw
from ..paths import Run
from ..progress import Progress
from ..templates import Layout, load_chat_template, response_layout
from .outputs import Sample, read_tokens, token_files  # noqa: F401  (stage 04 reads through these)

FORMAT_VERSION = 2

# ---- text -> ids ------------------------------------------------------------------------------


class Encoder:
    """Batched text -> ids, two ways. `template`: added-token strings become their tokens (the
    template's markup; prompts as engines tokenize them). `plain`: every character is text.

    Fast tokenizers: one Rust batch call each; `plain` uses a copy of the tokenizer with its added
    tokens removed (the tokenizer's own `split_special_tokens` still matches non-special added
    tokens such as DeepSeek's `<think>` and tool-call markers). Kimi's tiktoken tokenizer (remote
    code) takes `allow_special_tokens`. Any other slow tokenizer: `split_special_tokens`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.kind = "fast" if backend is not None else (
            "tiktoken" if "allow_special_tokens" in inspect.signature(tokenizer.encode).parameters else "slow")
        if self.kind == "fast":
            from tokenizers import Tokenizer

            spec = json.loads(backend.to_str())
            spec["added_tokens"] = []
            self._template, self._plain = backend, Tokenizer.from_str(json.dumps(spec))

    def template(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "fast":
            return _encode_batch(self._template, texts)
        if self.kind == "tiktoken":
            return [list(self.tokenizer.encode(t, allow_special_tokens=True)) for t in texts]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def plain(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "fast":
            return _encode_batch(self._plain, texts)
        if self.kind == "tiktoken":
            return [list(self.tokenizer.encode(t, allow_special_tokens=False)) for t in texts]
        return self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _encode_batch(tok, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: no character offsets
    return [e.ids for e in encode(texts, add_special_tokens=False)]


# ---- one raw response ---------------------------------------------------------------------------


class BadLine(ValueError):
    """A raw_responses line that cannot be used; the message names the field."""


@dataclass
class Response:
    """The fields of a raw_responses line that reconstruction and checks use."""

    sample_id: str
    dataset: str
    provider: str
    generation_id: str | None
    messages: list[dict]
    reasoning: str          # "" when absent, null or empty
    content: str            # "" when null
    finish_reason: str | None
    billed_prompt: int | None
    billed_completion: int | None
    billed_reasoning: int | None
    reasoning_excluded: bool  # the request asked the provider to leave the reasoning out of the reply
    reasoning_disabled: bool  # the request turned reasoning off: the prompt closes it, the reply is the answer
    source: str = "openrouter"  # where the answer came from (see `sources`)
    imported: bool = False      # read from an import file, not from stage 02's responses
    output_ids: list[int] | None = None  # the ids the engine sampled, when it returned them: the truth
    prompt_ids: list[int] | None = None  # the prompt ids the engine read, when it returned them
    prompt: str | None = None  # the rendered prompt, once rendered

    @property
    def expects_usage(self) -> bool:
        """Whether the line should carry token counts to check against: stage 02's lines without
        saved ids (an import has no usage; saved ids are checked against the text instead)."""
        return not self.imported and self.output_ids is None

    @classmethod
    def parse(cls, row: dict, imported: bool = False) -> "Response":
        if not isinstance(row, dict):
            raise BadLine("line is not a JSON object")
        sid = row.get("sample_id")
        if not isinstance(sid, (str, int)) or isinstance(sid, bool) or sid == "":
            raise BadLine(f"field 'sample_id' must be a non-empty string, got {sid!r}")
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
            raise BadLine("field 'messages' must be a non-empty list of {role, content} objects with string values")
        texts = {}
        for key in ("reasoning", "content"):
            v = row.get(key)
            if v is not None and not isinstance(v, str):
                raise BadLine(f"field {key!r} must be a string or null, got {type(v).__name__}")
            texts[key] = v or ""
        usage = row.get("usage") or {}
        if not isinstance(usage, dict):
            raise BadLine("field 'usage' must be an object")
        counts = {}
        for key in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
            v = usage.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise BadLine(f"field 'usage.{key}' must be a non-negative integer, got {v!r}")
            counts[key] = v
        request = row.get("request") if isinstance(row.get("request"), dict) else {}
        opts = request.get("reasoning") if isinstance(request.get("reasoning"), dict) else {}
        excluded = bool(opts.get("exclude")) or request.get("include_reasoning") is False
        disabled = opts.get("enabled") is False or opts.get("effort") == "none"
        ids = {}
        for key in ("output_ids", "prompt_ids"):
            v = row.get(key)
            if v is not None and (not isinstance(v, list) or not v or not all(type(t) is int and t >= 0 for t in v)):
                raise BadLine(f"field {key!r} must be a non-empty list of non-negative token ids")
            ids[key] = v
        if ids["prompt_ids"] is not None and ids["output_ids"] is None:
            raise BadLine("field 'prompt_ids' without 'output_ids': save both or neither")
        if ids["output_ids"] is not None:  # the ids are the truth; the engine's counts are theirs
            counts = dict.fromkeys(counts)
        source = row.get("source") or "openrouter"  # stage 02 lines written before sources existed
        if not isinstance(source, str):
            raise BadLine(f"field 'source' must be a string, got {type(source).__name__}")
        return cls(str(sid), str(row.get("dataset") or ""), str(row.get("provider") or source),
                   row.get("generation_id"), msgs, texts["reasoning"], texts["content"],
                   row.get("finish_reason"), counts["prompt_tokens"], counts["completion_tokens"],
                   counts["reasoning_tokens"], excluded, disabled, source, imported,
                   ids["output_ids"], ids["prompt_ids"])


@dataclass
class Rebuilt:
    prompt_ids: list[int]
    output_ids: list[int]
    reasoning_tokens: int  # plain-text tokens of the reasoning
    text_prompt_ids: list[int] | None = None  # where the engine's ids are saved: the ids rebuilt from the text
    text_output_ids: list[int] | None = None

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def loss_mask(self) -> list[int]:
        return [0] * len(self.prompt_ids) + [1] * len(self.output_ids)


# ---- reconstruction ----------------------------------------------------------------------------


class Reconstructor:
    """Rebuilds prompt and output ids of responses through the target's tokenizer and template."""

    def __init__(self, tokenizer, chat_template: str | None = None, source: str = ""):
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise ValueError(f"tokenizer {source or ''} has no chat template; name one with chat_template_file")
        self.template_origin = "chat_template_file" if chat_template else "tokenizer"
        self.source = source
        self.layout: Layout = response_layout(self.render)
        self.encoder = Encoder(tokenizer)
        self.think_end_ids = self.encoder.template([self.layout.think_end])[0] if self.layout.thinking else []
        self.end_of_turn_ids = self.encoder.template([self.layout.end_of_turn])[0]

    @classmethod
    def from_pretrained(cls, path, chat_template_file=None, trust_remote_code: bool = False) -> "Reconstructor":
        from ..target.checkpoint import load_tokenizer

        tok = load_tokenizer(path, trust_remote_code, log=lambda *a: None)
        return cls(tok, load_chat_template(chat_template_file), source=str(path))

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_text(self, messages: list[dict]) -> str:
        return self.render(messages, True)

    def rebuild(self, responses: list[Response]) -> list[Rebuilt]:
        """Ids of a batch of responses: two batched tokenizer calls (prompts, then the texts)."""
        prompts = self.encoder.template([r.prompt if r.prompt is not None else self.prompt_text(r.messages)
                                         for r in responses])
        texts = self.encoder.plain([t for r in responses for t in (r.reasoning, r.content)])
        out = [self._assemble(r, p, texts[2 * i], texts[2 * i + 1]) for i, (r, p) in enumerate(zip(responses, prompts))]
        return [self._saved(r, b) if r.output_ids is not None else b for r, b in zip(responses, out)]

    def _saved(self, r: Response, text: Rebuilt) -> Rebuilt:
        """The engine's own ids, with the text's rebuild kept beside them for the agreement check.
        Engines differ on returning the token they stopped on: a `stop` without the end-of-turn
        gets it appended."""
        out = list(r.output_ids)
        eot = self.end_of_turn_ids
        if r.finish_reason == "stop" and out[-len(eot):] != eot:
            out += eot
        prompt = list(r.prompt_ids) if r.prompt_ids is not None else text.prompt_ids
        return Rebuilt(prompt, out, text.reasoning_tokens, text.prompt_ids, text.output_ids)

    def _assemble(self, r: Response, prompt: list[int], reasoning: list[int], content: list[int]) -> Rebuilt:
        truncated = r.finish_reason == "length"
        eot = [] if truncated else self.end_of_turn_ids
        if r.reasoning_disabled:  # the provider closed the reasoning in the prompt
            return Rebuilt(prompt + self.think_end_ids, content + eot, 0)
        out = list(reasoning)
        if self.layout.thinking:
            # With no answer the text cannot say whether the model closed its reasoning (cut off
            # or ended inside it) or gave an empty answer; the billed count can.
            closed = bool(r.content) or not truncated
            if not r.content and r.billed_completion is not None:
                if r.billed_completion == len(reasoning) + len(eot):
                    closed = False
                elif r.billed_completion == len(reasoning) + len(self.think_end_ids) + len(eot):
                    closed = True
            if closed:
                out += self.think_end_ids
        return Rebuilt(prompt, out + content + eot, len(reasoning))


@lru_cache(maxsize=2)
def load_reconstructor(path: str, chat_template_file: str | None = None, trust_remote_code: bool = False) -> Reconstructor:
    """`Reconstructor.from_pretrained`, loaded once per process (a notebook re-run, the tests)."""
    return Reconstructor.from_pretrained(path, chat_template_file, trust_remote_code)


# ---- per-sample checks ---------------------------------------------------------------------------

# What the model did rather than what its provider did: flags the sample, does not count against
# the provider (a provider that dropped the answer also shows a count mismatch).
RESPONSE_ISSUES = ("empty_content",)


@dataclass(frozen=True)
class Thresholds:
    """When a sample or a provider is flagged."""

    sample_tolerance: float = 0.01   # sample: |billed - rebuilt| > max(1, this x billed), prompt or completion
    min_clean_rate: float = 0.95     # provider: share of its samples with exact counts and no issue
    max_relative_error: float = 0.005  # provider: |sum billed - sum rebuilt| / sum billed

    def sample_ok(self, delta: int | None, billed: int | None) -> bool:
        return delta is None or abs(delta) <= max(1, self.sample_tolerance * (billed or 0))


def check(r: Response, b: Rebuilt, layout: Layout, thresholds: Thresholds) -> dict:
    """What one sample shows on its own: counts vs billing, structural issues, a first cause."""
    issues = []
    rebuilt_c, rebuilt_p = len(b.output_ids), len(b.prompt_ids)
    dc = None if r.billed_completion is None else r.billed_completion - rebuilt_c
    dp = None if r.billed_prompt is None else r.billed_prompt - rebuilt_p
    if not b.output_ids:
        issues.append("no_output")  # nothing to train on: always left out
    if r.billed_completion is None and r.expects_usage:
        issues.append("no_usage")
    if r.finish_reason not in ("stop", "length"):
        issues.append(f"finish_reason:{r.finish_reason}")
    if not r.content and r.finish_reason == "stop":
        issues.append("empty_content")
    if layout.thinking and not r.reasoning and not r.reasoning_disabled:
        if r.reasoning_excluded:
            issues.append("reasoning_excluded")
        elif (r.billed_reasoning or 0) > 0 or not thresholds.sample_ok(dc, r.billed_completion):
            issues.append("reasoning_missing")
    if (not layout.thinking or r.reasoning_disabled) and r.reasoning:
        issues.append("unexpected_reasoning")
    if any(m in r.content for m in layout.think_markers):
        issues.append("think_marker_in_content")
    if any(m in r.reasoning for m in layout.think_markers):
        issues.append("think_marker_in_reasoning")
    dr = None if r.billed_reasoning is None or not r.reasoning else r.billed_reasoning - b.reasoning_tokens
    return {
        "completion_delta": dc,
        "prompt_delta": dp,
        "reasoning_tokens": b.reasoning_tokens,
        "billed_reasoning_tokens": r.billed_reasoning,
        "reasoning_delta": dr,
        "issues": issues,
        "cause": _local_cause(issues, dc, dp, dr, r.billed_reasoning, thresholds),
        "edges": _edges(r),
        "saved_ids": _agreement(b) if r.output_ids is not None else None,
    }


def _agreement(b: Rebuilt) -> dict:
    """Saved engine ids vs the ids rebuilt from the text: whether they agree, and the length gaps
    (saved - rebuilt). A disagreement is no fault of the sample (its ids are the engine's); the
    rate says how far text-only data of the same engine could be trusted."""
    return {"output_agree": b.output_ids == b.text_output_ids,
            "output_delta": len(b.output_ids) - len(b.text_output_ids),
            "prompt_agree": b.prompt_ids == b.text_prompt_ids,
            "prompt_delta": len(b.prompt_ids) - len(b.text_prompt_ids)}


def _local_cause(issues, dc, dp, dr, billed_r, th: Thresholds) -> str | None:
    """The cause a sample shows on its own; `count_mismatch` is settled per provider (`analyse`)."""
    if dp:
        return "other_tokenizer" if dc else "prompt_template"
    if "reasoning_missing" in issues or "reasoning_excluded" in issues:
        return "dropped_reasoning"
    if dr is not None and dr > max(2, 0.05 * billed_r):
        return "truncated_reasoning"
    if dc:
        return "count_mismatch"
    return None


def _edges(r: Response) -> dict:
    """Whether each text starts/ends with whitespace (None when empty): a provider that strips
    whitespace shows none where the others show some."""
    out = {}
    for key in ("content", "reasoning"):
        t = getattr(r, key)
        out[f"{key}_lead"] = t[:1].isspace() if t else None
        out[f"{key}_trail"] = t[-1:].isspace() if t else None
    return out


# ---- per-provider analysis ------------------------------------------------------------------------


def _never_seen(k: int, n: int, rate: float) -> bool:
    """True when a provider shows an edge whitespace 0 times in n texts although the others show it
    at `rate`: the chance of that is (1 - rate)^n, taken as significant below 1e-3."""
    return k == 0 and rate > 0 and n * -math.log1p(-min(rate, 0.999999)) > math.log(1e3)


def analyse(rows: list[dict], thresholds: Thresholds) -> dict:
    """Per-provider statistics, flags and causes; settles each row's `cause`, `flagged`.

    `rows` are check rows (see `check`) with `provider`, `billed_completion_tokens`,
    `reconstructed_completion_tokens`. Returns the `providers` part of the report."""
    by = defaultdict(list)
    for row in rows:
        by[row["provider"]].append(row)
    edge_keys = ("content_lead", "content_trail", "reasoning_lead", "reasoning_trail")
    edge_counts = {p: {e: (sum(1 for r in rs if r["checks"]["edges"][e]),
                           sum(1 for r in rs if r["checks"]["edges"][e] is not None)) for e in edge_keys}
                   for p, rs in by.items()}
    out = {}
    for p, rs in sorted(by.items()):
        stripped = []
        for e in edge_keys:
            k, n = edge_counts[p][e]
            ok = sum(edge_counts[q][e][0] for q in by if q != p)
            on = sum(edge_counts[q][e][1] for q in by if q != p)
            if on and _never_seen(k, n, ok / on):
                stripped.append(e)
        deltas = [r["checks"]["completion_delta"] for r in rs if r["checks"]["completion_delta"] is not None]
        common = Counter(d for d in deltas if d).most_common(1)
        offset = common[0][0] if common and common[0][1] >= 0.9 * len(deltas) and len(deltas) >= 5 else None
        for r in rs:
            c = r["checks"]
            if c["cause"] == "count_mismatch":
                c["cause"] = _settle(c, stripped, offset, r["billed_completion_tokens"])
            r["flagged"] = bool(c["issues"]) or not (
                thresholds.sample_ok(c["completion_delta"], r["billed_completion_tokens"])
                and thresholds.sample_ok(c["prompt_delta"], r["billed_prompt_tokens"]))
        out[p] = _provider_stats(rs, stripped, thresholds)
    return out


def _settle(c: dict, stripped: list[str], offset: int | None, billed: int | None) -> str:
    d = c["completion_delta"]
    if offset is not None and d == offset:
        return "billing_offset"
    if stripped and 0 < d <= 4 and any(c["edges"][e] is False for e in stripped):
        return "stripped_whitespace"
    if 0 < d <= max(3, 0.05 * (billed or 0)):
        return "non_canonical_split"
    return "unexplained"


def _provider_stats(rs: list[dict], stripped: list[str], th: Thresholds) -> dict:
    n = len(rs)
    billed = sum(r["billed_completion_tokens"] for r in rs if r["billed_completion_tokens"] is not None)
    rebuilt = sum(r["reconstructed_completion_tokens"] for r in rs if r["billed_completion_tokens"] is not None)
    deltas = sorted(r["checks"]["completion_delta"] for r in rs if r["checks"]["completion_delta"] is not None)
    exact = sum(1 for d in deltas if d == 0)
    prompt_counted = [r for r in rs if r["checks"]["prompt_delta"] is not None]  # rows with billed counts
    prompt_exact = sum(1 for r in prompt_counted if r["checks"]["prompt_delta"] == 0)
    clean = sum(1 for r in rs if r["checks"]["completion_delta"] in (0, None) and r["checks"]["prompt_delta"] in (0, None)
                and not set(r["checks"]["issues"]) - set(RESPONSE_ISSUES))
    rel = (billed - rebuilt) / billed if billed else None
    causes = Counter(r["checks"]["cause"] for r in rs if r["checks"]["cause"])
    reasons = []
    if n and clean / n < th.min_clean_rate:
        reasons.append(f"{clean}/{n} samples clean (< {th.min_clean_rate:.0%})")
    if rel is not None and abs(rel) > th.max_relative_error:
        reasons.append(f"relative error {rel:+.2%} (> {th.max_relative_error:.2%})")
    if stripped:
        reasons.append("strips whitespace: never shows " + ", ".join(e.replace("_", " ") + "ing" for e in stripped)
                       + " whitespace that the other providers show")
    ranked = [c for c, _ in causes.most_common()]
    cause = ranked[0] if ranked else None
    if stripped and cause in (None, "non_canonical_split", "billing_offset", "unexplained"):
        cause = "stripped_whitespace"  # the counts only move when a whole whitespace token went
    q = (lambda f: deltas[min(len(deltas) - 1, int(f * len(deltas)))] if deltas else None)
    return {
        "samples": n,
        "billed_completion_tokens": billed,
        "reconstructed_completion_tokens": rebuilt,
        "relative_error": rel,
        "exact_match_rate": exact / len(deltas) if deltas else None,
        "prompt_exact_match_rate": prompt_exact / len(prompt_counted) if prompt_counted else None,
        "clean_rate": clean / n if n else None,
        "delta": {"min": deltas[0] if deltas else None, "p50": q(0.5), "p99": q(0.99),
                  "max": deltas[-1] if deltas else None},
        "issues": dict(Counter(i for r in rs for i in r["checks"]["issues"])),
        "causes": dict(causes),
        "cause": cause,
        "stripped_edges": stripped,
        "flagged": bool(reasons),
        "reasons": reasons,
    }


def mark_duplicates(rows: list[dict]) -> None:
    """A sample id seen before in its dataset is dropped from the output (it would be trained on
    twice); a generation id seen before (any dataset) is an issue: one billed response, two samples."""
    seen_samples, seen_generations = set(), set()
    for r in rows:
        key = (r["dataset"], r["sample_id"])
        if key in seen_samples:
            r["checks"]["issues"].append("duplicate_sample_id")
            r["excluded"] = True
        seen_samples.add(key)
        g = r["generation_id"]
        if g is not None:
            if g in seen_generations:
                r["checks"]["issues"].append("duplicate_generation_id")
            seen_generations.add(g)


# ---- the stage -----------------------------------------------------------------------------------


def read_responses(path: Path, import_of: str | None = None):
    """(line number, Response or BadLine) per non-blank line of a stage-02 file, or of an import
    file of dataset `import_of`. A last line without its newline is torn (stage 02 writes whole
    lines) and reported, not read."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if not raw.endswith(b"\n"):
                yield lineno, BadLine("torn last line (no newline): stage 02 crashed or is still writing")
                return
            try:
                row = json.loads(raw)
                if import_of is not None:
                    row = to_raw(row, import_of)
                yield lineno, Response.parse(row, imported=import_of is not None)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield lineno, BadLine(f"not valid JSON: {e}")
            except BadLine as e:
                yield lineno, e
            except ValueError as e:  # the import shape
                yield lineno, BadLine(str(e))


def _row(r: Response, b: Rebuilt, checks: dict) -> dict:
    return {"sample_id": r.sample_id, "dataset": r.dataset, "source": r.source, "provider": r.provider,
            "prompt_hash": stable_id(r.messages),
            "generation_id": r.generation_id, "finish_reason": r.finish_reason,
            "billed_completion_tokens": r.billed_completion, "reconstructed_completion_tokens": len(b.output_ids),
            "billed_prompt_tokens": r.billed_prompt, "reconstructed_prompt_tokens": len(b.prompt_ids),
            "flagged": False, "excluded": False, "checks": checks}


def _ids_line(b: Rebuilt) -> str:
    """The ids part of an output line, built from string pieces (JSON of 60M ints is the stage's
    second cost after tokenizing)."""
    prompt, output = json.dumps(b.prompt_ids), json.dumps(b.output_ids)
    inputs = prompt[:-1] + ", " + output[1:] if b.prompt_ids and b.output_ids else (output if b.output_ids else prompt)
    mask = "[" + ("0, " * len(b.prompt_ids) + "1, " * len(b.output_ids))[:-2] + "]"
    return f'{{"input_ids": {inputs}, "loss_mask": {mask}, "output_ids": {output}}}\n'


class _Work:
    """Pass-1 results of one source file of a dataset (`name` = dataset.unit) under tokens/.work/:
    ids lines and check rows in step, and a fingerprint written last. A rerun with the same file
    and settings reuses them, so an interrupted stage redoes only the files it had not finished."""

    def __init__(self, tokens_dir: Path, name: str, fingerprint: dict):
        d = tokens_dir / ".work"
        d.mkdir(exist_ok=True)
        self.ids, self.rows, self.done = d / f"{name}.ids.jsonl", d / f"{name}.rows.jsonl", d / f"{name}.done.json"
        self.fingerprint = fingerprint

    def finished(self) -> bool:
        try:
            done = json.loads(self.done.read_text())
            done.pop("problems", None)
            return done == self.fingerprint and self.ids.is_file() and self.rows.is_file()
        except (OSError, ValueError):
            return False

    def load_rows(self) -> tuple[list[dict], list[str]]:
        data = json.loads(self.done.read_text())
        rows = [json.loads(line) for line in self.rows.open(encoding="utf-8")]
        return rows, data.get("problems", [])

    def remove(self) -> None:
        for p in (self.ids, self.rows, self.done):
            p.unlink(missing_ok=True)


def _fingerprint(src: Path, rec: Reconstructor, thresholds: Thresholds) -> dict:
    st = src.stat()
    return {"version": FORMAT_VERSION, "source": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "tokenizer": rec.source, "template": hashlib.sha256(rec.chat_template.encode()).hexdigest()[:16],
            "thresholds": asdict(thresholds)}


def rebuild_dataset(rec: Reconstructor, name: str, src: Path, work: _Work, thresholds: Thresholds,
                    batch_size: int = 256, imported: bool = False) -> tuple[list[dict], list[str]]:
    """Pass 1 over one raw_responses file (or, `imported`, one import file of dataset `name`): ids
    to the work file, check rows returned. Malformed lines are skipped and returned as
    'file:line: reason'."""
    if work.finished():
        return work.load_rows()
    total = sum(1 for _ in open(src, "rb"))
    vocab = len(rec.tokenizer)
    rows, problems, batch = [], [], []
    with open(work.ids, "w", encoding="utf-8") as ids_f, open(work.rows, "w", encoding="utf-8") as rows_f, \
            Progress(total=total, desc=f"tokens {name}", unit="samples") as bar:
        n_tokens = 0

        def flush():
            nonlocal n_tokens
            for r, b in zip(batch, rec.rebuild(batch)):
                row = _row(r, b, check(r, b, rec.layout, thresholds))
                row["dataset"] = row["dataset"] or name
                ids_f.write(_ids_line(b))
                rows_f.write(json.dumps(row, ensure_ascii=False) + "\n")
                rows.append(row)
                n_tokens += len(b.prompt_ids) + len(b.output_ids)
            bar.update(len(batch))
            bar.set(tokens=n_tokens)
            batch.clear()

        for lineno, item in read_responses(src, name if imported else None):
            if not isinstance(item, BadLine):
                try:
                    item.prompt = rec.prompt_text(item.messages)
                except Exception as e:  # the template has no place for this conversation (a role, ...)
                    item = BadLine(f"chat template: {type(e).__name__}: {e}")
            if not isinstance(item, BadLine):
                top = max((max(v) for v in (item.output_ids, item.prompt_ids) if v), default=-1)
                if top >= vocab:
                    item = BadLine(f"token id {top} in output_ids/prompt_ids is outside the target's "
                                   f"vocabulary ({vocab}): ids from another tokenizer?")
            if isinstance(item, BadLine):
                problems.append(f"{src}:{lineno}: {item}")
                bar.update(1)
                continue
            batch.append(item)
            if len(batch) >= batch_size:
                flush()
        if batch:
            flush()
    work.done.write_text(json.dumps({**work.fingerprint, "problems": problems}))
    return rows, problems


def _finalize(out_dir: Path, name: str, parts: list[tuple[list[dict], _Work]]) -> Path:
    """tokens/<name>.jsonl (kept samples: checks + ids) and tokens/checks/<name>.jsonl (every
    sample, kept or not) from the (rows, work) of each source file of the dataset, each written
    whole under a temporary name, then renamed."""
    (out_dir / "checks").mkdir(exist_ok=True)
    final, checks = out_dir / f"{name}.jsonl", out_dir / "checks" / f"{name}.jsonl"
    tmp, tmp_checks = out_dir / f".{name}.jsonl.tmp", out_dir / "checks" / f".{name}.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as out, open(tmp_checks, "w", encoding="utf-8") as out_checks:
        for rows, work in parts:
            with open(work.ids, encoding="utf-8") as ids_f:
                for row, ids in zip(rows, ids_f, strict=True):
                    meta = json.dumps({k: v for k, v in row.items() if k != "excluded"}, ensure_ascii=False)
                    out_checks.write(json.dumps(row, ensure_ascii=False) + "\n")
                    if not row["excluded"]:
                        out.write(meta[:-1] + ", " + ids[1:])  # two JSON objects' members, one object
    os.replace(tmp, final)
    os.replace(tmp_checks, checks)
    return final


def totals(rows: list[dict]) -> dict:
    counted = [r for r in rows if r["billed_completion_tokens"] is not None]
    billed = sum(r["billed_completion_tokens"] for r in counted)
    rebuilt = sum(r["reconstructed_completion_tokens"] for r in counted)
    kept = [r for r in rows if not r["excluded"]]
    return {
        "samples": len(rows),
        "kept": len(kept),
        "excluded": len(rows) - len(kept),
        "flagged": sum(1 for r in rows if r["flagged"]),
        "billed_completion_tokens": billed,
        "reconstructed_completion_tokens": rebuilt,
        "relative_error": (billed - rebuilt) / billed if billed else None,
        "exact_match_rate": (sum(1 for r in counted if r["checks"]["completion_delta"] == 0) / len(counted)
                             if counted else None),
        "prompt_exact_match_rate": (sum(1 for r in rows if r["checks"]["prompt_delta"] == 0)
                                    / max(1, sum(1 for r in rows if r["checks"]["prompt_delta"] is not None))
                                    if any(r["checks"]["prompt_delta"] is not None for r in rows) else None),
        "tokens_kept": sum(r["reconstructed_prompt_tokens"] + r["reconstructed_completion_tokens"] for r in kept),
        "response_tokens_kept": sum(r["reconstructed_completion_tokens"] for r in kept),
        "issues": dict(Counter(i for r in rows for i in r["checks"]["issues"])),
        "causes": dict(Counter(r["checks"]["cause"] for r in rows if r["checks"]["cause"])),
    }


def build(run: Run, datasets: list[DatasetSpec], target_model_path: str, chat_template_file: str | None = None,
          trust_remote_code: bool = False, thresholds: Thresholds = Thresholds(), exclude_flagged: bool = False,
          batch_size: int = 256, imports: list[dict] = (), log=print) -> dict:
    """Stage 03 end to end: rebuild every dataset from stage 02's responses and the files in
    `imports` (see `draftsmith.imports`), analyse, write outputs and report.json."""
    from ..target.checkpoint import resolve_target

    specs = parse_imports(list(imports), [s.name for s in datasets])
    rec = load_reconstructor(str(resolve_target(target_model_path, log=log)), chat_template_file, trust_remote_code)
    out_dir = run.dir("tokens")
    parts, problems = {}, {}
    for spec in datasets:
        parts[spec.name], problems[spec.name] = [], []
        for unit, src in source_files(run, spec.name, specs):
            work = _Work(out_dir, f"{spec.name}.{unit}", _fingerprint(src, rec, thresholds))
            rows_, probs = rebuild_dataset(rec, spec.name, src, work, thresholds, batch_size, unit != "generate")
            parts[spec.name].append((rows_, work))
            problems[spec.name] += probs
    per_ds = {name: [r for rows_, _ in ps for r in rows_] for name, ps in parts.items()}
    rows = [r for name in per_ds for r in per_ds[name]]
    mark_duplicates(rows)
    sources.drop_answered_elsewhere(rows)
    providers = analyse(rows, thresholds)
    bad = {p for p, s in providers.items() if s["flagged"]}
    for r in rows:
        r["excluded"] = (r["excluded"] or "no_output" in r["checks"]["issues"]
                         or (exclude_flagged and (r["flagged"] or r["provider"] in bad)))
    outputs = {name: _finalize(out_dir, name, parts[name]) for name in parts}
    report = {
        "format": f"draftsmith-tokens/{FORMAT_VERSION}",
        "target": {"tokenizer": rec.source, "chat_template": rec.template_origin, "encoder": rec.encoder.kind,
                   "think_end": rec.layout.think_end, "think_end_ids": rec.think_end_ids,
                   "end_of_turn": rec.layout.end_of_turn, "end_of_turn_ids": rec.end_of_turn_ids},
        "thresholds": asdict(thresholds),
        "exclude_flagged": exclude_flagged,
        "totals": totals(rows),
        "totals_unflagged_providers": totals([r for r in rows if r["provider"] not in bad]),
        "datasets": {name: {**totals(per_ds[name]), "output": str(outputs[name]),
                            "malformed_lines": len(problems[name]), "problems": problems[name][:20]}
                     for name in per_ds},
        "sources": sources.report(rows),
        "providers": providers,
        "flagged_providers": {p: {"cause": providers[p]["cause"], "reasons": providers[p]["reasons"]} for p in sorted(bad)},
    }
    report["figures"] = [str(p) for p in figures(rows, providers, run.dir("tokens/figures"))]
    tmp = out_dir / ".report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    os.replace(tmp, out_dir / "report.json")
    for ps in parts.values():
        for _, w in ps:
            w.remove()
    return report


# ---- reading the report --------------------------------------------------------------------------


def provider_table(report: dict):
    """One row per provider: samples, exact-match and clean rates, relative error, cause, flag."""
    import pandas as pd

    cols = ["samples", "exact_match_rate", "prompt_exact_match_rate", "clean_rate", "billed_completion_tokens",
            "reconstructed_completion_tokens", "relative_error", "cause", "flagged"]
    df = pd.DataFrame([{**{c: s[c] for c in cols}, "reasons": "; ".join(s["reasons"])}
                       for s in report["providers"].values()], index=list(report["providers"]))
    df.index.name = "provider"
    return df


def summary(report: dict) -> str:
    """A few lines: what was kept, the aggregate billed-vs-rebuilt error, each flagged provider."""
    t = report["totals"]
    rel, exact = t["relative_error"], t["exact_match_rate"]
    lines = [f"{t['samples']} samples, {t['kept']} kept ({t['tokens_kept']:,} tokens, {t['response_tokens_kept']:,} "
             f"response tokens), {t['flagged']} flagged, {t['excluded']} excluded",
             f"billed vs reconstructed completion tokens: {t['billed_completion_tokens']:,} vs "
             f"{t['reconstructed_completion_tokens']:,}, relative error "
             + (f"{rel:+.4%}" if rel is not None else "n/a")
             + (f"; exact count match on {exact:.1%} of samples" if exact is not None else "")
             if exact is not None else "billed vs reconstructed: no sample carries billed token counts"]
    u = report["totals_unflagged_providers"]
    if report["flagged_providers"] and u["relative_error"] is not None:
        lines.append(f"providers not flagged: relative error {u['relative_error']:+.4%} over "
                     f"{u['billed_completion_tokens']:,} billed tokens, exact count match on {u['exact_match_rate']:.1%}")
    if len(report["sources"]) > 1 or any(s["billing"] is None for s in report["sources"].values()):
        lines += sources.summary_lines(report)
    for p, f in report["flagged_providers"].items():
        lines.append(f"FLAGGED {p}: cause {f['cause']}; " + "; ".join(f["reasons"]))
    for name, d in report["datasets"].items():
        if d["malformed_lines"]:
            lines.append(f"{name}: {d['malformed_lines']} malformed lines skipped, e.g. {d['problems'][0]}")
    return "\n".join(lines)


# ---- figures -------------------------------------------------------------------------------------


def figures(rows: list[dict], providers: dict, fig_dir: Path) -> list[Path]:
    """delta_hist.png, provider_deltas.png, lengths.png under `fig_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    deltas = [r["checks"]["completion_delta"] for r in rows if r["checks"]["completion_delta"] is not None]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if deltas:
        lo, hi = max(min(deltas), -30), min(max(deltas), 30)
        ax.hist([min(max(d, lo), hi) for d in deltas], bins=range(lo, hi + 2), align="left", log=True, color="#4c72b0")
    ax.set_xlabel("billed − reconstructed completion tokens (clipped to ±30)")
    ax.set_ylabel("samples")
    ax.set_title("Per-sample completion-token delta (0 = exact)")
    paths.append(_save(fig, fig_dir / "delta_hist.png"))

    names = list(providers)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 1.5), sharey=True)
    colors = ["#c44e52" if providers[p]["flagged"] else "#55a868" for p in names]
    a1.barh(names, [100 * (providers[p]["relative_error"] or 0) for p in names], color=colors)
    a1.axvline(0, color="k", lw=0.5)
    a1.set_xlabel("(billed − reconstructed) / billed, %")
    a2.barh(names, [100 * (providers[p]["clean_rate"] or 0) for p in names], color=colors)
    a2.set_xlabel("samples with exact counts and no issue, %")
    for i, p in enumerate(names):
        if providers[p]["cause"]:
            a2.text(1, i, providers[p]["cause"], va="center", fontsize=8)
    fig.suptitle("Per provider (red = flagged)")
    paths.append(_save(fig, fig_dir / "provider_deltas.png"))

    by_ds = defaultdict(lambda: ([], []))
    for r in rows:
        by_ds[r["dataset"]][0].append(r["reconstructed_prompt_tokens"])
        by_ds[r["dataset"]][1].append(r["reconstructed_completion_tokens"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.5))
    for ax, k in ((a1, 0), (a2, 1)):
        values = [v for d in by_ds.values() for v in d[k]]
        bins = np.histogram_bin_edges(values, bins=30) if values else 30
        ax.hist([d[k] for d in by_ds.values()], bins=bins, label=list(by_ds), histtype="stepfilled", alpha=0.5)
    a1.set_xlabel("prompt tokens")
    a2.set_xlabel("response tokens")
    a1.set_ylabel("samples")
    a1.legend()
    fig.suptitle("Length distributions per dataset")
    paths.append(_save(fig, fig_dir / "lengths.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
