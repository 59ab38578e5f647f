"""Text -> ids: the prompt through the target's chat template, the response in the template's layout.

`Reconstructor.rebuild` gives each response's prompt and output ids (`Rebuilt`) as the target saw
and wrote them. What the model wrote is text, so a special-token string in an answer stays text
(the template's tool-call markers aside). Where the engine's sampled ids were saved they are the
truth, and the text's rebuild is kept beside them. Each sample records the layout it took after the
prompt (`LAYOUTS`) and what decided it (`DECIDED_BY`): a reasoning block unless the template has
none or the request turned reasoning off, ended by think_end, by the tool-call section's opening
marker (Kimi-K2.5's reasoning parsers), or never; then the answer, with or without tool calls.

Its input is an answer as a `Response` (a line of stage 02's responses or of an import file, parsed;
`BadLine` names the field that cannot be used): stage 03 rebuilds the training data with it, and
stage 01's logprob probe its own answers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ..encoding import Encoding
from ..templates import Layout, load_chat_template, response_layout, tool_calls_text



class BadLine(ValueError):
    """A response line that cannot be used; the message names the field."""


@dataclass
class Response:
    """The fields of a response line that reconstruction and checks use."""

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
    tool_calls: list[dict] | None = None  # the message's tool calls (OpenAI shape), when it made any

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
        calls = row.get("tool_calls") or None
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
            raise BadLine("field 'tool_calls' must be a list of {id, type, function: {name, arguments}} objects")
        source = row.get("source") or "openrouter"  # stage 02 lines written before sources existed
        if not isinstance(source, str):
            raise BadLine(f"field 'source' must be a string, got {type(source).__name__}")
        return cls(str(sid), str(row.get("dataset") or ""), str(row.get("provider") or source),
                   row.get("generation_id"), msgs, texts["reasoning"], texts["content"],
                   row.get("finish_reason"), counts["prompt_tokens"], counts["completion_tokens"],
                   counts["reasoning_tokens"], excluded, disabled, source, imported,
                   ids["output_ids"], ids["prompt_ids"], tool_calls=calls)


LAYOUTS = ("answer", "tool_calls", "reasoning_answer", "reasoning_tool_calls", "reasoning_into_tool_calls",
           "reasoning_unclosed")
# text: the returned text settles it; billed_count / saved_ids: that count chose between with and
# without think_end; assumed: nothing could, and the template's layout was taken
DECIDED_BY = ("text", "billed_count", "saved_ids", "assumed")


def layout_name(reasoning_block: bool, think_end: bool, tool_calls: bool) -> str:
    """One of LAYOUTS."""
    if not reasoning_block:
        return "tool_calls" if tool_calls else "answer"
    if think_end:
        return "reasoning_tool_calls" if tool_calls else "reasoning_answer"
    return "reasoning_into_tool_calls" if tool_calls else "reasoning_unclosed"


def layout_of_ids(ids: list[int], reasoning_block: bool, think_end: list[int], opening: int | None) -> str:
    """The layout of output ids: the reasoning ends at the first `think_end` or tool-call `opening` id."""
    q = ids.index(opening) if opening is not None and opening in ids else len(ids)
    p = _find(ids, think_end) if reasoning_block else len(ids)
    return layout_name(reasoning_block, p < q, q < len(ids))


def _find(ids: list[int], sub: list[int]) -> int:
    """Index of the first occurrence of `sub` in `ids`, len(ids) when none."""
    k = -1
    while sub:
        try:
            k = ids.index(sub[0], k + 1)
        except ValueError:
            break
        if ids[k:k + len(sub)] == sub:
            return k
    return len(ids)


@dataclass
class Rebuilt:
    prompt_ids: list[int]
    output_ids: list[int]
    reasoning_tokens: int  # plain-text tokens of the reasoning
    text_prompt_ids: list[int] | None = None  # where the engine's ids are saved: the ids rebuilt from the text
    text_output_ids: list[int] | None = None
    tool_calls_dropped: bool = False  # the response made tool calls the template does not render
    layout: str = "reasoning_answer"  # one of LAYOUTS
    layout_by: str = "text"  # one of DECIDED_BY

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def loss_mask(self) -> list[int]:
        return [0] * len(self.prompt_ids) + [1] * len(self.output_ids)


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
        self.encoder = Encoding(tokenizer, source)
        self.think_end_ids = self.encoder.template([self.layout.think_end])[0] if self.layout.thinking else []
        self.end_of_turn_ids = self.encoder.template([self.layout.end_of_turn])[0]
        markup = self._tool_calls_text([_PROBE_CALL])
        # the added tokens of the template's tool-call markup, as the tokenizer encodes that markup:
        # returned as text, emitted as one id each
        in_markup = self.encoder.template([markup])[0] if markup else []
        marked = set(in_markup)
        self.tool_tokens = {t: i for t, i in self.encoder.added.items() if i in marked}
        opening = next((i for i in in_markup if i in self.tool_tokens.values()), None)
        self.tool_open = next((t for t, i in self.tool_tokens.items() if i == opening), None)
        # an answer that opens with this ends a reasoning block that may or may not have been closed
        self._tool_lead = markup[:markup.index(self.tool_open)] + self.tool_open if self.tool_open else None
        self._markers = re.compile("(" + "|".join(re.escape(t) for t in sorted(self.tool_tokens, key=len,
                                                                                reverse=True)) + ")") \
            if self.tool_tokens else None

    @classmethod
    def from_pretrained(cls, path, chat_template_file=None, trust_remote_code: bool = False) -> "Reconstructor":
        from ..targets.checkpoint import load_tokenizer

        tok = load_tokenizer(path, trust_remote_code, log=lambda *a: None)
        return cls(tok, load_chat_template(chat_template_file), source=str(path))

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_text(self, messages: list[dict]) -> str:
        """The chat template with the generation prompt, as text: tokenized the way serving engines
        do it, a special-token string typed in a user message becomes that token, as it did for the
        target."""
        return self.render(messages, True)

    def output_content(self, r: Response) -> str:
        """The answer as the model wrote it: the content, then its `tool_calls` as the template
        renders them (nothing when the template renders none: the checks flag that sample)."""
        return r.content + self._tool_calls_text(r.tool_calls) if r.tool_calls else r.content

    def _tool_calls_text(self, calls: list[dict]) -> str:
        try:
            return tool_calls_text(self.render, calls)
        except Exception:  # a template without tool support may raise on them: it renders none
            return ""

    def rebuild(self, responses: list[Response]) -> list[Rebuilt]:
        """Ids of a batch of responses: two batched tokenizer calls (prompts, then the outputs;
        `draftsmith.encoding`), so 60M tokens take minutes (bench/bench_tokens.py). The output is
        encoded as the tokenizer encodes that whole text (`Encoding.compose`: Kimi's tokenizer counts
        a run of 25,000 characters across all of it)."""
        prompts = self.encoder.template([r.prompt if r.prompt is not None else self.prompt_text(r.messages)
                                         for r in responses])
        answers = [self.output_content(r) for r in responses]
        plans = [self._plan(r, a) for r, a in zip(responses, answers)]
        items = [self._parts(r, a, think) for r, a, plan in zip(responses, answers, plans) for think in plan[0]]
        encoded = iter(self.encoder.compose(items))
        out = []
        for r, a, prompt, (options, default, count) in zip(responses, answers, prompts, plans):
            found = {think: next(encoded) for think in options}
            matching = [t for t, (ids, _) in found.items() if len(ids) == count]
            think = matching[0] if len(matching) == 1 else default
            by = "text" if len(options) == 1 else "assumed" if len(matching) != 1 else \
                "saved_ids" if r.output_ids is not None else "billed_count"
            b = self._assemble(r, a, prompt, think, *found[think])
            b.layout_by = by
            if r.output_ids is not None:
                b = self._saved(r, b)
            b.tool_calls_dropped = bool(r.tool_calls) and a == r.content
            out.append(b)
        return out

    def _reasoning_block(self, r: Response) -> bool:
        return self.layout.thinking and not r.reasoning_disabled

    def _plan(self, r: Response, answer: str) -> tuple[tuple[bool, ...], bool, int | None]:
        """(whether think_end was written: the options to encode, the one taken when no count
        chooses, the count that chooses, if any). The text settles it unless the answer is empty or
        opens with the tool-call section: Kimi-K2.5's reasoning parsers end the reasoning at the
        first of `</think>` and that section's opening marker, so both layouts return the same text.
        There the billed count (or the count of the engine's saved ids) decides; without one the
        template's layout is assumed."""
        if not self._reasoning_block(r):
            return (False,), False, None
        if answer and not (self._tool_lead and answer.startswith(self._tool_lead)):
            return (True,), True, None
        default = bool(answer) or r.finish_reason != "length"
        count = len(self._saved_output(r)) if r.output_ids is not None else r.billed_completion
        return (default, not default), default, count

    def _parts(self, r: Response, answer: str, think: bool) -> list[tuple[str, bool]]:
        """The output as (text, markup) parts: reasoning, think_end, the answer split at its
        tool-call markers, the end of turn (`templates.response_layout`; none when the response
        stopped on `length`). A model emits each tool-call marker as one id and the API returns it
        as text, so those strings map back to their ids; everything else is text."""
        parts = []
        if self._reasoning_block(r):
            parts.append((r.reasoning, False))
            if think:
                parts.append((self.layout.think_end, True))
        elif r.reasoning and not self.layout.thinking:  # unexpected: text on its own (empty markup keeps it apart)
            parts += [(r.reasoning, False), ("", True)]
        if self._markers is not None and answer:
            parts += [(t, bool(k % 2)) for k, t in enumerate(self._markers.split(answer))]
        else:
            parts.append((answer, False))
        if r.finish_reason != "length":
            parts.append((self.layout.end_of_turn, True))
        return parts

    def _assemble(self, r: Response, answer: str, prompt: list[int], think: bool, output: list[int],
                  lead: int) -> Rebuilt:
        calls = bool(self.tool_open) and self.tool_open in answer
        if self._reasoning_block(r):
            return Rebuilt(prompt, output, lead, layout=layout_name(True, think, calls))
        if r.reasoning_disabled:  # the provider closed the reasoning in the prompt
            return Rebuilt(prompt + self.think_end_ids, output, 0, layout=layout_name(False, False, calls))
        return Rebuilt(prompt, output, lead if r.reasoning else 0, layout=layout_name(False, False, calls))

    def _saved_output(self, r: Response) -> list[int]:
        """The engine's output ids; engines differ on returning the token they stopped on, so a
        turn that ended (`stop`, `tool_calls`) without the end-of-turn gets it appended."""
        out = list(r.output_ids)
        eot = self.end_of_turn_ids
        if r.finish_reason in ("stop", "tool_calls") and out[-len(eot):] != eot:
            out += eot
        return out

    def _saved(self, r: Response, text: Rebuilt) -> Rebuilt:
        """The engine's own ids, with the text's rebuild kept beside them for the agreement check;
        the layout is read off the ids."""
        out = self._saved_output(r)
        prompt = list(r.prompt_ids) if r.prompt_ids is not None else text.prompt_ids
        opening = self.tool_tokens.get(self.tool_open) if self.tool_open else None
        layout = layout_of_ids(out, self._reasoning_block(r), self.think_end_ids, opening)
        return Rebuilt(prompt, out, text.reasoning_tokens, text.prompt_ids, text.output_ids, layout=layout,
                       layout_by="saved_ids")


_PROBE_CALL = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@lru_cache(maxsize=2)
def load_reconstructor(path: str, chat_template_file: str | None = None, trust_remote_code: bool = False) -> Reconstructor:
    """`Reconstructor.from_pretrained`, loaded once per process (a notebook re-run, the tests)."""
    return Reconstructor.from_pretrained(path, chat_template_file, trust_remote_code)
