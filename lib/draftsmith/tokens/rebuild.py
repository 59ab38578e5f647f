"""Text -> ids: the prompt through the target's chat template, the response in the template's layout.

Prompt ids: the chat template with the generation prompt, tokenized the way serving engines do
(template text through the tokenizer: a special-token string typed in a user message becomes that
token, as it did for the target). Output ids: reasoning, think_end, content, end_of_turn
(`templates.response_layout`); what the model wrote is encoded as plain text, so a literal
"<think>" or "<|im_end|>" in an answer is text, never a special token. The one exception is the
template's tool-call markup: a model emits each tool-call marker as one id and the API returns it
as text, so those strings map back to their ids; a response's `tool_calls` field is rendered after
the content the way the template renders an assistant turn's tool calls. No end-of-turn when the
response stopped on `length`. Where the engine's sampled ids were saved, they are the truth and the
text's rebuild is kept beside them. Encoding goes through `draftsmith.encoding` (batched: one
Rust or tiktoken call per batch), so 60M tokens take minutes (bench/bench_tokens.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..encoding import Encoding
from ..templates import Layout, load_chat_template, response_layout, tool_calls_text
from .responses import Response


@dataclass
class Rebuilt:
    prompt_ids: list[int]
    output_ids: list[int]
    reasoning_tokens: int  # plain-text tokens of the reasoning
    text_prompt_ids: list[int] | None = None  # where the engine's ids are saved: the ids rebuilt from the text
    text_output_ids: list[int] | None = None
    tool_calls_dropped: bool = False  # the response made tool calls the template does not render

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
        # the added tokens of the template's tool-call markup: returned as text, emitted as one id each
        self.tool_tokens = {t: i for t, i in self.encoder.added.items() if t in markup}

    @classmethod
    def from_pretrained(cls, path, chat_template_file=None, trust_remote_code: bool = False) -> "Reconstructor":
        from ..targets.checkpoint import load_tokenizer

        tok = load_tokenizer(path, trust_remote_code, log=lambda *a: None)
        return cls(tok, load_chat_template(chat_template_file), source=str(path))

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_text(self, messages: list[dict]) -> str:
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
        """Ids of a batch of responses: two batched tokenizer calls (prompts, then the texts)."""
        prompts = self.encoder.template([r.prompt if r.prompt is not None else self.prompt_text(r.messages)
                                         for r in responses])
        answers = [self.output_content(r) for r in responses]
        texts = self.encoder.plain([t for r, a in zip(responses, answers) for t in (r.reasoning, a)], self.tool_tokens)
        out = [self._assemble(r, p, texts[2 * i], texts[2 * i + 1]) for i, (r, p) in enumerate(zip(responses, prompts))]
        out = [self._saved(r, b) if r.output_ids is not None else b for r, b in zip(responses, out)]
        for r, a, b in zip(responses, answers, out):
            b.tool_calls_dropped = bool(r.tool_calls) and a == r.content
        return out

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


_PROBE_CALL = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@lru_cache(maxsize=2)
def load_reconstructor(path: str, chat_template_file: str | None = None, trust_remote_code: bool = False) -> Reconstructor:
    """`Reconstructor.from_pretrained`, loaded once per process (a notebook re-run, the tests)."""
    return Reconstructor.from_pretrained(path, chat_template_file, trust_remote_code)
